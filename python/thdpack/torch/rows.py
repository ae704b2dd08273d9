"""thdpack.torch.rows: samples held as columns (``SampleRows``), the way a padded batch, a
tokenized dataset or an Arrow table holds them: each column one buffer of every sample's values
one after another, and one offset a sample.

Wherever a list of sample dicts goes - ``pack_batch``'s loader list, a ``PackedDataIterator``
loader's iterable - a SampleRows goes too, and the C++ makes the step's samples from its columns
in one call (thdpack/columns.h: each column checked once, each row copied whole; the same rules
as for dicts, named with the column and the row). It is also a sequence of sample dicts (``len``,
``rows[b]``, iteration: views, no copy), and ``rows[a:b]`` is a SampleRows of those rows.
"""
from __future__ import annotations

import numpy as np
import torch

from .fed import _as_array, _field_value, field_specs

_TOKEN_DTYPES = ("int32", "int64", "uint8")
_MASK_DTYPES = ("bool", "uint8", "int32", "int64")


class SampleRows:
    """B samples as columns.

    ``input_ids``: [N] integer token ids of every sample one after another; ``offsets``:
    [B + 1] integers, sample b is ``input_ids[offsets[b]:offsets[b + 1]]`` (they need not start
    at 0); ``loss_mask``: [N] 0/1 of bool or any integer dtype, aligned like input_ids;
    ``token_fields``: name -> [N, *row] (input and target fields, aligned like input_ids);
    ``sample_fields``: name -> [B, *row]. Tensors or NumPy arrays, each kept in its dtype (a
    field's is never cast: the C++ refuses one that is not the declared dtype).
    """

    def __init__(self, input_ids, offsets, loss_mask=None, token_fields=None,
                 sample_fields=None):
        self.input_ids = input_ids
        self.offsets = np.ascontiguousarray(_as_array(offsets, "offsets"), dtype=np.int64)
        if self.offsets.ndim != 1 or self.offsets.size == 0:
            raise ValueError(f"offsets: expected [B + 1] integers, got shape "
                             f"{self.offsets.shape}")
        self.loss_mask = loss_mask
        self.token_fields = dict(token_fields or {})
        self.sample_fields = dict(sample_fields or {})
        for name in self.token_fields:
            if name in self.sample_fields or name in ("input_ids", "loss_mask", "position"):
                raise ValueError(f"token_fields[{name!r}]: the name is given twice (or is "
                                 f"input_ids, loss_mask or position)")

    def __len__(self):
        return self.offsets.size - 1

    @property
    def lengths(self):
        """[B] int64: each sample's tokens."""
        return np.diff(self.offsets)

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise ValueError("SampleRows: a slice of rows takes step 1")
            stop = max(stop, start)
            return SampleRows(self.input_ids, self.offsets[start:stop + 1], self.loss_mask,
                              self.token_fields,
                              {k: v[start:stop] for k, v in self.sample_fields.items()})
        b = int(key)
        if b < 0:
            b += len(self)
        if not 0 <= b < len(self):
            raise IndexError(f"SampleRows: row {key} of {len(self)}")
        lo, hi = int(self.offsets[b]), int(self.offsets[b + 1])
        out = {"input_ids": self.input_ids[lo:hi]}
        if self.loss_mask is not None:
            out["loss_mask"] = self.loss_mask[lo:hi]
        for name, v in self.token_fields.items():
            out[name] = v[lo:hi]
        for name, v in self.sample_fields.items():
            out[name] = v[b]
        return out

    def __iter__(self):
        return (self[b] for b in range(len(self)))

    def _columns(self):
        """The tuple the C++ takes (fields_py.h, SamplesFromPyColumns): ("columns", tokens,
        offsets, mask or None, {name: column}), a column (dtype name, inner shape, uint8
        bytes, per_token)."""
        def column(value, allowed, where):
            a = _as_array(value, where)
            if a.dtype.kind in "biu" and a.dtype.name not in allowed:
                a = a.astype(np.int64)  # exact for every integer the C++ then range-checks
            a = np.ascontiguousarray(a)
            if a.ndim != 1:
                raise ValueError(f"SampleRows: {where} has shape {a.shape}, expected one "
                                 f"value per token [N]")
            return (a.dtype.name, (), a.reshape(-1).view(np.uint8), True)

        fields = {}
        for name, v in self.token_fields.items():
            got, shape, raw = _field_value(v, "float32", f"SampleRows: token_fields[{name!r}]")
            fields[name] = (got, shape[1:], raw, True)
        for name, v in self.sample_fields.items():
            got, shape, raw = _field_value(v, "float32", f"SampleRows: sample_fields[{name!r}]")
            fields[name] = (got, shape[1:], raw, False)
        mask = None if self.loss_mask is None else column(self.loss_mask, _MASK_DTYPES,
                                                          "loss_mask")
        return ("columns", column(self.input_ids, _TOKEN_DTYPES, "input_ids"), self.offsets,
                mask, fields)


def rows_of_dicts(items, fields=None):
    """A list of sample dicts as one SampleRows, where they are alike: every dict with the same
    keys (input_ids, an optional loss_mask, declared fields; no position), each key's values
    NumPy arrays, NumPy scalars or CPU tensors of one dtype in the machine's byte order (bfloat16 and tensors
    that need a gradient aside), input_ids 1-D of int32, int64 or uint8, a mask of bool or an
    integer dtype, each token field as long as its input_ids. Else None, and the dicts go one
    by one, where whatever breaks a rule is named by its sample. The same samples either way:
    only the cost differs (one C++ call over the columns instead of a conversion a dict)."""
    if not isinstance(items, list) or not items or type(items[0]) is not dict:
        return None
    keys = items[0].keys()
    kinds = {f[0]: f[1] for f in field_specs(fields)}
    if "input_ids" not in keys or any(k not in kinds and k not in ("input_ids", "loss_mask")
                                      for k in keys):
        return None
    cols = {}
    for k in keys:
        arrays, dtype = [], None
        for x in items:
            if type(x) is not dict or x.keys() != keys:
                return None
            v = x[k]
            if isinstance(v, torch.Tensor):
                if v.device.type != "cpu" or v.dtype == torch.bfloat16 or v.requires_grad:
                    return None
                v = v.numpy()
            elif isinstance(v, np.generic):  # a NumPy scalar: a sample field's value
                v = np.asarray(v)
            elif type(v) is not np.ndarray:
                return None
            if dtype is None:
                dtype = v.dtype
            elif v.dtype != dtype:
                return None
            arrays.append(v)
        if dtype.byteorder not in "=|":
            return None
        cols[k] = arrays
    ids = cols["input_ids"]
    if ids[0].dtype.name not in _TOKEN_DTYPES or any(a.ndim != 1 or a.size == 0 for a in ids):
        return None
    if "loss_mask" in cols and (cols["loss_mask"][0].dtype.kind not in "biu" or
                                any(a.ndim != 1 for a in cols["loss_mask"])):
        return None
    lengths = [a.shape[0] for a in ids]
    token_fields, sample_fields = {}, {}
    for k, arrays in cols.items():
        if k == "input_ids":
            continue
        inner = arrays[0].shape[1:] if arrays[0].ndim else None
        if any(a.shape[1:] != inner if a.ndim else inner is not None for a in arrays):
            return None
        if kinds.get(k) == "sample":
            sample_fields[k] = np.stack(arrays)
            continue
        if inner is None or any(a.shape[0] != n for a, n in zip(arrays, lengths)):
            return None
        token_fields[k] = np.concatenate(arrays)
    mask = token_fields.pop("loss_mask", None)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return SampleRows(np.concatenate(ids), offsets, mask, token_fields, sample_fields)


__all__ = ["SampleRows"]
