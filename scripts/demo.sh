#!/usr/bin/env bash
# make demo: the thdpack command line on built-in defaults. Usage: scripts/demo.sh BUILD_DIR
set -euo pipefail
build=${1:-build}
thdpack="$build/thdpack"
repo=$(cd "$(dirname "$0")/.." && pwd)
data="$repo/data"   # real sequence-length data (data/README.md)
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
echo "== thdpack plan: balance, padding, microbatches and FLOPs of a data set at a topology =="
# Built-in defaults: 3 steps of 256 lognormal mock samples, DP=4, CP=2, 16384 tokens per rank,
# balanced scheduler, llama2-7b cost; the chart of per-replica load goes to an SVG file.
run plan --svg "$build/plan_demo.svg"
# The same steps with Megatron-LM's arrival-order scheduler: the straggler shows in imbalance.
run plan --scheduler sequential --summary-only
# Real long-tail document lengths (WLB-LLM), DP=8, CP=4: balanced, then sequential.
run plan --data "lengths:$data/wlbllm_doc_lengths.txt" --dp 8 --cp 4 \
  --max-tokens-per-rank 32768 --global-batch 512 --steps 4
run plan --data "lengths:$data/wlbllm_doc_lengths.txt" --dp 8 --cp 4 \
  --max-tokens-per-rank 32768 --global-batch 512 --steps 4 --scheduler sequential --summary-only
# The SQuAD-384 histogram packed into microbatches of 384 tokens (one epoch, one step).
run plan --data "histogram:$data/squad_384_histogram.csv" --dp 1 --cp 1 \
  --max-tokens-per-rank 384 --global-batch all --steps 1 --cost tokens --summary-only

# The Python module (built for Debian's /usr/bin/python3 when its dependencies are there): a tiny
# LM trained over DP=2 x CP=2 gloo processes on thdpack's plan, packing, shards and loss, each
# step checked against a single process.
if [ -d "$build/python/thdpack" ]; then
  echo
  echo "\$ python/examples/train_tiny.py --dp 2 --cp 2 --steps 4 --check"
  PYTHONPATH="$build/python" OMP_NUM_THREADS=1 /usr/bin/python3 python/examples/train_tiny.py \
    --dp 2 --cp 2 --steps 4 --check
fi

echo
echo "== thdpack run: the distributed step on 8 thread ranks (TP=2 CP=2 DP=2), built-in mock data =="
run run --backend threads --tp 2 --cp 2 --dp 2
# One step's figures as JSON (totals only): bytes each rank sent per phase, time per phase.
run run --backend threads --tp 2 --cp 2 --dp 2 --steps 1 --json --summary-only

echo
echo "== thdpack run --verify: a probe model over every microbatch, checked against one rank =="
# Short lognormal samples (the probe computes attention exactly, in fp64): TP=2 with SP, CP=2,
# DP=2, then a 4-stage pipeline; loss, ppl and entropy must equal a single-rank computation of
# each sample alone (relative difference below 1e-9), or the run fails.
verify_mock="$build/verify_mock.json"
echo '{"mode":"distribution","type":"lognormal","min_seq_len":8,"max_seq_len":400,"mean_seq_len":120,"lognormal_sigma":0.8}' >"$verify_mock"
run run --backend threads --tp 2 --cp 2 --dp 2 --sp --verify --data "mock:$verify_mock" \
  --global-batch 32 --steps 2 --max-tokens-per-rank 1024
run run --backend threads --dp 2 --cp 1 --pp 4 --verify --data "mock:$verify_mock" \
  --global-batch 32 --steps 2 --max-tokens-per-rank 2048
