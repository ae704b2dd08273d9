"""Every public function that takes an array, fed generated arrays: no crash, every refusal a
ValueError, and every accepted array read as its plain copy.

For each argument slot of each function, arrays are made from a valid value of that slot by
three kinds of change: the same values in another layout (read-only, strided, reversed,
transposed, Fortran order, byte-swapped, misaligned, a list, a tensor or a non-contiguous
tensor), the same values in another dtype, and garbage (any dtype NumPy has, Python objects,
strings, complex and datetimes included; 0-d, empty and 3-D shapes; extreme values). The oracle
of each call is the same call on a plain copy of the input (C-contiguous, aligned, native byte
order; for a tensor, its contiguous clone): both must give the same result, or both raise
ValueError. A read past a view, a strided array taken as contiguous or a byte-swapped one taken
as native shows up as a difference; anything else than ValueError as a failure; a crash as the
death of the test process. On the sanitizer build (make test-asan) the same calls run under ASan.

THDPACK_FUZZ_INPUTS (default 32) is the number of arrays per slot; the seed is printed and
THDPACK_FUZZ_SEED replays a run.
"""
import os
import random

import numpy as np
import torch

import thdpack
import thdpack.torch as tt

PER_SLOT = int(os.environ.get("THDPACK_FUZZ_INPUTS", "32"))
SEED = int(os.environ.get("THDPACK_FUZZ_SEED", str(random.SystemRandom().randrange(2**31))))

INT_DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]
FLOAT_DTYPES = ["float16", "float32", "float64"]
ODD_DTYPES = ["complex64", "complex128", "object", "U3", "S2", "V4", "datetime64[s]",
              "timedelta64[ms]", "longdouble", [("a", "<i4"), ("b", ">f8")]]
TORCH_DTYPES = {np.dtype(k): v for k, v in [
    ("bool", torch.bool), ("uint8", torch.uint8), ("int8", torch.int8), ("int16", torch.int16),
    ("int32", torch.int32), ("int64", torch.int64), ("float16", torch.float16),
    ("float32", torch.float32), ("float64", torch.float64), ("complex64", torch.complex64)]}

# -- valid values of each slot ---------------------------------------------------------------

CU16 = np.array([0, 8, 16], np.int32)  # two sequences of 8 tokens, CP = 2
T, V = 6, 11


def cu_padded(rng, multiple=4):
    n = int(rng.integers(1, 5))
    return np.concatenate([[0], np.cumsum(rng.integers(1, 4, n) * multiple)]).astype(np.int32)


def rows16(rng):
    dtype = rng.choice(INT_DTYPES + FLOAT_DTYPES + ["bool"])
    shape = (16,) + tuple(int(d) for d in rng.integers(1, 4, int(rng.integers(0, 3))))
    return (rng.standard_normal(shape) * 50).astype(dtype)


def tokens(rng, n=None):
    return rng.integers(0, 1000, int(n or rng.integers(1, 20))).astype(np.int32)


def labels(rng):
    y = rng.integers(0, V, T)
    y[rng.random(T) < 0.3] = -100
    return y.astype(np.int64)


def mask(rng, n=T):
    return (rng.random(n) < 0.7).astype(np.float32)


def logits(rng):
    return (rng.standard_normal((T, V)) * 3).astype(np.float32)


LENGTHS = np.array([5, 30, 12, 60, 1, 44, 9], np.int64)
MESSAGE = np.frombuffer(thdpack.encode_metadata(
    [{"cu_seqlens": [0, 3, 9], "cu_seqlens_padded": [0, 4, 12], "n_valid": 7}], cp_size=2,
    skipped_ids=[4, 11]), np.uint8)
SHARD_CU, SHARD_CUP = np.array([0, 2, 5], np.int32), np.array([0, 2, 6], np.int32)


def _fit_rows():
    rows = []
    for t in (2048, 4096, 8192):
        for pack in ([256] * (t // 256), [t], [t // 2] + [256] * (t // 512), [t // 4] * 4):
            p = np.array(pack, np.float64)
            rows.append((float(2e-6 * p.sum() + 4e-11 * (p * p).sum() + 3e-5 * len(p)), pack))
    return rows


FIT_ROWS = _fit_rows()


def loss_totals(**kw):
    args = dict(logprobs=-np.arange(1, T + 1) / 7.0, entropy=np.arange(T) / 3.0,
                counted=np.array([1, 0, 1, 1, 1, 0], bool), cu_seqlens=SHARD_CU,
                cu_seqlens_padded=SHARD_CUP)
    args.update(kw)
    t = thdpack._thdpack.LossTotals()
    t.add_shard(**args)
    return t.summary()


def torch_loss(x, y, m):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        x = x.detach().requires_grad_(True)
    share = tt.local_loss(x, y, m, 20)
    share.backward()
    return share, x.grad


H_LINEAR = 4


def hidden(rng):
    return rng.standard_normal((T, H_LINEAR)).astype(np.float32)


def weight(rng):
    return (rng.standard_normal((V, H_LINEAR)) / 2).astype(np.float32)


def torch_linear(h, w, y, m):
    """linear_loss and both gradients (of the inputs that can have one)."""
    h, w = (x.detach().requires_grad_(True)
            if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in (h, w))
    loss = tt.linear_loss(h, w, y, m, 20)
    loss.backward()
    return (loss,) + tuple(x.grad for x in (h, w) if isinstance(x, torch.Tensor))


def linear_args(rng):
    return (torch.from_numpy(hidden(rng)), torch.from_numpy(weight(rng)),
            torch.from_numpy(labels(rng)), torch.from_numpy(mask(rng)))


def torch_args(rng):
    return (torch.from_numpy(logits(rng)), torch.from_numpy(labels(rng)),
            torch.from_numpy(mask(rng)))


# slot name -> (make a valid value from rng, call with the generated value, feeds torch only)
SLOTS = {
    "cp_partition_indices.cu_seqlens_padded": (
        cu_padded, lambda a: thdpack.cp_partition_indices(a, 2, 1), False),
    "local_position_ids.cu_seqlens_padded": (
        cu_padded, lambda a: thdpack.local_position_ids(a, 2, 0), False),
    "local_cu_seqlens_padded.cu_seqlens_padded": (
        cu_padded, lambda a: thdpack.local_cu_seqlens_padded(a, 2), False),
    "shard.array": (rows16, lambda a: thdpack.shard(a, CU16, 2, 1), False),
    "shard.cu_seqlens_padded": (
        lambda r: CU16.copy(), lambda a: thdpack.shard(np.arange(16.0), a, 2, 0), False),
    "unshard.shards": (
        lambda r: np.arange(8, dtype=np.int64),
        lambda a: thdpack.unshard([a, np.arange(8, 16, dtype=np.int64)], CU16), False),
    "sp_split.array": (rows16, lambda a: thdpack.sp_split(a, 2, 1), False),
    "pack.samples": (tokens, lambda a: thdpack.pack([a, tokens(np.random.default_rng(1))],
                                                    cp_size=2), False),
    "pack.target_masks": (
        lambda r: mask(r, 7),
        lambda a: thdpack.pack([tokens(np.random.default_rng(2), 7)], [a], cp_size=2), False),
    "pack.ids": (lambda r: np.array([7, 3], np.int64),
                 lambda a: thdpack.pack([[1, 2, 3], [4, 5]], ids=a), False),
    "pack_shard.samples": (
        tokens, lambda a: thdpack.pack_shard([a, [3, 4, 5]], cp_size=2, cp_rank=1), False),
    "schedule.lengths": (
        lambda r: r.integers(1, 61, int(r.integers(1, 20))),
        lambda a: thdpack.schedule(a, dp_size=2, max_tokens_per_rank=64), False),
    "schedule.n_targets": (
        lambda r: LENGTHS - 1,
        lambda a: thdpack.schedule(LENGTHS, a, dp_size=2, max_tokens_per_rank=64), False),
    "schedule.ids": (
        lambda r: r.permutation(50)[:len(LENGTHS)],
        lambda a: thdpack.schedule(LENGTHS, ids=a, dp_size=2, max_tokens_per_rank=64), False),
    "encode_metadata.cu_seqlens": (
        lambda r: np.array([0, 3, 9], np.int32),
        lambda a: thdpack.encode_metadata(
            [{"cu_seqlens": a, "cu_seqlens_padded": [0, 4, 12], "n_valid": 7}], cp_size=2),
        False),
    "encode_metadata.cu_seqlens_padded": (
        lambda r: np.array([0, 4, 12], np.int32),
        lambda a: thdpack.encode_metadata(
            [{"cu_seqlens": [0, 3, 9], "cu_seqlens_padded": a, "n_valid": 7}], cp_size=2),
        False),
    "encode_metadata.skipped_ids": (
        lambda r: r.integers(0, 1000, int(r.integers(0, 5))),
        lambda a: thdpack.encode_metadata(
            [{"cu_seqlens": [0, 3, 9], "cu_seqlens_padded": [0, 4, 12], "n_valid": 7}],
            cp_size=2, skipped_ids=a), False),
    "decode_metadata.data": (lambda r: MESSAGE.copy(), thdpack.decode_metadata, False),
    "cross_entropy.logits": (
        logits, lambda a: thdpack.cross_entropy(a, labels(np.random.default_rng(3)),
                                                mask(np.random.default_rng(4)), 20,
                                                with_grad=True), False),
    "cross_entropy.labels": (
        labels, lambda a: thdpack.cross_entropy(logits(np.random.default_rng(5)), a, None, 20,
                                                with_grad=True), False),
    "cross_entropy.loss_mask": (
        mask, lambda a: thdpack.cross_entropy(logits(np.random.default_rng(6)),
                                              labels(np.random.default_rng(7)), a, 20), False),
    "cross_entropy.grad_out": (
        lambda r: np.zeros((T, V), np.float32),
        lambda a: thdpack.cross_entropy(logits(np.random.default_rng(8)),
                                        labels(np.random.default_rng(9)), None, 20,
                                        with_grad=True, grad_out=a), False),
    "flops.cu_seqlens_padded": (cu_padded, lambda a: thdpack.flops("llama2-7b", a), False),
    "fit_cost_profile.lengths": (
        lambda r: np.array([1024, 512, 512], np.int64),
        lambda a: thdpack.fit_cost_profile([(0.005, a)] + FIT_ROWS), False),
    "fit_cost_profile.held_out": (
        lambda r: r.random(len(FIT_ROWS)) < 0.25,
        lambda a: thdpack.fit_cost_profile(FIT_ROWS, a), False),
    "LossTotals.add_shard.logprobs": (
        lambda r: -np.arange(1, T + 1) / 7.0, lambda a: loss_totals(logprobs=a), False),
    "LossTotals.add_shard.entropy": (
        lambda r: np.arange(T) / 3.0, lambda a: loss_totals(entropy=a), False),
    "LossTotals.add_shard.counted": (
        lambda r: r.random(T) < 0.5, lambda a: loss_totals(counted=a), False),
    "LossTotals.add_shard.cu_seqlens_padded": (
        lambda r: SHARD_CUP.copy(), lambda a: loss_totals(cu_seqlens_padded=a), False),
    "torch.partition_indices.cu_seqlens_padded": (
        cu_padded, lambda a: tt.partition_indices(a, 2, 1), False),
    "torch.shard.tensor": (rows16, lambda a: tt.shard(a, CU16, 2, 1), True),
    "torch.shard.cu_seqlens_padded": (
        lambda r: CU16.copy(), lambda a: tt.shard(torch.arange(16.0), a, 2, 1), False),
    "torch.unshard.shards": (
        lambda r: np.arange(8, dtype=np.int64),
        lambda a: tt.unshard([a, torch.arange(8, 16)], CU16), True),
    "torch.sp_split.tensor": (rows16, lambda a: tt.sp_split(a, 2, 1), True),
    "torch.local_loss.logits": (
        logits, lambda a: torch_loss(a, *torch_args(np.random.default_rng(10))[1:]), True),
    "torch.local_loss.labels": (
        labels, lambda a: torch_loss(torch_args(np.random.default_rng(11))[0], a,
                                     torch_args(np.random.default_rng(11))[2]), True),
    "torch.local_loss.loss_mask": (
        mask, lambda a: torch_loss(*torch_args(np.random.default_rng(12))[:2], a), True),
    "torch.token_statistics.logits": (
        logits, lambda a: tt.token_statistics(a, *torch_args(np.random.default_rng(13))[1:]),
        True),
    "torch.linear_loss.hidden": (
        hidden, lambda a: torch_linear(a, *linear_args(np.random.default_rng(15))[1:]), True),
    "torch.linear_loss.weight": (
        weight, lambda a: torch_linear(*_with(linear_args(np.random.default_rng(16)), 1, a)),
        True),
    "torch.linear_loss.labels": (
        labels, lambda a: torch_linear(*_with(linear_args(np.random.default_rng(17)), 2, a)),
        True),
    "torch.linear_loss.loss_mask": (
        mask, lambda a: torch_linear(*_with(linear_args(np.random.default_rng(18)), 3, a)), True),
    "torch.LossStatistics.add_shard.cu_seqlens": (
        lambda r: SHARD_CU.copy(),
        lambda a: _stats(a), False),
    "torch.LossStatistics.add_shard.token_values.logprob": (
        lambda r: -np.arange(1, T + 1) / 7.0, lambda a: _device_stats(a), True),
    "shard_sequence_layout.cu_seqlens": (
        lambda r: SHARD_CU.copy(),
        lambda a: thdpack._thdpack.shard_sequence_layout(a, SHARD_CUP, 1, 0), False),
    "shard_sequence_layout.cu_seqlens_padded": (
        lambda r: SHARD_CUP.copy(),
        lambda a: thdpack._thdpack.shard_sequence_layout(SHARD_CU, a, 2, 1), False),
    "LossTotals.add_sums.sums": (
        lambda r: np.array([5.0, 3.0, 1.5, 0.5, 2.0, 1.0]),
        lambda a: thdpack._thdpack.LossTotals().add_sums(a), False),
    "torch.micro_batch_indices.seqlens": (
        lambda r: r.integers(1, 61, int(r.integers(1, 20))),
        lambda a: tt.micro_batch_indices(a, 64), False),
    "torch.rearrange_micro_batches.seqlens": (
        lambda r: r.integers(1, 61, int(r.integers(1, 20))),
        lambda a: tt.rearrange_micro_batches({"seqlens": a}, 64)[1], False),
}


def _with(args, k, a):
    """args with its k-th entry replaced by a."""
    return tuple(a if i == k else x for i, x in enumerate(args))


def _stats(cu):
    s = tt.LossStatistics()
    x, y, m = torch_args(np.random.default_rng(14))
    s.add_shard(x, y, m, cu, SHARD_CUP)
    return s.summary()


def _device_stats(logprob):
    """The statistics' device path (on CPU tensors) with a fuzzed per-token logprob."""
    s = tt.LossStatistics()
    d = {"logprob": logprob, "entropy": torch.arange(T, dtype=torch.float64) / 3.0,
         "counted": torch.tensor([1, 0, 1, 1, 1, 0], dtype=torch.bool)}
    s.add_shard(None, None, None, SHARD_CU, SHARD_CUP, token_values=d, on_device=True)
    return s.summary()


# -- generated inputs ------------------------------------------------------------------------

def same_values_other_layout(a, rng):
    """(name, array) with a's values in another layout or holder."""
    kind = int(rng.integers(0, 10))
    if kind == 0:
        return "read-only", np.lib.stride_tricks.as_strided(a, writeable=False)
    if kind == 1:
        doubled = np.repeat(a, 2, axis=0) if a.ndim else a
        return "strided", doubled[::2] if a.ndim else doubled
    if kind == 2:
        return "reversed", a[::-1] if a.ndim else a
    if kind == 3:
        return "Fortran order", np.asfortranarray(a)
    if kind == 4 and a.ndim >= 2:
        return "transposed", np.ascontiguousarray(np.swapaxes(a, 0, 1)).swapaxes(0, 1)
    if kind == 5 and a.dtype.kind not in "OUSV" and a.dtype.itemsize > 1:
        return "byte-swapped", a.astype(a.dtype.newbyteorder("S"))
    if kind == 6 and a.dtype.kind not in "O":
        raw = np.zeros(a.nbytes + 1, np.uint8)
        m = raw[1:].view(a.dtype).reshape(a.shape)
        m[...] = a
        return "misaligned", m
    if kind == 7 and a.ndim >= 1 and a.dtype.kind in "biuf":
        return "list", a.tolist()
    if kind == 8 and a.dtype in TORCH_DTYPES:
        return "tensor", torch.from_numpy(np.ascontiguousarray(a))
    if kind == 9 and a.dtype in TORCH_DTYPES and a.ndim >= 1:
        t = torch.from_numpy(np.repeat(np.ascontiguousarray(a), 2, axis=0))
        return "strided tensor", t[::2]
    return "as is", a


def other_dtype(a, rng):
    dtype = rng.choice(INT_DTYPES + FLOAT_DTYPES + ["bool"])
    with np.errstate(all="ignore"):
        return f"as {dtype}", a.astype(dtype)


def garbage(rng):
    choice = rng.integers(0, len(INT_DTYPES + FLOAT_DTYPES + ODD_DTYPES) + 1)
    pool = INT_DTYPES + FLOAT_DTYPES + ODD_DTYPES + ["bool"]
    dtype = np.dtype(pool[int(choice) % len(pool)]) if not isinstance(
        pool[int(choice) % len(pool)], list) else np.dtype(pool[int(choice) % len(pool)])
    shape = [(), (0,), (0, 3), (3, 0), (1,), (7,), (2, 3), (2, 3, 4), (16,), (6, 11)][
        int(rng.integers(0, 10))]
    values = rng.standard_normal(shape) * float(10.0 ** rng.integers(0, 12))
    if dtype.kind == "O":
        out = np.empty(shape, object)
        out[...] = None if rng.random() < 0.5 else 1
        return f"object {shape}", out
    if dtype.kind in "USV" or dtype.names:
        return f"{dtype} {shape}", np.zeros(shape, dtype)
    with np.errstate(all="ignore"):
        return f"{dtype} {shape}", values.astype(dtype)


def generated(valid, rng):
    """(description, input) from a valid value of the slot."""
    roll = rng.random()
    if roll < 0.4:
        return same_values_other_layout(valid, rng)
    if roll < 0.7:
        name, a = other_dtype(valid, rng)
        how, b = same_values_other_layout(a, rng)
        return f"{name}, {how}", b
    name, a = garbage(rng)
    how, b = same_values_other_layout(a, rng)
    return f"{name}, {how}", b


def to_torch(x, rng):
    """For slots that take tensors: the input as a tensor where torch can hold it."""
    if isinstance(x, torch.Tensor):
        t = x
    elif isinstance(x, np.ndarray) and x.dtype.isnative and np.dtype(x.dtype.str) in TORCH_DTYPES \
            and x.dtype.names is None:
        t = torch.from_numpy(np.array(x, copy=True))
        if x.ndim >= 1 and rng.random() < 0.3:
            t = torch.repeat_interleave(t, 2, dim=0)[::2]
    else:
        return x
    kind = rng.random()
    if t.is_floating_point() and t.dtype == torch.float32 and kind < 0.25:
        return t.to(torch.bfloat16)
    if t.dim() >= 2 and kind < 0.5:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if t.is_floating_point() and kind < 0.6:
        return t.clone().requires_grad_(True)
    return t


def plain(x):
    """The oracle's input: a C-contiguous, aligned, native copy (None where there is none)."""
    if isinstance(x, torch.Tensor):
        y = x.detach().clone(memory_format=torch.contiguous_format)
        return y.requires_grad_(True) if x.requires_grad else y
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject:
            return None
        y = np.array(x, dtype=x.dtype.newbyteorder("="), order="C", copy=True)
        y.flags.writeable = x.flags.writeable
        return y
    return x


def canon(v):
    """A comparable form of a result (arrays by dtype, shape and bytes; NaN equal to NaN)."""
    if isinstance(v, torch.Tensor):
        v = v.detach()
        return ("tensor", str(v.dtype), tuple(v.shape),
                b"" if v.numel() == 0 else
                v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    if isinstance(v, np.ndarray) and v.dtype.hasobject:
        return ("objects", v.shape, repr(v.tolist()))
    if isinstance(v, np.ndarray):  # values, whatever the byte order of a view of the input
        native = v.dtype.newbyteorder("=")
        return ("array", native.str, v.shape, np.array(v, dtype=native, order="C").tobytes())
    if isinstance(v, dict):
        return ("dict", tuple((k, canon(v[k])) for k in sorted(v)))
    if isinstance(v, (list, tuple)):
        return ("seq", tuple(canon(x) for x in v))
    if isinstance(v, float):
        return ("float", np.float64(v).tobytes())
    if isinstance(v, thdpack.Plan):
        return ("plan", v.num_microbatches, canon(v.figures),
                tuple(canon(v.microbatch(r, m)) for r in range(2)
                      for m in range(v.num_microbatches)))
    if isinstance(v, (bytes, int, str, bool, type(None))):
        return v
    return repr(v)


def outcome(call, x):
    try:
        return "ok", canon(call(x))
    except ValueError as e:
        return "ValueError", str(e)


def test_every_public_array_argument_takes_generated_arrays():
    rng = np.random.default_rng(SEED)
    print(f"THDPACK_FUZZ_SEED={SEED} THDPACK_FUZZ_INPUTS={PER_SLOT}")
    calls = accepted = refused = 0
    for slot, (make, call, wants_torch) in SLOTS.items():
        for k in range(PER_SLOT):
            desc, x = generated(make(rng), rng)
            if wants_torch or (slot.startswith("torch.") and rng.random() < 0.5):
                x = to_torch(x, rng)
            where = f"{slot} <- {desc} ({type(x).__name__}), input {k}, seed {SEED}"
            try:
                got = outcome(call, x)
            except Exception as e:  # anything but a ValueError
                raise AssertionError(f"{where}: raised {type(e).__name__}: {e}") from e
            calls += 1
            ref = plain(x)
            if ref is None:
                # Only a function that never reads the array's bytes (sp_split: a NumPy view)
                # may accept Python objects.
                assert got[0] == "ValueError" or slot == "sp_split.array", \
                    f"{where}: an array of objects was accepted"
                ref = np.array(x, copy=True)
            want = outcome(call, ref)
            assert got[0] == want[0], (f"{where}: {got[0]} ({str(got[1])[:200]}) but its plain "
                                       f"copy gave {want[0]} ({str(want[1])[:200]})")
            if got[0] == "ok":
                assert got[1] == want[1], f"{where}: a different result than its plain copy"
                accepted += 1
            else:
                refused += 1
    print(f"{calls} calls over {len(SLOTS)} slots: {accepted} accepted, {refused} refused "
          f"with ValueError")
    assert calls == PER_SLOT * len(SLOTS)
    # The generator is not degenerate: both outcomes are common.
    assert accepted > calls // 5 and refused > calls // 10, (accepted, refused)
