"""Static shapes (pad_to_max_tokens + max_seqs) against free shapes, on real document lengths.

For each DP x CP, `thdpack.plan_job` plans --steps steps of the same stream with free shapes,
then with every microbatch padded to CP * max_tokens_per_rank and at most S sequences, for S the
free plans' largest sequence count (the cap costs nothing there) and half of it. The table
gives the distinct microbatch shapes a rank sees over the steps (T/CP, and the length of the
offsets attention reads: n+1 free, S+1 static), the microbatches a step (mean), the padding
fraction, and the modelled step time (sum over the steps, llama3-8b on h100-ib; the fixed
shapes' padding counted as linear work) with its ratio to the free shapes'.

    PYTHONPATH=build/python python3 bench/static_shapes_bench.py [--steps 100]
"""
import argparse
import os

import numpy as np

import thdpack

HERE = os.path.dirname(os.path.abspath(__file__))


def shapes_per_rank(plan, cp, max_seqs):
    """The distinct (T/CP, offsets length) of each replica's microbatches (every rank of a
    replica holds the same); returns the largest count over replicas and the largest n seen."""
    per_replica = {}
    most = 0
    for step in plan["steps"]:
        for d, replica in enumerate(step["replicas"]):
            for mb in replica["microbatches"]:
                n = len(mb["samples"])
                most = max(most, n)
                offsets = (max_seqs if max_seqs else n) + 1
                per_replica.setdefault(d, set()).add((mb["padded_tokens"] // cp, offsets))
    return max(len(s) for s in per_replica.values()), most


def row(plan, cp, max_seqs):
    shapes, most = shapes_per_rank(plan, cp, max_seqs)
    steps = plan["steps"]
    m = np.array([s["num_microbatches"] for s in steps])
    real = sum(s["real_tokens"] for s in steps)
    padded = sum(s["padded_tokens"] for s in steps)
    time = sum(s["sim_step_time"] for s in steps)
    return dict(shapes=shapes, most=most, m=m.mean(), pad=1 - real / padded, time=time)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--data", default="wlbllm_doc_lengths.txt")
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32768, help="max_tokens_per_rank")
    ap.add_argument("--cost", default="llama3-8b")
    args = ap.parse_args()
    data = "lengths:" + os.path.join(HERE, "..", "data", args.data)
    print(f"data/{args.data}, {args.global_batch} samples a step, max_tokens_per_rank "
          f"{args.max_tokens}, cost {args.cost}, {args.steps} steps, oversize skip")
    print("| DP x CP | shapes | shapes a rank | microbatches a step | pad fraction | "
          "modelled time (s) | vs free |")
    print("|---|---|---|---|---|---|---|")
    for dp, cp in ((8, 1), (4, 2), (2, 4)):
        common = dict(data=data, dp=dp, cp=cp, max_tokens_per_rank=args.max_tokens,
                      cost=args.cost, oversize="skip", steps=args.steps,
                      global_batch=args.global_batch)
        free = row(thdpack.plan_job(**common), cp, 0)
        rows = [("free", free)]
        for s in (free["most"], max(1, free["most"] // 2)):
            got = row(thdpack.plan_job(pad_to_max_tokens=True, max_seqs=s, **common), cp, s)
            assert got["shapes"] == 1, f"{dp}x{cp} S={s}: {got['shapes']} shapes on a rank"
            rows.append((f"static, S = {s}", got))
        for label, r in rows:
            print(f"| {dp} x {cp} | {label} | {r['shapes']} | {r['m']:.2f} | {r['pad']:.2%} | "
                  f"{r['time']:.1f} | {r['time'] / free['time']:.3f} |")


if __name__ == "__main__":
    main()
