"""PackedDataIterator's prefetching over spawned gloo worlds of 2 and 4 ranks: with prefetch = 1
and 2 every rank's steps (tensors, CP groups, figures) and the state after each step equal those
of prefetch = 0, for the balanced and the dynamic scheduler, a file and a caller-fed source; a
source that fails in step 2 raises at the caller's step 2 on every rank, after steps 0 and 1
were handed out; ``steps=`` ends the iteration where prefetch = 0 does; an iterator closed
mid-run (its thread ahead of the caller) leaves no rank in a collective: the world still works
and a new iterator continues from its state; a dropped iterator is freed, its thread ends and
its group is destroyed.

Nothing here is timed: the wait figures belong to bench/prefetch_bench.py.
"""
import gc
import os
import pickle
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as dist

from test_torch_iterator import (FailingShare, as_item, coords, free_port, join_gloo, make_groups,
                                 read_samples, same_array, to_numpy)
from worlds import spawn

GLOBAL_BATCH = 12
MAX_TOKENS = 160
STEPS = 4
N_SAMPLES = 60  # > STEPS * GLOBAL_BATCH: no wrap-around
VOCAB = 1000
KEYS = ("tokens", "position_ids", "labels", "loss_mask", "padding_mask", "cu_seqlens",
        "cu_seqlens_padded")
GROUP_KEYS = ("cp_size", "cp_rank", "cp_ranks", "idle", "max_seqlen", "n_valid")

# (tp, cp, dp, pp) by world size.
TOPOLOGIES = {2: [(1, 1, 2, 1), (1, 2, 1, 1)], 4: [(1, 2, 2, 1), (2, 1, 1, 2)]}


def write_samples(path, seed=5):
    """Samples of 1 to 150 tokens, every third with a loss mask."""
    import json
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(N_SAMPLES):
            L = int(rng.integers(1, 151))
            row = {"input_ids": rng.integers(0, VOCAB, L).tolist()}
            if i % 3 == 1:
                row["loss_mask"] = rng.integers(0, 2, L).tolist()
            f.write(json.dumps(row) + "\n")


def share_of(samples, dp, d, steps=STEPS):
    out = []
    for s in range(steps):
        out += [samples[s * GLOBAL_BATCH + i] for i in range(d, GLOBAL_BATCH, dp)]
    return out


def kwargs(scheduler, **extra):
    return dict(global_batch=GLOBAL_BATCH, max_tokens_per_rank=MAX_TOKENS, scheduler=scheduler,
                cost="llama2-7b" if scheduler == "dynamic" else "1,0.02", **extra)


def loader_of(c, scheduler):
    """The ranks that read with data_on="tp0": (tp, cp, pp) = 0 (balanced) or (tp, pp) = 0 and
    cp = 0 (dynamic: the same ranks)."""
    return c["tp"] == 0 and c["cp"] == 0 and c["pp"] == 0


def registered(group):
    """Whether torch.distributed still holds `group` (not destroyed)."""
    c10d = dist.distributed_c10d
    pg_map = c10d._world.pg_map if hasattr(c10d, "_world") else c10d._pg_map
    return group in pg_map


def run(groups, source, scheduler, prefetch, **extra):
    """Every step of the iterator as NumPy, each with the state after it; its last_wait values."""
    from thdpack.torch import PackedDataIterator
    it = PackedDataIterator(source, groups, prefetch=prefetch, **kwargs(scheduler, **extra))
    out, waits = [], []
    for step in it:
        d = to_numpy(step)
        d["state"] = it.state_dict()
        d["groups"] = [{k: mb[k] for k in GROUP_KEYS} for mb in step]
        out.append(d)
        waits.append(it.last_wait)
    it.close()
    return out, waits


def error_at(groups, source, prefetch):
    """(steps handed out, "Type: message") of an iterator whose source fails."""
    from thdpack.torch import PackedDataIterator
    it = PackedDataIterator(source, groups, prefetch=prefetch, **kwargs("balanced"))
    got = 0
    try:
        for _ in it:
            got += 1
    except Exception as e:  # noqa: BLE001 - the test looks at every rank's error
        return got, f"{type(e).__name__}: {e}"
    finally:
        it.close()
    return got, None


def worker(rank, world, port, data_path, out_dir):
    join_gloo(rank, world, port)
    from thdpack.torch import PackedDataIterator
    samples = read_samples(data_path)
    source = "jsonl:" + data_path
    results = {}
    for topo in TOPOLOGIES[world]:
        tp, cp, dp, pp = topo
        groups = make_groups(tp, cp, dp, pp)
        c = coords(rank, tp, cp, dp, pp)
        for scheduler in ("balanced", "dynamic"):
            for fed in (False, True):
                for prefetch in (0, 1, 2):
                    src = source
                    if fed:
                        src = ([as_item(x, k) for k, x in enumerate(share_of(samples, dp, c["dp"]))]
                               if loader_of(c, scheduler) else None)
                    steps, waits = run(groups, src, scheduler, prefetch,
                                       **({} if fed else {"steps": STEPS}))
                    assert all(isinstance(w, float) and w >= 0 for w in waits), waits
                    results[(topo, scheduler, fed, prefetch)] = steps
        # steps= ends the iteration at that step, whatever runs ahead.
        results[(topo, "limit")] = [len(run(groups, source, "balanced", p, steps=2)[0])
                                    for p in (0, 1, 2)]
        # A source that fails at the third step's first sample of loader dp = dp - 1.
        src = None
        if loader_of(c, "balanced"):
            items = [as_item(x, k) for k, x in enumerate(share_of(samples, dp, c["dp"]))]
            per_step = len(items) // STEPS
            src = FailingShare(items, 2 * per_step if c["dp"] == dp - 1 else len(items) + 1)
        results[(topo, "failure")] = error_at(groups, src, 3)

        # Closed after one step with the thread two steps ahead: the world still answers, and
        # an iterator from the closed one's state gives the uninterrupted run's steps 1..3.
        it = PackedDataIterator(source, groups, prefetch=2, **kwargs("balanced", steps=STEPS))
        next(it)
        state = it.state_dict()
        it.close()
        ping = torch.ones(1)
        dist.all_reduce(ping)
        assert int(ping) == world
        it = PackedDataIterator(source, groups, prefetch=2, **kwargs("balanced", steps=STEPS - 1))
        it.load_state_dict(state)
        results[(topo, "resumed")] = [to_numpy(s) for s in it]
        it.close()

        # Dropped without close, its thread ahead: the iterator is freed, its source closes as
        # close() would (the thread finishes the steps it owes its peers, every rank's the
        # same ones) and the data plane's group is destroyed.
        it = PackedDataIterator(source, groups, prefetch=1, **kwargs("balanced", steps=STEPS))
        next(it)
        group = it._src.data_group
        ref = weakref.ref(it)
        assert registered(group)
        del it
        gc.collect()
        results[(topo, "dropped")] = (ref() is None, registered(group))
        dist.barrier()
    # Bad values of prefetch: a ValueError naming it, before any collective.
    bad = []
    for value in (-1, 65, True, 1.5, "2"):
        try:
            PackedDataIterator(source, make_groups(1, 1, world, 1), prefetch=value,
                               **kwargs("balanced"))
            bad.append(None)
        except ValueError as e:
            bad.append(str(e))
    results["bad"] = bad
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def same_step(a, b, where):
    for name in ("num_microbatches", "n_loss_tokens", "seqlen_sum", "seqlen_squared_sum"):
        assert a[name] == b[name], f"{where}: {name} {a[name]} != {b[name]}"
    assert a["figures"] == b["figures"], where
    assert len(a["microbatches"]) == len(b["microbatches"]), where
    for m, (x, y) in enumerate(zip(a["microbatches"], b["microbatches"])):
        for k in KEYS:
            same_array(x[k], y[k], f"{where} mb {m} {k}")
    if "groups" in a:
        assert a["groups"] == b["groups"], where
        assert a["state"] == b["state"], where


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.no_sanitizer)])
def test_prefetch_equals_prefetch_zero(world, tmp_path):
    data = str(tmp_path / "samples.jsonl")
    write_samples(data)
    spawn(worker, args=(world, free_port(), data, str(tmp_path)), nprocs=world)
    got = [pickle.load(open(tmp_path / f"rank{r}.pkl", "rb")) for r in range(world)]
    for topo in TOPOLOGIES[world]:
        tp, cp, dp, pp = topo
        for scheduler in ("balanced", "dynamic"):
            for fed in (False, True):
                for r in range(world):
                    plain = got[r][(topo, scheduler, fed, 0)]
                    assert len(plain) == STEPS, (topo, scheduler, fed, r, len(plain))
                    for prefetch in (1, 2):
                        mine = got[r][(topo, scheduler, fed, prefetch)]
                        assert len(mine) == STEPS
                        for s in range(STEPS):
                            same_step(mine[s], plain[s],
                                      f"{topo} {scheduler} fed={fed} prefetch={prefetch} "
                                      f"rank {r} step {s}")
                    # The state after the last step: every sample read once, on every rank.
                    assert plain[-1]["state"]["consumed"] == STEPS * GLOBAL_BATCH
                    assert plain[-1]["state"] == got[0][(topo, scheduler, fed, 0)][-1]["state"]
        for r in range(world):
            assert got[r][(topo, "limit")] == [2, 2, 2], got[r][(topo, "limit")]
            # The failure: steps 0 and 1 handed out, step 2 raises on every rank.
            steps, error = got[r][(topo, "failure")]
            assert steps == 2 and error is not None and "disk on fire" in error, (topo, r, error)
            plain = got[r][(topo, "balanced", False, 0)]
            resumed = got[r][(topo, "resumed")]
            assert len(resumed) == STEPS - 1
            for s, step in enumerate(resumed):
                same_step(step, plain[s + 1], f"{topo} resumed after close, rank {r} step {s + 1}")
            # Freed, its group destroyed.
            assert got[r][(topo, "dropped")] == (True, False), got[r][(topo, "dropped")]
    for r in range(world):
        bad = got[r]["bad"]
        assert all(b is not None and "prefetch: " in b for b in bad), bad
