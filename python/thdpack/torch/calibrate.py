"""thdpack.torch.calibrate: a cost profile measured on the user's own hardware.

``calibrate(step_fn, max_tokens)`` builds a designed set of packed microbatches at two or three
totals T up to the token budget - all short (T/256 x 256), one long (1 x T), mixed (T/2 and
shorts), quarters, a halving series and random long-tailed packs - runs ``step_fn`` (one
forward and backward of the user's model on a microbatch) on each with warm-up and repetitions,
times it (CUDA events on CUDA, a monotonic clock on the CPU), and fits thdpack's profile
(``thdpack.fit_cost_profile``: a P + b P^2 + c seconds a sequence of padded length P, with a
constant per microbatch beside it when that predicts better). The microbatches of the middle
total, and every random pack, are held out: the profile's report gives the fit's R^2 and its
largest and 95th-percentile relative error on them, 1 x T against T/256 x 256 included.
Plans take it as ``cost="profile:FILE"`` (``thdpack.schedule``, the iterator, ``thdpack plan
--cost profile:FILE``).
"""
from __future__ import annotations

import os
import platform
import statistics
import time

import numpy as np
import torch

from .. import _thdpack


def _designs(total, short, rng):
    """(name, lengths, random) packs of `total` tokens."""
    packs = [("all short", [short] * (total // short), False),
             ("one long", [total], False),
             ("mixed", [total // 2] + [short] * (total // 2 // short), False),
             ("quarters", [total // 4] * 4, False)]
    halving, left, p = [], total, total // 2
    while p >= short and left - p >= short:
        halving.append(p)
        left -= p
        p //= 2
    halving += [short] * (left // short)
    packs.append(("halving", halving, False))
    for k in range(2):
        lengths, left = [], total
        while left >= short:
            draw = int(np.clip(rng.lognormal(np.log(total / 8), 1.2), short, left))
            draw = max(short, draw // short * short)
            lengths.append(draw)
            left -= draw
        packs.append((f"random {k}", lengths, True))
    return packs


def _microbatch(lengths, device, vocab, seed, first_id):
    samples = [_thdpack.mock_tokens(seed, first_id + i, int(n), vocab)
               for i, n in enumerate(lengths)]
    mb = _thdpack.pack(samples)
    out = {k: (torch.from_numpy(v).to(device) if isinstance(v, np.ndarray) else v)
           for k, v in mb.items()}
    out["packed_seq_params"] = {
        "qkv_format": "thd", "cu_seqlens_q": out["cu_seqlens"], "cu_seqlens_kv": out["cu_seqlens"],
        "cu_seqlens_q_padded": out["cu_seqlens_padded"],
        "cu_seqlens_kv_padded": out["cu_seqlens_padded"], "max_seqlen_q": out["max_seqlen"],
        "max_seqlen_kv": out["max_seqlen"]}
    return out


def _timer(device, clock):
    """time(fn) -> seconds of one call."""
    if clock is not None:
        def timed(fn):
            t0 = clock()
            fn()
            return clock() - t0
        return timed
    if device.type == "cuda":
        def timed(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        return timed

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return timed


def _device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "CPU"


def calibrate(step_fn, max_tokens, *, out=None, totals=None, short=256, warmup=1, repeats=3,
              device=None, model="", dtype="", attention="", tp_size=1, cp_size=1, vocab=32000,
              seed=1234, clock=None, refine=True, timings_out=None, verbose=False):
    """Measures ``step_fn`` on designed packed microbatches and fits a cost profile.

    step_fn(mb): runs one microbatch forward and backward on the user's device. mb is
    thdpack's dict of torch tensors on ``device``: tokens, labels, position_ids (int64 [T]),
    loss_mask (float32 [T]), cu_seqlens, cu_seqlens_padded (int32 [n+1]), max_seqlen, n_valid,
    packed_seq_params (TransformerEngine's THD fields). The tokens are thdpack's mock tokens in
    [0, vocab).
    max_tokens: the token budget of one microbatch; totals (default max_tokens/4, /2 and 1,
    multiples of ``short``) the T of the designed packs; short the length of the short
    sequences (256).
    warmup, repeats: calls before timing each microbatch, and timed calls (the median is kept).
    device: where the tensors go (default the current CUDA device, else the CPU); timing uses
    CUDA events there, time.perf_counter elsewhere, or ``clock`` (a callable returning seconds:
    tests and other timers).
    model, dtype, attention, tp_size, cp_size: what is measured (written into the profile;
    model a cost spec with dimensions, e.g. "llama2-7b", also gives the step-time model the
    K/V exchange of CP). out: write the profile there. timings_out: write the timings as the CSV
    ``thdpack calibrate --timings`` reads.
    Returns the profile (the JSON objects of the file: a, b, c, refined, use, measured_on, fit).
    ValueError for a budget too small to design packs from, or timings that do not vary enough.
    """
    if not callable(step_fn):
        raise ValueError(f"step_fn: expected a callable, got {type(step_fn).__name__}")
    max_tokens, short = int(max_tokens), int(short)
    if short < 1 or max_tokens < 8 * short:
        raise ValueError(f"max_tokens = {max_tokens}: calibrate designs packs of at least 8 "
                         f"sequences of short = {short} tokens; give max_tokens >= {8 * short} "
                         f"(or a smaller short)")
    if totals is None:
        totals = sorted({max(8 * short, max_tokens // 4 // short * short),
                         max(8 * short, max_tokens // 2 // short * short),
                         max_tokens // short * short})
    totals = [int(t) for t in totals]
    if len(totals) < 2 or len(set(totals)) != len(totals):
        raise ValueError(f"totals = {totals}: calibrate needs at least two different totals "
                         f"(the fit needs packs of different sizes)")
    if any(t < 8 * short or t > max_tokens or t % short for t in totals):
        raise ValueError(f"totals = {totals}: each must be a multiple of short = {short} in "
                         f"[{8 * short}, max_tokens = {max_tokens}]")
    if int(warmup) < 0 or int(repeats) < 1:
        raise ValueError(f"warmup = {warmup} must be >= 0 and repeats = {repeats} >= 1")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(device)
    rng = np.random.default_rng(seed)
    middle = totals[len(totals) // 2] if len(totals) >= 3 else None
    plan = []
    for t in totals:
        for name, lengths, random_pack in _designs(t, short, rng):
            plan.append((t, name, lengths, random_pack or t == middle))
    timed = _timer(device, clock)
    timings, held_out, rows = [], [], []
    first_id = 0
    for t, name, lengths, hold in plan:
        mb = _microbatch(lengths, device, vocab, seed, first_id)
        first_id += len(lengths)
        for _ in range(int(warmup)):
            step_fn(mb)
        seconds = float(statistics.median(timed(lambda: step_fn(mb)) for _ in range(int(repeats))))
        if not seconds > 0:
            raise ValueError(f"the {name} pack of {t} tokens took {seconds} s: a timer that does "
                             "not advance (clock?)")
        timings.append((seconds, lengths))
        held_out.append(hold)
        rows.append(f"{seconds!r},{' '.join(str(int(n)) for n in lengths)}")
        if verbose:
            print(f"calibrate: T={t} {name:<10} {len(lengths):5d} sequences  {seconds:.6g} s"
                  f"{'  (held out)' if hold else ''}")
    if timings_out is not None:
        with open(timings_out, "w") as f:
            f.write("seconds,lengths\n" + "\n".join(rows) + "\n")
    return _thdpack.fit_cost_profile(
        timings, np.array(held_out, dtype=bool), model=model, device=_device_name(device),
        dtype=dtype, attention=attention, tp_size=int(tp_size), cp_size=int(cp_size),
        refine=bool(refine), out=None if out is None else os.fspath(out))


def calibrate_encoder(encoder_fn, profile, *, out=None, width=1176, dtype=torch.bfloat16,
                      sides=(8, 16, 24, 32, 48, 64), frames=(1, 2), warmup=1, repeats=3,
                      device=None, model="", seed=1234, clock=None, verbose=False):
    """Measures a vision encoder and writes its term into a cost profile (docs/media.md).

    encoder_fn(pixel_values, grid_thw): runs the encoder forward and backward on one item, as
    the step hands a rank its media: pixel_values [t*h*w, width] of ``dtype`` and grid_thw
    int64 [[t, h, w]], both on ``device``. Items of h = w = each of ``sides`` patches (even,
    for a 2 x 2 merge) and t = each of ``frames`` are timed (``warmup`` calls, then the median
    of ``repeats``; CUDA events on CUDA, time.perf_counter elsewhere, or ``clock``), every 4th
    held out. thdpack's fit (FitEncoderProfile: per_patch * t*h*w + per_frame_sq * t*(h*w)^2
    seconds, non-negative least squares of the relative error) is written into ``profile`` -
    a file of ``calibrate`` (the language model's, measured on the same hardware: one unit) -
    in place, or to ``out``. With it, ``cost="profile:FILE"`` gives media the encoder's
    measured term when ``media_cost`` is not given. Returns the profile (its JSON objects).
    ValueError for bad arguments or timings that cannot tell the two terms apart."""
    if not callable(encoder_fn):
        raise ValueError(f"encoder_fn: expected a callable, got {type(encoder_fn).__name__}")
    sides, frames = [int(s) for s in sides], [int(t) for t in frames]
    if len(set(sides)) < 2 or any(s < 2 or s % 2 for s in sides) or any(t < 1 for t in frames):
        raise ValueError(f"sides = {sides}, frames = {frames}: at least two different even sides "
                         f">= 2 (the fit tells the two terms apart by the frame size) and frames "
                         f">= 1")
    if int(warmup) < 0 or int(repeats) < 1:
        raise ValueError(f"warmup = {warmup} must be >= 0 and repeats = {repeats} >= 1")
    if int(width) < 1:
        raise ValueError(f"width = {width} must be >= 1")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(int(seed))
    timed = _timer(device, clock)
    seconds, patches, frame_sq, held_out = [], [], [], []
    for k, (t, side) in enumerate((t, s) for t in frames for s in sides):
        n = t * side * side
        pixels = torch.randn(n, int(width), generator=gen).to(dtype=dtype, device=device)
        grid = torch.tensor([[t, side, side]], dtype=torch.int64, device=device)
        for _ in range(int(warmup)):
            encoder_fn(pixels, grid)
        s = float(statistics.median(timed(lambda: encoder_fn(pixels, grid))
                                    for _ in range(int(repeats))))
        if not s > 0:
            raise ValueError(f"the item of grid [{t}, {side}, {side}] took {s} s: a timer that "
                             "does not advance (clock?)")
        seconds.append(s)
        patches.append(n)
        frame_sq.append(t * (side * side) ** 2)
        held_out.append(k % 4 == 3)
        if verbose:
            print(f"calibrate_encoder: grid [{t}, {side}, {side}] {n:7d} patches  {s:.6g} s"
                  f"{'  (held out)' if held_out[-1] else ''}")
    return _thdpack.fit_encoder_profile(
        seconds, np.asarray(patches, dtype=np.int64), np.asarray(frame_sq, dtype=np.int64),
        np.asarray(held_out, dtype=bool), model=model, profile=os.fspath(profile),
        out=None if out is None else os.fspath(out))
