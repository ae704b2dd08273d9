#!/usr/bin/env bash
# make test's current-stack part: thdpack as a user of today's PyPI stack gets it.
#   1. the wheel, built by pip through scikit-build-core with the system's nlohmann_json hidden
#      (so the headers come from PyPI's nlohmann-json), incremental in OUT (a build folder beside
#      BUILD, at the same depth, with BUILD's launcher and flags when LAUNCHER and RELEASE_FLAGS
#      are set: make test's wheel then shares every library object with BUILD through ccache;
#      the flags add line tables, which install.strip removes); its contents checked: the thdpack
#      package only, a module that links neither libtorch nor libpython;
#   2. a fresh virtual environment with NumPy alone: the wheel installed, the smoke test;
#   3. a fresh virtual environment with the current stack (VENV's packages through a .pth file,
#      so 5 GB of torch are not copied): the wheel installed, the smoke test, then the Python
#      suite against the installed package (THDPACK_CLI: the command line of BUILD) - the whole
#      suite, or with PYTEST_MARKERS the tests of that marker expression (make test passes
#      "no_sanitizer": the rest run on the same stack in the sanitized build, docs/testing.md);
#   4. the command line built with that stack's pyarrow's Arrow C++ (build-arrow, beside BUILD),
#      run on Parquet and Arrow files (tests/cli_columnar_test.py), before the suite.
# Prints the time of each part and the wheel's size. Usage: test_current_stack.sh VENV BUILD [OUT]
set -euo pipefail
venv=$(realpath "${1:?usage: test_current_stack.sh VENV BUILD [OUT]}")
build=$(realpath "${2:?usage: test_current_stack.sh VENV BUILD [OUT]}")
here=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "${3:-$here/build-wheel}")
cd "$here"
unset PYTHONPATH
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
python=$venv/bin/python
base=$(readlink -f "$(dirname "$(readlink -f "$python")")")/python3  # the interpreter of the venv
version=$(sed -n 's/^project(thdpack VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt)
clock() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(clock)" 'BEGIN { printf "%.1f s", b - a }'; }

t=$(clock)
rm -rf "$out/dist"
settings=(--config-settings=build-dir="$out"
          --config-settings=cmake.define.CMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=ON)
if [ -n "${LAUNCHER:-}" ]; then
  # BUILD's compiler by the same name (ccache keys on it; pip's environment names gcc
  # x86_64-linux-gnu-g++ where cmake found /usr/bin/c++).
  cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt")
  settings+=(--config-settings=cmake.define.CMAKE_CXX_COMPILER_LAUNCHER="$LAUNCHER"
             --config-settings=cmake.define.CMAKE_CUDA_COMPILER_LAUNCHER="$LAUNCHER"
             ${cxx:+--config-settings=cmake.define.CMAKE_CXX_COMPILER="$cxx"})
fi
if [ -n "${RELEASE_FLAGS:-}" ]; then
  settings+=(--config-settings=cmake.define.CMAKE_CXX_FLAGS_RELEASE="$RELEASE_FLAGS")
fi
"$python" -m pip wheel . -q --no-build-isolation --no-deps -w "$out/dist" "${settings[@]}"
wheel=$(ls "$out"/dist/thdpack-*.whl)
echo "current stack: wheel $(basename "$wheel"), $(du -k "$wheel" | cut -f1) KiB, built in $(since "$t")"
"$python" - "$wheel" <<'PY'
import subprocess, sys, tempfile, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
stray = [n for n in names if not (n.startswith("thdpack/") or ".dist-info/" in n)]
assert not stray, f"the wheel holds more than the package: {stray}"
modules = [n for n in names if n.startswith("thdpack/_thdpack") and n.endswith(".so")]
assert len(modules) == 1 and "thdpack/torch/loss.py" in names, names
with tempfile.TemporaryDirectory() as d:
    path = zipfile.ZipFile(sys.argv[1]).extract(modules[0], d)
    needed = subprocess.run(["readelf", "-d", path], check=True, capture_output=True,
                            text=True).stdout
needed = [l.split("[")[1].rstrip("]") for l in needed.splitlines() if "(NEEDED)" in l]
bad = [n for n in needed if n.startswith(("libtorch", "libc10", "libpython", "libcudart", "libcuda."))]
assert not bad, (f"the module links {bad}: it must serve every torch and Python build, and load "
                 f"without a GPU (the CUDA runtime is linked statically)")
print(f"current stack: the wheel holds {len(names)} files, the module needs {', '.join(needed)}")
PY

t=$(clock)
env_numpy=$out/env-numpy
"$base" -m venv --clear "$env_numpy"
"$env_numpy/bin/pip" install -q --no-index --find-links "$venv/wheels" numpy "$wheel"
(cd "$out" && "$env_numpy/bin/python" -I "$here/scripts/smoke_installed.py" "$version")
echo "current stack: NumPy-only environment made and checked in $(since "$t")"

t=$(clock)
env_torch=$out/env-torch
"$base" -m venv --clear "$env_torch"
site=$("$env_torch/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/current-stack.pth"
"$env_torch/bin/pip" install -q --no-index --no-deps "$wheel"
(cd "$out" && "$env_torch/bin/python" -I "$here/scripts/smoke_installed.py" "$version")
(cd "$out" && "$env_torch/bin/python" -I -c "import thdpack, thdpack.torch")
echo "current stack: torch environment made and checked in $(since "$t")"

t=$(clock)
# The command line with the Arrow C++ of the current stack's pyarrow (cmake/arrow_cli.cmake),
# built beside BUILD at its depth with BUILD's compiler, flags and MPI (ccache then shares
# every library object with BUILD), and run on columnar files (tests/cli_columnar_test.py).
arrow_build=$(dirname "$build")/build-arrow
cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt")
generator=$(sed -n 's/^CMAKE_GENERATOR:[A-Z]*=//p' "$build/CMakeCache.txt")
mpi=$(sed -n 's/^THDPACK_WITH_MPI:[A-Z]*=//p' "$build/CMakeCache.txt")
cmake -S . -B "$arrow_build" ${generator:+-G "$generator"} -DCMAKE_BUILD_TYPE=Release \
  ${cxx:+-DCMAKE_CXX_COMPILER="$cxx"} ${LAUNCHER:+-DCMAKE_CXX_COMPILER_LAUNCHER="$LAUNCHER"} \
  ${RELEASE_FLAGS:+-DCMAKE_CXX_FLAGS_RELEASE="$RELEASE_FLAGS"} -DTHDPACK_BUILD_TESTS=OFF \
  -DTHDPACK_BUILD_BENCH=OFF -DTHDPACK_BUILD_PYTHON=OFF -DTHDPACK_WITH_MPI="${mpi:-OFF}" \
  -DTHDPACK_ARROW_PYTHON="$python" > "$out/build-arrow.log" 2>&1 \
  || { cat "$out/build-arrow.log"; exit 1; }
cmake --build "$arrow_build" -j "$(nproc)" --target thdpack_cli > "$out/build-arrow.log" 2>&1 \
  || { cat "$out/build-arrow.log"; exit 1; }
mpirun=()
if [ "$mpi" = ON ] && command -v mpirun >/dev/null; then
  mpirun=(mpirun --allow-run-as-root --oversubscribe --mca btl self,vader)
fi
OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_hwloc_base_binding_policy=none \
  "$env_torch/bin/python" tests/cli_columnar_test.py "$arrow_build/thdpack" "$build/thdpack" \
  "$out/cli-columnar" "${mpirun[@]}"
echo "current stack: the command line with pyarrow's Arrow C++ built and run on columnar files in $(since "$t")"

t=$(clock)
# In one process per core (pytest-xdist), as ctest runs it (python/CMakeLists.txt).
markers=()
if [ -n "${PYTEST_MARKERS:-}" ]; then markers=(-m "$PYTEST_MARKERS"); fi
(cd "$out" && THDPACK_CLI="$build/thdpack" THDPACK_WHEELS="$venv/wheels" OMP_NUM_THREADS=1 \
  "$env_torch/bin/python" -m pytest -q -p no:cacheprovider -rs -n "$(nproc)" --dist loadgroup \
  "${markers[@]}" "$here/python/tests")
echo "current stack: the Python suite${PYTEST_MARKERS:+ (-m $PYTEST_MARKERS)} on the installed wheel in $(since "$t")"
