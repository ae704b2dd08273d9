"""What keeping groups together costs: the straggler (by the cost model) of the same steps
with and without keep_groups, on real document lengths.

Pairs (DPO, reward models): each step draws `pairs` lengths L from a data file and makes a
pair (L, L') with L' = L * exp(N(0, sigma)) (chosen and rejected of similar lengths, capped
at the budget). Groups (GRPO): `group` responses per prompt, lengths drawn independently from
the file (a prompt's responses vary as much as the data does). The same samples are scheduled
with keep_groups "none" and with "microbatch" / "replica"; the table gives the mean and worst
ratio of the straggler over the steps, and the microbatch counts.

    PYTHONPATH=build/python python3 bench/groups_bench.py [--steps 20]
"""
import argparse
import os
import sys

import numpy as np

import thdpack

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name):
    with open(os.path.join(HERE, "..", "data", name)) as f:
        return np.array([int(x) for x in f if x.strip()], dtype=np.int64)


def pairs_step(rng, data, n_pairs, cap, sigma):
    base = np.minimum(rng.choice(data, n_pairs), cap)
    other = np.clip(np.rint(base * np.exp(rng.normal(0.0, sigma, n_pairs))), 1, cap)
    lengths = np.empty(2 * n_pairs, dtype=np.int64)
    lengths[0::2] = base
    lengths[1::2] = other.astype(np.int64)
    groups = np.repeat(np.arange(n_pairs, dtype=np.int64), 2)
    return lengths, groups


def grpo_step(rng, data, n_prompts, group, cap):
    lengths = np.minimum(rng.choice(data, n_prompts * group), cap).astype(np.int64)
    groups = np.repeat(np.arange(n_prompts, dtype=np.int64), group)
    return lengths, groups


def straggler(plan):
    f = plan.figures
    return f["max_replica_cost"], plan.num_microbatches


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--data", default="wlbllm_doc_lengths.txt")
    ap.add_argument("--max-tokens", type=int, default=16384, help="max_tokens_per_rank")
    ap.add_argument("--pairs", type=int, default=256, help="pairs a step")
    ap.add_argument("--sigma", type=float, default=0.1, help="log-spread inside a pair")
    ap.add_argument("--prompts", type=int, default=64, help="GRPO prompts a step")
    ap.add_argument("--group", type=int, default=8, help="GRPO responses a prompt")
    ap.add_argument("--cost", default="llama3-8b")
    args = ap.parse_args()
    data = load(args.data)
    print(f"data/{args.data}: {len(data)} lengths; max_tokens_per_rank {args.max_tokens}, "
          f"cost {args.cost}, {args.steps} steps a row")
    print("| batch | DP x CP | scheduler | keep_groups | straggler / none: mean | worst | "
          "M none | M kept |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in ("pairs", "grpo"):
        for dp, cp in ((8, 1), (4, 2), (2, 4)):
            cap = cp * args.max_tokens
            # Pairs in one microbatch (a pair's loss needs both); GRPO groups on one replica
            # (a group of 8 long responses does not fit one microbatch). Under dynamic CP
            # both mean one CP group of one microbatch.
            keep = "microbatch" if kind == "pairs" else "replica"
            for sched in ("balanced", "dynamic"):
                rng = np.random.default_rng(1234)
                ratios, m_none, m_kept = [], [], []
                for _ in range(args.steps):
                    if kind == "pairs":
                        lengths, groups = pairs_step(rng, data, args.pairs, cap // 2, args.sigma)
                    else:
                        lengths, groups = grpo_step(rng, data, args.prompts, args.group,
                                                    cap // 2)
                    common = dict(dp_size=dp, cp_size=cp, max_tokens_per_rank=args.max_tokens,
                                  scheduler=sched, cost=args.cost)
                    free = thdpack.schedule(lengths, **common)
                    kept = thdpack.schedule(lengths, groups=groups, keep_groups=keep, **common)
                    if sched == "dynamic":
                        a, b = free.sim_step_time, kept.sim_step_time
                    else:
                        a, b = straggler(free)[0], straggler(kept)[0]
                    ratios.append(b / a)
                    m_none.append(free.num_microbatches)
                    m_kept.append(kept.num_microbatches)
                what = "step time" if sched == "dynamic" else "straggler"
                label = (f"{args.pairs} pairs (sigma {args.sigma})" if kind == "pairs"
                         else f"{args.prompts} x {args.group} GRPO")
                print(f"| {label} | {dp} x {cp} | {sched} ({what}) | {keep} | "
                      f"{np.mean(ratios):.4f} | {np.max(ratios):.4f} | "
                      f"{np.mean(m_none):.1f} | {np.mean(m_kept):.1f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
