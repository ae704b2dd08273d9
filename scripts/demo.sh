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

echo
echo "== thdpack run: the distributed step on 8 thread ranks (TP=2 CP=2 DP=2), built-in mock data =="
run run --backend threads --tp 2 --cp 2 --dp 2
# One step's figures as JSON (totals only): bytes each rank sent per phase, time per phase.
run run --backend threads --tp 2 --cp 2 --dp 2 --steps 1 --json --summary-only
