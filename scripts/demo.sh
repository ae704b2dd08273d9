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
