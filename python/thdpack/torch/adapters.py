"""Adapters between an RL trainer's padded batch and thdpack's samples (docs/python.md,
"A verl user's loop").

verl's batch (a DataProto) holds, for B rollouts, ``input_ids`` [B, S] (each row its prompt,
left-padded to P, then its response, right-padded to R: S = P + R), ``attention_mask`` [B, S],
``response_mask`` [B, R] (the response tokens that count; tool outputs may be masked),
per-token tensors [B, R] (``old_log_probs``, ``advantages``, ...) and per-sample ones [B]
(``uid``, scores). thdpack wants each rollout as a sample - its real tokens, a token-aligned
loss mask, its fields - and gives per-token outputs back per sample (``step.unpack``);
verl's ``compute_log_prob`` returns [B, R].

- ``samples_from_padded(batch, response_length, per_token=(), per_sample=())``: the B samples
  (a ``SampleRows`` for pack_batch / PackedDataIterator): ``input_ids`` the row's real tokens,
  ``loss_mask`` 1 on its response tokens that ``response_mask`` keeps, each per-token name a
  target field (the value of response token k on that token, 0 on the prompt), each per-sample
  name a sample field. No object per sample.
- ``padded_from_unpacked(values, batch, response_length, fill=0)``: ``step.unpack``'s per-sample
  outputs (entry j: the value that predicted token j; a list, or ``flat=True``'s pair) as
  [B, R] - row b, column k: the value of response token k, ``fill`` past the row's response -
  verl's layout. Both by one C++ pass over the mask's runs (thdpack/columns.h).
- ``fields_of(per_token=(), per_sample=())``: the ``fields=`` declaration those samples need.
"""
import numpy as np
import torch

from .. import _thdpack


def _np(x, name):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    raise TypeError(f"{name}: expected a tensor or a NumPy array, got {type(x).__name__}")


def _layout(batch, response_length):
    """(input_ids, the attention mask in a dtype the C++ reads, P, R), shapes checked."""
    ids = _np(batch["input_ids"], "input_ids")
    mask = _np(batch["attention_mask"], "attention_mask")
    if ids.ndim != 2 or mask.shape != ids.shape:
        raise ValueError(f"input_ids {ids.shape} and attention_mask {mask.shape}: expected the "
                         f"same [B, S]")
    b, s = ids.shape
    r = int(response_length)
    if not 0 < r <= s:
        raise ValueError(f"response_length = {response_length}: must be in [1, S = {s}]")
    if mask.dtype.name not in ("bool", "uint8", "int32", "int64"):
        mask = mask != 0
    return ids, np.ascontiguousarray(mask), s - r, r


def _check_rows(offsets):
    lengths = np.diff(offsets)
    if (lengths == 0).any():
        row = int(np.argmax(lengths == 0))
        raise ValueError(f"attention_mask[{row}] keeps no token: a rollout needs at least one")


def fields_of(per_token=(), per_sample=(), dtype="float32"):
    """The ``fields=`` declaration of samples_from_padded's fields: each per-token name a
    target field, each per-sample name a sample field, of ``dtype`` (a name or a dict of name
    -> dtype)."""
    def dt(name):
        return dtype.get(name, "float32") if isinstance(dtype, dict) else dtype
    out = {name: {"kind": "target", "dtype": dt(name)} for name in per_token}
    out.update({name: {"kind": "sample", "dtype": dt(name)} for name in per_sample})
    return out


def samples_from_padded(batch, response_length, per_token=(), per_sample=()):
    """A padded batch's rows as thdpack samples, in row order (see the module's docstring): a
    ``SampleRows`` (columns, made into the step's samples in one C++ call; also a sequence of
    sample dicts). ``batch``: a mapping with input_ids and attention_mask [B, S], optional
    response_mask [B, R] (default: attention_mask's last R columns), and the named per-token
    [B, R] and per-sample [B] tensors or arrays (their dtypes kept)."""
    from .rows import SampleRows
    ids, mask, p, r = _layout(batch, response_length)
    b, s = ids.shape
    resp = batch.get("response_mask")
    resp = np.ones((b, r), np.uint8) if resp is None else _np(resp, "response_mask")
    if resp.shape != (b, r):
        raise ValueError(f"response_mask: expected [B, R] = [{b}, {r}], got {tuple(resp.shape)}")
    values = []
    for name in per_token:
        v = _np(batch[name], name)
        if v.shape[:2] != (b, r):
            raise ValueError(f"{name}: expected [B, R] = [{b}, {r}], got {tuple(v.shape)}")
        values.append(np.ascontiguousarray(v))
    # One pass of the C++ over the mask's runs: each row's kept tokens, and its kept response
    # columns' values at their tokens (0 on the prompt).
    offsets, (tokens,), (loss, *flat) = _thdpack._flatten_padded(
        mask, r, [np.ascontiguousarray(ids)], [np.ascontiguousarray(resp)] + values)
    _check_rows(offsets)
    sample_fields = {}
    for name in per_sample:
        v = _np(batch[name], name)
        if v.shape[:1] != (b,):
            raise ValueError(f"{name}: expected [B] = [{b}], got {tuple(v.shape)}")
        sample_fields[name] = v
    return SampleRows(tokens, offsets, loss, dict(zip(per_token, flat)), sample_fields)


def padded_from_unpacked(values, batch, response_length, fill=0):
    """``step.unpack``'s per-sample values as verl's [B, R] (or [B, R, *row]): each row's
    response values, ``fill`` past its response. ``values``: one [L] or [L, *row] tensor per
    row of ``batch``, in row order, or ``step.unpack(..., flat=True)``'s ``(values, offsets)``
    (no concatenation needed)."""
    ids, mask, p, r = _layout(batch, response_length)
    b = ids.shape[0]
    if isinstance(values, tuple):
        flat, offsets = values
        offsets = _np(offsets, "offsets").astype(np.int64)
    else:
        if len(values) != b:
            raise ValueError(f"values: {len(values)} samples, the batch has {b} rows")
        offsets = np.zeros(b + 1, dtype=np.int64)
        np.cumsum([v.shape[0] for v in values], out=offsets[1:])
        flat = torch.cat(list(values)) if b else torch.zeros(0)
    if not isinstance(flat, torch.Tensor):
        flat = torch.as_tensor(flat)
    flat = flat.detach().cpu().contiguous()
    bf16 = flat.dtype == torch.bfloat16  # NumPy has none: its bits as int16, the same bytes
    raw = (flat.view(torch.int16) if bf16 else flat).numpy()
    fill_row = torch.full(flat.shape[1:], fill, dtype=flat.dtype)
    fill_row = (fill_row.view(torch.int16) if bf16 else fill_row).numpy()
    out = torch.from_numpy(_thdpack._pad_flat(mask, r, raw, offsets, fill_row))
    return out.view(torch.bfloat16) if bf16 else out
