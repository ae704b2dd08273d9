#!/usr/bin/env bash
# Fetches into .whl/ (git-ignored) the wheels scripts/device_check.sh installs on a lent device
# machine, which has no network: PyPI's nlohmann-json (the one build requirement of
# `pip install .` its image lacks: headers only) and the peers bench/loss_cuda.py compares
# with, Liger-Kernel and Cut Cross-Entropy (pure Python over Triton; torch and triton are in the
# image, so --no-deps). Pinned: the versions bench/loss_cuda.py was written against (Liger's
# accum_dtype, Cut Cross-Entropy's filter_eps); one version of each, since two wheels of one
# name stop the whole install there. About 1.1 MB.
#
# Usage: scripts/fetch_wheels.sh [DIR]   (default .whl; PYTHON picks the pip, default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
python=${PYTHON:-python3}
wheels=(nlohmann-json==3.12.0 liger-kernel==0.8.5 cut-cross-entropy==25.1.1)
mkdir -p "$dest"
rm -f "$dest"/nlohmann_json-*.whl "$dest"/liger_kernel-*.whl "$dest"/cut_cross_entropy-*.whl
# The device's interpreter: CPython 3.12 on x86-64 Linux (these three are pure Python wheels).
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$dest" "${wheels[@]}"
ls -l "$dest"
if [ "$dest" = .whl ] && ! git check-ignore -q .whl/x.whl; then
  echo "fetch_wheels: .whl/ is not ignored by git: add /.whl/ to .gitignore" >&2
  exit 1
fi
