#!/usr/bin/env python3
"""DPO on packed (THD) batches from thdpack: the tiny model of train_tiny.py trained on
preference pairs over torch.distributed (gloo, CPU) with DP x CP (x PP) processes, checked
against a single process.

Each step's pairs are held in memory by the loaders, a chosen and a rejected response to one
prompt each, with three sample fields: the pair id, the role (chosen or not) and the reference
model's summed log-probability of the response (precomputed, as DPO trainers do). One
thdpack.torch.pack_batch call a step packs them with keep_groups="microbatch" on the pair id:
both responses of a pair land in one microbatch of one replica (one CP group under dynamic CP),
side by side. On the last stage each rank takes the per-token log-probabilities of its CP shard,
thdpack.torch.sequence_sums sums each response's over its loss tokens across the CP group, and
the pair loss -log sigmoid(beta * ((s_c - ref_c) - (s_r - ref_r))) is computed alike on every CP
rank of the pair; each rank's share is its pairs' losses / (pairs in the step * CP), so that the
shares summed over DP x CP are the step's mean pair loss and its gradient (the convention of
thdpack's local loss). The reward accuracy and mean margin are reduced the same way.

The single process trains the same model on the same pairs with plain torch (the whole batch,
F.cross_entropy, per-sequence sums by index_add): the loss, the statistics and the parameters
after every update must agree to float64 rounding.

  /usr/bin/python3 python/examples/train_dpo.py --dp 2 --cp 2 --pp 2 --steps 3 --check
(with PYTHONPATH=<build>/python). Exit status 1 when --check finds a difference.
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import thdpack  # noqa: E402
import thdpack.torch as tt  # noqa: E402
from train_tiny import (HIDDEN, LR, SEED, VOCAB, TinyLM, causal_attention,  # noqa: E402
                        free_port, join_world, param_sum, run_microbatch, sgd_step,
                        stage_params)

BETA = 0.5  # DPO's temperature


def pairs_of(step, n_pairs):
    """The pairs of one step, the same on every rank: per sample (2 per pair, chosen first, ids
    step * 2 * n_pairs + 0, 1, ...) its tokens (int32: the pair's prompt, then its response),
    target mask (0 on the prompt), pair id, role, and the reference model's log-probability of
    its response (a pure function of the id, near the tiny model's own)."""
    out = []
    for j in range(n_pairs):
        q = step * n_pairs + j
        prompt = thdpack.mock_tokens(SEED, q, 2 + (q * 7) % 9, VOCAB)
        for role, length in ((1, 3 + (q * 5 + 1) % 17), (0, 3 + (q * 11 + 4) % 19)):
            i = 2 * q + (1 - role)
            response = thdpack.mock_tokens(SEED + 1, i, length, VOCAB)
            tokens = np.concatenate([prompt, response]).astype(np.int32)
            mask = np.concatenate([np.zeros(len(prompt), np.uint8), np.ones(length, np.uint8)])
            ref = -np.log(VOCAB) * length + 0.3 * np.sin(0.9 * i)
            out.append({"input_ids": tokens, "loss_mask": mask, "pair": q, "chosen": role,
                        "ref": ref})
    return out


FIELDS = {"pair": {"kind": "sample", "dtype": "int64"},
          "chosen": {"kind": "sample", "dtype": "uint8"},
          "ref": {"kind": "sample", "dtype": "float64"}}


def pair_terms(logp_sums, mb):
    """The microbatch's pairs: (chosen index, rejected index) of its sequences, found by the
    pair field; each pair must be whole and side by side (keep_groups="microbatch")."""
    pair, chosen = mb["pair"].tolist(), mb["chosen"].tolist()
    out = []
    for a in range(0, len(pair), 2):
        if a + 1 >= len(pair) or pair[a] != pair[a + 1] or chosen[a] == chosen[a + 1]:
            raise RuntimeError(f"pair {pair[a]}: not whole and side by side in its microbatch "
                               f"(pairs {pair})")
        out.append((a, a + 1) if chosen[a] else (a + 1, a))
    return out


def dpo_margins(logp_sums, ref, pairs):
    """beta * ((s_c - ref_c) - (s_r - ref_r)) of each pair."""
    c = torch.tensor([p[0] for p in pairs])
    r = torch.tensor([p[1] for p in pairs])
    ratio = logp_sums - ref
    return BETA * (ratio[c] - ratio[r])


def worker(rank, dp, cp, pp, steps, n_pairs, port, out_path, scheduler):
    place, groups, dpcp_group = join_world(rank, dp, cp, pp, port)
    loader = place.cp_rank == 0 and place.first
    if scheduler == "dynamic":
        opts = dict(max_tokens_per_rank=32, scheduler="dynamic",
                    cost=f"l=2,h={HIDDEN},nh=1,nkv=1,f={2 * HIDDEN},v={VOCAB}")
    else:  # a pair (two prompts of up to 10 tokens, responses of up to 21) fits one rank
        opts = dict(max_tokens_per_rank=64, scheduler=scheduler, cost="1,0.05")
    # Loader d holds samples d, d + DP, ... of the step (pack_batch's convention): a pair's two
    # responses are usually on different loaders; the step brings them together.
    it = (tt.pack_batch(pairs_of(s, n_pairs)[place.dp_rank::dp] if loader else None, groups,
                        fields=FIELDS, keep_groups="microbatch", group_field="pair", **opts)
          for s in range(steps))
    model = TinyLM()
    params = stage_params(model, place)
    results = []
    for step in it:
        for p in params:
            p.grad = torch.zeros_like(p)
        # This rank's shares: the loss, and (once per pair: cp_rank 0) correct pairs, margins.
        sums = torch.zeros(3, dtype=torch.float64)
        for mb in step:
            if mb["idle"]:
                continue

            def loss_of(logits):
                ce = F.cross_entropy(logits, mb["labels"].clamp(min=0), reduction="none")
                # Each response's log-probability, over its WHOLE sequence (CP-reduced).
                logp_sums = tt.sequence_sums(-ce, mb)
                margins = dpo_margins(logp_sums, mb["ref"], pair_terms(logp_sums, mb))
                share = -F.logsigmoid(margins).sum() / (n_pairs * mb["cp_size"])
                sums[0] += float(share)
                if mb["cp_rank"] == 0:
                    sums[1] += float((margins > 0).sum())
                    sums[2] += float(margins.sum())
                return share

            run_microbatch(model, mb, place, loss_of)
        sgd_step(params, dpcp_group)
        summary = {}
        if place.last:
            dist.all_reduce(sums, group=dpcp_group)
            summary = {"loss": float(sums[0]), "accuracy": float(sums[1]) / n_pairs,
                       "margin": float(sums[2]) / n_pairs}
        summary["num_microbatches"] = step.num_microbatches
        summary["param_sum"] = param_sum(params, place)
        results.append(summary)
    if rank == place.at(0, 0, pp - 1):
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def single_process(steps, n_pairs):
    """The reference: every pair of a step in one batch, plain torch."""
    torch.set_num_threads(1)
    model = TinyLM()
    results = []
    for step in range(steps):
        samples = pairs_of(step, n_pairs)
        lengths = [len(x["input_ids"]) for x in samples]
        tok = torch.from_numpy(np.concatenate([x["input_ids"] for x in samples]).astype(np.int64))
        pos = torch.cat([torch.arange(L) for L in lengths])
        seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        labels = torch.cat([torch.cat([torch.from_numpy(x["input_ids"][1:].astype(np.int64)),
                                       torch.tensor([0])]) for x in samples])
        target = torch.cat([torch.cat([torch.from_numpy(x["loss_mask"][1:].astype(np.float64)),
                                       torch.tensor([0.0])]) for x in samples])
        idx = torch.arange(tok.numel())
        logits = model(tok, pos, lambda q, k, v: causal_attention(q, k, v, idx, idx, seq, seq))
        logp = -F.cross_entropy(logits, labels, reduction="none") * target
        sums = torch.zeros(len(samples), dtype=torch.float64).index_add(0, seq, logp)
        ref = torch.tensor([x["ref"] for x in samples], dtype=torch.float64)
        pairs = [(2 * j, 2 * j + 1) for j in range(n_pairs)]  # chosen first
        margins = dpo_margins(sums, ref, pairs)
        loss = -F.logsigmoid(margins).mean()
        for p in model.parameters():
            p.grad = None
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        results.append({"loss": float(loss), "accuracy": float((margins > 0).double().mean()),
                        "margin": float(margins.mean()),
                        "param_sum": float(sum(p.sum() for p in model.parameters()))})
    return results



def start_ranks(fn, args, nprocs):
    """fn(rank, *args) in nprocs processes, joined (torch.multiprocessing.spawn's contract),
    forked from a forkserver that imported torch and thdpack once: a rank then starts in a
    fraction of a second instead of importing torch again (5.4 s -> 3.0 s for this example at 4
    ranks, 10.4 s -> 4.0 s at 8, on 2 cores). No rank touches CUDA before it is forked."""
    import multiprocessing
    multiprocessing.set_forkserver_preload(
        ["numpy", "torch", "torch.distributed", "thdpack", "thdpack.torch"])
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1, choices=(1, 2))
    ap.add_argument("--scheduler", default="balanced", choices=("balanced", "dynamic"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=8, help="preference pairs a step")
    ap.add_argument("--check", action="store_true",
                    help="also train in one process and compare (relative tolerance --rtol)")
    ap.add_argument("--rtol", type=float, default=1e-9)
    ap.add_argument("--port", type=int, default=0,
                    help="the gloo rendezvous port (default: one the OS finds free)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        start_ranks(worker, (args.dp, args.cp, args.pp, args.steps, args.pairs,
                             args.port or free_port(), out, args.scheduler),
                    args.dp * args.cp * args.pp)
        with open(out) as f:
            multi = json.load(f)
    print(f"DPO DP={args.dp} CP={args.cp} PP={args.pp} {args.scheduler}: {args.steps} steps of "
          f"{args.pairs} pairs")
    single = single_process(args.steps, args.pairs) if args.check else None
    failures = 0
    for s, r in enumerate(multi):
        line = (f"step {s}: microbatches {r['num_microbatches']} loss {r['loss']:.12f} "
                f"accuracy {r['accuracy']:.3f} margin {r['margin']:.6f}")
        if single is not None:
            ref = single[s]
            worst = max(abs(r[k] - ref[k]) / max(abs(ref[k]), 1e-300)
                        for k in ("loss", "margin", "param_sum"))
            ok = worst <= args.rtol and r["accuracy"] == ref["accuracy"]
            failures += not ok
            line += f" | single {ref['loss']:.12f} max rel diff {worst:.2e} {'OK' if ok else 'FAIL'}"
        print(line, flush=True)
    if single is not None:
        print("check:", "FAIL" if failures else "OK (multi-process equals single-process)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
