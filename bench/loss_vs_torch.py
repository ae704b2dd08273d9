#!/usr/bin/env python3
"""The loss of one rank's shard, forward and backward, on CPU: thdpack.torch.local_loss (the
C++ kernel, and its chunked torch path forced on CPU) against F.cross_entropy, the call a torch
user would otherwise write (reduction="sum" over the masked labels, divided by N).

Usage:  PYTHONPATH=build/python python3 bench/loss_vs_torch.py [--threads K] [--reps R]
        [--cases 16384x32000,4096x151936] [--dtypes bf16,fp32] [--methods ...]

Every (case, dtype, method) runs in its own child process, one at a time (the logits of
4096 x 151,936 fp32 are 2.3 GiB and F.cross_entropy needs several times that).

Memory, measured per child: the logits (and labels, mask) are made in place, then one warm-up
call on 64 rows; VmRSS is read from /proc/self/status, the peak (VmHWM) is reset by writing "5"
to /proc/self/clear_refs, one forward + backward runs, and VmHWM is read again. Extra peak =
VmHWM - VmRSS before - the bytes of the logits' gradient (which every method must produce):
what the loss costs beyond the logits and their gradient, everything the process touched
included (temporaries, allocator slack, thread stacks). Printed as a multiple of the logits'
bytes. Time: the best of --reps forward + backward calls (logits.grad cleared in between), the
same torch thread count for both (the C++ kernel uses torch.get_num_threads()).
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

    best, best_cpu, extra, value = float("inf"), float("inf"), -float("inf"), None
    for _ in range(reps):
        logits.grad = None
        before = rss_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        c0, t0 = cpu_seconds(), time.perf_counter()
        value = run(logits, labels, mask, masked_labels, n)
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, cpu_seconds() - c0)
        peak = rss_kib("VmHWM")
        grad_bytes = logits.grad.numel() * logits.grad.element_size()
        extra = max(extra, peak * 1024 - before * 1024 - grad_bytes)
    logits_bytes = logits.numel() * logits.element_size()
    print(json.dumps({"method": method, "t": t, "v": v, "dtype": dtype_name, "seconds": best,
                      "cpu_seconds": best_cpu, "load": os.getloadavg()[0],
                      "extra_bytes": extra, "logits_bytes": logits_bytes, "loss": value,
                      "threads": threads}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", nargs=4, metavar=("METHOD", "T", "V", "DTYPE"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cases", default="16384x32000,4096x151936")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--methods", default="thdpack,thdpack-chunked,torch")
    args = ap.parse_args()
    if args.child:
        m, t, v, d = args.child
        child(m, int(t), int(v), d, args.threads, args.reps)
        return
    print(f"loss forward + backward on CPU, {args.threads} threads, best of {args.reps}; extra "
          "peak memory beyond the logits and their gradient (VmHWM delta), / logits bytes")
    print("speedup = F.cross_entropy's seconds / the method's, wall and process CPU time (user + "
          "sys, less sensitive to other processes sharing the cores); load = 1-min load average")
    print(f"{'T/CP x V':>14} {'dtype':>5} {'method':>16} {'wall s':>8} {'speedup':>7} "
          f"{'cpu s':>8} {'speedup':>7} {'extra GiB':>9} {'extra/logits':>12} {'loss':>10} "
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
            for r in rows:
                wall = f"{ref['seconds'] / r['seconds']:.1f}x" if ref else "-"
                cpu = f"{ref['cpu_seconds'] / r['cpu_seconds']:.1f}x" if ref else "-"
                print(f"{case:>14} {dtype:>5} {r['method']:>16} {r['seconds']:8.3f} {wall:>7} "
                      f"{r['cpu_seconds']:8.3f} {cpu:>7} {r['extra_bytes'] / 2**30:9.3f} "
                      f"{r['extra_bytes'] / r['logits_bytes']:12.3f} {r['loss']:10.6f} "
                      f"{r['load']:5.1f}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
