"""One job, agreed over the world; the options a step took, and which were defaulted.

Two gloo ranks given different options (a careless launch) - a field float32 on one and float64
on the other, keep_groups on one only, another scheduler, max_tokens_per_rank or cost, other
field names - each raise on both ranks when the iterator (or pack_batch) is made, naming the
option and both values: before the job was agreed they aborted the process inside gloo, or
planned the step by two plans (one sample on both replicas, another on none), or matched fields
by position under the other rank's name. A check one rank fails alone before a collective (a
misspelt option, a bad label_format, pack_batch's own arguments, RLStatistics.summary with other
names or with nothing added) raises on both ranks too, never leaving the other waiting in the
collective. Every case runs in one world, one after the other: a case that left a rank behind
would hang the next, which the world's timeout turns into a failure.
"""
import datetime
import os

import numpy as np
import torch
import torch.distributed as dist

from worlds import spawn

WORLD = 2
FIELDS = {"adv": {"kind": "sample", "dtype": "float32"}}


def rollouts(n, seed=3):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, 50, int(rng.integers(2, 30))),
             "adv": np.float32(rng.normal())} for _ in range(n)]


# (case, what rank 1 is given instead of rank 0's, the texts each rank's error must hold)
CASES = [
    ("field dtype", {"fields": {"adv": {"kind": "sample", "dtype": "float64"}}},
     ["the job differs over the world: fields[0]", "float64", "float32"]),
    ("field name", {"fields": {"advantage": {"kind": "sample", "dtype": "float32"}}},
     ["fields[0]", "advantage (sample float32", "adv (sample float32"]),
    ("keep_groups on one rank", {"keep_groups": "replica", "group_field": "uid",
                                 "fields": dict(FIELDS, uid={"kind": "sample",
                                                             "dtype": "int64"})},
     ["the job differs over the world: keep_groups", '"replica"', '"none"']),
    ("scheduler", {"scheduler": "sequential"},
     ["the job differs over the world: scheduler", '"sequential"', '"balanced"']),
    ("max_tokens_per_rank", {"max_tokens_per_rank": 4096},
     ["the job differs over the world: max_tokens_per_rank", '"4096"', '"16384"']),
    ("cost", {"cost": "tokens"},
     ["the job differs over the world: cost", '"tokens (a 1', '"llama2-7b (a ']),
]


def make(source, groups, rank, extra):
    from thdpack.torch import PackedDataIterator
    opts = dict(global_batch=8, fields=FIELDS, prefetch=0)
    if rank == 1:
        opts.update(extra)
    if "keep_groups" in opts:  # rank 1's samples carry the group field it declares
        source = [dict(x, uid=np.int64(k // 2)) for k, x in enumerate(source)]
    return PackedDataIterator(source, groups, **opts)


def error_of(fn):
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def worker(rank, port, out):
    from test_torch_iterator import make_groups
    from thdpack.torch import PackedDataIterator, RLStatistics, pack_batch
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    # A rank left waiting fails the case after 60 s instead of hanging the test.
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    groups = make_groups(1, 1, WORLD, 1)
    items = rollouts(8)
    mine = items[rank::WORLD]
    got = {}
    for name, extra, _ in CASES:
        got[name] = error_of(lambda: make(mine, groups, rank, extra))
    # One rank's own error before the collective.
    got["misspelt option"] = error_of(lambda: PackedDataIterator(
        mine, groups, global_batch=8, fields=FIELDS, prefetch=0,
        **({"max_token_per_rank": 4096} if rank == 1 else {})))
    got["label_format"] = error_of(lambda: PackedDataIterator(
        mine, groups, global_batch=8, fields=FIELDS, prefetch=0,
        label_format="hf-shifted" if rank == 1 else "megatron"))
    got["pack_batch argument"] = error_of(lambda: pack_batch(
        mine, groups, fields=FIELDS, **({"steps": 2} if rank == 1 else {})))
    # The same job on both ranks: a step, its options and what was defaulted.
    it = PackedDataIterator(mine, groups, global_batch=8, fields=FIELDS, prefetch=0,
                            scheduler="balanced")
    step = next(it)
    options = (dict(step.options), sorted(step.options.defaulted))
    it.close()
    # RLStatistics over the world: other names on rank 1, then nothing added on rank 1.
    for case, names in (("RLStatistics names", ("ratio", "kl") if rank == 0 else ("ratio",)),
                        ("RLStatistics nothing added", ("ratio",) if rank == 0 else ())):
        stats = RLStatistics()
        for mb in step:
            if names:
                stats.add_microbatch(mb, **{n: torch.ones(mb["loss_mask"].shape[0],
                                                          dtype=torch.float64) for n in names})
        got[case] = error_of(lambda: stats.summary(groups.world))
    # An error about a defaulted option says so: a sample longer than CP x max_tokens_per_rank.
    long = [dict(x, input_ids=np.zeros(20000, dtype=np.int64)) if k == 0 else x
            for k, x in enumerate(mine)]
    got["defaulted in an error"] = error_of(lambda: next(iter(PackedDataIterator(
        long, groups, global_batch=8, fields=FIELDS, prefetch=0))))
    # And the world still works: every case left both ranks in step.
    t = torch.ones(1)
    dist.all_reduce(t)
    torch.save((got, options, float(t)), f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_a_job_that_differs_over_the_world_is_named_on_every_rank(tmp_path):
    from test_torch_iterator import free_port
    spawn(worker, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    results = [torch.load(f"{tmp_path}/rank{r}.pt") for r in range(WORLD)]
    for rank, (got, options, total) in enumerate(results):
        assert total == WORLD
        for name, _, texts in CASES:
            e = got[name]
            assert e is not None, (rank, name)
            for text in texts + ["on world rank 1", "on world rank 0"]:
                assert text in e, (rank, name, text, e)
            # Rank 1 found the difference; rank 0 gets it as the peer's failure.
            assert e.startswith("ValueError" if rank == 1 else "RuntimeError"), (rank, name, e)
        for name, text in (("misspelt option", "unexpected keyword argument 'max_token_per_rank'"),
                           ("label_format", "'hf-shifted' is not 'megatron'"),
                           ("pack_batch argument", "steps is the batch's own"),
                           ("RLStatistics names", "names is \"ratio\" on world rank 1 and "
                                                  "\"kl,ratio\" on world rank 0"),
                           ("RLStatistics nothing added", "this rank added no microbatch")):
            assert got[name] is not None and text in got[name], (rank, name, got[name])
        assert got["misspelt option"].startswith("TypeError" if rank == 1 else "RuntimeError")
        e = got["defaulted in an error"]
        assert e is not None and "max_tokens_per_rank defaulted" in e, (rank, e)
        values, defaulted = options
        assert values["max_tokens_per_rank"] == 16384 and values["cost"] == "llama2-7b"
        assert values["scheduler"] == "balanced" and values["global_batch"] == 8
        assert "max_tokens_per_rank" in defaulted and "cost" in defaulted
        assert "scheduler" not in defaulted and "global_batch" not in defaulted
        assert "dp" not in defaulted  # the groups give the topology
