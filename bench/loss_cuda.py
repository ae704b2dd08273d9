#!/usr/bin/env python3
"""The loss on the GPU: thdpack's CUDA kernel beside what a user would otherwise run, and the
memory-bandwidth floor measured in the same run.

For each shape T x V (bf16 logits; also float32 at 16384 x 32000), forward + backward of the
token-mean cross-entropy over the counted tokens, each method timed with CUDA events (median
of --repeat runs after a warm-up), and for each:
  time      milliseconds
  floor     time / the three-pass floor (read the logits twice, write the gradient once, at the
            card's device-to-device copy bandwidth measured here); the two-pass floor is the copy
            itself (the one-read kernel's goal: its rows are read once); /2-pass is time over it
  extra     peak memory beyond the logits and the gradient the method returns, as a multiple of
            the logits' bytes (in place: beyond the logits alone)
  loss err  |loss - the float64 loss| / |float64 loss|
  grad err  the largest |grad - float64 grad| over the largest |float64 grad| of its row
Methods: thdpack's kernel with a separate gradient and in place (local_loss(backend="cuda")),
its one-read kernel (rows staged in shared memory, a cluster of blocks per large row; sm_90 for
clusters, where it does not run the fused kernel runs instead),
thdpack's chunked torch path (backend="torch"), F.cross_entropy on the bf16 logits, on
logits.float(), torch.compile of the latter, and Liger-Kernel's cross-entropy and Cut
Cross-Entropy where they import (carry their wheels to the device). A method that runs out of
memory prints "out of memory". Then (--linear TxVxH, default 65536x151936x4096) the fused
linear loss (thdpack.torch.linear_loss) against the unfused GEMM + kernel, Liger's fused linear
cross-entropy and Cut Cross-Entropy: time, peak memory and its ratio to the logits' bytes.

  python3 bench/loss_cuda.py [--shapes 16384x32000,4096x151936,32768x151936,65536x151936]
                             [--repeat 5] [--json FILE]
Prints a table; exits 0 with a message where there is no GPU.
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F

SHAPES = [(16384, 32000), (4096, 151936), (32768, 151936), (65536, 151936)]


def events_time(fn, repeat):
    """Median milliseconds of fn() over `repeat` runs after one warm-up (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def copy_ms(nbytes, repeat):
    """Device-to-device copy of nbytes (one read, one write): the two-pass floor."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return events_time(lambda: y.copy_(x), repeat)


def reference(logits, labels, counted, chunk=2048):
    """float64 loss, and per row-chunk generator of the float64 gradient (of the mean)."""
    n = int(counted.sum())
    total = 0.0
    for s in range(0, logits.shape[0], chunk):
        z = logits[s:s + chunk].double()
        lp = torch.log_softmax(z, -1)
        c = counted[s:s + chunk]
        y = labels[s:s + chunk].clamp(min=0)
        total += float(-(lp.gather(-1, y[:, None]).squeeze(-1) * c).sum())
    return total / n, n


def grad_error(logits, labels, counted, n, grad, chunk=2048):
    worst = 0.0
    for s in range(0, logits.shape[0], chunk):
        z = logits[s:s + chunk].double()
        p = torch.softmax(z, -1)
        c = counted[s:s + chunk].double()[:, None]
        y = labels[s:s + chunk].clamp(min=0)
        p.scatter_add_(-1, y[:, None], -torch.ones_like(p[:, :1]))
        want = p * c / n
        got = grad[s:s + chunk].double()
        scale = want.abs().amax(-1).clamp(min=1e-300)
        worst = max(worst, float(((got - want).abs().amax(-1) / scale * (c[:, 0] > 0)).max()))
    return worst


def methods(args):
    import thdpack.torch as tt

    def thdpack_kernel(logits, labels, mask, n, inplace=False):
        if inplace:
            x = logits.detach()
            loss = tt.local_loss(x, labels, mask, n, backend="cuda", inplace=True)
            return loss, x
        x = logits.detach().requires_grad_(True)
        loss = tt.local_loss(x, labels, mask, n, backend="cuda")
        loss.backward()
        return loss, x.grad

    def thdpack_one_read(logits, labels, mask, n, inplace=False):
        """The one-read kernel (each row staged in shared memory, split over a cluster when
        large) through the same call."""
        from thdpack.torch import _loss_cuda
        saved = _loss_cuda.ONE_READ_BY_DEFAULT
        _loss_cuda.ONE_READ_BY_DEFAULT = True
        try:
            return thdpack_kernel(logits, labels, mask, n, inplace)
        finally:
            _loss_cuda.ONE_READ_BY_DEFAULT = saved

    def thdpack_torch(logits, labels, mask, n):
        x = logits.detach().requires_grad_(True)
        loss = tt.local_loss(x, labels, mask, n, backend="torch")
        loss.backward()
        return loss, x.grad

    def torch_ce(logits, labels, mask, n, upcast=False, compiled=None):
        x = logits.detach().requires_grad_(True)
        y = torch.where(mask != 0, labels, torch.full_like(labels, -100))
        fn = compiled or (lambda z, t: F.cross_entropy(z.float() if upcast else z, t))
        loss = fn(x, y)
        loss.backward()
        return loss, x.grad

    out = [("thdpack kernel", thdpack_kernel, False),
           ("thdpack kernel, in place", lambda *a: thdpack_kernel(*a, inplace=True), True),
           ("thdpack one-read kernel", thdpack_one_read, False),
           ("thdpack one-read kernel, in place",
            lambda *a: thdpack_one_read(*a, inplace=True), True),
           ("thdpack chunked torch", thdpack_torch, False),
           ("F.cross_entropy bf16", torch_ce, False),
           ("F.cross_entropy float", lambda *a: torch_ce(*a, upcast=True), False)]
    if not args.no_compile:
        compiled = torch.compile(lambda z, t: F.cross_entropy(z.float(), t))
        out.append(("torch.compile(F.cross_entropy float)",
                    lambda *a: torch_ce(*a, compiled=compiled), False))
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss
        liger = LigerCrossEntropyLoss()

        def liger_ce(logits, labels, mask, n):
            x = logits.detach().requires_grad_(True)
            y = torch.where(mask != 0, labels, torch.full_like(labels, -100))
            loss = liger(x, y)
            loss.backward()
            return loss, x.grad
        # Liger's kernel writes the gradient over its input: it gets a copy of the logits, as
        # thdpack's in-place call does, so the reference and the next method see the logits.
        out.append(("Liger cross-entropy (in place)", liger_ce, True))
    except Exception as e:  # noqa: BLE001 - report what is missing and go on
        print(f"(Liger-Kernel not loaded: {type(e).__name__}: {e})")
    try:
        import cut_cross_entropy  # noqa: F401
        print("(Cut Cross-Entropy loaded: it fuses the lm-head GEMM; compared in the fused "
              "linear loss benchmark, not here)")
    except Exception as e:  # noqa: BLE001
        print(f"(Cut Cross-Entropy not loaded: {type(e).__name__}: {e})")
    return out


def run(args):
    if not torch.cuda.is_available():
        print("loss_cuda: no CUDA device here: nothing to measure")
        return 0
    import thdpack
    if not thdpack._thdpack.cuda_loss_built():
        print("loss_cuda: this thdpack was built without the CUDA kernels")
        return 1
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] \
        if args.shapes else SHAPES
    cases = [(t, v, torch.bfloat16) for t, v in shapes]
    if (16384, 32000) in shapes:
        cases.insert(1, (16384, 32000, torch.float32))
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    rows = []
    table = methods(args)
    for t, v, dtype in cases:
        g = torch.Generator(device="cuda").manual_seed(t + v)
        logits = (torch.randn(t, v, device="cuda", generator=g) * 2).to(dtype)
        labels = torch.randint(0, v, (t,), device="cuda", generator=g)
        mask = (torch.rand(t, device="cuda", generator=g) > 0.1).float()
        counted = mask != 0
        nbytes = logits.numel() * logits.element_size()
        floor2 = copy_ms(nbytes, args.repeat)
        floor3 = 1.5 * floor2
        ref_loss, n = reference(logits, labels, counted)
        print(f"\n{t} x {v} {str(dtype).replace('torch.', '')}: logits {nbytes / 1e9:.2f} GB; "
              f"copy (two-pass floor) {floor2:.2f} ms = {2 * nbytes / floor2 / 1e9:.0f} GB/s; "
              f"three-pass floor {floor3:.2f} ms")
        print(f"  {'method':40s} {'time ms':>9s} {'/3-pass':>8s} {'/2-pass':>8s} {'extra':>7s} "
              f"{'loss err':>9s} {'grad err':>9s}")
        for name, fn, inplace in table:
            work = logits.clone() if inplace else logits
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                loss, grad = fn(work, labels, mask, n)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
                held = 0 if inplace else grad.numel() * grad.element_size()
                extra = max(0, peak - held) / nbytes
                loss_err = abs(float(loss) - ref_loss) / abs(ref_loss)
                g_err = grad_error(logits, labels, counted, n, grad)
                del loss, grad
                if inplace:
                    ms = events_time(lambda: fn(logits.clone(), labels, mask, n), args.repeat)
                    ms -= events_time(lambda: logits.clone(), args.repeat)  # the clone's share
                else:
                    ms = events_time(lambda: fn(logits, labels, mask, n), args.repeat)
                print(f"  {name:40s} {ms:9.2f} {ms / floor3:8.2f} {ms / floor2:8.2f} {extra:6.2f}x "
                      f"{loss_err:9.1e} {g_err:9.1e}", flush=True)
                rows.append(dict(shape=f"{t}x{v}", dtype=str(dtype), method=name, ms=ms,
                                 over_floor3=ms / floor3, extra=extra, loss_err=loss_err,
                                 grad_err=g_err, floor2_ms=floor2))
            except torch.cuda.OutOfMemoryError:
                print(f"  {name:40s} out of memory")
                rows.append(dict(shape=f"{t}x{v}", dtype=str(dtype), method=name, oom=True))
            finally:
                work = None
                torch.cuda.empty_cache()
    if args.linear:
        rows += linear(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def linear(args):
    """The fused linear loss (hidden [T, H] x weight [V, H], never the [T, V] logits) against the
    unfused GEMM + thdpack's kernel + the backward GEMMs, and the peers where they import."""
    import thdpack.torch as tt
    t, v, h = (int(x) for x in args.linear.split("x"))
    g = torch.Generator(device="cuda").manual_seed(1)
    hidden = (torch.randn(t, h, device="cuda", generator=g) / h ** 0.5).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) / 4).bfloat16()
    labels = torch.randint(0, v, (t,), device="cuda", generator=g)
    mask = torch.ones(t, device="cuda")
    logit_bytes = t * v * 2

    def forward_backward(loss_of):
        """A method as the table runs it: fresh leaves, the loss, its backward."""
        def run():
            x, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
            loss = loss_of(x, w)
            loss.backward()
            return loss
        return run

    table = [
        ("thdpack linear_loss", forward_backward(
            lambda x, w: tt.linear_loss(x, w, labels, mask, t, backend="cuda"))),
        ("GEMM + thdpack kernel (unfused)", forward_backward(
            lambda x, w: tt.local_loss(x @ w.t(), labels, mask, t, backend="cuda"))),
    ]
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        flce = LigerFusedLinearCrossEntropyLoss()
        table.append(("Liger fused linear cross-entropy",
                      forward_backward(lambda x, w: flce(w, x, labels))))
    except Exception as e:  # noqa: BLE001
        print(f"(Liger fused linear cross-entropy not loaded: {type(e).__name__}: {e})")
    try:
        from cut_cross_entropy import linear_cross_entropy
        table.append(("Cut Cross-Entropy",
                      forward_backward(lambda x, w: linear_cross_entropy(x, w, labels))))
    except Exception as e:  # noqa: BLE001
        print(f"(Cut Cross-Entropy not loaded: {type(e).__name__}: {e})")
    print(f"\nlinear loss {t} x {v}, H = {h}, bf16: the logits would be {logit_bytes / 1e9:.1f} GB")
    print(f"  {'method':40s} {'time ms':>9s} {'peak GB':>8s} {'/logits':>8s} {'loss':>12s}")
    rows = []
    for name, fn in table:
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss = float(fn())
            peak = torch.cuda.max_memory_allocated() - base
            ms = events_time(fn, args.repeat)
            print(f"  {name:40s} {ms:9.2f} {peak / 1e9:8.2f} {peak / logit_bytes:8.3f} {loss:12.6f}",
                  flush=True)
            rows.append(dict(linear=args.linear, method=name, ms=ms, peak_bytes=peak, loss=loss))
        except torch.cuda.OutOfMemoryError:
            print(f"  {name:40s} out of memory")
            rows.append(dict(linear=args.linear, method=name, oom=True))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="", help="comma-separated TxV (default: the four)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--json", default="")
    ap.add_argument("--linear", default="65536x151936x4096",
                    help="TxVxH of the fused linear loss comparison ('' to skip)")
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
