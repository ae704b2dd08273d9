#!/usr/bin/env bash
# The GPU checks, prepared to run on a lent device machine in one call (docs/testing.md,
# "On a GPU"): it has no network, so the one build requirement its image lacks, PyPI's
# nlohmann-json, travels as a wheel in .whl/ (carry .whl). Steps, each timed, the GPU's own
# first (a call that runs out of time keeps what mattered most):
#   1. pip install --no-build-isolation . into the image's Python (torch, NumPy 2, pybind11);
#   2. the `cuda` tests (the CUDA loss against the CPU execution, float64 and F.cross_entropy);
#   3. the CUDA loss benchmark (bench/loss_cuda.py);
#   4. the rest of the Python suite against the installed package;
#   5. the iterator on NCCL at world size 1, beside a gloo world inside the NCCL job;
#   6. calibrate a llama2-7b-sized layer and the measured-balance benchmark (bench/);
#   7. the `cuda` tests under compute-sanitizer's memcheck and racecheck (Firecracker machines;
#      gVisor ones refuse the device, which the log then says).
# Writes its logs under $OUT when set. Usage: scripts/device_check.sh [STEPS]
set -uo pipefail
out=${OUT:-/tmp/device_check}
mkdir -p "$out"
steps=${1:-3}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
run() {
  local name=$1
  shift
  local t0=$(date +%s)
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "device_check: $name rc=$rc $(( $(date +%s) - t0 )) s"
  tail -5 "$out/$name.log"
  return $rc
}
nvidia-smi -L
run install python3 -m pip install -v --no-build-isolation . || exit 1
run cuda-tests python3 -m pytest -q -p no:cacheprovider -rs -m cuda python/tests
cat "$out/cuda-tests.log"
run loss-cuda python3 bench/loss_cuda.py --json "$out/loss_cuda.json"
cat "$out/loss-cuda.log"
run suite python3 -m pytest -q -p no:cacheprovider -rs -m "not cuda" python/tests
run nccl python3 scripts/nccl_iterator_check.py
run nccl-dynamic python3 scripts/nccl_iterator_check.py --scheduler dynamic
run balance python3 bench/balance_measured.py --device cuda --steps "$steps" --out "$out/h_profile.json"
cat "$out/balance.log"
for tool in memcheck racecheck; do
  run "sanitizer-$tool" timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider -m cuda -x python/tests/test_loss_cuda.py
done
