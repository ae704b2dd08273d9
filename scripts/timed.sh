#!/usr/bin/env bash
# make test's clock: runs one part and appends "NAME START END STATUS" (seconds since the epoch)
# to FILE, or prints the parts of FILE with their times (--summary).
# Usage: scripts/timed.sh FILE NAME COMMAND...   |   scripts/timed.sh --summary FILE
set -uo pipefail
if [ "${1:-}" = "--summary" ]; then
  file=${2:?usage: timed.sh --summary FILE}
  awk 'NR == 1 { first = $2 } { if ($3 > last) last = $3
         printf "make test: %-13s %6.0f s (from %4.0f s to %4.0f s)%s\n", $1, $3 - $2,
                $2 - first, $3 - first, ($4 == 0 ? "" : "  FAILED") }
       END { printf "make test: %-13s %6.0f s\n", "total", last - first }' "$file"
  exit 0
fi
file=${1:?usage: timed.sh FILE NAME COMMAND...}
name=${2:?usage: timed.sh FILE NAME COMMAND...}
shift 2
start=$(date +%s.%N)
"$@"
status=$?
echo "$name $start $(date +%s.%N) $status" >> "$file"
exit $status
