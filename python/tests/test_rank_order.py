"""PackedDataIterator under every rank order Groups accepts (spawned gloo worlds of 4 and 8
ranks; TP, CP, DP and PP mixed; the balanced and the dynamic scheduler; a file source, and a
caller-fed one at 4 ranks): the world rank that holds coordinates (tp, cp, dp, pp) under an
order gets, byte for byte, what the rank with the same coordinates gets under Megatron's
default order, its CP group's members (world ranks) renumbered the same way; and the members of
each of the caller's CP groups hold the complementary shards of one microbatch.

The caller's groups are made here by plain arithmetic from the order (an independent reference
for thdpack.Topology's rule). Orders that give the same rank -> coordinates mapping at a
topology (they differ only in dimensions of size 1) are run once; every one of the 24 is
checked to map like one that ran.
"""
import itertools
import json
import os
import pickle

import numpy as np
import pytest
import torch.distributed as dist

from test_torch_iterator import as_item, free_port, join_gloo, same_array, to_numpy
from worlds import spawn

DIMS = ("tp", "cp", "dp", "pp")
ORDERS = ["-".join(p) for p in itertools.permutations(DIMS)]
DEFAULT = "tp-cp-dp-pp"
STEPS = 2
GLOBAL_BATCH = 12
MAX_TOKENS = 96  # a sample of up to 89 tokens fits one rank (CP = 1)
N_SAMPLES = 40
VOCAB = 1000
KEYS = ("tokens", "position_ids", "labels", "loss_mask", "padding_mask", "cu_seqlens",
        "cu_seqlens_padded")
GROUP_KEYS = ("cp_size", "cp_rank", "idle", "max_seqlen", "n_valid", "sp_range")

# (tp, cp, dp, pp, sp) by world size, each with both schedulers; the sources by world size (a
# caller-fed one at 4 ranks). Every order at three dimensions of size 2 with PP as one of them
# runs on threads (tests/rank_order_test.cc); here the torch adapter and Groups are the subject.
TOPOLOGIES = {
    4: [(1, 2, 2, 1, False), (2, 1, 1, 2, False)],
    8: [(2, 2, 2, 1, True)],
}
FED = {4: (False, True), 8: (False,)}
SCHEDULERS = ("balanced", "dynamic")


def coords_of(rank, sizes, order):
    """(tp, cp, dp, pp) of a world rank under `order` (fastest first): plain arithmetic."""
    c, r = {}, rank
    for k in order.split("-"):
        c[k] = r % sizes[k]
        r //= sizes[k]
    return tuple(c[k] for k in DIMS)


def mapping(sizes, order):
    world = int(np.prod([sizes[k] for k in DIMS]))
    return tuple(coords_of(r, sizes, order) for r in range(world))


def distinct_orders(sizes):
    """One order per distinct rank -> coordinates mapping at these sizes, the default first."""
    seen, out = set(), []
    for order in [DEFAULT] + [o for o in ORDERS if o != DEFAULT]:
        m = mapping(sizes, order)
        if m not in seen:
            seen.add(m)
            out.append(order)
    return out


def caller_groups(sizes, order):
    """The caller's TP, CP, DP, PP groups under `order`, made on every rank (collective)."""
    from thdpack.torch import Groups
    rank, world = dist.get_rank(), dist.get_world_size()
    cs = [coords_of(r, sizes, order) for r in range(world)]
    mine = {}
    for i, k in enumerate(DIMS):
        if sizes[k] == 1:
            continue
        members = {}
        for r in range(world):  # ranks sharing every other coordinate, ordered by this one
            key = cs[r][:i] + cs[r][i + 1:]
            members.setdefault(key, []).append(r)
        for ranks in sorted(members.values()):
            ranks.sort(key=lambda r: cs[r][i])
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[k] = g
    return Groups(**mine, order=order)


def write_samples(path, seed=13):
    rng = np.random.default_rng(seed)
    samples = []
    with open(path, "w") as f:
        for i in range(N_SAMPLES):
            L = int(rng.integers(1, 90))
            tokens = rng.integers(0, VOCAB, L).tolist()
            row = {"input_ids": tokens}
            mask = None
            if i % 3 == 1:
                mask = rng.integers(0, 2, L).tolist()
                row["loss_mask"] = mask
            f.write(json.dumps(row) + "\n")
            samples.append((tokens, mask))
    return samples


def share_of(samples, dp, d):
    return [samples[s * GLOBAL_BATCH + i] for s in range(STEPS) for i in range(d, GLOBAL_BATCH, dp)]


def worker(rank, world, port, data_path, out_dir):
    join_gloo(rank, world, port)
    from thdpack.torch import PackedDataIterator
    with open(data_path) as f:
        samples = [(d["input_ids"], d.get("loss_mask")) for d in map(json.loads, f)]
    results = {}
    for tp, cp, dp, pp, sp in TOPOLOGIES[world]:
        sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        for order in distinct_orders(sizes):
            groups = caller_groups(sizes, order)
            assert groups.order == order
            c = dict(zip(DIMS, coords_of(rank, sizes, order)))
            assert groups.coord == c, (groups.coord, c)
            for scheduler in SCHEDULERS:
                for fed in FED[world]:
                    source = "jsonl:" + data_path
                    if fed:
                        source = [as_item(x, k) for k, x in
                                  enumerate(share_of(samples, dp, c["dp"]))]
                    it = PackedDataIterator(
                        source, groups, global_batch=GLOBAL_BATCH, max_tokens_per_rank=MAX_TOKENS,
                        scheduler=scheduler, sp=sp,
                        cost="llama2-7b" if scheduler == "dynamic" else "1,0.02")
                    steps = [to_numpy(next(it)) for _ in range(STEPS)]
                    it.close()
                    results[(tp, cp, dp, pp, sp, order, scheduler, fed)] = steps
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [4, pytest.param(8, marks=pytest.mark.no_sanitizer)])
def test_every_rank_order_gives_each_coordinate_the_default_orders_data(world, tmp_path):
    data = str(tmp_path / "samples.jsonl")
    write_samples(data)
    spawn(worker, args=(world, free_port(), data, str(tmp_path)), nprocs=world)
    got = [pickle.load(open(tmp_path / f"rank{r}.pkl", "rb")) for r in range(world)]
    for tp, cp, dp, pp, sp in TOPOLOGIES[world]:
        sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        ran = distinct_orders(sizes)
        assert len(ran) > 1, sizes  # the topology tells orders apart
        for order in ORDERS:  # every order maps like one that ran
            assert mapping(sizes, order) in {mapping(sizes, o) for o in ran}, order
        default_rank = {coords_of(r, sizes, DEFAULT): r for r in range(world)}
        for order in ran:
            to_default = [default_rank[coords_of(r, sizes, order)] for r in range(world)]
            for scheduler in SCHEDULERS:
                for fed in FED[world]:
                    key = (tp, cp, dp, pp, sp, order, scheduler, fed)
                    ref_key = (tp, cp, dp, pp, sp, DEFAULT, scheduler, fed)
                    for r in range(world):
                        mine, ref = got[r][key], got[to_default[r]][ref_key]
                        for s in range(STEPS):
                            where = f"{key} rank {r} (default rank {to_default[r]}) step {s}"
                            assert mine[s]["num_microbatches"] == ref[s]["num_microbatches"], where
                            assert mine[s]["n_loss_tokens"] == ref[s]["n_loss_tokens"], where
                            for m, (a, b) in enumerate(zip(mine[s]["microbatches"],
                                                           ref[s]["microbatches"])):
                                for k in KEYS:
                                    same_array(a[k], b[k], f"{where} mb {m} {k}")
                                for k in GROUP_KEYS:
                                    assert a[k] == b[k], f"{where} mb {m} {k}: {a[k]} != {b[k]}"
                                # The CP group's members, renumbered.
                                assert [to_default[x] for x in a["cp_ranks"]] == b["cp_ranks"], \
                                    f"{where} mb {m} cp_ranks {a['cp_ranks']} vs {b['cp_ranks']}"
                    check_cp_groups(got, key, sizes, order, world)


def check_cp_groups(got, key, sizes, order, world):
    """The members of each microbatch's CP group hold shards 0..c-1 of one microbatch (its m-th
    on each of them); for a static step that group is the caller's CP group under `order`."""
    scheduler = key[6]
    for s in range(STEPS):
        for r in range(world):
            for m, mb in enumerate(got[r][key][s]["microbatches"]):
                if mb["idle"]:
                    continue
                ranks = mb["cp_ranks"]
                where = f"{key} rank {r} step {s} mb {m}"
                if scheduler == "balanced":
                    c = coords_of(r, sizes, order)
                    want = sorted((x for x in range(world)
                                   if coords_of(x, sizes, order)[:1] + coords_of(x, sizes, order)[2:]
                                   == c[:1] + c[2:]), key=lambda x: coords_of(x, sizes, order)[1])
                    assert ranks == want, f"{where}: cp_ranks {ranks}, the caller's CP group {want}"
                assert len(ranks) == mb["cp_size"] and ranks[mb["cp_rank"]] == r, where
                for k, x in enumerate(ranks):  # microbatch m of every member: one microbatch
                    other = got[x][key][s]["microbatches"][m]
                    assert other["cp_ranks"] == ranks and other["cp_rank"] == k, where
                    same_array(other["cu_seqlens_padded"], mb["cu_seqlens_padded"], where)
