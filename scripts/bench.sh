#!/usr/bin/env bash
# make bench: every benchmark program, one after another (they print tables; none fails on a
# time), then the Python comparison scripts. Usage: scripts/bench.sh BUILD_DIR
set -euo pipefail
build=${1:-build}
for b in "$build"/*_bench; do
  [ -x "$b" ] || continue
  echo "== $(basename "$b") =="
  "$b"
  echo
done
echo "== verify_speed.sh =="
bash "$(dirname "$0")/../bench/verify_speed.sh" "$build/thdpack"
echo
if [ -d "$build/python/thdpack" ]; then
  here=$(cd "$(dirname "$0")/.." && pwd)
  echo "== schedule_vs_python.py =="
  PYTHONPATH="$build/python" /usr/bin/python3 "$here/bench/schedule_vs_python.py"
  echo
  echo "== prefetch_bench.py =="
  PYTHONPATH="$build/python" /usr/bin/python3 "$here/bench/prefetch_bench.py"
  echo
  echo "== rank_multiple_pad.py =="
  PYTHONPATH="$build/python" /usr/bin/python3 "$here/bench/rank_multiple_pad.py"
  echo
fi
