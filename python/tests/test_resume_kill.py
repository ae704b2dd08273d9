"""Proof by killing: a training loop over PackedDataIterator (spawned gloo ranks) saves its
state every step as a checkpoint would (rank 0 writes the state with the run's log, atomically),
and is killed with SIGKILL - the whole job, at random steps, mid-step included - and restarted
from its last checkpoint, on another topology and world size each time, until the run is done.
Over the whole run: every step is in the log once, with the samples of an uninterrupted run;
every sample of every epoch is trained exactly once; and every rank's tensors are, byte for
byte, those an uninterrupted run at the same topology hands that rank. Once with a shuffled
mock source, once with a JSONL file, once with the mock source in steps counted in tokens
(global_batch_tokens: the samples a step takes vary with their lengths), and once with its long
samples cut into pieces (oversize "split": the pieces are the stream's samples), and once with
the JSONL file's samples in two Parquet files (thdpack/arrow.h, read through pyarrow).

This file is also the worker: ``python test_resume_kill.py CONFIG_JSON`` under RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
"""
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

GLOBAL_BATCH = 8
BATCH_TOKENS = 300  # the token-counted run: about 7 samples a step of the mock lengths
TOTAL = 12  # steps of the run
SPLIT_LONGEST = 64  # the split run: the longest piece (the mock's lengths reach 200)
STEP_SECONDS = 0.08  # the simulated compute of a step

# (tp, cp, dp, pp, scheduler) by world size.
TOPOLOGIES = {
    2: [(1, 1, 2, 1, "balanced"), (1, 2, 1, 1, "balanced"), (2, 1, 1, 1, "balanced")],
    4: [(1, 2, 2, 1, "balanced"), (1, 1, 4, 1, "sequential"), (1, 2, 2, 1, "dynamic"),
        (2, 1, 1, 2, "balanced")],
}


def options(source, scheduler, tokens=0, split=False, topology=None):
    opts = dict(global_batch=GLOBAL_BATCH, max_tokens_per_rank=256, scheduler=scheduler,
                cost="llama2-7b")
    if tokens:
        opts = dict(opts, global_batch_tokens=tokens)
    if split:
        # Pieces of at most SPLIT_LONGEST tokens at every topology: the longest a step keeps
        # (CP x max tokens per rank; a dynamic step's widest group, DP x CP of them) must not
        # change on resume, as the pieces are the stream's samples.
        tp, cp, dp, pp = (topology or (1, 1, 1, 1, ""))[:4]
        ranks = cp * (dp if scheduler == "dynamic" else 1)
        opts = dict(opts, oversize="split", max_tokens_per_rank=SPLIT_LONGEST // ranks)
    if source.startswith("mock"):
        opts.update(shuffle=True, seed=5, mock_samples=20)
    return opts


def digest(mb):
    """A hash of what a rank holds of a microbatch."""
    h = hashlib.sha1()
    for k in ("tokens", "position_ids", "labels", "loss_mask", "cu_seqlens_padded"):
        v = mb[k]
        if v is None:
            h.update(b"-")
        else:
            v = v.numpy() if hasattr(v, "numpy") else v
            h.update(str(v.dtype).encode() + v.tobytes())
    return h.hexdigest()


def worker_main(config_path):
    import torch
    import torch.distributed as dist
    from thdpack.torch import PackedDataIterator
    from test_torch_iterator import make_groups
    with open(config_path) as f:
        cfg = json.load(f)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tp, cp, dp, pp, scheduler = cfg["topology"]
    groups = make_groups(tp, cp, dp, pp)
    it = PackedDataIterator(cfg["source"], groups,
                            **options(cfg["source"], scheduler, cfg["tokens"], cfg["split"],
                                      cfg["topology"]))
    log = []
    if os.path.exists(cfg["checkpoint"]):
        with open(cfg["checkpoint"]) as f:
            ckpt = json.load(f)
        it.load_state_dict(ckpt["state"])
        log = ckpt["log"]
    while it.state_dict()["next_step"] < TOTAL:
        step = next(it)
        ids = None
        if rank == 0:
            if step.dynamic:
                ids = sorted(i for mb in step.figures["groups"] for g in mb for i in g["samples"])
            else:
                ids = sorted(i for r in step.figures["replicas"] for mb in r["microbatches"]
                             for i in mb["samples"])
        hashes = [None] * dist.get_world_size()
        dist.all_gather_object(hashes, [digest(mb) for mb in step])
        time.sleep(STEP_SECONDS)  # the training step
        if rank == 0:
            log.append({"step": step.step, "ids": ids, "topology": cfg["topology"],
                        "hashes": hashes})
            tmp = cfg["checkpoint"] + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"state": step.state_dict(), "log": log}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, cfg["checkpoint"])
        dist.barrier()
    # The source's thread, which makes the step after the last one ahead of the loop, is
    # stopped on every rank together before the process groups go (a thread still in a
    # collective at exit aborted a rank once a peer had gone: -6, on torch 1.13).
    it.close()
    dist.destroy_process_group()


def launch(cfg_path, world):
    from test_torch_iterator import free_port  # a claimed port (xdist workers side by side)
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONPATH=os.pathsep.join(sys.path),
               OMP_NUM_THREADS="1")
    return [subprocess.Popen([sys.executable, __file__, cfg_path], env=dict(env, RANK=str(r)),
                             start_new_session=True)
            for r in range(world)]


def committed(path):
    try:
        with open(path) as f:
            return json.load(f)["state"]["next_step"]
    except FileNotFoundError:
        return 0


def run_killed(tmp_path, source, kills, rng, tokens=0, split=False):
    """The run, killed `kills` times at random steps and restarted; returns the final log and
    the topologies used."""
    ckpt = str(tmp_path / "ckpt.json")
    attempt = 0
    kills_done = 0
    used = set()
    while committed(ckpt) < TOTAL:
        world = rng.choice([2, 4]) if attempt else 4
        topology = rng.choice(TOPOLOGIES[world])
        used.add(tuple(topology))
        cfg = tmp_path / f"cfg{attempt}.json"
        cfg.write_text(json.dumps({"source": source, "topology": topology, "checkpoint": ckpt,
                                   "tokens": tokens, "split": split}))
        procs = launch(str(cfg), world)
        start = committed(ckpt)
        if attempt < kills:
            # Kill a few steps on, at a random point inside a step.
            target = min(TOTAL - 2, start + rng.randint(1, 3))  # two steps left at least
            deadline = time.time() + 120
            while committed(ckpt) < target and all(p.poll() is None for p in procs):
                if time.time() > deadline:
                    pytest.fail("no progress in 120 s")
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.7 * STEP_SECONDS))
            alive = [p for p in procs if p.poll() is None]
            for p in alive:
                os.killpg(p.pid, signal.SIGKILL)
            kills_done += bool(alive)
        for p in procs:
            p.wait(timeout=120)
        if attempt >= kills:
            assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]
        attempt += 1
    assert kills_done == kills, f"{kills_done} of {kills} kills hit a running job"
    with open(ckpt) as f:
        return json.load(f)["log"], used


# Not under the sanitizers: killed and restarted interpreters are the subject; the C++ of a
# resume runs under ASan on threads (ResumeTest) and in test_resume.py's world.
@pytest.mark.no_sanitizer
@pytest.mark.parametrize("kind", ["mock", "jsonl", "parquet", "mock-tokens", "mock-split"])
def test_killed_and_resumed_run_trains_every_sample_once(tmp_path, kind):
    import thdpack
    from thdpack import _thdpack
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    if kind in ("jsonl", "parquet"):
        from test_torch_iterator import write_samples
        path = str(tmp_path / "data.jsonl")
        rows = write_samples(path)  # 40 samples: the run crosses two epoch ends
        source = "jsonl:" + path
        epoch_size = 40
        if kind == "parquet":  # the same samples in two Parquet files of row groups of 6
            pa = pytest.importorskip("pyarrow")
            import pyarrow.parquet as pq
            table = pa.table({"input_ids": [t for t, _ in rows],
                              "loss_mask": [m if m is not None else [1] * len(t)
                                            for t, m in rows]})
            (tmp_path / "pq").mkdir()
            pq.write_table(table.slice(0, 25), tmp_path / "pq" / "a.parquet", row_group_size=6)
            pq.write_table(table.slice(25), tmp_path / "pq" / "b.parquet", row_group_size=6)
            source = f"parquet:{tmp_path / 'pq'}"
    else:
        config = tmp_path / "mock.json"  # short lengths: every sample fits 256 tokens a rank
        config.write_text(json.dumps({"mode": "distribution", "type": "lognormal",
                                      "min_seq_len": 2, "max_seq_len": 200,
                                      "mean_seq_len": 40, "lognormal_sigma": 1.0}))
        source = "mock:" + str(config)
        epoch_size = 20
    tokens = BATCH_TOKENS if kind.endswith("tokens") else 0
    split = kind.endswith("split")
    if split:  # the stream's samples are the pieces: an epoch holds sum ceil(L / longest)
        lengths = thdpack.read_lengths(source, shuffle=True, seed=5, mock_num_samples=20)
        epoch_size = sum(-(-int(n) // SPLIT_LONGEST) for n in lengths["lengths"])
        assert epoch_size > 20  # some samples were cut
    log, used = run_killed(tmp_path, source, kills=3 if kind.startswith("mock") else 2, rng=rng,
                           tokens=tokens, split=split)
    assert [e["step"] for e in log] == list(range(TOTAL)), f"seed {seed}"
    # The samples of every step are those of an uninterrupted run (any topology: the plan).
    one_rank = dict(dp=1, cp=1) if split else {}  # the longest piece of options' topology
    plan = thdpack.plan_job(data=source, steps=TOTAL,
                            **options(source, "balanced", tokens, split), **one_rank)
    for entry, want in zip(log, plan["steps"]):
        got_ids = entry["ids"]
        want_ids = sorted(i for r in want["replicas"] for mb in r["microbatches"]
                          for i in mb["samples"])
        assert got_ids == want_ids, f"seed {seed}: step {entry['step']}"
    # Every sample of every epoch exactly once (ids count the stream: id = epoch * size + i).
    trained = sorted(i for e in log for i in e["ids"])
    assert trained == list(range(len(trained))), f"seed {seed}"
    if not tokens and not split:
        assert len(trained) == TOTAL * GLOBAL_BATCH
    elif split:  # the split stream: pieces, none longer than SPLIT_LONGEST
        assert sum(w["n_split"] for w in plan["steps"]) > 0, f"seed {seed}"
        assert len(trained) == TOTAL * GLOBAL_BATCH
    else:  # steps in tokens: each within the budget, the counts of samples varying
        assert len({len(e["ids"]) for e in log}) > 1, f"seed {seed}"
        assert all(w["real_tokens"] <= tokens for w in plan["steps"]), f"seed {seed}"
    for epoch in range(len(trained) // epoch_size):
        assert sum(1 for i in trained if i // epoch_size == epoch) == epoch_size
    # Byte for byte what an uninterrupted run at the same topology hands each rank.
    reference = {}
    for topology in used:
        tp, cp, dp, pp, scheduler = topology
        opts = dict(options(source, scheduler, tokens, split, topology), tp=tp, cp=cp, dp=dp,
                    pp=pp)
        steps = _thdpack._run_steps_on_threads(opts, TOTAL, source, None)
        reference[topology] = [[[digest(mb) for mb in s["microbatches"]] for s in per_rank]
                               for per_rank in steps]
    for entry in log:
        ref = reference[tuple(entry["topology"])]
        for r, got in enumerate(entry["hashes"]):
            assert got == ref[r][entry["step"]], \
                f"seed {seed}: step {entry['step']} rank {r} at {entry['topology']}"


if __name__ == "__main__":
    worker_main(sys.argv[1])
