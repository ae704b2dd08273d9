"""Spawned gloo worlds for the tests, started cheaply.

``spawn(fn, args, nprocs)`` keeps ``torch.multiprocessing.spawn``'s contract - ``fn(rank, *args)``
in ``nprocs`` fresh processes, joined, the first rank's exception raised in the caller - but
forks the ranks from a forkserver that imported torch, NumPy and thdpack once per pytest
process, instead of starting an interpreter that imports them again in every rank: an 8-rank
world then starts in about 0.3 s instead of about 5 s on 2 cores (docs/testing.md). Each rank
is still a process of its own, made for its test and gone after it; nothing is shared between
tests but the imported modules.

What a forked rank does not do is finish like an interpreter: multiprocessing ends it with
``os._exit`` after ``fn`` returns, so atexit handlers and the interpreter's finalisation do not
run there. A test of what happens at a process's exit starts its own interpreters
(test_resume_kill.py, test_train_tiny.py, the exit-path tests).
"""
import multiprocessing

import torch.multiprocessing as mp

# Imported once, in the forkserver, before it forks any rank. set_forkserver_preload only acts
# before the forkserver starts, which is at the first spawn() of the process.
multiprocessing.set_forkserver_preload(
    ["numpy", "pytest", "torch", "torch.distributed", "thdpack", "thdpack.torch"])


def spawn(fn, args=(), nprocs=1):
    """fn(rank, *args) in nprocs processes forked from the preloaded forkserver, joined; raises
    as torch.multiprocessing.spawn does when a rank fails."""
    return mp.start_processes(fn, args=tuple(args), nprocs=nprocs, join=True,
                              start_method="forkserver")
