#!/usr/bin/env python3
"""PackedDataIterator on NCCL at world size 1, beside a gloo world inside the same NCCL job.

Runs the iterator over the mock source on the default NCCL group (prefetching one step, the
default, and without prefetching), then again with the world given as a gloo group made inside
the NCCL job (as Megatron keeps gloo groups beside its NCCL ones), and checks that every tensor
of every step is equal and on the GPU. Prints the time a step of each. Exits 0 with a message where there is no GPU (the tests cover the gloo paths).

Usage: PYTHONPATH=... python3 scripts/nccl_iterator_check.py [--steps 4] [--scheduler dynamic]
"""
import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--backend", default="nccl",
                    help="the job's backend (gloo: the same check on the CPU, for this script)")
    ap.add_argument("--scheduler", default="balanced", choices=("balanced", "dynamic"))
    args = ap.parse_args()
    cuda = args.backend == "nccl"
    if cuda and not torch.cuda.is_available():
        print("nccl_iterator_check: no CUDA device here: nothing to check")
        return 0
    from thdpack.torch import Groups, PackedDataIterator
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    if cuda:
        torch.cuda.set_device(0)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group(args.backend, rank=0, world_size=1)
    opts = dict(global_batch=64, max_tokens_per_rank=16384, steps=args.steps,
                scheduler=args.scheduler, cost="llama2-7b")
    runs = {}
    gloo_world = Groups(world=dist.new_group([0], backend="gloo"))
    for name, groups, prefetch in ((args.backend, Groups(), None),
                                   ("no prefetch", Groups(), 0),
                                   ("gloo world in the job", gloo_world, None)):
        it = PackedDataIterator("mock", groups, device=device, prefetch=prefetch, **opts)
        t0 = time.perf_counter()
        steps = []
        for step in it:
            steps.append([{k: v for k, v in mb.items() if isinstance(v, torch.Tensor)} for mb in step])
        if cuda:
            torch.cuda.synchronize()
        runs[name] = (steps, (time.perf_counter() - t0) / max(1, len(steps)))
    (a, ta) = runs[args.backend]
    n = 0
    for other in ("no prefetch", "gloo world in the job"):
        b = runs[other][0]
        assert len(a) == len(b) == args.steps, (other, len(a), len(b))
        for sa, sb in zip(a, b):
            assert len(sa) == len(sb), other
            for ma, mb in zip(sa, sb):
                assert ma.keys() == mb.keys(), other
                for k in ma:
                    assert ma[k].is_cuda == mb[k].is_cuda == cuda, (other, k)
                    assert torch.equal(ma[k], mb[k]), (other, k)
                    n += 1
    where = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"nccl_iterator_check ({args.scheduler}): {n} tensors of {args.steps} steps equal; "
          f"{1000 * ta:.1f} ms a step on {args.backend} (prefetch 1, no compute to hide it "
          f"behind), {1000 * runs['no prefetch'][1]:.1f} ms without prefetching, "
          f"{1000 * runs['gloo world in the job'][1]:.1f} ms with a gloo world inside the job "
          f"({where}, torch {torch.__version__})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
