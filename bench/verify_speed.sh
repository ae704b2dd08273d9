#!/usr/bin/env bash
# The time of `thdpack run --verify`: the single-rank run of docs/verify.md's example data, and
# the set of eight runs (four topologies on threads and on MPI, three steps each). Prints the
# wall time of each and the two totals; fails only if a run fails (never on a time).
# Usage: bench/verify_speed.sh [THDPACK_BINARY] [MPIRUN]
set -euo pipefail
thdpack=${1:-build/thdpack}
mpirun=${2:-$(command -v mpirun || true)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/M.json" <<'JSON'
{"mode": "distribution", "type": "lognormal", "min_seq_len": 64, "max_seq_len": 4096,
 "mean_seq_len": 1024, "lognormal_sigma": 1.1}
JSON
common=(--verify --data "mock:$work/M.json" --global-batch 64 --max-tokens-per-rank 8192)
clock() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(clock)" 'BEGIN { printf "%.2f", b - a }'; }

t=$(clock)
"$thdpack" run "${common[@]}" --steps 1 > "$work/single.log"
single=$(elapsed "$t")
printf "verify, one rank, one step                 %8s s\n" "$single"

total=0
for topo in "1 2 2 1" "2 2 2 1 --sp" "1 1 2 4" "2 2 1 2"; do
  read -r tp cp dp pp sp <<< "$topo"
  world=$((tp * cp * dp * pp))
  args=(--tp "$tp" --cp "$cp" --dp "$dp" --pp "$pp" ${sp:-} --steps 3)
  t=$(clock)
  "$thdpack" run "${common[@]}" "${args[@]}" > "$work/threads.log"
  s=$(elapsed "$t")
  printf "verify, threads, tp=%s cp=%s dp=%s pp=%s%-5s %8s s\n" "$tp" "$cp" "$dp" "$pp" "${sp:+ sp}" "$s"
  total=$(awk -v a="$total" -v b="$s" 'BEGIN { print a + b }')
  if [ -n "$mpirun" ]; then
    t=$(clock)
    "$mpirun" --allow-run-as-root --oversubscribe -np "$world" "$thdpack" run "${common[@]}" \
      "${args[@]}" --backend mpi > "$work/mpi.log"
    s=$(elapsed "$t")
    printf "verify, MPI,     tp=%s cp=%s dp=%s pp=%s%-5s %8s s\n" "$tp" "$cp" "$dp" "$pp" "${sp:+ sp}" "$s"
    total=$(awk -v a="$total" -v b="$s" 'BEGIN { print a + b }')
  fi
done
printf "verify: one rank %s s (goal < 3 s); the eight runs %s s (goal < 60 s), on %s cores\n" \
  "$single" "$total" "$(nproc)"
