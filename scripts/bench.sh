#!/usr/bin/env bash
# make bench: every benchmark program, one after another (they print tables; none fails on a
# time). Usage: scripts/bench.sh BUILD_DIR
set -euo pipefail
build=${1:-build}
for b in "$build"/*_bench; do
  [ -x "$b" ] || continue
  echo "== $(basename "$b") =="
  "$b"
  echo
done
