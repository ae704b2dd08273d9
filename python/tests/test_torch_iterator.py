"""PackedDataIterator over torch.distributed (gloo, loopback, spawned processes): every rank's
tensors equal, byte for byte, what the same C++ step delivers to that rank over threads, and
what a plain reference computes from the plan (pack, labels, zigzag), at several topologies,
both data_on modes and both kinds of source, with a rank multiple, and with Hugging Face's
labels; a failing source on one rank raises on every rank; Megatron's entry points return
Megatron's shapes and a PackedSeqParams.

One spawned world per world size runs every topology of that size (groups made once per
topology), to keep the suite within CI's time.
"""
import dataclasses
import datetime
import json
import os
import pickle
import socket
import sys
import tempfile
import time
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist

import thdpack
from thdpack import _thdpack
from worlds import spawn

STEPS = 2
GLOBAL_BATCH = 14
MAX_TOKENS = 48
N_SAMPLES = 40  # > STEPS * GLOBAL_BATCH: no wrap-around
VOCAB = 1000
COST = "1,0.02"
PAD_ID = 0

# (tp, cp, dp, pp, sp) by world size.
TOPOLOGIES = {
    4: [(1, 2, 2, 1, False)],
    8: [(2, 2, 2, 1, True), (1, 1, 2, 4, False), (2, 1, 2, 2, False), (2, 2, 1, 2, False)],
}
VARIANTS = [(data_on, fed) for data_on in ("tp0", "all") for fed in (False, True)]


def write_samples(path, seed=7):
    """A JSONL file of random samples, some with a loss_mask; returns them."""
    rng = np.random.default_rng(seed)
    samples = []
    with open(path, "w") as f:
        for i in range(N_SAMPLES):
            L = int(rng.integers(1, 47))  # fits MAX_TOKENS at CP = 1
            tokens = rng.integers(0, VOCAB, L).tolist()
            row = {"input_ids": tokens}
            mask = None
            if i % 3 == 1:
                mask = rng.integers(0, 2, L).tolist()
                row["loss_mask"] = mask
            f.write(json.dumps(row) + "\n")
            samples.append((tokens, mask))
    return samples


def options(tp, cp, dp, pp, sp, data_on, **more):
    return dict(tp=tp, cp=cp, dp=dp, pp=pp, sp=sp, data_on=data_on, global_batch=GLOBAL_BATCH,
                max_tokens_per_rank=MAX_TOKENS, cost=COST, scheduler="balanced", **more)


# World 4, beside its topology: the fp8 rank multiple (16 tokens a CP rank) at CP = 2 with
# thdpack's labels, and Hugging Face's labels at CP = 1 with SP and 8 tokens a TP rank.
RANK_MULTIPLE_RUN = ((1, 2, 2, 1, False), dict(rank_multiple="fp8"))
HF_RUN = ((2, 1, 2, 1, True), dict(rank_multiple=8, label_format="hf"))


def share_of(samples, dp, d, steps=STEPS):
    """Loader d's samples of the first `steps` steps, in order (source positions i = d mod DP)."""
    out = []
    for s in range(steps):
        out += [samples[s * GLOBAL_BATCH + i] for i in range(d, GLOBAL_BATCH, dp)]
    return out


def as_item(sample, k):
    """The loader's dict, in turn as NumPy arrays, torch tensors and lists."""
    tokens, mask = sample
    kind = k % 3
    conv = (lambda v: np.asarray(v, np.int64)) if kind == 0 else \
        (lambda v: torch.tensor(v)) if kind == 1 else list
    item = {"input_ids": conv(tokens)}
    if mask is not None:
        item["loss_mask"] = conv(mask)
    return item


def coords(rank, tp, cp, dp, pp):
    return {"tp": rank % tp, "cp": (rank // tp) % cp, "dp": (rank // (tp * cp)) % dp,
            "pp": rank // (tp * cp * dp)}


def make_groups(tp, cp, dp, pp, world=None):
    """Every TP, CP, DP, PP group of the world (Megatron's order), made on every rank. With
    ``world`` (a number of ranks below the default group's), of ranks 0 .. world-1 and their
    own world group (the other ranks, encoder ranks of their own, make them too and get None)."""
    from thdpack.torch import Groups
    rank = dist.get_rank()
    world_group = None
    if world is None:
        world = dist.get_world_size()
    else:
        world_group = dist.new_group(list(range(world)))
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    stride = {"tp": 1, "cp": tp, "dp": tp * cp, "pp": tp * cp * dp}
    mine = {}
    for k in ("tp", "cp", "dp", "pp"):
        seen = set()
        for r in range(world):
            c = coords(r, tp, cp, dp, pp)
            ranks = tuple(r + (i - c[k]) * stride[k] for i in range(sizes[k]))
            if ranks in seen:
                continue
            seen.add(ranks)
            g = dist.new_group(list(ranks))
            if rank in ranks:
                mine[k] = g
    if world_group is not None:
        return Groups(world=world_group, **mine) if rank < world else None
    return Groups(**mine)


def to_numpy(step):
    out = {"num_microbatches": step.num_microbatches, "n_loss_tokens": step.n_loss_tokens,
           "seqlen_sum": step.seqlen_sum, "seqlen_squared_sum": step.seqlen_squared_sum,
           "figures": step.figures, "microbatches": []}
    for mb in step:
        out["microbatches"].append({k: (v.numpy() if isinstance(v, torch.Tensor) else v)
                                    for k, v in mb.items()
                                    if k not in ("packed_seq_params", "cp_group")})
        # The microbatch's CP group: a torch group of exactly cp_ranks (None for one rank).
        g = mb["cp_group"]
        if mb["cp_size"] == 1:
            assert g is None
        else:
            world = dist.get_process_group_ranks(dist.group.WORLD)
            assert [world.index(r) for r in dist.get_process_group_ranks(g)] == mb["cp_ranks"]
            assert dist.get_rank(g) == mb["cp_rank"]
        psp = mb["packed_seq_params"]
        assert psp["qkv_format"] == "thd" and psp["max_seqlen_q"] == mb["max_seqlen"]
        assert torch.equal(psp["cu_seqlens_q"], mb["cu_seqlens"])
        assert torch.equal(psp["cu_seqlens_kv_padded"], mb["cu_seqlens_padded"])
        for k in ("cu_seqlens", "cu_seqlens_padded"):  # the host copies
            assert mb[k + "_cpu"].device.type == "cpu"
            assert torch.equal(mb[k + "_cpu"], mb[k].cpu())
    return out


def without_topology(opts):
    """Job options as PackedDataIterator takes them: the topology comes from the groups."""
    return {k: v for k, v in opts.items() if k not in ("tp", "cp", "dp", "pp")}


def second_step_error(source, groups, opts):
    """The error ("Type: message") the iterator's second step raises on this rank, or None."""
    from thdpack.torch import PackedDataIterator
    it = PackedDataIterator(source, groups, **without_topology(opts))
    next(it)
    try:
        next(it)
        return None
    except Exception as e:  # noqa: BLE001 - the test looks at every rank's error
        return f"{type(e).__name__}: {e}"


class FailingShare:
    """Yields a loader's share, then raises at sample `at`."""

    def __init__(self, items, at):
        self.items, self.at = items, at

    def __iter__(self):
        for k, item in enumerate(self.items):
            if k == self.at:
                raise OSError("disk on fire (test)")
            yield item


def join_gloo(rank, world, port, timeout=None):
    """A spawned worker's start: one thread, then a gloo world on localhost:port (its
    collectives' timeout `timeout` seconds, else torch's default)."""
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    kw = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    dist.init_process_group("gloo", rank=rank, world_size=world, **kw)


def read_samples(data_path):
    """The (input_ids, loss_mask or None) of each line of a JSONL file."""
    with open(data_path) as f:
        return [(d["input_ids"], d.get("loss_mask")) for d in map(json.loads, f)]


def worker(rank, world, port, data_path, out_dir):
    join_gloo(rank, world, port)
    from thdpack.torch import PackedDataIterator
    samples = read_samples(data_path)
    results = {}
    for tp, cp, dp, pp, sp in TOPOLOGIES[world]:
        groups = make_groups(tp, cp, dp, pp)
        c = coords(rank, tp, cp, dp, pp)
        for data_on, fed in VARIANTS:
            loader = data_on == "all" or (c["tp"] == 0 and c["cp"] == 0 and c["pp"] == 0)
            if fed:
                source = ([as_item(x, k) for k, x in enumerate(share_of(samples, dp, c["dp"]))]
                          if loader else None)
            else:
                source = "jsonl:" + data_path
            it = PackedDataIterator(source, groups,
                                    **without_topology(options(tp, cp, dp, pp, sp, data_on)))
            steps = [to_numpy(step) for step in it] if fed else \
                [to_numpy(next(it)) for _ in range(STEPS)]
            results[(tp, cp, dp, pp, sp, data_on, fed)] = steps
            it.close()
    if world == 4:
        for name, (topo, more) in (("rank_multiple", RANK_MULTIPLE_RUN), ("hf", HF_RUN)):
            groups = make_groups(*topo[:4])
            it = PackedDataIterator("jsonl:" + data_path, groups,
                                    **without_topology(options(*topo, "tp0", **more)))
            results[name] = [to_numpy(next(it)) for _ in range(STEPS)]
            it.close()
        tp, cp, dp, pp, sp = TOPOLOGIES[4][0]
        groups = make_groups(tp, cp, dp, pp)
        c = coords(rank, tp, cp, dp, pp)
        try:  # Hugging Face's labels need whole microbatches: refused at CP = 2
            PackedDataIterator("jsonl:" + data_path, groups, label_format="hf",
                               **without_topology(options(tp, cp, dp, pp, sp, "tp0")))
            results["hf_cp"] = None
        except ValueError as e:
            results["hf_cp"] = str(e)
        results["megatron"] = megatron_entry_points(groups, data_path, tp, cp, dp, pp, sp)
        # A source that fails on loader dp=1 in step 1: every rank raises, none hangs.
        source = None
        if c["tp"] == 0 and c["cp"] == 0 and c["pp"] == 0:
            items = [as_item(x, k) for k, x in enumerate(share_of(samples, dp, c["dp"]))]
            per_step = len(items) // STEPS
            source = FailingShare(items, per_step + 2 if c["dp"] == 1 else len(items) + 1)
        results["failure"] = second_step_error(source, groups, options(tp, cp, dp, pp, sp, "tp0"))
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


@dataclasses.dataclass
class StandInPackedSeqParams:
    """Megatron-LM main's PackedSeqParams fields, for a stack without megatron.core."""
    qkv_format: str = None
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_kv: torch.Tensor = None
    cu_seqlens_q_padded: torch.Tensor = None
    cu_seqlens_kv_padded: torch.Tensor = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None
    local_cp_size: int = None
    cp_group: object = None
    total_tokens: int = None
    pad_between_seqs: bool = None


def megatron_entry_points(groups, data_path, tp, cp, dp, pp, sp):
    """Megatron's entry points over the iterator: the real PackedSeqParams where megatron.core
    imports (the current stack), a stand-in with Megatron main's fields elsewhere."""
    try:
        from megatron.core.packed_seq_params import PackedSeqParams
    except ImportError:
        for name in ("megatron", "megatron.core", "megatron.core.packed_seq_params"):
            sys.modules.setdefault(name, types.ModuleType(name))
        sys.modules["megatron.core.packed_seq_params"].PackedSeqParams = StandInPackedSeqParams
        PackedSeqParams = StandInPackedSeqParams
    from thdpack.torch import megatron
    config = types.SimpleNamespace(max_seqlen_per_dp_cp_rank=MAX_TOKENS,
                                   sequence_packing_scheduler="dp_balanced",
                                   sequence_parallel=sp, global_batch_size=GLOBAL_BATCH)
    pgs = types.SimpleNamespace(tp=groups.tp, cp=groups.cp, dp=groups.dp, pp=groups.pp)
    source = "jsonl:" + data_path
    out = []
    for _ in range(STEPS):
        it, m, seqlen_sum, seqlen_sq = megatron.wrap_data_iterator(source, config, None, pgs,
                                                                   cost=COST)
        assert isinstance(seqlen_sum, float) and isinstance(seqlen_sq, float)
        batches = []
        for _ in range(m):
            t = megatron.get_batch_on_this_rank_for_sequence_packing(it, pg_collection=pgs,
                                                                     config=config)
            assert len(t) == 7 and t[3] is None
            assert type(t[5]) is PackedSeqParams and t[5].qkv_format == "thd"
            assert t[5].local_cp_size is None and t[5].cp_group is None  # static CP
            batches.append({"tokens": t[0].numpy(), "labels": t[1].numpy(),
                            "loss_mask": t[2].numpy(), "position_ids": t[4].numpy(),
                            "cu_seqlens_q": t[5].cu_seqlens_q.numpy(),
                            "cu_seqlens_kv_padded": t[5].cu_seqlens_kv_padded.numpy(),
                            "max_seqlen_q": t[5].max_seqlen_q, "padding_mask": t[6].numpy()})
        with pytest.raises(StopIteration):
            next(it)
        out.append({"num_microbatches": m, "seqlen_sum": seqlen_sum, "seqlen_sq": seqlen_sq,
                    "batches": batches})
    return out


# ---- the plain reference: pack, labels and zigzag from the plan, in NumPy ----

def reference_step(samples, step, tp, cp, dp, pp, sp, rank, rank_multiple=1,
                   label_format="megatron"):
    first = step * GLOBAL_BATCH
    pos = [first + i for i in range(GLOBAL_BATCH)]
    order = [p for d in range(dp) for p in pos if (p - first) % dp == d]  # scheduling order
    L = np.array([len(samples[p][0]) for p in order], np.int64)
    nt = np.array([(sum(samples[p][1][1:]) if samples[p][1] is not None else len(samples[p][0]) - 1)
                   for p in order], np.int64)
    plan = thdpack.schedule(L, nt, np.array(order, np.int64), dp_size=dp, cp_size=cp,
                            tp_size=tp, sp=sp, max_tokens_per_rank=MAX_TOKENS,
                            scheduler="balanced", cost=COST, rank_multiple=rank_multiple)
    layout = thdpack.ParallelLayout(cp_size=cp, tp_size=tp, sp=sp, rank_multiple=rank_multiple)
    c = coords(rank, tp, cp, dp, pp)
    totals = {"seqlen_sum": 0, "seqlen_squared_sum": 0,
              "n_loss_tokens": int(nt.sum()), "num_microbatches": plan.num_microbatches}
    mbs = []
    for d in range(dp):
        for m in range(plan.num_microbatches):
            ids = [int(i) for i in plan.microbatch(d, m)]
            lens = [len(samples[i][0]) for i in ids]
            P = [layout.padded_length(n) for n in lens]
            T = layout.microbatch_tokens(sum(P))
            P[-1] += T - sum(P)  # the last sequence absorbs the tail (SP, rank multiple)
            totals["seqlen_sum"] += T
            totals["seqlen_squared_sum"] += sum(p * p for p in P)
            if d != c["dp"]:
                continue
            tok, posi, lab, msk, pad = [], [], [], [], []
            for i, p in zip(ids, P):
                t, mk = samples[i]
                n = len(t)
                mk = mk if mk is not None else [1] * n
                tok += list(t) + [PAD_ID] * (p - n)
                posi += list(range(p))
                if label_format == "hf":  # token j itself where its own mask is 1
                    lab += [t[j] if 1 <= j < n and mk[j] else -100 for j in range(p)]
                    msk += [1 if 1 <= j < n and mk[j] else 0 for j in range(p)]
                else:
                    lab += [t[j + 1] if j + 1 < n else -100 for j in range(p)]
                    msk += [mk[j + 1] if j + 1 < n else 0 for j in range(p)]
                pad += [j >= n for j in range(p)]
            cup = np.concatenate([[0], np.cumsum(P)]).astype(np.int32)
            keep = []
            for s in range(len(ids)):
                chunk = P[s] // (2 * cp) if cp > 1 else P[s]
                if cp == 1:
                    keep += list(range(cup[s], cup[s + 1]))
                else:
                    r = c["cp"]
                    keep += list(range(cup[s] + r * chunk, cup[s] + (r + 1) * chunk))
                    q = 2 * cp - 1 - r
                    keep += list(range(cup[s] + q * chunk, cup[s] + (q + 1) * chunk))
            keep = np.array(keep, np.int64)
            first_stage, last_stage = c["pp"] == 0, c["pp"] == pp - 1
            mbs.append({
                "tokens": np.array(tok, np.int64)[keep] if first_stage else None,
                "position_ids": np.array(posi, np.int64)[keep] if first_stage else None,
                "labels": np.array(lab, np.int64)[keep] if last_stage else None,
                "loss_mask": np.array(msk, np.float32)[keep] if last_stage else None,
                "padding_mask": np.array(pad, bool)[keep],
                "cu_seqlens": np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
                "cu_seqlens_padded": cup,
                "max_seqlen": max(P),
            })
    return totals, mbs


def same_array(a, b, where):
    if a is None or b is None:
        assert a is None and b is None, where
        return
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    assert a.tobytes() == b.tobytes(), f"{where}: differs\n{a}\n{b}"


_PORTS = os.path.join(tempfile.gettempdir(), f"thdpack-test-ports-{os.getuid()}")


def _below_ephemeral():
    """The ports below the kernel's ephemeral range (ip_local_port_range), from 10000: a port
    the OS hands an outgoing connection is never one of them."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(10000, max(low, 11000))


def free_port():
    """A free port for a world's rendezvous that no other test process was given in the last
    10 minutes: one below the ephemeral range that binds now (a port the OS picked from that
    range could be given to another world's outgoing gloo connection before the store listens
    on it: the store's EADDRINUSE), and a claim file (created exclusively) keeps two
    pytest-xdist workers from starting worlds on one port, where the ranks of one world would
    join the other's store."""
    os.makedirs(_PORTS, exist_ok=True)
    ports = _below_ephemeral()
    while True:
        port = ports[int.from_bytes(os.urandom(4), "little") % len(ports)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use (a service, a world's store, TIME_WAIT): another
                continue
        claim = os.path.join(_PORTS, str(port))
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return port
        except FileExistsError:
            try:
                if time.time() - os.path.getmtime(claim) > 600:  # a stale claim: taken over
                    os.utime(claim)
                    return port
            except OSError:
                pass


@pytest.mark.parametrize("world", [4, pytest.param(8, marks=pytest.mark.no_sanitizer)])
def test_iterator_equals_threads_and_reference(world, tmp_path):
    data = str(tmp_path / "samples.jsonl")
    samples = write_samples(data)
    spawn(worker, args=(world, free_port(), data, str(tmp_path)), nprocs=world)
    got = [pickle.load(open(tmp_path / f"rank{r}.pkl", "rb")) for r in range(world)]
    keys = ("tokens", "position_ids", "labels", "loss_mask", "padding_mask", "cu_seqlens",
            "cu_seqlens_padded")
    for tp, cp, dp, pp, sp in TOPOLOGIES[world]:
        for data_on, fed in VARIANTS:
            key = (tp, cp, dp, pp, sp, data_on, fed)
            opts = options(tp, cp, dp, pp, sp, data_on)
            shares = [share_of(samples, dp, d) for d in range(dp)] if fed else None
            shares = None if shares is None else [
                [(np.asarray(t, np.int32), None if m is None else np.asarray(m, np.uint8))
                 for t, m in share] for share in shares]
            threads = _thdpack._run_steps_on_threads(opts, STEPS, None if fed else "jsonl:" + data,
                                                     shares)
            for r in range(world):
                steps = got[r][key]
                assert len(steps) == STEPS, (key, r, len(steps))
                for s in range(STEPS):
                    where = f"{key} rank {r} step {s}"
                    mine, ref_t = steps[s], threads[r][s]
                    totals, ref_mbs = reference_step(samples, s, tp, cp, dp, pp, sp, r)
                    for name, value in totals.items():
                        assert mine[name] == value, f"{where}: {name} {mine[name]} != {value}"
                    assert mine["figures"] == ref_t["figures"], where
                    assert len(mine["microbatches"]) == len(ref_t["microbatches"]) == len(ref_mbs)
                    for m, (a, b, ref) in enumerate(zip(mine["microbatches"],
                                                        ref_t["microbatches"], ref_mbs)):
                        for k in keys:
                            same_array(a[k], b[k], f"{where} mb {m} {k} (threads)")
                            same_array(a[k], ref[k], f"{where} mb {m} {k} (reference)")
                        assert a["max_seqlen"] == b["max_seqlen"] == ref["max_seqlen"], where
                    # Every TP rank of a stage holds identical tensors.
                    c = coords(r, tp, cp, dp, pp)
                    if c["tp"] > 0:
                        r0 = r - c["tp"]
                        for a, b in zip(mine["microbatches"], got[r0][key][s]["microbatches"]):
                            for k in keys:
                                same_array(a[k], b[k], f"{where} vs tp 0")
            # The iterable and the file give the same steps.
            if fed:
                for r in range(world):
                    for a, b in zip(got[r][key], got[r][key[:-1] + (False,)]):
                        for x, y in zip(a["microbatches"], b["microbatches"]):
                            for k in keys:
                                same_array(x[k], y[k], f"{key} rank {r}: iterable vs file")
    if world == 4:
        tp, cp, dp, pp, sp = TOPOLOGIES[4][0]
        for r in range(world):
            plain = got[r][(tp, cp, dp, pp, sp, "tp0", False)]
            for s, meg in enumerate(got[r]["megatron"]):
                assert meg["num_microbatches"] == plain[s]["num_microbatches"]
                assert meg["seqlen_sum"] == plain[s]["seqlen_sum"]
                assert meg["seqlen_sq"] == plain[s]["seqlen_squared_sum"]
                for b, mb in zip(meg["batches"], plain[s]["microbatches"]):
                    for k in ("tokens", "labels", "loss_mask", "position_ids", "padding_mask"):
                        assert b[k].shape == (1, mb[k].shape[0]), k
                        same_array(b[k][0], mb[k], f"megatron rank {r} step {s} {k}")
                    # The real offsets and the padded ones, as Megatron builds them.
                    same_array(b["cu_seqlens_q"], mb["cu_seqlens"], "megatron cu_seqlens_q")
                    same_array(b["cu_seqlens_kv_padded"], mb["cu_seqlens_padded"],
                               "megatron cu_seqlens_kv_padded")
                    assert b["max_seqlen_q"] == mb["max_seqlen"]
        for name, (topo, more) in (("rank_multiple", RANK_MULTIPLE_RUN), ("hf", HF_RUN)):
            r_mult = more["rank_multiple"]
            r_mult = 16 if r_mult == "fp8" else r_mult
            fmt = more.get("label_format", "megatron")
            threads = None
            if fmt == "megatron":  # the C++ step on threads (HF's labels are the iterator's)
                threads = _thdpack._run_steps_on_threads(options(*topo, "tp0", **more), STEPS,
                                                         "jsonl:" + data, None)
            for r in range(world):
                for s in range(STEPS):
                    where = f"{name} rank {r} step {s}"
                    mine = got[r][name][s]
                    totals, ref_mbs = reference_step(samples, s, *topo, r, r_mult, fmt)
                    for k, value in totals.items():
                        assert mine[k] == value, f"{where}: {k} {mine[k]} != {value}"
                    assert len(mine["microbatches"]) == len(ref_mbs), where
                    split = topo[1] * (topo[0] if topo[4] else 1)
                    for m, (a, ref) in enumerate(zip(mine["microbatches"], ref_mbs)):
                        for k in keys:
                            same_array(a[k], ref[k], f"{where} mb {m} {k} (reference)")
                        # Every rank's tokens a multiple of the rank multiple.
                        assert (int(a["cu_seqlens_padded"][-1]) // split) % r_mult == 0, where
                        if threads is not None:
                            for k in keys:
                                same_array(a[k], threads[r][s]["microbatches"][m][k],
                                           f"{where} mb {m} {k} (threads)")
                        if fmt == "hf":
                            same_array(a["input_ids"], a["tokens"], where)
                            same_array(a["cu_seq_lens_q"], a["cu_seqlens_padded"], where)
                            same_array(a["cu_seq_lens_k"], a["cu_seqlens_padded"], where)
                            assert a["max_length_q"] == a["max_length_k"] == a["max_seqlen"]
        for r in range(world):
            assert "label_format='hf' needs whole microbatches" in got[r]["hf_cp"], got[r]["hf_cp"]
            assert "got CP = 2" in got[r]["hf_cp"]
        failures = [got[r]["failure"] for r in range(world)]
        assert all(f is not None for f in failures), failures
        c = [coords(r, tp, cp, dp, pp) for r in range(world)]
        failed = [r for r in range(world) if c[r]["dp"] == 1 and c[r]["cp"] == 0 and c[r]["tp"] == 0]
        for r in range(world):
            assert "disk on fire" in failures[r], failures[r]
            if r not in failed:
                assert f"rank {failed[0]}" in failures[r], failures[r]


def single_rank_worker(rank, port, out_dir):
    """World size 1: the iterable source's rules, each as an error on the rank or a clean end."""
    join_gloo(0, 1, port)
    from thdpack.torch import Groups, PackedDataIterator
    groups = Groups()
    opts = dict(global_batch=4, max_tokens_per_rank=64, cost=COST)
    good = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}] * 8
    out = {}
    # Two whole steps, then the iterable ends at a step boundary: iteration stops.
    out["steps"] = [s.num_microbatches for s in PackedDataIterator(iter(good), groups, **opts)]

    def error_of(items):
        try:
            for _ in PackedDataIterator(iter(items), groups, **opts):
                pass
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return None

    out["mid_step"] = error_of(good[:6])
    out["mask"] = error_of(good[:2] + [{"input_ids": [1, 2], "loss_mask": [0, 2]}] + good[:1])
    out["range"] = error_of([{"input_ids": np.array([1, 2**40])}] + good[:3])
    out["length"] = error_of([{"input_ids": [1, 2], "loss_mask": [1]}] + good[:3])
    out["not_dict"] = error_of([[1, 2, 3]] + good[:3])
    try:
        Groups(dp=dist.new_group([0]), order="tp-cp-xx-pp")
        out["order"] = None
    except ValueError as e:
        out["order"] = str(e)
    for name, extra in (("hf_dynamic", dict(label_format="hf", scheduler="dynamic")),
                        ("label_format", dict(label_format="HF"))):
        try:
            PackedDataIterator(iter(good), groups, **dict(opts, **extra))
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    with open(os.path.join(out_dir, "single.pkl"), "wb") as f:
        pickle.dump(out, f)
    dist.destroy_process_group()


def test_iterable_source_rules(tmp_path):
    spawn(single_rank_worker, args=(free_port(), str(tmp_path)), nprocs=1)
    out = pickle.load(open(tmp_path / "single.pkl", "rb"))
    assert len(out["steps"]) == 2 and all(m >= 1 for m in out["steps"])
    assert "ended after 2 of the 4 samples" in out["mid_step"], out["mid_step"]
    assert "sample 2 of the share" in out["mask"] and "other than 0 and 1" in out["mask"], out["mask"]
    assert "got the dynamic scheduler" in out["hf_dynamic"], out["hf_dynamic"]
    assert "'HF' is not 'megatron'" in out["label_format"], out["label_format"]
    assert "outside [0, 2^31)" in out["range"], out["range"]
    assert "token-aligned" in out["length"], out["length"]
    assert "expected a dict with 'input_ids'" in out["not_dict"], out["not_dict"]
    assert "permutation" in out["order"], out["order"]


def world_backend_worker(rank, world, port, data_path, out_dir):
    """A world given as its own group (Megatron keeps gloo groups beside its NCCL ones): every
    group the step makes must be made with that world's backend, never the default one (with an
    NCCL default group, a group made without a backend is NCCL and the CPU collectives fail).
    NCCL cannot run here, so every dist.new_group call is recorded and its backend checked."""
    join_gloo(rank, world, port)
    from thdpack.torch import Groups, PackedDataIterator
    world_group = dist.new_group(list(range(world)), backend="gloo")
    tp, cp, dp, pp, sp = BACKEND_TOPOLOGY
    given = make_groups(tp, cp, dp, pp)  # made before the recording starts
    calls = []
    made = dist.new_group

    def recording_new_group(*args, **kwargs):
        calls.append(kwargs.get("backend", args[2] if len(args) > 2 else None))
        return made(*args, **kwargs)

    dist.new_group = recording_new_group
    try:
        opts = without_topology(options(tp, cp, dp, pp, sp, "tp0"))
        # The caller's TP and CP groups and its world; the step makes the others it needs (its
        # loaders' group, the replica group of TP x CP ranks) itself.
        groups = Groups(tp=given.tp, cp=given.cp, world=world_group)
        it = PackedDataIterator("jsonl:" + data_path, groups, **opts)
        steps = [to_numpy(next(it)) for _ in range(STEPS)]
        it.close()
    finally:
        dist.new_group = made
    with open(os.path.join(out_dir, f"backend{rank}.pkl"), "wb") as f:
        pickle.dump({"calls": calls, "world_backend": dist.get_backend(world_group),
                     "steps": steps}, f)
    dist.barrier()
    dist.destroy_process_group()


# One replica of TP x CP = 2 x 2: its replica group is none of the caller's groups.
BACKEND_TOPOLOGY = (2, 2, 1, 1, False)


def test_groups_the_step_makes_take_the_worlds_backend(tmp_path):
    world = 4
    data = str(tmp_path / "samples.jsonl")
    write_samples(data)
    spawn(world_backend_worker, args=(world, free_port(), data, str(tmp_path)), nprocs=world)
    tp, cp, dp, pp, sp = BACKEND_TOPOLOGY
    threads = _thdpack._run_steps_on_threads(options(tp, cp, dp, pp, sp, "tp0"), STEPS,
                                             "jsonl:" + data, None)
    for r in range(world):
        got = pickle.load(open(tmp_path / f"backend{r}.pkl", "rb"))
        assert got["calls"], f"rank {r}: the step made no group (nothing was checked)"
        assert all(b == got["world_backend"] for b in got["calls"]), (r, got["calls"])
        for s in range(STEPS):
            for a, b in zip(got["steps"][s]["microbatches"], threads[r][s]["microbatches"]):
                for k in ("tokens", "labels", "loss_mask", "cu_seqlens_padded"):
                    same_array(a[k], b[k], f"rank {r} step {s} {k}")


def test_step_figures_equal_plan_json():
    """step.figures (FiguresOf, the same code on threads as over torch) is plan --json's step for
    the same options: every field, sim_step_time included (a model cost), on loaders; the
    totals without per-replica detail elsewhere. The memory report is plan's alone."""
    opts = dict(tp=2, cp=2, dp=2, pp=1, global_batch=24, max_tokens_per_rank=16384,
                cost="llama2-7b", scheduler="balanced")
    threads = _thdpack._run_steps_on_threads(opts, 2, "mock", None)
    plan = thdpack.plan_job(data="mock", steps=2, **opts)
    for s in range(2):
        want = {k: v for k, v in plan["steps"][s].items() if k != "memory"}
        assert want["sim_step_time"] > 0
        for r, steps in enumerate(threads):
            got = steps[s]["figures"]
            if steps[s]["is_loader"]:
                assert got == want, (s, r)
            else:
                assert got == {k: v for k, v in want.items() if k != "replicas"}, (s, r)
