#!/usr/bin/env python3
"""The loss of one rank's shard, forward and backward, on CPU: thdpack.torch.local_loss (the
C++ kernel, and its chunked torch path forced on CPU) against F.cross_entropy, the call a torch
user would otherwise write (reduction="sum" over the masked labels, divided by N).

Usage:  PYTHONPATH=build/python python3 bench/loss_vs_torch.py [--threads K] [--reps R]
        [--cases 16384x32000,4096x151936] [--dtypes bf16,fp32] [--methods ...]

Every (case, dtype, method) runs in its own child process, one at a time (the logits of
4096 x 151,936 fp32 are 2.3 GiB and F.cross_entropy needs several times that).

Memory, measured per child on its first (cold) call: the logits (and labels, mask) are made
in place, then one warm-up call on 64 rows; VmRSS is read from /proc/self/status, the peak
(VmHWM) is reset by writing "5" to /proc/self/clear_refs, one forward + backward runs, and VmHWM
is read again. Extra peak = VmHWM - VmRSS before - the bytes of the logits' gradient (which every
method must produce): what the loss costs beyond the logits and their gradient, everything the
process touched included (temporaries, allocator slack, thread stacks). Printed as a multiple of
the logits' bytes.

Time: call 1 (cold) and the best of calls 2..--reps (warm), logits.grad cleared in between, the
same torch thread count for both (the C++ kernel uses torch.get_num_threads()). Warm is what a
training loop sees from its second microbatch on: torch returns large CPU blocks to the system
and faults them in again each call, thdpack's gradient cache (thdpack.torch.grad_cache_info)
hands the freed gradient buffer out again.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time


def rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(method, t, v, dtype_name, threads, reps):
    import torch
    import torch.nn.functional as F

    import thdpack.torch as tt

    torch.set_num_threads(threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype_name]
    g = torch.Generator().manual_seed(1)
    logits = torch.empty(t, v, dtype=dtype)
    for s in range(0, t, 256):  # in place, chunk by chunk: no full-size temporary
        logits[s:s + 256] = torch.randn(min(256, t - s), v, generator=g) * 2
    labels = torch.randint(0, v, (t,), generator=g)
    mask = (torch.rand(t, generator=g) < 0.9).float()
    n = int(((labels != -100) & (mask != 0)).sum())
    masked_labels = torch.where(mask != 0, labels, torch.full_like(labels, -100))

    def run(z, lab, msk, lab_masked, nn):
        if method == "torch":
            loss = F.cross_entropy(z, lab_masked, ignore_index=-100, reduction="sum") / nn
        else:
            loss = tt.local_loss(z, lab, msk, nn, chunked=method == "thdpack-chunked")
        loss.backward()
        return float(loss)

    logits.requires_grad_(True)
    w = logits[:64].detach().clone().requires_grad_(True)  # warm-up: code paths, thread pools
    run(w, labels[:64], mask[:64], masked_labels[:64], n)
    del w
    def cpu_seconds():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    # Call 1 is cold: every buffer a method makes is fresh memory, whose first touch (the
    # kernel zeroing pages) is much of a CPU loss's time. Calls 2..reps are what a training loop
    # sees from its second microbatch on: torch's CPU allocator hands large blocks back to the
    # system and faults them in again on every call; thdpack's gradient cache keeps the freed
    # gradient buffer and hands it out again (bind_grad_cache.cc).
    walls, cpus, extra, value = [], [], None, None
    for rep in range(reps):
        logits.grad = None
        before = rss_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        c0, t0 = cpu_seconds(), time.perf_counter()
        value = run(logits, labels, mask, masked_labels, n)
        walls.append(time.perf_counter() - t0)
        cpus.append(cpu_seconds() - c0)
        if rep == 0:  # memory of the cold call: nothing cached yet (the warm-up's 64 rows aside)
            peak = rss_kib("VmHWM")
            grad_bytes = logits.grad.numel() * logits.grad.element_size()
            extra = peak * 1024 - before * 1024 - grad_bytes
    logits_bytes = logits.numel() * logits.element_size()
    warm = walls[1:] or walls
    warm_cpu = cpus[1:] or cpus
    print(json.dumps({"method": method, "t": t, "v": v, "dtype": dtype_name,
                      "cold_seconds": walls[0], "cold_cpu_seconds": cpus[0],
                      "seconds": min(warm), "cpu_seconds": min(warm_cpu),
                      "load": os.getloadavg()[0],
                      "extra_bytes": extra, "logits_bytes": logits_bytes, "loss": value,
                      "threads": threads}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", nargs=4, metavar=("METHOD", "T", "V", "DTYPE"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cases", default="16384x32000,4096x151936")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--methods", default="thdpack,thdpack-chunked,torch")
    args = ap.parse_args()
    if args.child:
        m, t, v, d = args.child
        child(m, int(t), int(v), d, args.threads, args.reps)
        return
    print(f"loss forward + backward on CPU, {args.threads} threads; call 1 (cold: fresh "
          f"buffers) and the best of calls 2..{args.reps} (warm: as from a training loop's "
          "second microbatch on)")
    print("speedup = F.cross_entropy's seconds / the method's, in wall and in process CPU time "
          "(user + sys, less sensitive to other processes sharing the cores); extra = peak "
          "memory of the cold call beyond the logits and their gradient (VmHWM delta), also / "
          "logits bytes; load = 1-min load average")
    print(f"{'T/CP x V':>14} {'dtype':>5} {'method':>16} {'cold s':>7} {'wall':>5} {'cpu':>5} "
          f"{'warm s':>7} {'wall':>5} {'cpu':>5} {'extra GiB':>9} {'/logits':>7} {'loss':>10} "
          f"{'load':>5}")
    for case in args.cases.split(","):
        t, v = (int(x) for x in case.split("x"))
        for dtype in args.dtypes.split(","):
            rows = []
            for method in args.methods.split(","):
                cmd = [sys.executable, __file__, "--child", method, str(t), str(v), dtype,
                       "--threads", str(args.threads), "--reps", str(args.reps)]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    print(f"{case:>14} {dtype:>5} {method:>16} failed: {out.stderr.strip()[-400:]}")
                    continue
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            ref = next((r for r in rows if r["method"] == "torch"), None)
            def ratio(r, key):
                return f"{ref[key] / r[key]:.1f}x" if ref else "-"

            for r in rows:
                print(f"{case:>14} {dtype:>5} {r['method']:>16} {r['cold_seconds']:7.3f} "
                      f"{ratio(r, 'cold_seconds'):>5} {ratio(r, 'cold_cpu_seconds'):>5} "
                      f"{r['seconds']:7.3f} {ratio(r, 'seconds'):>5} "
                      f"{ratio(r, 'cpu_seconds'):>5} {r['extra_bytes'] / 2**30:9.3f} "
                      f"{r['extra_bytes'] / r['logits_bytes']:7.3f} {r['loss']:10.6f} "
                      f"{r['load']:5.1f}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
