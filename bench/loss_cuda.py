#!/usr/bin/env python3
"""The loss on the GPU: thdpack's CUDA kernel beside what a user would otherwise run, and the
memory-bandwidth floor measured in the same run.

For each shape T x V (bf16 logits; also float32 at 16384 x 32000), forward + backward of the
token-mean cross-entropy over the counted tokens, each method timed with CUDA events (median
of --repeat runs after a warm-up), and for each:
  time      milliseconds; thdpack's calls are timed with validate=False (the validated call
            reads a flag back, a host synchronisation that does not belong in a kernel's time);
            an in-place method gets a fresh copy of the logits before each run, outside the
            timed events
  /3-pass   time / the three-pass floor (read the logits twice, write the gradient once, at the
            card's device-to-device copy bandwidth measured here); the two-pass floor is the copy
            itself (the one-read kernel's goal: its rows are read once); /2-pass is time over it
  extra     peak memory beyond the logits and the gradient the method returns, as a multiple of
            the logits' bytes (in place: beyond the logits alone)
  loss err  |loss - the float64 loss| / |float64 loss|
  grad err  the largest |grad - float64 grad| over the largest |float64 grad| of its row
  ign!=0    gradient elements of ignored rows (label -100 or mask 0) that are not exactly 0: the
            float64 reference multiplies those rows by 0, so grad err cannot see them
Methods: thdpack's kernel (local_loss(backend="cuda")), version 2 and version 1 (kept beside
it: thdpack/cuda_loss.h), with a separate gradient and in place; its one-read kernel (rows
staged in shared memory, a cluster of blocks per large row; sm_90 for clusters, where it does not
run the fused kernel runs instead); thdpack's chunked torch path (backend="torch");
F.cross_entropy on the bf16 logits, on logits.float(), torch.compile of the latter (not with
--no-compile), and Liger-Kernel's cross-entropy where it imports (carry its wheel to the device:
scripts/fetch_wheels.sh).

Then (--linear TxVxH, default 65536x151936x4096) the fused linear loss (thdpack.torch.linear_loss)
against the unfused GEMM + kernel, Liger's fused linear cross-entropy (with
accum_dtype=torch.float32 where its version takes it, as thdpack accumulates the weight's
gradient in float32) and Cut Cross-Entropy, twice: with its default filter_eps="high", which
skips the gradient of logits whose probability is below a threshold (so its gradient is not the
exact one), and with filter_eps=None: time, peak memory and its ratio to the logits' bytes.

Failures stay local: a method that runs out of memory prints "out of memory", any other error
of a method (a refused launch, torch.compile failing) prints it and skips that method; a shape
whose logits do not fit is skipped. Only a sticky CUDA error (the context is lost: every later
call would fail) ends the run, with exit status 3. Every row is written to --json as soon as it
is measured (the file always holds a whole JSON list), so a run cut short keeps what it measured.

  python3 bench/loss_cuda.py [--shapes 16384x32000,4096x151936,32768x151936,65536x151936|none]
                             [--repeat 5] [--no-compile] [--skip REGEX] [--json FILE]
                             [--linear TxVxH | --linear ''] [--device cuda|cpu]
--device cpu rehearses the script on a machine without a GPU (small shapes: the thdpack kernel's
methods then fail with their error and are skipped, which is part of what it rehearses). Prints a
table; exits 0 with a message where there is no GPU and --device is cuda.
"""
import argparse
import gc
import inspect
import json
import os
import re
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = [(16384, 32000), (4096, 151936), (32768, 151936), (65536, 151936)]


class Device:
    """The timing and memory calls of the device the benchmark runs on (CUDA events and the
    caching allocator's statistics; on the CPU, for the rehearsal, the wall clock and no
    memory figures)."""

    def __init__(self, name):
        self.name = name
        self.cuda = name == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def free(self):
        gc.collect()
        if self.cuda:
            try:
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 - after a sticky error; alive() reports it
                pass

    def start_peak(self):
        """Resets the peak and returns the bytes allocated now."""
        if not self.cuda:
            return 0
        self.sync()
        self.free()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak(self):
        return torch.cuda.max_memory_allocated() if self.cuda else 0

    def alive(self):
        """False after a sticky CUDA error: the context is lost and every call fails."""
        if not self.cuda:
            return True
        try:
            torch.cuda.synchronize()
            return float(torch.ones(1, device="cuda").add_(1).item()) == 2.0
        except Exception:  # noqa: BLE001 - any failure here means the context is gone
            return False

    def time_ms(self, fn, repeat, setup=None):
        """Median milliseconds of fn(arg) over `repeat` runs after one warm-up; arg = setup()
        (None without one) is made before each run's start, outside the timed region."""
        def once():
            arg = setup() if setup is not None else None
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn(arg)
                b.record()
                torch.cuda.synchronize()
                return a.elapsed_time(b)
            t0 = time.perf_counter()
            fn(arg)
            return (time.perf_counter() - t0) * 1e3
        once()
        times = sorted(once() for _ in range(repeat))
        return times[len(times) // 2]


class Rows:
    """The measured rows, rewritten to `path` (when given) after each one: the file always holds
    a whole JSON list."""

    def __init__(self, path):
        self.path = path
        self.rows = []

    def add(self, row):
        self.rows.append(row)
        if self.path:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.rows, f, indent=1)
            os.replace(tmp, self.path)


class Sticky(Exception):
    """A sticky CUDA error: the run cannot go on."""


def reference(logits, labels, counted, chunk=1024):
    """The float64 loss (token mean over the counted tokens) and the counted tokens."""
    n = int(counted.sum())
    total = 0.0
    for s in range(0, logits.shape[0], chunk):
        z = logits[s:s + chunk].double()
        lp = torch.log_softmax(z, -1)
        c = counted[s:s + chunk]
        y = labels[s:s + chunk].clamp(min=0)
        total += float(-(lp.gather(-1, y[:, None]).squeeze(-1) * c).sum())
    return total / max(n, 1), n


def grad_error(logits, labels, counted, n, grad, chunk=1024):
    """(the largest row-relative error of grad over the counted rows against float64, the
    number of elements of ignored rows that are not exactly 0). A chunk's float64 temporaries
    are about 6 x 1.2 GB at V = 151,936, beside the logits and the method's gradient."""
    worst, nonzero = 0.0, 0
    for s in range(0, logits.shape[0], chunk):
        z = logits[s:s + chunk].double()
        p = torch.softmax(z, -1)
        c = counted[s:s + chunk]
        y = labels[s:s + chunk].clamp(min=0)
        p.scatter_add_(-1, y[:, None], -torch.ones_like(p[:, :1]))
        want = p * c.double()[:, None] / max(n, 1)
        g = grad[s:s + chunk]
        got = g.double()
        scale = want.abs().amax(-1).clamp(min=1e-300)
        row = (got - want).abs().amax(-1) / scale
        if bool(c.any()):
            worst = max(worst, float(row[c].max()))
        if not bool(c.all()):
            nonzero += int((g[~c] != 0).sum())
    return worst, nonzero


def methods(args):
    """(name, fn(logits, labels, mask, n, validate) -> (loss, grad), in place) of every method
    to run; fn gets the logits to consume when in place."""
    import thdpack.torch as tt
    from thdpack.torch import _loss_cuda

    def thdpack_kernel(kernel, version, inplace):
        def run(logits, labels, mask, n, validate):
            saved = (_loss_cuda.ONE_READ_BY_DEFAULT, _loss_cuda.KERNEL_VERSION)
            _loss_cuda.ONE_READ_BY_DEFAULT = kernel == "one_read"
            _loss_cuda.KERNEL_VERSION = version
            try:
                if inplace:
                    x = logits.detach()
                    loss = tt.local_loss(x, labels, mask, n, backend="cuda", inplace=True,
                                         validate=validate)
                    return loss, x
                x = logits.detach().requires_grad_(True)
                loss = tt.local_loss(x, labels, mask, n, backend="cuda", validate=validate)
                loss.backward()
                return loss, x.grad
            finally:
                _loss_cuda.ONE_READ_BY_DEFAULT, _loss_cuda.KERNEL_VERSION = saved
        return run

    def thdpack_torch(logits, labels, mask, n, validate):
        x = logits.detach().requires_grad_(True)
        loss = tt.local_loss(x, labels, mask, n, backend="torch")
        loss.backward()
        return loss, x.grad

    def torch_ce(upcast=False, compiled=None):
        def run(logits, labels, mask, n, validate):
            x = logits.detach().requires_grad_(True)
            y = torch.where(mask != 0, labels, torch.full_like(labels, -100))
            fn = compiled or (lambda z, t: F.cross_entropy(z.float() if upcast else z, t))
            loss = fn(x, y)
            loss.backward()
            return loss, x.grad
        return run

    out = []
    for kernel, label in (("fused", "thdpack kernel"), ("one_read", "thdpack one-read kernel")):
        for version in (2, 1):
            out.append((f"{label} v{version}", thdpack_kernel(kernel, version, False), False))
            out.append((f"{label} v{version}, in place", thdpack_kernel(kernel, version, True),
                        True))
    out += [("thdpack chunked torch", thdpack_torch, False),
            ("F.cross_entropy bf16", torch_ce(), False),
            ("F.cross_entropy float", torch_ce(upcast=True), False)]
    if not args.no_compile:
        try:
            compiled = torch.compile(lambda z, t: F.cross_entropy(z.float(), t))
            out.append(("torch.compile(F.cross_entropy float)", torch_ce(compiled=compiled),
                        False))
        except Exception as e:  # noqa: BLE001 - torch without compile: say so and go on
            print(f"(torch.compile not available: {type(e).__name__}: {e})")
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss
        liger = LigerCrossEntropyLoss()

        def liger_ce(logits, labels, mask, n, validate):
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
    if args.skip:
        out = [m for m in out if not re.search(args.skip, m[0])]
    return out


def measure(dev, args, rows, name, fn, inplace, logits, labels, mask, counted, n, ref_loss,
            nbytes, floor2, extra_row):
    """One method at one shape: its row (printed and added), or the reason it has none."""
    floor3 = 1.5 * floor2
    try:
        base = dev.start_peak()
        work = logits.clone() if inplace else logits
        loss, grad = fn(work, labels, mask, n, True)
        dev.sync()
        peak = dev.peak() - base
        held = 0 if inplace else grad.numel() * grad.element_size()
        extra = max(0, peak - held - (nbytes if inplace else 0)) / nbytes
        loss_err = abs(float(loss) - ref_loss) / abs(ref_loss)
        g_err, ignored_nonzero = grad_error(logits, labels, counted, n, grad)
        del loss, grad, work
        dev.free()
        if inplace:
            ms = dev.time_ms(lambda x: fn(x, labels, mask, n, False), args.repeat,
                             setup=lambda: logits.clone())
        else:
            ms = dev.time_ms(lambda _: fn(logits, labels, mask, n, False), args.repeat)
        print(f"  {name:40s} {ms:9.2f} {ms / floor3:8.2f} {ms / floor2:8.2f} {extra:6.2f}x "
              f"{loss_err:9.1e} {g_err:9.1e} {ignored_nonzero:7d}", flush=True)
        rows.add(dict(extra_row, method=name, ms=ms, over_floor3=ms / floor3,
                      over_floor2=ms / floor2, extra=extra, loss_err=loss_err, grad_err=g_err,
                      ignored_nonzero=ignored_nonzero, floor2_ms=floor2))
    except torch.cuda.OutOfMemoryError:
        print(f"  {name:40s} out of memory", flush=True)
        rows.add(dict(extra_row, method=name, oom=True))
    except Exception as e:  # noqa: BLE001 - one method's failure skips that method
        if not dev.alive():
            rows.add(dict(extra_row, method=name, error=f"{type(e).__name__}: {e}", sticky=True))
            raise Sticky(f"{name}: {type(e).__name__}: {e}") from e
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"  {name:40s} skipped: {msg}", flush=True)
        rows.add(dict(extra_row, method=name, error=msg))
    finally:
        dev.free()


def run(args):
    dev = Device(args.device)
    if dev.cuda and not torch.cuda.is_available():
        print("loss_cuda: no CUDA device here: nothing to measure")
        return 0
    import thdpack
    if dev.cuda and not thdpack._thdpack.cuda_loss_built():
        print("loss_cuda: this thdpack was built without the CUDA kernels")
        return 1
    if args.shapes == "none":
        shapes = []
    elif args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    else:
        shapes = SHAPES
    cases = [(t, v, torch.bfloat16) for t, v in shapes]
    if (16384, 32000) in shapes:
        cases.insert(1, (16384, 32000, torch.float32))
    name = torch.cuda.get_device_name(0) if dev.cuda else "cpu (rehearsal)"
    print(f"device {name}, torch {torch.__version__}")
    rows = Rows(args.json)
    table = methods(args)
    try:
        for t, v, dtype in cases:
            run_shape(dev, args, rows, table, t, v, dtype)
        if args.linear:
            linear(dev, args, rows)
    except Sticky as e:
        print(f"\nloss_cuda: a sticky CUDA error ({e}): the context is lost, stopping here; "
              f"{len(rows.rows)} rows written", flush=True)
        return 3
    return 0


def run_shape(dev, args, rows, table, t, v, dtype):
    tag = f"{t}x{v} {str(dtype).replace('torch.', '')}"
    extra_row = dict(shape=f"{t}x{v}", dtype=str(dtype))
    dev.free()  # the previous shape's tensors died with its run_shape; give their memory back
    try:
        # The logits in their dtype, drawn in place: no float32 copy of [T, V] (37 GiB at
        # 65536 x 151936).
        g = torch.Generator(device=dev.name).manual_seed(t + v)
        logits = torch.empty(t, v, dtype=dtype, device=dev.name)
        logits.normal_(0.0, 2.0, generator=g)
        labels = torch.randint(0, v, (t,), device=dev.name, generator=g)
        mask = (torch.rand(t, device=dev.name, generator=g) > 0.1).float()
        counted = mask != 0
        nbytes = logits.numel() * logits.element_size()
        x = torch.empty(nbytes, dtype=torch.uint8, device=dev.name)
        y = torch.empty_like(x)
        floor2 = dev.time_ms(lambda _: y.copy_(x), args.repeat)  # one read, one write
        del x, y
        ref_loss, n = reference(logits, labels, counted)
    except torch.cuda.OutOfMemoryError:
        print(f"\n{tag}: out of memory making the logits and the reference: shape skipped")
        rows.add(dict(extra_row, method="(shape)", oom=True))
        return
    except Exception as e:  # noqa: BLE001
        if not dev.alive():
            raise Sticky(f"{tag}: {type(e).__name__}: {e}") from e
        print(f"\n{tag}: {type(e).__name__}: {e}: shape skipped")
        rows.add(dict(extra_row, method="(shape)", error=f"{type(e).__name__}: {e}"))
        return
    print(f"\n{tag}: logits {nbytes / 1e9:.2f} GB; copy (two-pass floor) {floor2:.2f} ms = "
          f"{2 * nbytes / floor2 / 1e6:.0f} GB/s; three-pass floor {1.5 * floor2:.2f} ms")
    print(f"  {'method':40s} {'time ms':>9s} {'/3-pass':>8s} {'/2-pass':>8s} {'extra':>7s} "
          f"{'loss err':>9s} {'grad err':>9s} {'ign!=0':>7s}")
    for name, fn, inplace in table:
        measure(dev, args, rows, name, fn, inplace, logits, labels, mask, counted, n, ref_loss,
                nbytes, floor2, extra_row)


def linear(dev, args, rows):
    """The fused linear loss (hidden [T, H] x weight [V, H], never the [T, V] logits) against the
    unfused GEMM + thdpack's kernel + the backward GEMMs, and the peers where they import."""
    import thdpack.torch as tt
    t, v, h = (int(x) for x in args.linear.split("x"))
    g = torch.Generator(device=dev.name).manual_seed(1)
    try:
        hidden = (torch.randn(t, h, device=dev.name, generator=g) / h ** 0.5).bfloat16()
        weight = (torch.randn(v, h, device=dev.name, generator=g) / 4).bfloat16()
    except torch.cuda.OutOfMemoryError:
        print(f"\nlinear loss {args.linear}: out of memory making the inputs: skipped")
        rows.add(dict(linear=args.linear, method="(shape)", oom=True))
        return
    labels = torch.randint(0, v, (t,), device=dev.name, generator=g)
    mask = torch.ones(t, device=dev.name)
    logit_bytes = t * v * 2

    def forward_backward(loss_of):
        """A method as the table runs it: fresh leaves, the loss, its backward."""
        def run(_=None):
            x, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
            loss = loss_of(x, w)
            loss.backward()
            return loss
        return run

    table = [
        ("thdpack linear_loss", forward_backward(
            lambda x, w: tt.linear_loss(x, w, labels, mask, t, backend="cuda", validate=False))),
        ("GEMM + thdpack kernel (unfused)", forward_backward(
            lambda x, w: tt.local_loss(x @ w.t(), labels, mask, t, backend="cuda",
                                       validate=False))),
    ]
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        kw, label = {}, "Liger fused linear cross-entropy"
        if "accum_dtype" in inspect.signature(LigerFusedLinearCrossEntropyLoss).parameters:
            kw["accum_dtype"] = torch.float32  # the weight's gradient accumulated in float32
            label += " (accum float32)"
        flce = LigerFusedLinearCrossEntropyLoss(**kw)
        table.append((label, forward_backward(lambda x, w: flce(w, x, labels))))
    except Exception as e:  # noqa: BLE001
        print(f"(Liger fused linear cross-entropy not loaded: {type(e).__name__}: {e})")
    try:
        from cut_cross_entropy import linear_cross_entropy
        table.append(("Cut Cross-Entropy (default: filters grads)",
                      forward_backward(lambda x, w: linear_cross_entropy(x, w, labels))))
        if "filter_eps" in inspect.signature(linear_cross_entropy).parameters:
            table.append(("Cut Cross-Entropy, filter_eps=None", forward_backward(
                lambda x, w: linear_cross_entropy(x, w, labels, filter_eps=None))))
        print("(Cut Cross-Entropy's default filter_eps='high' skips the gradient where the "
              "softmax is below a threshold: its gradient is an approximation; the "
              "filter_eps=None row is the exact one)")
    except Exception as e:  # noqa: BLE001
        print(f"(Cut Cross-Entropy not loaded: {type(e).__name__}: {e})")
    if args.skip:
        table = [m for m in table if not re.search(args.skip, m[0])]
    print(f"\nlinear loss {t} x {v}, H = {h}, bf16: the logits would be {logit_bytes / 1e9:.1f} GB")
    print(f"  {'method':40s} {'time ms':>9s} {'peak GB':>8s} {'/logits':>8s} {'loss':>12s}")
    for name, fn in table:
        try:
            base = dev.start_peak()
            loss = float(fn())
            peak = dev.peak() - base
            ms = dev.time_ms(fn, args.repeat)
            print(f"  {name:40s} {ms:9.2f} {peak / 1e9:8.2f} {peak / logit_bytes:8.3f} "
                  f"{loss:12.6f}", flush=True)
            rows.add(dict(linear=args.linear, method=name, ms=ms, peak_bytes=peak, loss=loss))
        except torch.cuda.OutOfMemoryError:
            print(f"  {name:40s} out of memory", flush=True)
            rows.add(dict(linear=args.linear, method=name, oom=True))
        except Exception as e:  # noqa: BLE001
            if not dev.alive():
                rows.add(dict(linear=args.linear, method=name, error=str(e), sticky=True))
                raise Sticky(f"{name}: {type(e).__name__}: {e}") from e
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"  {name:40s} skipped: {msg}", flush=True)
            rows.add(dict(linear=args.linear, method=name, error=msg))
        finally:
            dev.free()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="",
                    help="comma-separated TxV (default: the four; none: only --linear)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--skip", default="", help="leave out the methods whose name matches")
    ap.add_argument("--json", default="", help="the rows, rewritten after each one")
    ap.add_argument("--linear", default="65536x151936x4096",
                    help="TxVxH of the fused linear loss comparison ('' to skip)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a rehearsal of the script on small shapes, without a GPU")
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
