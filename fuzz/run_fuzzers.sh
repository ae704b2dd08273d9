#!/usr/bin/env bash
# Runs every libFuzzer target of a fuzzing build (THDPACK_BUILD_FUZZ=ON) for a given time each,
# one after the other, and prints one line per target: executions, exec/s, coverage (libFuzzer's
# cov: edges and ft: features), corpus, and the verdict. Exits 1 if any target crashed, leaked,
# timed out or ran out of memory; the input that did it is kept in BUILD/fuzz-artifacts/.
#
# Usage: fuzz/run_fuzzers.sh [--smoke] BUILD SECONDS [TARGET...]
#   BUILD     the fuzzing build folder (make fuzz and make test: build-san)
#   SECONDS   libFuzzer's -max_total_time per target (the seed corpus is run first, inside it)
#   --smoke   start from the checked-in seeds only, in a scratch corpus removed afterwards
#             (make test); otherwise new inputs accumulate in BUILD/fuzz-corpus/<target>/
#   TARGET    default: every fuzz/<target>_fuzz.cc
# Extra libFuzzer flags may be given in FUZZ_FLAGS (e.g. FUZZ_FLAGS="-jobs=2 -workers=2", then
# with FUZZ_JOBS=1); FUZZ_JOBS targets run at a time (default: the number of cores).
set -euo pipefail

smoke=0
if [ "${1:-}" = "--smoke" ]; then
  smoke=1
  shift
fi
if [ $# -lt 2 ]; then
  echo "usage: $0 [--smoke] BUILD SECONDS [TARGET...]" >&2
  exit 2
fi
build=$1
seconds=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for f in "$here"/*_fuzz.cc; do
    t=$(basename "$f" _fuzz.cc)
    targets+=("$t")
  done
fi

artifacts="$build/fuzz-artifacts"
logs="$build/fuzz-logs"
mkdir -p "$artifacts" "$logs"
scratch=""
if [ $smoke -eq 1 ]; then
  scratch=$(mktemp -d "${TMPDIR:-/tmp}/thdpack_fuzz_smoke.XXXXXX")
  trap 'rm -rf "$scratch"' EXIT
fi

# The targets run side by side, FUZZ_JOBS at a time (default: one per core; each libFuzzer
# process uses one), then their lines are printed in order.
jobs_max=${FUZZ_JOBS:-$(nproc)}
for t in "${targets[@]}"; do
  exe="$build/fuzz/fuzz_$t"
  if [ ! -x "$exe" ]; then
    echo "$t: $exe not built (configure $build with -DTHDPACK_BUILD_FUZZ=ON)" >&2
    exit 2
  fi
done
for t in "${targets[@]}"; do
  exe="$build/fuzz/fuzz_$t"
  if [ $smoke -eq 1 ]; then
    work="$scratch/$t"
  else
    work="$build/fuzz-corpus/$t"
  fi
  mkdir -p "$work"
  log="$logs/$t.log"
  rm -f "$logs/$t.status"
  # New inputs go to the first folder only: the checked-in seeds are read, never written.
  # -timeout: one input taking 10 s is a hang; -rss_limit_mb also caps a single malloc.
  (
    rc=0
    # shellcheck disable=SC2086
    "$exe" -max_total_time="$seconds" -print_final_stats=1 -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="$artifacts/$t-" ${FUZZ_FLAGS:-} "$work" "$here/corpus/$t" >"$log" 2>&1 || rc=$?
    echo "$rc" > "$logs/$t.status"
  ) &
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do
    wait -n || true
  done
done
wait

failed=0
printf '%-20s %10s %8s %7s %7s %12s  %s\n' target execs exec/s cov ft corpus verdict
for t in "${targets[@]}"; do
  log="$logs/$t.log"
  rc=$(cat "$logs/$t.status" 2>/dev/null || echo "no status")
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  last=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  corp=$(sed -n 's/.* corp: \([^ ]*\).*/\1/p' <<<"$last")
  if [ "$rc" = 0 ]; then
    verdict=ok
  else
    verdict="FAILED (exit $rc): $(grep -m1 -E '^==[0-9]+==ERROR|fuzz property failed|^SUMMARY|deadly signal|Test unit written' "$log" || echo "see $log")"
    failed=1
  fi
  printf '%-20s %10s %8s %7s %7s %12s  %s\n' "$t" "${execs:--}" "${rate:--}" "${cov:--}" \
    "${ft:--}" "${corp:--}" "$verdict"
  if [ "$rc" != 0 ]; then
    grep -E 'Test unit written|fuzz property failed|^    #[0-9]+ ' "$log" | head -15 | sed 's/^/    /' >&2
  fi
done
if [ $failed -ne 0 ]; then
  echo "fuzz: a target failed; logs in $logs, inputs in $artifacts (replay: $build/fuzz/fuzz_TARGET FILE)" >&2
  exit 1
fi
