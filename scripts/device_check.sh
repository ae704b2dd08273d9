#!/usr/bin/env bash
# The GPU checks, prepared to run on a lent device machine in one call of about 10 minutes
# (docs/testing.md, "On a GPU"). The machine has no network: the wheels it needs travel in .whl/
# (scripts/fetch_wheels.sh; carry .whl). Steps, in the order of what matters most, each in a
# process of its own under `timeout`:
#   env            the GPU, the driver, torch, compute-sanitizer
#   wheels         .whl/*.whl into a scratch site-packages (nlohmann-json, Liger, Cut CE)
#   install        pip install --no-build-isolation . (sm_90 only, all cores)
#   kernels        that install has the CUDA kernels (nvcc was found)
#   cuda-fused     the `cuda` tests but the one-read kernel's (fused kernel, vocab-parallel,
#                  backward scaling, linear loss, statistics, no sync, CUDA graph)
#   cuda-one-read  the one-read kernel's tests (`one_read`), in a process of their own: a fault
#                  in the cluster kernel must not hide the fused results
#   sanitizer-*    memcheck, racecheck, synccheck over a small selection of those tests,
#                  thdpack's kernels only (--kernel-name kns=thdpack) and torch's caching
#                  allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1) so memcheck sees each
#                  tensor's own bounds
#   loss-bench     bench/loss_cuda.py trimmed (two shapes and float32, no torch.compile)
#   linear-bench   its fused linear loss comparison (65536 x 151936, H = 4096)
#   nccl, nccl-dynamic   scripts/nccl_iterator_check.py (the iterator on NCCL, prefetching and
#                  not, beside gloo)
#   prefetch-bench bench/prefetch_bench.py --device cuda (the wait in next() with prefetch 0, 1, 2
#                  at world size 1 on NCCL, bf16 matmuls as the compute)
#   balance        bench/balance_measured.py --device cuda (calibrate a llama2-7b layer)
#   cuda-ctest     the C++ GPU tests (tests/cuda/), where the image has GoogleTest
# Every step's timeout is cut to the time left of --budget (default 540 s), and a step that
# cannot start in time is skipped and listed, so the run ends, with its logs, before the
# device's limit. After every step the logs are packed again into $OUT/device_check_logs.tar.gz
# and $OUT/summary.txt says what ran, its exit status and time, and what was skipped and why
# (only a few files come back from a device).
#
# --rehearse runs the script on a machine without a GPU (a ctest does, python/CMakeLists.txt):
# the thdpack on PYTHONPATH instead of an install, the cuda tests (which skip) and a check that
# every test selection above collects tests, bench/loss_cuda.py on the CPU at a small shape, the
# NCCL check's gloo twin, the prefetch benchmark at world size 1 on gloo; the sanitizer and
# balance steps say they were skipped.
#
# Usage: scripts/device_check.sh [--rehearse] [--budget SECONDS] [--only STEP,...]
#                                [--balance-steps N]
# Environment: OUT (default /tmp/device_check), PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."

rehearse=0
budget=540
only=""
balance_steps=2
while [ $# -gt 0 ]; do
  case "$1" in
    --rehearse) rehearse=1 ;;
    --budget) budget=$2; shift ;;
    --only) only=",$2,"; shift ;;
    --balance-steps) balance_steps=$2; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "device_check: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
  shift
done

out=${OUT:-/tmp/device_check}
python=${PYTHON:-python3}
work=$(mktemp -d /tmp/device_check.XXXXXX)
logs=$work/logs
mkdir -p "$out" "$logs"
export PYTHONUNBUFFERED=1
start=$(date +%s)
reserve=10  # seconds kept for packing the logs at the end
summary=$logs/summary.txt
: > "$summary"
failed=0

note() { echo "device_check: $*" | tee -a "$summary"; }

pack() {
  cp "$summary" "$out/summary.txt"
  tar -czf "$out/device_check_logs.tar.gz.tmp" -C "$logs" . &&
    mv "$out/device_check_logs.tar.gz.tmp" "$out/device_check_logs.tar.gz"
}

wanted() { [ -z "$only" ] || [[ "$only" == *",$1,"* ]]; }

# step NAME LIMIT_S COMMAND...: runs COMMAND under timeout (its log in $logs/NAME.log), cut to
# the budget's time left; the last lines of the log on stdout; the logs packed again.
step() {
  local name=$1 limit=$2
  shift 2
  if ! wanted "$name"; then
    return 0
  fi
  local left=$(( budget - reserve - ($(date +%s) - start) ))
  if [ "$left" -lt 15 ]; then
    note "$name: skipped: out of time (${left} s of the budget left)"
    pack
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  local took=$(( $(date +%s) - t0 ))
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    note "$name: TIMED OUT after ${limit} s (rc $rc)"
  else
    note "$name: rc $rc, ${took} s"
  fi
  [ "$rc" -ne 0 ] && failed=$(( failed + 1 ))
  tail -n 15 "$logs/$name.log" | sed "s/^/  $name| /"
  pack
  return "$rc"
}

skip() {
  if wanted "$1"; then
    note "$1: skipped: $2"
  fi
}

# A pytest selection must collect tests: a renamed test or marker would otherwise drop a check
# of the device run without a word. Used by the rehearsal, where the tests themselves skip.
collects() {
  local n
  n=$("$python" -m pytest -q -p no:cacheprovider --collect-only "$@" 2>/dev/null |
      grep -cE '::')
  echo "collected $n tests: pytest $*"
  [ "$n" -gt 0 ]
}

fused_sel=(-m "cuda and not one_read" python/tests)
one_read_sel=(-m "one_read" python/tests)
# Small shapes only: the sanitizers run kernels 10 to 100 times slower. Clusters of 4 (151,936
# bf16 columns) and 8 (float32) for the one-read kernel's distributed shared memory.
sanitize_sel=(-m cuda -k "(kernel_equals_float64 and 37-1000) or (one_read and 9-151936) or \
in_place_without or vocab_parallel_pieces or backward_scales" python/tests/test_loss_cuda.py)

note "start $(date -u +%FT%TZ), budget ${budget} s, rehearsal ${rehearse}, logs ${out}"
step env 20 bash -c "nvidia-smi || echo 'no nvidia-smi'; getconf _NPROCESSORS_ONLN; \
  $python -c 'import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \
\"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available())'; \
  command -v compute-sanitizer && compute-sanitizer --version || echo 'no compute-sanitizer'; \
  command -v nvcc && nvcc --version | tail -2 || echo 'no nvcc'"

if ls .whl/*.whl > /dev/null 2>&1; then
  step wheels 60 "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$work/site" .whl/*.whl
  export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
else
  skip wheels "no .whl/ here (scripts/fetch_wheels.sh fetches them; carry .whl)"
fi

if [ "$rehearse" -eq 1 ]; then
  skip install "rehearsal: the thdpack on PYTHONPATH"
  skip kernels "rehearsal: a build without nvcc is fine here"
  step import 30 "$python" -c "import thdpack, thdpack.torch; print(thdpack.__file__)" || exit 1
else
  # One architecture (the device's), every core, a build folder a rerun on the same machine
  # reuses.
  export CMAKE_BUILD_PARALLEL_LEVEL=$(getconf _NPROCESSORS_ONLN)
  step install 300 "$python" -m pip install -v --no-build-isolation --no-deps \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 -C build-dir="/tmp/thdpack-build" . || {
    note "install failed: nothing else can run"
    pack
    exit 1
  }
  # A build that found no nvcc installs without the kernels, and every cuda test would skip.
  step kernels 30 "$python" -c "import thdpack; assert thdpack._thdpack.cuda_loss_built(), \
'thdpack was built without the CUDA kernels: no nvcc found at build time'; print('kernels built')"
fi

pytest=("$python" -m pytest -q -p no:cacheprovider -rs)
step cuda-fused 180 "${pytest[@]}" "${fused_sel[@]}"
step cuda-one-read 120 "${pytest[@]}" "${one_read_sel[@]}"

if [ "$rehearse" -eq 1 ]; then
  step selections 60 bash -c "set -e; $(declare -f collects); python=$python; \
    collects $(printf '%q ' "${fused_sel[@]}"); collects $(printf '%q ' "${one_read_sel[@]}"); \
    collects $(printf '%q ' "${sanitize_sel[@]}")"
fi

if command -v compute-sanitizer > /dev/null 2>&1 && [ "$rehearse" -eq 0 ]; then
  for tool in memcheck racecheck synccheck; do
    step "sanitizer-$tool" 120 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
      compute-sanitizer --tool "$tool" --kernel-name kns=thdpack --error-exitcode 9 \
      "${pytest[@]}" -x "${sanitize_sel[@]}"
  done
else
  for tool in memcheck racecheck synccheck; do
    skip "sanitizer-$tool" "$([ "$rehearse" -eq 1 ] && echo "rehearsal: needs a GPU" ||
      echo "no compute-sanitizer on PATH")"
  done
fi

if [ "$rehearse" -eq 1 ]; then
  step loss-bench 90 "$python" bench/loss_cuda.py --device cpu --shapes 64x1000 --repeat 1 \
    --no-compile --linear 64x1000x32 --json "$logs/loss_cuda.json"
  skip linear-bench "rehearsal: loss-bench ran its linear table on the CPU"
  step nccl 60 "$python" scripts/nccl_iterator_check.py --backend gloo --steps 2
  skip nccl-dynamic "rehearsal: needs a GPU"
  step prefetch-bench 60 "$python" bench/prefetch_bench.py --worlds 1 --steps 3
  skip balance "rehearsal: needs a GPU (its CPU run takes minutes)"
  skip cuda-ctest "rehearsal: needs a GPU (ctest -L cuda builds and runs them here)"
else
  step loss-bench 200 "$python" bench/loss_cuda.py --shapes 16384x32000,65536x151936 \
    --repeat 3 --no-compile --linear '' --json "$logs/loss_cuda.json"
  step linear-bench 150 "$python" bench/loss_cuda.py --shapes none --repeat 3 \
    --json "$logs/loss_cuda_linear.json"
  step nccl 60 "$python" scripts/nccl_iterator_check.py
  step nccl-dynamic 60 "$python" scripts/nccl_iterator_check.py --scheduler dynamic
  step prefetch-bench 90 "$python" bench/prefetch_bench.py --device cuda --steps 10
  step balance 150 "$python" bench/balance_measured.py --device cuda --steps "$balance_steps" \
    --out "$logs/h_profile.json"
  # The C++ GPU tests (ctest label `cuda`) need GoogleTest, which the image may lack: the
  # configure then fails in seconds and the log says so.
  step cuda-ctest 240 bash -c "cmake -S . -B /tmp/thdpack-ctest \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DTHDPACK_WITH_CUDA=ON \
    -DTHDPACK_BUILD_PYTHON=OFF -DTHDPACK_BUILD_TOOLS=OFF -DTHDPACK_BUILD_BENCH=OFF \
    -DTHDPACK_WITH_MPI=OFF -DPython3_EXECUTABLE=$(command -v "$python") && \
    cmake --build /tmp/thdpack-ctest --target thdpack_cuda_tests \
      --parallel $(getconf _NPROCESSORS_ONLN) && \
    /tmp/thdpack-ctest/tests/thdpack_cuda_tests"
fi

note "end: $(( $(date +%s) - start )) s, ${failed} step(s) failed"
pack
rm -rf "$work"
[ "$failed" -eq 0 ]
