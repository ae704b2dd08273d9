"""PackedDataIterator with scheduler="dynamic" over torch.distributed (gloo, spawned processes):
every rank's tensors and CP group equal, byte for byte, what the C++ dynamic step delivers to
that rank over threads, at (tp, cp, dp, pp) = (1,2,2,1), (1,4,1,1), (2,2,2,1) with SP and
(1,2,2,2), both data_on modes and both kinds of source; each microbatch's groups, unsharded
the plain way, hold the step's samples exactly once; a failing source on one loader raises on
every rank; a cache of one CP group evicts and stays exact; Megatron's entry points hand each
microbatch's group to PackedSeqParams as its hybrid CP path expects.
"""
import json
import os
import pickle
import types

import numpy as np
import pytest
import torch.distributed as dist

from thdpack import _thdpack
from test_torch_iterator import (FailingShare, as_item, coords, free_port, join_gloo, make_groups,
                                 read_samples, same_array, second_step_error, to_numpy,
                                 without_topology)
from worlds import spawn

STEPS = 2
GLOBAL_BATCH = 14
MAX_TOKENS = 48
N_SAMPLES = 70  # > (STEPS + 2) * GLOBAL_BATCH: no wrap-around, also for the 4-step cache run
VOCAB = 1000
COST = "llama2-7b"  # the dynamic scheduler minimises the modelled step time: a model cost

# (tp, cp, dp, pp, sp) by world size; every domain DP x CP has 4 ranks.
TOPOLOGIES = {
    4: [(1, 2, 2, 1, False), (1, 4, 1, 1, False)],
    8: [(2, 2, 2, 1, True), (1, 2, 2, 2, False)],
}
VARIANTS = [(data_on, fed) for data_on in ("tp0", "all") for fed in (False, True)]
KEYS = ("tokens", "position_ids", "labels", "loss_mask", "padding_mask", "cu_seqlens",
        "cu_seqlens_padded")
GROUP_KEYS = ("cp_size", "cp_rank", "cp_ranks", "idle", "max_seqlen", "sp_range", "n_valid")


def write_samples(path, seed=11):
    """Samples of 1 to 150 tokens (up to 4 ranks of 48 each): groups of every size."""
    rng = np.random.default_rng(seed)
    samples = []
    with open(path, "w") as f:
        for i in range(N_SAMPLES):
            L = int(rng.integers(1, 151))
            tokens = rng.integers(0, VOCAB, L).tolist()
            row = {"input_ids": tokens}
            mask = None
            if i % 4 == 1:
                mask = rng.integers(0, 2, L).tolist()
                row["loss_mask"] = mask
            f.write(json.dumps(row) + "\n")
            samples.append((tokens, mask))
    return samples


def options(tp, cp, dp, pp, sp, data_on, **extra):
    return dict(tp=tp, cp=cp, dp=dp, pp=pp, sp=sp, data_on=data_on, global_batch=GLOBAL_BATCH,
                max_tokens_per_rank=MAX_TOKENS, cost=COST, scheduler="dynamic", **extra)


def share_of(samples, dp, d, steps=STEPS):
    out = []
    for s in range(steps):
        out += [samples[s * GLOBAL_BATCH + i] for i in range(d, GLOBAL_BATCH, dp)]
    return out


def is_reader(c, data_on):
    """The dynamic step's readers: ranks cp = 0 of the first slice (tp0) or of every one (all)."""
    return c["cp"] == 0 and (data_on == "all" or (c["tp"] == 0 and c["pp"] == 0))


def iterate(groups, source, topo, data_on, steps=STEPS, **extra):
    from thdpack.torch import PackedDataIterator
    it = PackedDataIterator(source, groups, **without_topology(options(*topo, data_on, **extra)))
    out = [to_numpy(next(it)) for _ in range(steps)]
    it.close()
    return out


def worker(rank, world, port, data_path, out_dir):
    join_gloo(rank, world, port)
    samples = read_samples(data_path)
    results = {}
    for topo in TOPOLOGIES[world]:
        tp, cp, dp, pp, sp = topo
        groups = make_groups(tp, cp, dp, pp)
        c = coords(rank, tp, cp, dp, pp)
        for data_on, fed in VARIANTS:
            if fed:
                source = ([as_item(x, k) for k, x in enumerate(share_of(samples, dp, c["dp"]))]
                          if is_reader(c, data_on) else None)
            else:
                source = "jsonl:" + data_path
            results[topo + (data_on, fed)] = iterate(groups, source, topo, data_on)
    if world == 4:
        topo = TOPOLOGIES[4][0]
        tp, cp, dp, pp, sp = topo
        groups = make_groups(tp, cp, dp, pp)
        c = coords(rank, tp, cp, dp, pp)
        # A cache of one group over four steps: groups are destroyed and made again.
        results["cache"] = iterate(groups, "jsonl:" + data_path, topo, "tp0", steps=4,
                                   max_cp_groups=1)
        results["megatron"] = megatron_entry_points(groups, data_path)
        # A source that fails on loader dp=1 in step 1: every rank raises, none hangs.
        source = None
        if is_reader(c, "tp0"):
            items = [as_item(x, k) for k, x in enumerate(share_of(samples, dp, c["dp"]))]
            per_step = len(items) // STEPS
            source = FailingShare(items, per_step + 2 if c["dp"] == 1 else len(items) + 1)
        results["failure"] = second_step_error(source, groups, options(*topo, "tp0"))
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def megatron_entry_points(groups, data_path):
    """Megatron's entry points with config.hybrid_context_parallel: each PackedSeqParams carries
    local_cp_size and the microbatch's torch CP group (None for a group of one)."""
    from thdpack.torch import megatron
    config = types.SimpleNamespace(max_seqlen_per_dp_cp_rank=MAX_TOKENS,
                                   hybrid_context_parallel=True, global_batch_size=GLOBAL_BATCH)
    pgs = types.SimpleNamespace(tp=groups.tp, cp=groups.cp, dp=groups.dp, pp=groups.pp)
    out = []
    world = dist.get_process_group_ranks(dist.group.WORLD)
    source = "jsonl:" + data_path  # one object: later calls continue its step loop
    for _ in range(STEPS):
        it, m, _, _ = megatron.wrap_data_iterator(source, config, None, pgs, cost=COST)
        batches = []
        for _ in range(m):
            t = megatron.get_batch_on_this_rank_for_sequence_packing(it, pg_collection=pgs,
                                                                     config=config,
                                                                     dynamic_cp=True)
            psp = t[5]
            local_cp = psp["local_cp_size"] if isinstance(psp, dict) else psp.local_cp_size
            group = psp["cp_group"] if isinstance(psp, dict) else psp.cp_group
            ranks = None if group is None else [world.index(r)
                                                for r in dist.get_process_group_ranks(group)]
            batches.append({"tokens": t[0].numpy(), "local_cp_size": local_cp,
                            "group_ranks": ranks})
        out.append(batches)
    return out


def zigzag(cup, cp, r):
    """Global positions CP rank r of cp keeps (the plain definition)."""
    keep = []
    for s in range(len(cup) - 1):
        P = cup[s + 1] - cup[s]
        if cp == 1:
            keep += list(range(cup[s], cup[s + 1]))
            continue
        chunk = P // (2 * cp)
        for q in (r, 2 * cp - 1 - r):
            keep += list(range(cup[s] + q * chunk, cup[s] + (q + 1) * chunk))
    return np.array(keep, np.int64)


def check_groups_hold_the_samples(samples, step_index, topo, per_rank, where):
    """The first stage's shards of every group, unsharded the plain way, are the step's samples
    (each exactly once, the padding after each), and every rank of a group agrees on it."""
    tp, cp, dp, pp, sp = topo
    world = tp * cp * dp * pp
    want = sorted(tuple(samples[step_index * GLOBAL_BATCH + i][0]) for i in range(GLOBAL_BATCH))
    got = []
    M = per_rank[0]["num_microbatches"]
    for m in range(M):
        seen = set()
        for r in range(world):
            c = coords(r, tp, cp, dp, pp)
            if c["tp"] != 0 or c["pp"] != 0:
                continue
            mb = per_rank[r]["microbatches"][m]
            if mb["idle"] or tuple(mb["cp_ranks"]) in seen:
                continue
            seen.add(tuple(mb["cp_ranks"]))
            cup = mb["cu_seqlens_padded"].astype(np.int64)
            cu = mb["cu_seqlens"].astype(np.int64)
            full = np.full(int(cup[-1]), -1, np.int64)
            pad = np.zeros(int(cup[-1]), bool)  # the padding of the microbatch, plainly
            for s in range(len(cu) - 1):
                pad[cup[s] + (cu[s + 1] - cu[s]):cup[s + 1]] = True
            for k, member in enumerate(mb["cp_ranks"]):
                other = per_rank[member]["microbatches"][m]
                assert other["cp_rank"] == k and other["cp_ranks"] == mb["cp_ranks"], where
                same_array(other["cu_seqlens_padded"], mb["cu_seqlens_padded"], where)
                keep = zigzag(cup, mb["cp_size"], k)
                full[keep] = other["tokens"]
                same_array(other["padding_mask"], pad[keep], f"{where} padding_mask")
            for s in range(len(cu) - 1):
                n = int(cu[s + 1] - cu[s])
                got.append(tuple(full[cup[s]:cup[s] + n].tolist()))
                assert np.all(full[cup[s] + n:cup[s + 1]] == 0), f"{where}: padding"
    assert sorted(got) == want, f"{where}: the groups do not hold the step's samples once each"


@pytest.mark.parametrize("world", [4, pytest.param(8, marks=pytest.mark.no_sanitizer)])
def test_dynamic_iterator_equals_threads(world, tmp_path):
    data = str(tmp_path / "samples.jsonl")
    samples = write_samples(data)
    got = {}
    spawn(worker, args=(world, free_port(), data, str(tmp_path)), nprocs=world)
    got[world] = [pickle.load(open(tmp_path / f"rank{r}.pkl", "rb")) for r in range(world)]
    sizes_seen = set()
    for topo in TOPOLOGIES[world]:
        for data_on, fed in VARIANTS:
            key = topo + (data_on, fed)
            tp, cp, dp, pp, sp = topo
            shares = None
            if fed:
                shares = [[(np.asarray(t, np.int32),
                            None if m is None else np.asarray(m, np.uint8))
                           for t, m in share_of(samples, dp, d)] for d in range(dp)]
            threads = _thdpack._run_steps_on_threads(options(*topo, data_on), STEPS,
                                                     None if fed else "jsonl:" + data, shares)
            for s in range(STEPS):
                per_rank = [got[world][r][key][s] for r in range(world)]
                for r in range(world):
                    where = f"{key} rank {r} step {s}"
                    mine, ref = per_rank[r], threads[r][s]
                    assert mine["figures"] == ref["figures"], where
                    assert mine["num_microbatches"] == ref["num_microbatches"], where
                    assert mine["n_loss_tokens"] == ref["n_loss_tokens"], where
                    for m, (a, b) in enumerate(zip(mine["microbatches"],
                                                   ref["microbatches"])):
                        for k in KEYS:
                            same_array(a[k], b[k], f"{where} mb {m} {k}")
                        for k in GROUP_KEYS:
                            assert a[k] == b[k], f"{where} mb {m} {k}: {a[k]} != {b[k]}"
                        assert a["dynamic"], where
                        sizes_seen.add(a["cp_size"])
                assert "groups_made" in per_rank[0]["figures"], key
                check_groups_hold_the_samples(samples, s, topo, per_rank, f"{key} step {s}")
            # The iterable and the file give the same steps.
            if fed:
                for r in range(world):
                    for a, b in zip(got[world][r][key], got[world][r][key[:-1] + (False,)]):
                        for x, y in zip(a["microbatches"], b["microbatches"]):
                            for k in KEYS:
                                same_array(x[k], y[k], f"{key} rank {r}: iterable vs file")
    assert {1, 2}.issubset(sizes_seen) and max(sizes_seen) >= 3, sizes_seen
    if world != 4:
        return

    # World 4: the cache of one group, the failing source, Megatron's entry points.
    topo = TOPOLOGIES[4][0]
    tp, cp, dp, pp, sp = topo
    threads = _thdpack._run_steps_on_threads(options(*topo, "tp0", max_cp_groups=1), 4,
                                             "jsonl:" + data, None)
    evicted = 0
    for s in range(4):
        figures = got[world][0]["cache"][s]["figures"]
        evicted += figures["groups_evicted"]
        assert figures["groups_cached"] <= max(1, figures["groups_made"] +
                                               figures["groups_reused"]), figures
        for r in range(world):
            for a, b in zip(got[world][r]["cache"][s]["microbatches"], threads[r][s]["microbatches"]):
                for k in KEYS:
                    same_array(a[k], b[k], f"cache rank {r} step {s} {k}")
    assert evicted > 0, "a cache of one group evicted nothing"
    failures = [got[world][r]["failure"] for r in range(world)]
    failed = [r for r in range(world) if coords(r, *topo[:4])["dp"] == 1
              and coords(r, *topo[:4])["cp"] == 0]
    for r in range(world):
        assert failures[r] is not None and "disk on fire" in failures[r], failures[r]
        if r not in failed:
            assert f"rank {failed[0]}" in failures[r], failures[r]
    plain = {r: got[world][r][topo + ("tp0", False)] for r in range(world)}
    for r in range(world):
        for s, batches in enumerate(got[world][r]["megatron"]):
            assert len(batches) == plain[r][s]["num_microbatches"]
            for b, mb in zip(batches, plain[r][s]["microbatches"]):
                assert b["tokens"].shape == (1, mb["tokens"].shape[0])
                same_array(b["tokens"][0], mb["tokens"], f"megatron rank {r} step {s}")
                assert b["local_cp_size"] == mb["cp_size"]
                assert b["group_ranks"] == (mb["cp_ranks"] if mb["cp_size"] > 1 else None)
