#!/usr/bin/env python3
"""An in-memory batch of rollouts with fields: thdpack's pack_batch and step.unpack beside verl's
own Python path for the same work.

The batch: --samples rollouts (default 1,024), their lengths the first ones of
data/wikipedia_doc_lengths.txt capped at --max-len (default 8,192, a response-length cap), each
with four float32 per-token target fields (old and reference log-probabilities, advantages,
returns). DP = --ranks replicas (default 4), CP = 1, --max-tokens-per-rank tokens a microbatch
(default 16,384).

thdpack, over gloo (--ranks processes): each loader holds its share (samples d, d + DP, ...) as
dicts; `pack_batch` (schedule over DP and microbatches, move the samples and fields, pack) and
`step.unpack` of one float32 value per token back to the loaders, wall time of each call (the
slowest rank, median of --repeats), and the bytes the step sent (every rank, every phase)
against the bytes the fields hold. On --threads ranks in one process (default 8): the same step
through the thread backend (pack only).

And from a verl rank's own padded batch (its share with prompts left-padded and responses
right-padded, the fields [B, R]): thdpack.torch.adapters' samples_from_padded + pack_batch, and
step.unpack + padded_from_unpacked back to [B, R], the conversions included.

verl (its own code, loaded from the verl wheel: verl/utils/seqlen_balancing.py and
verl/utils/npu_utils.py, its copy of flash-attn's unpad/pad; needs einops): the
driver's balance over DP (`get_seqlen_balanced_partitions`, equal sizes, on the whole batch),
then one rank's work on its share as padded [B, S] tensors: `rearrange_micro_batches` under the
same token cap, `unpad_input` of input_ids and the four fields per microbatch (packed tensors and
cu_seqlens), and back: `pad_input` of one float32 value per token per microbatch, concatenated,
`restore_dynamic_batch`. Times of one process (what each of verl's ranks does), median of
--repeats. The wheel and einops come from PyPI into --cache (default ~/.cache/thdpack-bench) the
first time; without them the verl rows are left out, saying why.

A benchmark, not a test: it prints figures and never fails on a time.

Usage: PYTHONPATH=build/python python3 bench/fields_bench.py [--ranks 4] [--threads 8]
"""
import argparse
import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import time
import types

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ("old_logprobs", "ref_logprobs", "advantages", "returns")
VERL_VERSION = "0.6.1"


def lengths_of(n, cap):
    path = os.path.join(os.environ.get("THDPACK_DATA_DIR", os.path.join(ROOT, "data")),
                        "wikipedia_doc_lengths.txt")
    with open(path) as f:
        out = []
        for line in f:
            if len(out) == n:
                break
            out.append(min(int(line), cap))
    return np.array(out, np.int64)


def rollout(i, L):
    rng = np.random.default_rng(i)
    item = {"input_ids": rng.integers(0, 32000, L).astype(np.int64),
            "loss_mask": (np.arange(L) >= L // 4).astype(np.uint8)}
    for name in FIELDS:
        item[name] = rng.standard_normal(L).astype(np.float32)
    return item


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_worker(rank, world, port, args, out):
    import thdpack.torch as tt
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = tt.Groups(dp=dist.new_group(list(range(world))))
    lengths = lengths_of(args.samples, args.max_len)
    mine = [rollout(i, int(lengths[i])) for i in range(rank, args.samples, world)]
    fields = {name: "target" for name in FIELDS}
    packs, unpacks = [], []
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        step = tt.pack_batch(mine, groups, fields=fields, max_tokens_per_rank=args.max_tokens,
                             cost="llama2-7b")
        t1 = time.perf_counter()
        values = [mb["old_logprobs"] for mb in step]
        dist.barrier()
        t2 = time.perf_counter()
        got = step.unpack(values)
        t3 = time.perf_counter()
        assert len(got) == len(mine)
        packs.append(t1 - t0)
        unpacks.append(t3 - t2)
    # The same share as a verl rank holds it - a padded batch, prompts (the first L/4 tokens)
    # left-padded, responses right-padded, the fields [B, R] - through the adapters
    # (thdpack.torch.adapters): in, pack_batch, unpack, out to [B, R].
    from thdpack.torch.adapters import padded_from_unpacked, samples_from_padded
    batch, r = padded_share(mine)
    ins, outs = [], []
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        samples = samples_from_padded(batch, r, per_token=FIELDS)
        t1 = time.perf_counter()
        step = tt.pack_batch(samples, groups, fields=fields, max_tokens_per_rank=args.max_tokens,
                             cost="llama2-7b")
        t2 = time.perf_counter()
        # As above: each call timed from a barrier, so that one rank's wait for the other's
        # pack (a training step's forward and backward stands there) is not counted twice, in
        # the slowest pack and again in the other rank's unpack.
        dist.barrier()
        t2b = time.perf_counter()
        got = padded_from_unpacked(step.unpack([mb["old_logprobs"] for mb in step], flat=True),
                                   batch, r)
        t3 = time.perf_counter()
        assert got.shape == (len(mine), r)
        ins.append(t2 - t0)
        outs.append(t3 - t2b)
    # The slowest rank's time of each repeat; the bytes every rank sent, and held in fields.
    times = torch.tensor([packs, unpacks, ins, outs], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    sent = torch.tensor([sum(step.bytes_sent.values()), step.field_bytes], dtype=torch.int64)
    dist.all_reduce(sent)
    if rank == 0:
        torch.save({"pack": times[0].tolist(), "unpack": times[1].tolist(),
                    "adapted_in": times[2].tolist(), "adapted_out": times[3].tolist(),
                    "sent": int(sent[0]), "held": int(sent[1]),
                    "microbatches": step.num_microbatches}, out)
    dist.destroy_process_group()


def padded_share(mine):
    """A rank's rollouts as a verl batch: input_ids and attention_mask [B, P + R] (prompts, the
    first L/4 tokens, left-padded to P; responses right-padded to R), the fields [B, R]."""
    prompts = [len(x["input_ids"]) // 4 for x in mine]
    p = max(prompts)
    r = max(len(x["input_ids"]) - q for x, q in zip(mine, prompts))
    b = len(mine)
    batch = {"input_ids": torch.zeros(b, p + r, dtype=torch.int64),
             "attention_mask": torch.zeros(b, p + r, dtype=torch.int64)}
    for name in FIELDS:
        batch[name] = torch.zeros(b, r, dtype=torch.float32)
    for i, (x, q) in enumerate(zip(mine, prompts)):
        n = len(x["input_ids"])
        batch["input_ids"][i, p - q:p - q + n] = torch.from_numpy(x["input_ids"])
        batch["attention_mask"][i, p - q:p - q + n] = 1
        for name in FIELDS:
            batch[name][i, :n - q] = torch.from_numpy(x[name][q:])
    return batch, r


def thdpack_threads(args, lengths):
    from thdpack import _thdpack
    from thdpack.torch.iterator import _to_sample, field_specs
    specs = field_specs({name: "target" for name in FIELDS})
    dp = args.threads
    shares = [[_to_sample(rollout(i, int(lengths[i])), f"sample {i}", specs)
               for i in range(d, args.samples, dp)] for d in range(dp)]
    opts = dict(tp=1, cp=1, dp=dp, pp=1, sp=False, data_on="tp0", global_batch=args.samples,
                max_tokens_per_rank=args.max_tokens, cost="llama2-7b", scheduler="balanced")
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        _thdpack._run_steps_on_threads(opts, 1, None, shares, None, specs)
        times.append(time.perf_counter() - t0)
    return times


def load_verl(cache):
    """verl's seqlen_balancing and npu_utils modules, executed from the wheel's own
    source with its package imports stubbed (its DataProto, device and tensordict helpers are
    not used on this path but imported at module level); None and the reason without them."""
    os.makedirs(cache, exist_ok=True)
    wheel = [f for f in os.listdir(cache) if f.startswith("verl-") and f.endswith(".whl")]
    have_einops = any(f.startswith("einops-") for f in os.listdir(cache))
    if not wheel or not have_einops:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                            cache, f"verl=={VERL_VERSION}", "einops"], capture_output=True,
                           text=True)
        if r.returncode != 0:
            return None, "pip download verl einops failed: " + r.stderr.strip()[-200:]
        wheel = [f for f in os.listdir(cache) if f.startswith("verl-") and f.endswith(".whl")]
    import zipfile
    for f in os.listdir(cache):
        if f.startswith("einops-") and f.endswith(".whl") and cache + "/" + f not in sys.path:
            sys.path.insert(0, os.path.join(cache, f))
    z = zipfile.ZipFile(os.path.join(cache, wheel[0]))
    verl = types.ModuleType("verl")
    verl.__path__ = []
    utils = types.ModuleType("verl.utils")
    utils.__path__ = []
    protocol = types.ModuleType("verl.protocol")
    protocol.DataProto = object
    device = types.ModuleType("verl.utils.device")
    device.get_device_name = lambda: "cpu"
    tu = types.ModuleType("verl.utils.tensordict_utils")
    # rearrange_micro_batches takes the rows of each microbatch with this; on a dict of padded
    # tensors it is an index_select of every entry (what it does on a TensorDict).
    tu.index_select_tensor_dict = lambda batch, idx: {
        k: v.index_select(0, torch.as_tensor(idx)) for k, v in batch.items()}
    utils.tensordict_utils = tu
    sys.modules.update({"verl": verl, "verl.utils": utils, "verl.protocol": protocol,
                        "verl.utils.device": device, "verl.utils.tensordict_utils": tu})
    mods = {}
    for name in ("seqlen_balancing", "npu_utils"):
        source = z.read(f"verl/utils/{name}.py").decode()
        spec = importlib.util.spec_from_loader(f"verl.utils.{name}", loader=None)
        m = importlib.util.module_from_spec(spec)
        exec(compile(source, f"verl/utils/{name}.py", "exec"), m.__dict__)
        mods[name] = m
    return mods, wheel[0]


def verl_rank(mods, lengths, dp, max_tokens):
    """One of verl's ranks: its share after the driver's balance, as padded tensors, through
    rearrange_micro_batches + unpad_input, and back through pad_input + restore."""
    sb, fa = mods["seqlen_balancing"], mods["npu_utils"]
    t0 = time.perf_counter()
    parts = sb.get_seqlen_balanced_partitions(lengths.tolist(), dp, equal_size=True)
    balance = time.perf_counter() - t0
    share = sorted(parts[0])
    S = int(lengths[share].max())
    B = len(share)
    batch = {"input_ids": torch.zeros(B, S, dtype=torch.int64),
             "attention_mask": torch.zeros(B, S, dtype=torch.int64)}
    for name in FIELDS:
        batch[name] = torch.zeros(B, S, dtype=torch.float32)
    for r, i in enumerate(share):
        x = rollout(int(i), int(lengths[i]))
        L = int(lengths[i])
        batch["input_ids"][r, :L] = torch.from_numpy(x["input_ids"])
        batch["attention_mask"][r, :L] = 1
        for name in FIELDS:
            batch[name][r, :L] = torch.from_numpy(x[name])
    t0 = time.perf_counter()
    mbs, idx = sb.rearrange_micro_batches(batch, max_token_len=max_tokens)
    packed = []
    for mb in mbs:
        ids, indices, cu, _, _ = fa.unpad_input(mb["input_ids"].unsqueeze(-1),
                                                mb["attention_mask"])
        fields = {name: fa.IndexFirstAxis.apply(mb[name].reshape(-1, 1), indices)
                  for name in FIELDS}
        packed.append((ids, indices, cu, fields, mb["input_ids"].shape))
    t1 = time.perf_counter()
    outs = []
    for ids, indices, cu, fields, (b, s) in packed:
        out = fa.pad_input(fields["old_logprobs"], indices, b, s).squeeze(-1)
        outs.append(torch.nn.functional.pad(out, (0, S - s)))
    restored = sb.restore_dynamic_batch(torch.cat(outs), idx)
    t2 = time.perf_counter()
    assert restored.shape == (B, S)
    return balance, t1 - t0, t2 - t1, len(mbs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/thdpack-bench"))
    args = ap.parse_args()
    lengths = lengths_of(args.samples, args.max_len)
    held = int(lengths.sum()) * 4 * len(FIELDS)
    print(f"{args.samples} rollouts, {int(lengths.sum())} tokens (mean {lengths.mean():.0f}, "
          f"max {lengths.max()}), {len(FIELDS)} float32 target fields ({held / 1e6:.1f} MB), "
          f"{args.max_tokens} tokens a microbatch")
    out = os.path.join(args.cache, "fields_bench_gloo.pt")
    os.makedirs(args.cache, exist_ok=True)
    mp.spawn(gloo_worker, args=(args.ranks, free_port(), args, out), nprocs=args.ranks)
    g = torch.load(out)
    threads = thdpack_threads(args, lengths)
    med = statistics.median
    print("\n| path | ranks | pack (ms) | unpack (ms) | microbatches a rank |")
    print("|---|---|---|---|---|")
    print(f"| thdpack pack_batch / step.unpack, gloo | {args.ranks} | {1e3 * med(g['pack']):.1f} | "
          f"{1e3 * med(g['unpack']):.1f} | {g['microbatches']} |")
    print(f"| thdpack from verl's padded batch: samples_from_padded + pack_batch / unpack + "
          f"padded_from_unpacked, gloo | {args.ranks} | {1e3 * med(g['adapted_in']):.1f} | "
          f"{1e3 * med(g['adapted_out']):.1f} | {g['microbatches']} |")
    print(f"| thdpack step on threads (pack only) | {args.threads} | {1e3 * med(threads):.1f} | - "
          f"| - |")
    mods, why = load_verl(args.cache)
    if mods is None:
        print(f"| verl | - | left out: {why} | | |")
    else:
        runs = [verl_rank(mods, lengths, args.ranks, args.max_tokens) for _ in range(args.repeats)]
        bal, pack, unpack = (med(r[k] for r in runs) for k in range(3))
        print(f"| verl ({why}): driver balance | 1 | {1e3 * bal:.1f} | - | - |")
        print(f"| verl: one rank's rearrange + unpad / pad + restore | 1 of {args.ranks} | "
              f"{1e3 * pack:.1f} | {1e3 * unpack:.1f} | {runs[0][3]} |")
        print(f"\nratio verl (balance + one rank's pack) / thdpack pack_batch: "
              f"{(bal + pack) / med(g['pack']):.2f}; unpack: {unpack / med(g['unpack']):.2f}")
        both = med(g["adapted_in"]) + med(g["adapted_out"])
        print(f"ratio verl (balance + pack + unpack) / thdpack with the adapters in and out: "
              f"{(bal + pack + unpack) / both:.2f}")
    print(f"\nbytes: the gloo step sent {g['sent'] / 1e6:.1f} MB over every rank and phase; the "
          f"fields the ranks hold after it: {g['held'] / 1e6:.1f} MB (the batch's fields: "
          f"{held / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
