"""thdpack.torch.fed: samples fed by the caller, as the C++ step takes them.

``fields=`` as the C++ schema takes it (``field_specs``), a loader's sample dict as int32 tokens,
a uint8 mask, each field's (dtype name, shape, bytes) and the position it says it has
(``_to_sample``), the reader of a loader's iterable that the step source calls for each share
(``_FedShares``), and ``loader_positions``. Conversions only: which positions a loader yields,
how many samples a share holds and every field rule are the C++'s (FedShares of thdpack/step.h,
thdpack/fields.h), asked here, never restated.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from .. import _thdpack
from ._dtypes import NUMPY_NAMES, TORCH, dtype_name


def _as_array(value, name):
    """A tensor, array or list as a NumPy array of the same values: bfloat16 (which NumPy has
    not) as float32, exactly; another byte order than the machine's as the machine's, exactly
    (a big-endian array's bytes are never read as little-endian)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            value = value.float()
        value = value.numpy()
    a = np.asarray(value)
    if a.dtype.byteorder not in "=|":
        a = a.astype(a.dtype.newbyteorder("="))
    return a


# The keys of a fed sample that are not fields: the tokens, their target mask, and the stream
# position the caller says the sample has (checked by the C++).
_SAMPLE_KEYS = ("input_ids", "loss_mask", "position")


def field_specs(fields):
    """``fields=`` as the C++ schema takes it: [(name, kind, dtype, shape, fill)] in the order
    given. Each entry is a kind ("input", "target", "sample"; dtype float32, scalar rows) or a
    dict with ``kind`` and optional ``dtype`` (a name, NumPy or torch dtype; default float32),
    ``shape`` (the inner shape: () for [L] or one value, (k,) for [L, k]; default ()) and
    ``fill`` (the padding value, default 0). The C++ checks every rule (thdpack/fields.h)."""
    if fields is None:
        return []
    if not isinstance(fields, dict):
        raise TypeError(f"fields: expected a dict of name -> kind or spec, got "
                        f"{type(fields).__name__}")
    out = []
    for name, spec in fields.items():
        where = f"fields[{name!r}]"
        if not isinstance(name, str):
            raise TypeError(f"{where}: a field's name must be a str, got {type(name).__name__}")
        if isinstance(spec, str):
            spec = {"kind": spec}
        if not isinstance(spec, dict) or "kind" not in spec:
            raise TypeError(f"{where}: expected a kind ('input', 'target', 'sample') or a dict "
                            f"with 'kind' (and optional 'dtype', 'shape', 'fill')")
        unknown = sorted(set(spec) - {"kind", "dtype", "shape", "fill"})
        if unknown:
            raise TypeError(f"{where}: unknown keys {unknown} (kind, dtype, shape, fill)")
        shape = spec.get("shape", ())
        if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
            shape = (shape,)
        elif isinstance(shape, (str, bytes)) or not all(
                isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in shape):
            raise TypeError(f"{where}: shape {spec['shape']!r} is not an int or a tuple of ints")
        shape = tuple(int(d) for d in shape)
        out.append((str(name), str(spec["kind"]), dtype_name(spec.get("dtype", "float32"), where),
                    shape, float(spec.get("fill", 0))))
    return out


def _field_value(value, dtype, where):
    """A fed field value as (dtype name, shape, uint8 bytes) for the C++ to check. Arrays and
    tensors keep their dtype (a different one is an error there: never cast); a list or a
    Python number has none and is made the declared dtype, if its values fit it exactly (or,
    for a float dtype, are numbers)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        got, shape = dtype_name(t.dtype, where), tuple(t.shape)
        a = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    elif isinstance(value, (np.ndarray, np.generic)):
        # asarray keeps a NumPy scalar 0-d (shape []); ascontiguousarray would make it [1]. A
        # byte order other than the machine's is converted (exactly), never reinterpreted.
        a = _as_array(value, where)
        a = a if a.flags.c_contiguous else np.ascontiguousarray(a)
        got = NUMPY_NAMES.get(a.dtype) or a.dtype.name
        shape = a.shape
    else:
        given = np.asarray(value)
        if given.dtype.kind not in "biuf":
            raise ValueError(f"{where}: holds {given.dtype} values, declared {dtype}")
        if dtype == "bfloat16":
            t = torch.tensor(given.tolist(), dtype=torch.bfloat16)
            a, got = t.view(torch.int16).numpy(), "bfloat16"
            made = t.float().numpy()
        else:
            a = given.astype(dtype)
            exact = TORCH[dtype].is_floating_point or np.array_equal(a, given)
            got = dtype if exact else given.dtype.name
            made = a
        if TORCH[dtype].is_floating_point and given.dtype.kind in "biuf":
            over = np.isfinite(given) & ~np.isfinite(made.astype(np.float64))
            if over.any():
                k = int(np.flatnonzero(over.reshape(-1))[0])
                value = float(given.reshape(-1)[k])
                raise ValueError(f"{where}: value {value!r} does not fit {dtype} (it would "
                                 f"become inf)")
        shape = given.shape
    return got, tuple(int(d) for d in shape), np.ascontiguousarray(a).reshape(-1).view(np.uint8)


_FLOAT_NAMES = ("float32", "float64", "bfloat16", "float16")


def _media_parts(item, media, where):
    """A sample's media, one part per declared modality in order, as the C++ takes it: (int64
    grid [3k], seconds or None, payload dtype name, row width, uint8 payload bytes). The payload
    keeps its dtype (a float dtype; never cast) and is [rows, width]; the C++ checks the rows
    against the grids and the grids against the tokens (CheckSampleMedia, thdpack/media.h)."""
    parts = []
    for name, spec in media.items():
        at = f"{where}, media {name!r}"
        grid = item.get(spec["grid"])
        grid = np.zeros(0, dtype=np.int64) if grid is None else \
            np.ascontiguousarray(_as_array(grid, spec["grid"]), dtype=np.int64).reshape(-1)
        seconds = None
        if "seconds" in spec and item.get(spec["seconds"]) is not None:
            seconds = [float(v) for v in _as_array(item[spec["seconds"]], "seconds").reshape(-1)]
        payload = item.get(spec["payload"])
        if payload is None:
            parts.append((grid, seconds, "float32", 0, np.zeros(0, dtype=np.uint8)))
            continue
        got, shape, raw = _field_value(payload, "float32", f"{at} {spec['payload']!r}")
        if got not in _FLOAT_NAMES or len(shape) != 2:
            raise ValueError(f"{at}: {spec['payload']!r} must be a [rows, D] array of a float "
                             f"dtype (kept as it is), got {got} of shape {shape}")
        parts.append((grid, seconds, got, int(shape[1]), raw))
    return parts


def _media_keys(media):
    keys = set()
    for spec in (media or {}).values():
        keys.update(spec[k] for k in ("payload", "grid", "seconds") if k in spec)
    return keys


def _to_sample(item, where, fields=(), media=None):
    """A loader's sample (dict with input_ids, optional loss_mask and position, and the run's
    fields) as (int32 tokens, uint8 mask or None, fields, position or None). Values outside
    int32 or a mask that is not 0/1 are errors, never cast away; every other key goes to the
    C++ as a field, which refuses one not declared; the position, when given, is checked there
    against the one the sample has (FedShares)."""
    if not isinstance(item, dict) or "input_ids" not in item:
        raise ValueError(f"{where}: expected a dict with 'input_ids', got {type(item).__name__}")
    tokens = _as_array(item["input_ids"], "input_ids")
    if tokens.ndim != 1:
        raise ValueError(f"{where}: input_ids has shape {tokens.shape}, expected one sequence "
                         f"[L] (a sample is one sequence: give each row as its own sample)")
    if tokens.size == 0:
        raise ValueError(f"{where}: input_ids is empty")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{where}: input_ids has dtype {tokens.dtype}, expected integers")
    if tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max:
        raise ValueError(f"{where}: input_ids holds {int(tokens.min())}..{int(tokens.max())}, "
                         f"outside [0, 2^31)")
    mask = item.get("loss_mask")
    if mask is not None:
        mask = _as_array(mask, "loss_mask")
        if mask.shape != tokens.shape:
            raise ValueError(f"{where}: loss_mask has {mask.size} entries, input_ids "
                             f"{tokens.size} (the mask is token-aligned)")
        if not np.all((mask == 0) | (mask == 1)):
            raise ValueError(f"{where}: loss_mask holds values other than 0 and 1")
        mask = np.ascontiguousarray(mask, dtype=np.uint8)
    declared = {f[0]: f[2] for f in fields}
    skip = _media_keys(media)
    values = {k: _field_value(v, declared.get(k, "float32"), f"{where}, field {k!r}")
              for k, v in item.items() if k not in _SAMPLE_KEYS and k not in skip}
    position = item.get("position")
    if position is not None and (isinstance(position, bool) or
                                 not isinstance(position, (int, np.integer))):
        raise ValueError(f"{where}: position {position!r} is not an integer stream position")
    return (np.ascontiguousarray(tokens, dtype=np.int32), mask, values,
            None if position is None else int(position),
            None if not media else _media_parts(item, media, where))


def loader_positions(start, global_batch, dp_size, loader):
    """The stream positions loader ``loader`` yields, in order, from position ``start`` on.

    A step of ``global_batch`` samples takes the stream positions ``p .. p + global_batch - 1``
    (``p``: the samples consumed before it) and loader ``d`` yields ``p + d, p + d + DP, ...``
    of them; the next step starts at ``p + global_batch``. ``start`` is a position or a run
    state (``state_dict()``: its ``consumed``). This is where each loader's iterable continues
    after ``load_state_dict``, at any DP size and global batch: a caller's resumable sampler
    yields these positions (an infinite generator). The rule is the C++ step's (FedShares of
    thdpack/step.h), asked step by step.
    """
    if isinstance(start, dict):
        start = start["consumed"]
    p, global_batch, dp_size, loader = int(start), int(global_batch), int(dp_size), int(loader)
    while True:
        positions, p = _thdpack._fed_positions(p, global_batch, dp_size, loader)
        yield from positions


class _FedShares:
    """A caller-fed loader's iterable, read one share at a time by the step source (on the
    thread that makes the step): ``take(count)`` gives the next ``count`` samples as
    ``_to_sample`` makes them, fewer where the iterable ended inside the share, None where it
    ended at the step boundary (the C++ step agrees the end over every loader). ``whole``
    (pack_batch: a list that is the loader's whole share) gives every sample it holds, however
    many. The C++ (FedShares) checks the count and every position given."""

    def __init__(self, fields=(), media=None):
        self._fields = fields
        self._media = media
        self._it = None
        self._rows = None  # a SampleRows source and the rows taken of it
        self._taken = 0
        self.whole = False

    def start(self, source):
        from .rows import SampleRows
        self._rows, self._taken = None, 0
        if isinstance(source, SampleRows):
            if self._media:
                raise ValueError("media: a SampleRows carries no media; give the samples of a "
                                 "run with media as dicts")
            self._rows, self._it = source, ()
            return
        self._it = None if source is None else iter(source)

    def __call__(self, count):
        if self._rows is not None:  # columns: the C++ makes every sample in one call
            end = len(self._rows) if self.whole else min(self._taken + count,
                                                         len(self._rows))
            if count and end == self._taken and not self.whole:
                return None
            part, self._taken = self._rows[self._taken:end], end
            return part._columns()
        if self._it is None:
            raise ValueError("source: this rank is a loader but was given None (give each "
                             "loader its iterable)")
        items = self._it if self.whole else itertools.islice(self._it, count)
        out = [_to_sample(item, f"sample {k} of the share", self._fields, self._media)
               for k, item in enumerate(items)]
        return None if count and not out and not self.whole else out
