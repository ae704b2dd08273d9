#!/usr/bin/env python3
"""Balance measured, not modelled: the plans of several schedulers on real documents, each
replica's microbatches run through the same step function on the device, one replica after
another, and the straggler measured.

Usage:  PYTHONPATH=build/python python3 bench/balance_measured.py [--device cpu|cuda]
        [--steps 3] [--global-batch 128] [--dp 8] [--cp 1] [--max-tokens-per-rank N]
        [--scale S] [--profile FILE] [--hidden H --heads NH --ffn F] [--repeats 2]

Data: data/wlbllm_doc_lengths.txt in file order, global_batch documents a step. On the CPU the
lengths are divided by --scale (default 16: the long tail kept, the times affordable) and the
budget is --max-tokens-per-rank (default 2048); documents over the budget are left out of every
plan alike.

Plans (the same documents, DP replicas, budget):
  sequential       Megatron-LM's arrival-order next-fit (thdpack's "sequential");
  balanced FLOPs   thdpack's balanced scheduler, cost = the layer's training FLOPs;
  balanced profile thdpack's balanced scheduler, cost = the profile measured on this device by
                   thdpack.torch.calibrate on the same layer (--profile FILE reuses one);
  verl KK          verl's balance: Karmarkar-Karp over DP on its workload 24576 L + L^2 with
                   equal sample counts, then per replica ceil(tokens / budget) microbatches by
                   Karmarkar-Karp on lengths (which may go over the budget: counted);
  dynamic profile  thdpack's dynamic CP scheduler (a CP group per microbatch), its step-time
                   model from the profile.

The step function: one transformer layer (pre-norm causal self-attention, each sequence
attending within itself, and a GELU MLP), forward and backward, on a packed microbatch. Each
distinct microbatch is timed best of --repeats after a warm-up, and reused for equal packs. A
CP group of c ranks is emulated on one device: each member takes the group's microbatch time / c
(no exchange is measured). Per step and in total: the measured straggler (slowest replica over
the mean), the measured step time (the slowest replica; for dynamic plans the dependency
simulation of the groups) over sequential's, and beside them the straggler the plan's own cost
model predicted (its costliest replica over the mean; a plan whose largest sequence alone
exceeds the mean cannot reach 1) and the one the profile predicts. Nothing is asserted: a
benchmark.
"""
import argparse
import math
import os
import platform
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import thdpack
import thdpack.torch as tt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def causal_attention(q, k, v):
    """F.scaled_dot_product_attention(q, k, v, is_causal=True), written out where torch lacks
    it (torch 1.13)."""
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    n = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


class Layer(torch.nn.Module):
    """One pre-norm transformer layer over packed sequences (attention within each)."""

    def __init__(self, hidden, heads, ffn, device, dtype):
        super().__init__()
        self.heads = heads
        kw = dict(device=device, dtype=dtype)
        self.norm1 = torch.nn.LayerNorm(hidden, **kw)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False, **kw)
        self.out = torch.nn.Linear(hidden, hidden, bias=False, **kw)
        self.norm2 = torch.nn.LayerNorm(hidden, **kw)
        self.up = torch.nn.Linear(hidden, ffn, bias=False, **kw)
        self.down = torch.nn.Linear(ffn, hidden, bias=False, **kw)

    def forward(self, x, cu):
        h = self.norm1(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        t, d = x.shape
        parts = []
        for s in range(len(cu) - 1):
            a, b = cu[s], cu[s + 1]
            shape = (1, b - a, self.heads, d // self.heads)
            qs, ks, vs = (z[a:b].reshape(shape).transpose(1, 2) for z in (q, k, v))
            o = causal_attention(qs, ks, vs)
            parts.append(o.transpose(1, 2).reshape(b - a, d))
        x = x + self.out(torch.cat(parts))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def make_step(args, device):
    torch.manual_seed(0)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    layer = Layer(args.hidden, args.heads, args.ffn, device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(mb):
        cu = mb["cu_seqlens_padded"].tolist()
        x = torch.randn(cu[-1], args.hidden, device=device, dtype=dtype, requires_grad=True)
        layer(x, cu).float().square().mean().backward()
        layer.zero_grad(set_to_none=True)
        sync()
    return step, dtype


def karmarkar_karp(weights, k, equal_size):
    """The k-way largest differencing method: indices of each part. With equal_size, the items
    are first grouped into rows of k (sorted), each row one item per part, as verl does."""
    order = sorted(range(len(weights)), key=lambda i: weights[i])
    states = []  # each: list of k (sum, [indices]), sorted by sum descending
    if equal_size:
        if len(weights) % k:
            raise ValueError("equal_size needs a multiple of k items")
        for r in range(0, len(order), k):
            row = order[r:r + k]
            states.append(sorted(((weights[i], [i]) for i in row), key=lambda p: -p[0]))
    else:
        for i in order:
            states.append([(weights[i], [i])] + [(0, []) for _ in range(k - 1)])
    spread = lambda s: s[0][0] - s[-1][0]  # noqa: E731
    while len(states) > 1:
        states.sort(key=spread)
        a, b = states.pop(), states.pop()
        merged = [(x[0] + y[0], x[1] + y[1]) for x, y in zip(a, reversed(b))]
        states.append(sorted(merged, key=lambda p: -p[0]))
    return [sorted(p[1]) for p in states[0]]


def verl_plan(lengths, dp, budget):
    """verl's balance: DP partition on 24576 L + L^2 (equal sample counts when they divide),
    then ceil(tokens / budget) microbatches per replica by Karmarkar-Karp on lengths."""
    work = [24576 * L + L * L for L in lengths]
    equal = len(lengths) % dp == 0
    replicas = karmarkar_karp(work, dp, equal)
    plan, over = [], 0
    for r in replicas:
        tokens = sum(lengths[i] for i in r)
        m = max(1, math.ceil(tokens / budget))
        m = min(m, len(r))
        parts = karmarkar_karp([lengths[i] for i in r], m, False)
        mbs = [[r[j] for j in part] for part in parts if part]
        over += sum(1 for mb in mbs if sum(lengths[i] for i in mb) > budget)
        plan.append(mbs)
    # The straggler under its own workload: the largest replica over the mean.
    loads = [sum(work[i] for mb in rep for i in mb) for rep in plan]
    return plan, max(loads) / (sum(loads) / len(loads)), over


class Timer:
    """step time of a pack, measured once per distinct pack (best of repeats after a warm-up)."""

    def __init__(self, step, repeats, device):
        self.step, self.repeats, self.device, self.cache = step, repeats, device, {}

    def __call__(self, lengths):
        key = tuple(lengths)
        if key not in self.cache:
            cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            mb = {"cu_seqlens_padded": torch.from_numpy(cu)}
            self.step(mb)
            best = math.inf
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                self.step(mb)
                best = min(best, time.perf_counter() - t0)
            self.cache[key] = best
        return self.cache[key]


def model_straggler(figures, domain):
    """The plan's own cost model's straggler: the costliest replica (rank) over the mean."""
    return figures["max_replica_cost"] / (figures["total_cost"] / domain)


def profile_seconds(profile, lengths):
    f = profile["refined"] if profile["use"] == "refined" else profile
    p = np.asarray(lengths, np.float64)
    return f["a"] * p.sum() + f["b"] * (p * p).sum() + f["c"] * len(p) + f.get("m", 0.0)


def run_static(replicas, lengths, timer, profile):
    """Measured and profile-predicted time of each replica (its microbatches one after another)."""
    measured, predicted = [], []
    for rep in replicas:
        measured.append(sum(timer([lengths[i] for i in mb]) for mb in rep if mb))
        predicted.append(sum(profile_seconds(profile, [lengths[i] for i in mb]) for mb in rep if mb))
    return measured, predicted


def run_dynamic(plan, id_to_len, timer, profile, domain):
    """A CP group of c ranks: each member takes the group's microbatch time / c; the step is the
    dependency simulation (a group starts when all its ranks are free)."""
    free = [0.0] * domain
    busy = [0.0] * domain
    free_p, busy_p = [0.0] * domain, [0.0] * domain
    for groups in plan.groups:
        for g in groups:
            ranks = [int(r) for r in g["ranks"]]
            lens = [id_to_len[int(i)] for i in g["samples"]]
            if not lens:
                continue
            c = len(ranks)
            t, tp = timer(lens) / c, profile_seconds(profile, lens) / c
            start, start_p = max(free[r] for r in ranks), max(free_p[r] for r in ranks)
            for r in ranks:
                free[r], busy[r] = start + t, busy[r] + t
                free_p[r], busy_p[r] = start_p + tp, busy_p[r] + tp
    return max(free), busy, max(free_p), busy_p


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "wlbllm_doc_lengths.txt"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=128)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--max-tokens-per-rank", type=int, default=None)
    ap.add_argument("--scale", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--ffn", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", default=None, help="reuse a profile instead of calibrating")
    ap.add_argument("--out", default="balance_profile.json", help="where calibrate writes")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    args.max_tokens_per_rank = args.max_tokens_per_rank or (2048 if cpu else 32768)
    args.scale = args.scale or (16 if cpu else 1)
    args.hidden = args.hidden or (128 if cpu else 4096)
    args.heads = args.heads or (4 if cpu else 32)
    args.ffn = args.ffn or (512 if cpu else 11008)
    if args.threads:
        torch.set_num_threads(args.threads)
    budget = args.max_tokens_per_rank * args.cp
    flops_cost = (f"l=1,h={args.hidden},nh={args.heads},nkv={args.heads},f={args.ffn},v=8")
    step, dtype = make_step(args, device)
    label = "CPU" if cpu else torch.cuda.get_device_name(device)
    print(f"balance measured on {label} ({platform.processor() or platform.machine()}; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads): one layer h={args.hidden} "
          f"heads={args.heads} ffn={args.ffn} {str(dtype).replace('torch.', '')}, forward + "
          f"backward; {os.path.basename(args.data)} / {args.scale}, DP={args.dp} CP={args.cp}, "
          f"{args.max_tokens_per_rank} tokens per rank, {args.global_batch} documents a step")
    t0 = time.perf_counter()
    if args.profile:
        profile = thdpack.read_cost_profile(args.profile)
        profile_path = args.profile
    else:
        profile = tt.calibrate(step, budget, out=args.out, device=device,
                               short=max(16, min(256, budget // 32)),
                               model=flops_cost, dtype=str(dtype).replace("torch.", ""),
                               attention="sdpa per sequence", repeats=args.repeats)
        profile_path = args.out
    fit = profile["fit"]["refined" if profile["use"] == "refined" else "abc"]
    print(f"profile {profile_path}: a={profile['a']:.4g} b={profile['b']:.4g} "
          f"c={profile['c']:.4g} (use {profile['use']}); held-out R^2 "
          f"{fit['held_out']['r2']:.5f}, max error {100 * fit['held_out']['max_rel_error']:.2f}%, "
          f"p95 {100 * fit['held_out']['p95_rel_error']:.2f}% "
          f"({fit['held_out']['n']} microbatches; calibrated in {time.perf_counter() - t0:.0f} s)")
    timer = Timer(step, args.repeats, device)
    all_lengths = thdpack.read_lengths(f"lengths:{args.data}")["lengths"]
    all_lengths = np.maximum(all_lengths // args.scale, 1)
    planners = ["sequential", "balanced FLOPs", "balanced profile", "verl KK", "dynamic profile"]
    totals = {p: [0.0, 0.0] for p in planners}  # measured step time, profile step time
    print(f"\n{'step':>4} {'plan':<17} {'straggler':>9} {'(model: own cost)':>18} "
          f"{'(profile)':>9} {'step s':>8} {'vs seq':>7} {'profile s':>9}  notes")
    for s in range(args.steps):
        chunk = all_lengths[s * args.global_batch:(s + 1) * args.global_batch]
        step_lengths = [int(L) for L in chunk if thdpack.ParallelLayout(cp_size=args.cp)
                        .padded_length(int(L)) <= budget]
        dropped = len(chunk) - len(step_lengths)
        lengths = step_lengths
        rows = {}
        for name in planners:
            note = ""
            if name == "verl KK":
                replicas, model_imb, over = verl_plan(lengths, args.dp, budget)
                own = f"{model_imb:.4f} 24576L+L^2"
                note = f"{over} microbatches over the budget" if over else ""
                measured, predicted = run_static(replicas, lengths, timer, profile)
                if args.cp > 1:  # the same emulation of CP as thdpack's static plans
                    measured = [t / args.cp for t in measured]
                    predicted = [t / args.cp for t in predicted]
                    note = "CP emulated" + (f"; {note}" if note else "")
                step_t, step_p = max(measured), max(predicted)
                strag, strag_p = step_t / np.mean(measured), step_p / np.mean(predicted)
            elif name == "dynamic profile":
                plan = thdpack.schedule(lengths, dp_size=args.dp, cp_size=args.cp,
                                        max_tokens_per_rank=args.max_tokens_per_rank,
                                        scheduler="dynamic", cost=f"profile:{profile_path}")
                step_t, busy, step_p, busy_p = run_dynamic(
                    plan, dict(enumerate(lengths)), timer, profile, plan.domain_size)
                strag, strag_p = step_t / np.mean(busy), step_p / np.mean(busy_p)
                own = f"{model_straggler(plan.figures, plan.domain_size):.4f} profile"
                degrees = {}
                for groups in plan.groups:
                    for g in groups:
                        degrees[len(g["ranks"])] = degrees.get(len(g["ranks"]), 0) + len(g["samples"])
                note = "CP emulated: " + " ".join(f"{c}:{n}" for c, n in sorted(degrees.items()))
            else:
                scheduler = "sequential" if name == "sequential" else "balanced"
                cost = f"profile:{profile_path}" if "profile" in name else flops_cost
                plan = thdpack.schedule(lengths, dp_size=args.dp, cp_size=args.cp,
                                        max_tokens_per_rank=args.max_tokens_per_rank,
                                        scheduler=scheduler, cost=cost)
                replicas = [[plan.microbatch(d, m).tolist() for m in range(plan.num_microbatches)]
                            for d in range(args.dp)]
                measured, predicted = run_static(replicas, lengths, timer, profile)
                if args.cp > 1:  # each CP rank: its zigzag half of every sequence, emulated
                    measured = [t / args.cp for t in measured]
                    predicted = [t / args.cp for t in predicted]
                    note = "CP emulated"
                step_t, step_p = max(measured), max(predicted)
                strag, strag_p = step_t / np.mean(measured), step_p / np.mean(predicted)
                own = f"{model_straggler(plan.figures, args.dp):.4f} " + (
                    "profile" if "profile" in name else "FLOPs")
            rows[name] = (strag, own, strag_p, step_t, step_p, note)
            totals[name][0] += step_t
            totals[name][1] += step_p
        for name in planners:
            strag, own, strag_p, step_t, step_p, note = rows[name]
            print(f"{s:>4} {name:<17} {strag:9.4f} {own:>18} {strag_p:9.4f} {step_t:8.3f} "
                  f"{step_t / rows['sequential'][3]:7.3f} {step_p:9.3f}  {note}"
                  f"{'; ' if note and dropped else ''}"
                  f"{f'{dropped} over the budget left out' if dropped and name == 'sequential' else ''}")
    print(f"\ntotal over {args.steps} steps (measured step time, and against sequential's):")
    for name in planners:
        m, p = totals[name]
        print(f"  {name:<17} {m:8.3f} s  {m / totals['sequential'][0]:6.3f}x   "
              f"(profile predicts {p:.3f} s, {p / totals['sequential'][1]:.3f}x)")
    print(f"  distinct microbatches timed: {len(timer.cache)}")


if __name__ == "__main__":
    sys.exit(main())
