"""Every way a training script leaves a prefetching PackedDataIterator ends its process with
status 0: close(); break out of the loop and drop it, then destroy_process_group(); break and
just return (the interpreter's exit); an exception raised in the loop and caught outside; the
iterator freed with `del` before destroy_process_group(). Each rank is an interpreter of its
own (never a forked one, which skips the interpreter's finalisation), on gloo worlds of 2 and 4
ranks. An abort there was a race (1 run in 5 of 4 ranks): ten worlds here are a guard, and
bench/exit_paths.py, which runs each path many times with the CPU loaded, is the measure.

With the Python prefetcher the four paths that leave without close() ended about 1 world in 25
of the current stack's suite with one rank's "terminate called without an active exception"
(torch 2 only), and were quarantined there. The iterator's source is now the C++ StepSource,
closed by an atexit hook before the interpreter finalises; bench/exit_paths.py counted 210
worlds of 4 ranks for each of the four paths without close() and 30 with close() (3,480 rank
processes) on torch 2 with the CPU loaded, every rank with status 0 (docs/decisions.md,
"Prefetching"), and they run on both stacks again.
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest


PATHS = ("close", "break_destroy", "break_return", "exception", "del_destroy")
# pack_batch called once, then the process ends, with and without destroy_process_group. The
# step pack_batch returns and its iterator hold each other; uncollected, they kept the C++ source
# and its torch groups until the collection inside the interpreter's finalisation, where a rank
# aborted ("terminate called without an active exception": 10 and 7 of 100 rank processes on
# torch 2.15). The exit hook collects garbage before and after closing (iterator.py,
# _stop_at_exit); bench/exit_paths.py counts these paths (--paths batch_return,batch_destroy).
BATCH_PATHS = ("batch_return", "batch_destroy")
RUNS = 1  # per path and world size (the race it guards against hit 1 run in 5 at 4 ranks)


def write_samples(path):
    rng = np.random.default_rng(3)
    with open(path, "w") as f:
        for _ in range(200):
            tokens = rng.integers(0, 1000, int(rng.integers(1, 90)))
            f.write(json.dumps({"input_ids": tokens.tolist()}) + "\n")


def rank_main(path, data, store):
    """One rank (RANK, WORLD_SIZE in the environment; `store` the world's FileStore, so that
    worlds started side by side never meet at one port)."""
    import faulthandler
    import torch
    import torch.distributed as dist
    from thdpack.torch import Groups, PackedDataIterator
    # An abort prints every thread's Python stack (the thread that aborts shows none when it is
    # one of torch's); a rank still running after 150 s prints them and ends (the test's limit
    # for a world is 180 s): a hang shows where it is.
    faulthandler.enable(all_threads=True)
    faulthandler.dump_traceback_later(float(os.environ.get("THDPACK_TEST_HANG_S", "150")),
                                      exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store,
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    world, rank = dist.get_world_size(), dist.get_rank()
    cp = 2
    dp = world // cp
    cp_group = dp_group = None
    for d in range(dp):
        g = dist.new_group([d * cp + c for c in range(cp)])
        if rank // cp == d:
            cp_group = g
    for c in range(cp):
        g = dist.new_group([d * cp + c for d in range(dp)])
        if rank % cp == c:
            dp_group = g
    groups = Groups(cp=cp_group, dp=dp_group if dp > 1 else None)
    if path in BATCH_PATHS:
        from thdpack.torch import pack_batch
        with open(data) as f:
            samples = [{"input_ids": json.loads(line)["input_ids"]} for line in f][:8]
        loader = rank % cp == 0
        step = pack_batch(samples[rank // cp::dp] if loader else None, groups,
                          max_tokens_per_rank=256, cost="1,0.02")
        assert step.num_microbatches >= 1
        if path == "batch_destroy":
            dist.destroy_process_group()
        print(f"rank {rank}: {path} done", flush=True)
        return
    opts = dict(global_batch=8, max_tokens_per_rank=256, cost="1,0.02", prefetch=1)
    # A state loaded first, as a resumed job does.
    it = PackedDataIterator("jsonl:" + data, groups, **opts)
    state = it.state_dict()
    it.close()
    it = PackedDataIterator("jsonl:" + data, groups, **opts)
    it.load_state_dict(state)
    if path == "close":
        for _ in range(4):
            next(it)
        it.close()
        dist.destroy_process_group()
    elif path in ("break_destroy", "break_return", "del_destroy"):
        for k, _ in enumerate(it):
            if k == 3:
                break
        if path == "del_destroy":
            del it
        if path != "break_return":
            dist.destroy_process_group()
    elif path == "exception":
        try:
            for k, _ in enumerate(it):
                if k == 3:
                    raise KeyError("the training loop failed")
        except KeyError:
            pass
        dist.destroy_process_group()
    print(f"rank {rank}: {path} done", flush=True)


def run_world(path, world, data):
    env = dict(os.environ, WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    store = tempfile.mktemp(prefix="thdpack-exit-store-")  # a name the first rank creates
    procs = [subprocess.Popen([sys.executable, __file__, path, data, store],
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = []
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            said = "\n".join(f"rank {k}: {q.communicate()[0]}" for k, q in enumerate(procs))
            raise AssertionError(f"{path}, world {world}: rank {r} did not end in 180 s\n{said}")
        outs.append((p.returncode, out))
    if os.path.exists(store):
        os.unlink(store)
    return outs


# Not under the sanitizers: what these test is the interpreters' end beside gloo's threads; the
# C++ they run (the torch adapter, the step) runs under ASan in every spawned-world test.
@pytest.mark.no_sanitizer
@pytest.mark.parametrize("path, world", [(p, w) for p in PATHS for w in (2, 4)]
                         + [(p, 4) for p in BATCH_PATHS])
def test_every_exit_path_ends_with_status_zero(path, world, tmp_path):
    data = str(tmp_path / "samples.jsonl")
    write_samples(data)
    for run in range(RUNS):
        outs = run_world(path, world, data)
        said = "\n".join(f"--- rank {r}, status {code}:\n{out}"
                         for r, (code, out) in enumerate(outs))
        for r, (code, out) in enumerate(outs):
            assert code == 0, f"{path}, world {world}, run {run}, rank {r}: status {code}\n{said}"
            assert f"rank {r}: {path} done" in out, said


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2], sys.argv[3])
