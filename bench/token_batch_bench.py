"""Steps counted in tokens against steps counted in samples, on real document lengths.

For each DP x CP, `thdpack.plan_job` plans --steps steps with global_batch_tokens B, then the
same stream with a sample count N equal to the token run's mean samples a step (rounded): the
table gives, for both, the samples and real tokens a step (min-max), the mean imbalance (the
straggler over its lower bound) and the straggler's cost a step relative to its mean (min-max:
how much the step time swings).

    PYTHONPATH=build/python python3 bench/token_batch_bench.py [--steps 100]
"""
import argparse
import os

import numpy as np

import thdpack

HERE = os.path.dirname(os.path.abspath(__file__))


def figures(plan):
    steps = plan["steps"]
    samples = np.array([s["n_samples"] + s["n_skipped"] for s in steps])
    tokens = np.array([s["real_tokens"] for s in steps])
    imbalance = np.array([s["imbalance"] for s in steps])
    straggler = np.array([s["max_replica_cost"] for s in steps])
    return samples, tokens, imbalance, straggler / straggler.mean()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--data", default="wlbllm_doc_lengths.txt")
    ap.add_argument("--tokens", type=int, default=2_000_000, help="B, tokens a step")
    ap.add_argument("--max-tokens", type=int, default=32768, help="max_tokens_per_rank")
    ap.add_argument("--cost", default="llama3-8b")
    args = ap.parse_args()
    data = "lengths:" + os.path.join(HERE, "..", "data", args.data)
    print(f"data/{args.data}, B = {args.tokens:,} tokens a step, max_tokens_per_rank "
          f"{args.max_tokens}, cost {args.cost}, {args.steps} steps, oversize skip")
    print("| DP x CP | batch | samples a step | real tokens a step | mean imbalance | "
          "straggler / its mean |")
    print("|---|---|---|---|---|---|")
    for dp, cp in ((8, 1), (4, 2), (2, 4)):
        common = dict(data=data, dp=dp, cp=cp, max_tokens_per_rank=args.max_tokens,
                      cost=args.cost, oversize="skip", steps=args.steps)
        by_tokens = thdpack.plan_job(global_batch_tokens=args.tokens, **common)
        s, t, imb, strag = figures(by_tokens)
        assert t.max() <= args.tokens, "a token step over B"
        n = int(round(s.mean()))
        by_samples = thdpack.plan_job(global_batch=n, **common)
        rows = [(f"{args.tokens:,} tokens", s, t, imb, strag)]
        rows.append((f"{n} samples",) + figures(by_samples))
        for label, s, t, imb, strag in rows:
            print(f"| {dp} x {cp} | {label} | {s.min()}-{s.max()} | {t.min():,}-{t.max():,} | "
                  f"{imb.mean():.4f} | {strag.min():.3f}-{strag.max():.3f} |")


if __name__ == "__main__":
    main()
