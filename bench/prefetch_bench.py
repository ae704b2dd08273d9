"""How long a training loop waits for its data in PackedDataIterator.__next__, with the step
prepared ahead (prefetch = 1, 2) and without (prefetch = 0), over spawned gloo worlds of 4 and 8
ranks on this machine: two topologies per world, each with a static and the dynamic scheduler.

For each configuration the loop first runs without prefetching to measure the data step (the
time next() takes, median over the steps after the first); the simulated compute - a sleep,
which like a GPU step leaves the CPU to the data plane - is then set to 1.25 x that median, and
the loop is run with prefetch 0, 1 and 2, taking each step and "computing" on it. Printed per
configuration: each steady step's wait in next() - the wall time of the call, what the training
loop waits, tensors and dicts included - for prefetch 0, 1, 2 and the ratio to prefetch 0
(beside it the iterator's `last_wait`, the same call timed inside next()); the median and worst
ratios over the steady steps (from step 2 on: step 0 has nothing prefetched, step 1 overlaps
only part of the compute); and the end-to-end loop time per step with a compute of half the data
step, prefetch 1 against 0 (prefetching must not make a step slower when the data step is the
longer one) - the compute a sleep, then a Python loop that holds the GIL (the thread must not
take it from the caller for long).

With --device cuda (a GPU; the device run of scripts/device_check.sh) the world is one rank on
NCCL, the step's tensors go to the GPU (pinned memory, a copy stream), and the compute is a
real one: bf16 matmuls of 4096 x 4096 on the GPU, as many as take the wanted time, ended by a
synchronisation (as a training loop's `loss.item()` ends its step); the data plane's own
communicator is gloo, as always.

Usage: PYTHONPATH=build/python python3 bench/prefetch_bench.py [--steps N] [--worlds 4,8]
                                                               [--device cpu|cuda]
"""
import argparse
import os
import pickle
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GLOBAL_BATCH = 256
MAX_TOKENS = 16384


def topologies(world):
    """(name, tp, cp, dp, pp) by world size: two per world (one at world 1 or 2)."""
    if world <= 2:
        return [(f"dp{world}", 1, 1, world, 1)]
    if world == 4:
        return [("cp2 dp2", 1, 2, 2, 1), ("tp2 dp2", 2, 1, 2, 1)]
    return [("cp2 dp4", 1, 2, 4, 1), ("tp2 cp2 dp2", 2, 2, 2, 1)]


def coords(rank, tp, cp, dp, pp):
    return {"tp": rank % tp, "cp": (rank // tp) % cp, "dp": (rank // (tp * cp)) % dp,
            "pp": rank // (tp * cp * dp)}


def make_groups(tp, cp, dp, pp):
    from thdpack.torch import Groups
    rank, world = dist.get_rank(), dist.get_world_size()
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
    return Groups(**mine)


def busy(seconds):
    """A compute that holds the GIL (pure Python), as a CPU-side training step would."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1
    return x


class GpuCompute:
    """A GPU step of about the wanted time: bf16 matmuls of 4096 x 4096, then a sync."""

    N = 4096

    def __init__(self, device):
        self.a = torch.randn(self.N, self.N, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(self.N, self.N, device=device, dtype=torch.bfloat16)
        for _ in range(3):
            self.a @ self.b
        torch.cuda.synchronize(device)
        reps = 50
        t0 = time.perf_counter()
        for _ in range(reps):
            self.a @ self.b
        torch.cuda.synchronize(device)
        self.per_matmul = (time.perf_counter() - t0) / reps

    def __call__(self, seconds):
        for _ in range(max(1, round(seconds / self.per_matmul))):
            self.a @ self.b
        torch.cuda.synchronize(self.a.device)


def loop(groups, scheduler, prefetch, steps, compute, hold_gil=False, device=None, gpu=None,
         internal=None):
    """[(wall time of next(), whole step)] of `steps` steps, each followed by `compute` seconds
    (a sleep, with hold_gil a busy loop in Python, with gpu matmuls on the GPU); the
    iterator's own last_wait of each step appended to `internal` when given."""
    from thdpack.torch import PackedDataIterator
    it = PackedDataIterator("mock", groups, global_batch=GLOBAL_BATCH,
                            max_tokens_per_rank=MAX_TOKENS, scheduler=scheduler,
                            cost="llama2-7b", shuffle=True, seed=3, prefetch=prefetch,
                            steps=steps, device=device)
    dist.barrier()
    out = []
    t_prev = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        try:
            step = next(it)  # noqa: F841 - held until the next one, as a training loop holds it
        except StopIteration:
            break
        wait = time.perf_counter() - t0
        if internal is not None:
            internal.append(it.last_wait)
        if compute > 0:
            if gpu is not None and not hold_gil:
                gpu(compute)
            elif hold_gil:
                busy(compute)
            else:
                time.sleep(compute)
        now = time.perf_counter()
        out.append((wait, now - t_prev))
        t_prev = now
        del step
    it.close()
    return out


def agreed_max(values):
    """Each step's value, the slowest rank's (the loop is as slow as its slowest rank)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def worker(rank, world, port, steps, out_path, cuda=False):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    device, gpu = None, None
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        gpu = GpuCompute(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    run = dict(device=device, gpu=gpu)
    results = []
    for name, tp, cp, dp, pp in topologies(world):
        groups = make_groups(tp, cp, dp, pp)
        for scheduler in ("balanced", "dynamic"):
            data = agreed_max([w for w, _ in loop(groups, scheduler, 0, steps, 0.0, **run)])
            data_step = statistics.median(data[1:])
            compute = 1.25 * data_step
            waits, internal = {}, {}
            for p in (0, 1, 2):
                inside = []
                waits[p] = agreed_max([w for w, _ in loop(groups, scheduler, p, steps, compute,
                                                          internal=inside, **run)])
                internal[p] = agreed_max(inside)
            short = 0.5 * data_step
            whole = {p: agreed_max([t for _, t in loop(groups, scheduler, p, steps, short,
                                                       **run)])
                     for p in (0, 1)}
            gil = {p: agreed_max([t for _, t in loop(groups, scheduler, p, steps, short,
                                                     hold_gil=True, **run)])
                   for p in (0, 1)}
            results.append({"world": world, "topology": name, "scheduler": scheduler,
                            "data": data, "data_step": data_step, "compute": compute,
                            "waits": waits, "internal": internal, "short": short,
                            "whole": whole,
                            "gil": gil})
    if rank == 0:
        with open(out_path, "wb") as f:
            pickle.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(r):
    ms = 1e3
    print(f"-- world {r['world']}, {r['topology']}, {r['scheduler']}: data step "
          f"{r['data_step'] * ms:.1f} ms (median of steps 1..), compute {r['compute'] * ms:.1f} ms")
    print(f"{'step':>4} {'data':>8} {'wait p0':>8} {'wait p1':>8} {'wait p2':>8} "
          f"{'p1/p0':>7} {'p2/p0':>7}   (ms)")
    w = r["waits"]
    for s in range(len(w[0])):
        print(f"{s:>4} {r['data'][s] * ms:>8.2f} {w[0][s] * ms:>8.2f} {w[1][s] * ms:>8.3f} "
              f"{w[2][s] * ms:>8.3f} {w[1][s] / w[0][s]:>7.4f} {w[2][s] / w[0][s]:>7.4f}")
    steady = range(2, len(w[0]))
    for p in (1, 2):
        ratios = [w[p][s] / w[0][s] for s in steady]
        waits = [w[p][s] for s in steady]
        inside = [r["internal"][p][s] for s in steady]
        print(f"     prefetch {p}: steady wait in next() median "
              f"{statistics.median(waits) * ms:.3f} ms, worst {max(waits) * ms:.3f} ms; ratio to "
              f"prefetch 0 median {statistics.median(ratios):.4f}, worst {max(ratios):.4f}; "
              f"last_wait (next() timed inside) median "
              f"{statistics.median(inside) * ms:.3f} ms")
    whole0 = statistics.median(r["whole"][0][2:])
    whole1 = statistics.median(r["whole"][1][2:])
    print(f"     compute {r['short'] * ms:.1f} ms (half the data step): loop step "
          f"{whole0 * ms:.1f} ms with prefetch 0, {whole1 * ms:.1f} ms with prefetch 1 "
          f"({whole1 / whole0:.3f}x)")
    gil0 = statistics.median(r["gil"][0][2:])
    gil1 = statistics.median(r["gil"][1][2:])
    print(f"     the same compute holding the GIL (a Python loop): {gil0 * ms:.1f} ms with "
          f"prefetch 0, {gil1 * ms:.1f} ms with prefetch 1 ({gil1 / gil0:.3f}x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--worlds", default=None,
                    help="world sizes (default 4,8 on the CPU, 1 with --device cuda)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("prefetch_bench: --device cuda, and no CUDA device here", file=sys.stderr)
        return 2
    worlds = [int(w) for w in (args.worlds or ("1" if cuda else "4,8")).split(",")]
    if cuda and max(worlds) > torch.cuda.device_count():
        print(f"prefetch_bench: world {max(worlds)} needs as many GPUs, "
              f"{torch.cuda.device_count()} here", file=sys.stderr)
        return 2
    where = (f"NCCL on {torch.cuda.get_device_name(0)}, compute: bf16 matmuls on the GPU"
             if cuda else f"gloo on {os.cpu_count()} CPUs")
    print(f"prefetch_bench: {where}, torch {torch.__version__}, "
          f"python {sys.version.split()[0]}; mock data, global batch {GLOBAL_BATCH}, "
          f"{MAX_TOKENS} tokens a rank; waits are the slowest rank's")
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "results.pkl")
            mp.spawn(worker, args=(world, free_port(), args.steps, out, cuda), nprocs=world,
                     join=True)
            with open(out, "rb") as f:
                for r in pickle.load(f):
                    report(r)


if __name__ == "__main__":
    sys.exit(main())
