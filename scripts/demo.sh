#!/usr/bin/env bash
# make demo: the thdpack command line on built-in defaults. Usage: scripts/demo.sh BUILD_DIR
set -euo pipefail
build=${1:-build}
thdpack="$build/thdpack"
run() {
  echo
  echo "\$ thdpack $*"
  "$thdpack" "$@"
}
echo "== thdpack $("$thdpack" --version | awk '{print $2}'): THD layouts at a given topology =="
# Two sequences at CP=2: padding to multiples of 2*CP, then the zigzag.
run layout --lengths 7,3 --cp 2
# Sequence parallelism over TP=4: the last sequence absorbs the tail so T/CP divides by TP.
run layout --lengths 7,3 --cp 2 --tp 4 --sp
# Realistic lengths at CP=4 (long sequences are drawn as runs).
run layout --lengths 4000,1200,813 --cp 4 --tp 2 --sp
# Machine-readable form.
run layout --lengths 7,3 --cp 2 --json

# The Python module (built for Debian's /usr/bin/python3 when its dependencies are there): a tiny
# LM trained over DP=2 x CP=2 gloo processes on thdpack's plan, packing, shards and loss, each
# step checked against a single process.
if [ -d "$build/python/thdpack" ]; then
  echo
  echo "\$ python/examples/train_tiny.py --dp 2 --cp 2 --steps 4 --check"
  PYTHONPATH="$build/python" OMP_NUM_THREADS=1 /usr/bin/python3 python/examples/train_tiny.py \
    --dp 2 --cp 2 --steps 4 --check
fi
