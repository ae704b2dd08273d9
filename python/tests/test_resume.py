"""Resuming a run from Python: the run state's record (check_run_state, run_state_at, the files),
plan_job from a step and from a state, and PacketDataIterator.state_dict / load_state_dict over
spawned gloo worlds - at another topology and scheduler, with another global batch, with a
caller-fed source whose loaders continue at loader_positions, through Megatron's entry points
and its consumed_train_samples - against the steps of an uninterrupted run.
"""
import json
import os
import pickle
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist

import thdpack
from thdpack import _thdpack

from test_torch_iterator import (coords, free_port, join_gloo, make_groups, read_samples,
                                 write_samples)
from worlds import spawn

# The module's spawned world (resume_results) is made once, in one pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("resume")

GLOBAL_BATCH = 8
MAX_TOKENS = 256
COST = "1,0.02"


def plan_ids(report):
    """The sample ids of each step of a plan_job / run_job report, sorted."""
    out = []
    for step in report:
        ids = []
        for replica in step["replicas"]:
            for mb in replica["microbatches"]:
                ids += mb["samples"]
        out.append(sorted(ids))
    return out


def test_state_record_checks_and_positions(tmp_path):
    report = thdpack.plan_job(data="mock", global_batch=8, steps=3, dp=2, cp=2, shuffle=True,
                              mock_samples=20, max_tokens_per_rank=16384)
    state = report["state"]
    assert state["next_step"] == 3 and state["consumed"] == 24
    assert state["cursor"]["epoch"] == 1 and state["cursor"]["position"] == 4
    assert state["data"]["seed"] == 1234 and state["data"]["shuffle"] is True
    assert thdpack.check_run_state(state) == state
    assert thdpack.check_run_state(json.dumps(state)) == state
    edited = dict(state, consumed=25)
    with pytest.raises(ValueError, match='field "checksum"'):
        thdpack.check_run_state(edited)
    with pytest.raises(ValueError, match="not a JSON record"):
        thdpack.check_run_state(json.dumps(state)[:-7])
    with pytest.raises(TypeError, match="expected a run state"):
        thdpack.check_run_state(42)
    at = thdpack.run_state_at(state, 10, 77)
    assert at["next_step"] == 10 and at["consumed"] == 77 and at["cursor"] is None
    assert at["data"] == state["data"]
    path = str(tmp_path / "state.json")
    thdpack.write_run_state(path, state)
    assert thdpack.read_run_state(path) == state
    # The positions a caller-fed loader yields, at a new DP size and global batch.
    from thdpack.torch import loader_positions
    it = loader_positions(state, 5, 2, 1)
    assert [next(it) for _ in range(6)] == [25, 27, 30, 32, 35, 37]
    it = loader_positions(0, 4, 4, 3)
    assert [next(it) for _ in range(3)] == [3, 7, 11]
    with pytest.raises(ValueError, match="loader_positions"):
        next(loader_positions(0, 4, 2, 2))


def test_plan_job_from_a_step_and_from_a_state(tmp_path):
    common = dict(data="mock", global_batch=10, dp=2, cp=2, shuffle=True, mock_samples=23,
                  max_tokens_per_rank=16384, cost="tokens")
    whole = thdpack.plan_job(steps=6, **common)
    from_step = thdpack.plan_job(steps=3, start_step=3, **common)
    assert from_step["steps"] == whole["steps"][3:]
    assert from_step["state"] == whole["state"]
    path = str(tmp_path / "s.json")
    thdpack.plan_job(steps=3, save_state=path, **common)
    # Another topology and scheduler from the state: the same samples in every step.
    other = dict(common, dp=4, cp=1)
    resumed = thdpack.plan_job(steps=3, resume=path, **other)
    assert plan_ids(resumed["steps"]) == plan_ids(whole["steps"][3:])
    assert [s["step"] for s in resumed["steps"]] == [3, 4, 5]
    with pytest.raises(ValueError, match="resume: the state was saved with seed 1234"):
        thdpack.plan_job(steps=1, resume=path, **dict(common, seed=5))
    with pytest.raises(ValueError, match="--start-step"):
        thdpack.plan_job(steps=1, resume=path, start_step=2, **common)


# --- the iterator over spawned gloo worlds ---------------------------------------------------

def ids_of(step):
    """The sample ids of a step as a planning rank sees it (None elsewhere): a dynamic step's
    from its groups (a sample of a group of c ranks is in each of their microbatches)."""
    if not step.is_loader:
        return None
    if step.dynamic:
        return sorted(i for mb in step.figures["groups"] for g in mb for i in g["samples"])
    return sorted(i for replica in step.figures["replicas"] for mb in replica["microbatches"]
                  for i in mb["samples"])


def tensors_of(step):
    return [{k: (v.numpy().copy() if isinstance(v, torch.Tensor) else v)
             for k, v in mb.items() if k in ("tokens", "labels", "loss_mask", "position_ids",
                                             "cu_seqlens_padded")}
            for mb in step]


def resume_worker(rank, world, port, data_path, out_dir):
    join_gloo(rank, world, port)
    from thdpack.torch import PackedDataIterator, megatron
    samples = read_samples(data_path)
    out = {}
    common = dict(global_batch=GLOBAL_BATCH, max_tokens_per_rank=MAX_TOKENS, cost=COST)

    # 1. A file source: 4 steps at (cp 2, dp 2), the state after step 1 saved on every rank.
    g22 = make_groups(1, 2, 2, 1)
    it = PackedDataIterator("jsonl:" + data_path, g22, **common)
    assert it.state_dict()["next_step"] == 0
    steps = [next(it) for _ in range(4)]
    out["whole_ids"] = [ids_of(s) for s in steps]
    out["whole_tensors"] = [tensors_of(s) for s in steps]
    out["states"] = [s.state_dict() for s in steps]
    out["state_after_1"] = steps[1].state_dict()
    assert it.state_dict() == steps[3].state_dict()
    with pytest.raises(RuntimeError, match="before the first step"):
        it.load_state_dict(out["state_after_1"])
    it.close()
    # The same topology from the state: the same bytes.
    it = PackedDataIterator("jsonl:" + data_path, g22, **common)
    it.load_state_dict(out["state_after_1"])
    out["same_topology"] = [tensors_of(next(it)) for _ in range(2)]
    it.close()
    # Another topology (dp 4), then the dynamic scheduler (cp 2 dp 2, llama cost).
    g14 = make_groups(1, 1, 4, 1)
    it = PackedDataIterator("jsonl:" + data_path, g14, **common)
    it.load_state_dict(json.loads(json.dumps(out["state_after_1"])))  # as from a checkpoint
    out["dp4_ids"] = [ids_of(next(it)) for _ in range(2)]
    it.close()
    it = PackedDataIterator("jsonl:" + data_path, g22, global_batch=GLOBAL_BATCH,
                            max_tokens_per_rank=MAX_TOKENS, scheduler="dynamic")
    it.load_state_dict(out["state_after_1"])
    out["dynamic_ids"] = [ids_of(next(it)) for _ in range(2)]
    it.close()
    # A new global batch continues at the stream position.
    it = PackedDataIterator("jsonl:" + data_path, g14, **dict(common, global_batch=9))
    it.load_state_dict(out["state_after_1"])
    out["batch9_ids"] = ids_of(next(it))
    it.close()
    # A state that does not fit: the same ValueError on every rank.
    other = os.path.join(out_dir, f"other{rank}.jsonl")  # the first 30 lines: other data
    with open(data_path) as f, open(other, "w") as g:
        g.writelines(f.readlines()[:30])
    it = PackedDataIterator("jsonl:" + other, g22, **common)
    try:
        it.load_state_dict(out["state_after_1"])
        out["bad"] = None
    except ValueError as e:
        out["bad"] = str(e)
    it.close()

    # 2. A caller-fed source: loaders continue at loader_positions; a sample that says its
    # position is checked.
    c = coords(rank, 1, 2, 2, 1)
    loader = c["tp"] == 0 and c["cp"] == 0 and c["pp"] == 0

    def fed(groups, dp, d, state=None, shift=0):
        if not loader:
            return None
        from thdpack.torch import loader_positions
        start = 0 if state is None else state

        def gen():
            for p in loader_positions(start, GLOBAL_BATCH, dp, d):
                if p >= len(samples):
                    return
                tokens, mask = samples[p]
                item = {"input_ids": tokens, "position": p + shift}
                if mask is not None:
                    item["loss_mask"] = mask
                yield item
        return gen()

    it = PackedDataIterator(fed(g22, 2, c["dp"]), g22, **common)
    fed_steps = [next(it) for _ in range(3)]
    out["fed_ids"] = [ids_of(s) for s in fed_steps]
    fed_state = fed_steps[0].state_dict()
    it.close()
    assert fed_state["cursor"] is None and fed_state["data"]["source"] == "fed"
    c14 = coords(rank, 1, 1, 4, 1)
    loader = True  # every rank of (1, 1, 4, 1) is a loader
    it = PackedDataIterator(fed(g14, 4, c14["dp"], fed_state), g14, **common)
    it.load_state_dict(fed_state)
    out["fed_resumed_ids"] = [ids_of(next(it)) for _ in range(2)]
    it.close()
    # An iterable that did not continue where the state says: named on the loader, raised
    # everywhere.
    it = PackedDataIterator(fed(g14, 4, c14["dp"], fed_state, shift=1), g14, **common)
    it.load_state_dict(fed_state)
    try:
        next(it)
        out["fed_bad"] = None
    except Exception as e:  # noqa: BLE001
        out["fed_bad"] = f"{type(e).__name__}: {e}"
    it.close()

    # 3. Megatron's counters: a restarted job given consumed_train_samples and iteration.
    config = types.SimpleNamespace(max_seqlen_per_dp_cp_rank=MAX_TOKENS,
                                   global_batch_size=GLOBAL_BATCH)
    pgs = types.SimpleNamespace(tp=None, cp=g22.cp, dp=g22.dp, pp=None)
    source = "jsonl:" + data_path
    consumed = megatron.consumed_train_samples(out["state_after_1"])
    _, m, _, _ = megatron.wrap_data_iterator(source, config, None, pgs, cost=COST,
                                             consumed_train_samples=consumed, iteration=2)
    wrapped = megatron._ITERATORS[id(source)][1]
    out["megatron_state"] = wrapped.state_dict()
    out["megatron_consumed"] = consumed
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def resume_results(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    data = str(d / "data.jsonl")
    write_samples(data)
    out = d / "out"
    out.mkdir()
    spawn(resume_worker, args=(4, free_port(), data, str(out)), nprocs=4)
    results = []
    for r in range(4):
        with open(out / f"rank{r}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results, data


def test_iterator_resumes_on_any_topology(resume_results):
    results, data = resume_results
    zero = results[0]
    whole = zero["whole_ids"]
    # The state is the same on every rank.
    for r in results[1:]:
        assert r["states"] == zero["states"]
        assert r["state_after_1"] == zero["state_after_1"]
    assert zero["state_after_1"]["next_step"] == 2
    assert zero["state_after_1"]["consumed"] == 2 * GLOBAL_BATCH
    # The steps after the state, on another topology and with the dynamic scheduler.
    assert zero["dp4_ids"] == whole[2:4]
    assert zero["dynamic_ids"] == whole[2:4]
    # Every rank at the same topology: the same bytes as the uninterrupted run.
    for r in results:
        for got, want in zip(r["same_topology"], r["whole_tensors"][2:4]):
            assert len(got) == len(want)
            for a, b in zip(got, want):
                for k in a:
                    assert (a[k] is None and b[k] is None) or np.array_equal(a[k], b[k]), k
    # A batch of 9 from position 16: samples 16..24.
    assert zero["batch9_ids"] == list(range(16, 25))
    for r in results:
        assert r["bad"] is not None and "resume: the state was saved with data" in r["bad"], \
            r["bad"]


def test_fed_loaders_continue_at_their_positions(resume_results):
    results, _ = resume_results
    zero = results[0]
    # Fed ids are stream positions: the file's ids.
    assert zero["fed_ids"] == zero["whole_ids"][:3]
    assert zero["fed_resumed_ids"] == zero["whole_ids"][1:3]
    for r in results:
        assert r["fed_bad"] is not None and "position" in r["fed_bad"], r["fed_bad"]
    assert "expected 6" in results[0]["fed_bad"] or "position" in results[0]["fed_bad"]


def test_megatron_counters_resume(resume_results):
    results, _ = resume_results
    zero = results[0]
    assert zero["megatron_consumed"] == 16
    st = zero["megatron_state"]
    assert st["next_step"] == 3 and st["consumed"] == 16 + GLOBAL_BATCH
