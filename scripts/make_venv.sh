#!/usr/bin/env bash
# Makes the virtual environment of the current stack (python/requirements-current.txt: the
# newest NumPy 2, pybind11 3, PyTorch, megatron-core, transformers and TRL from PyPI) for
# Debian's python3, once: a second run finds it up to date and downloads nothing. It is remade
# when the requirements file changes or the environment is broken. The wheels stay in pip's
# cache (PIP_CACHE_DIR, ~/.cache/pip; about 3.4 GB), so that the environment of another clone
# (CI's) installs without downloading them again. Also keeps a NumPy wheel in VENV/wheels for the
# fresh NumPy-only environment the wheel test installs into (scripts/test_current_stack.sh).
# Usage: scripts/make_venv.sh VENV [PYTHON]
set -euo pipefail
venv=${1:?usage: make_venv.sh VENV [PYTHON]}
python=${2:-/usr/bin/python3}
here=$(cd "$(dirname "$0")/.." && pwd)
reqs=$here/python/requirements-current.txt
stamp=$venv/.thdpack-requirements

want=$(sha256sum "$reqs" | cut -d' ' -f1)
# verl's wheel, kept (not installed: pure Python, its dependencies unwanted) for the tests that
# run verl's own log-prob functions (python/tests/verl_code.py); without it they skip, saying so.
verl=verl-0.6.1-py3-none-any.whl
keep_verl() {
  [ -f "$venv/wheels/$verl" ] && return 0
  "$venv/bin/pip" download -q --no-deps --only-binary=:all: -d "$venv/wheels" verl==0.6.1 ||
    echo "make_venv: verl's wheel not downloaded: test_logprobs_verl.py will skip" >&2
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "import numpy, torch, pybind11, pytest, xdist" 2>/dev/null; then
  keep_verl
  exit 0
fi

echo "make_venv: making $venv (the current stack from PyPI: one-time download)" >&2
start=$(date +%s)
rm -rf "$venv"
"$python" -m venv "$venv"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
"$venv/bin/pip" install -q -r "$reqs"
"$venv/bin/pip" download -q --no-deps --only-binary=:all: -d "$venv/wheels" \
  "numpy==$("$venv/bin/python" -c 'import numpy; print(numpy.__version__)')"
"$venv/bin/python" - "$venv" <<'PY' | tee "$venv/versions.txt" >&2
import importlib.metadata as m, platform, sys
names = ["numpy", "pybind11", "torch", "megatron-core", "transformers", "trl", "pytest",
         "pytest-xdist", "scikit-build-core", "nlohmann-json"]
print(f"make_venv: {sys.argv[1]}: Python {platform.python_version()}, " +
      ", ".join(f"{n} {m.version(n)}" for n in names))
PY
echo "make_venv: made in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1) on disk" >&2
keep_verl
echo "$want" > "$stamp"
