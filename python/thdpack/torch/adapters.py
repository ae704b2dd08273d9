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
  (dicts for pack_batch / PackedDataIterator): ``input_ids`` the row's real tokens,
  ``loss_mask`` 1 on its response tokens that ``response_mask`` keeps, each per-token name a
  target field (the value of response token k on that token, 0 on the prompt), each per-sample
  name a sample field. Vectorised: one boolean gather per tensor, and views of it per sample.
- ``padded_from_unpacked(values, batch, response_length, fill=0)``: ``step.unpack``'s per-sample
  outputs (entry j: the value that predicted token j) as [B, R] - row b, column k: the value of
  response token k, ``fill`` past the row's response - verl's layout.
- ``fields_of(per_token=(), per_sample=())``: the ``fields=`` declaration those samples need.
"""
import numpy as np
import torch


def _np(x, name):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    raise TypeError(f"{name}: expected a tensor or a NumPy array, got {type(x).__name__}")


def _layout(batch, response_length):
    ids = _np(batch["input_ids"], "input_ids")
    mask = _np(batch["attention_mask"], "attention_mask")
    if ids.ndim != 2 or mask.shape != ids.shape:
        raise ValueError(f"input_ids {ids.shape} and attention_mask {mask.shape}: expected the "
                         f"same [B, S]")
    b, s = ids.shape
    r = int(response_length)
    if not 0 < r <= s:
        raise ValueError(f"response_length = {response_length}: must be in [1, S = {s}]")
    keep = mask.astype(bool)
    lengths = keep.sum(1)
    if (lengths == 0).any():
        row = int(np.argmax(lengths == 0))
        raise ValueError(f"attention_mask[{row}] keeps no token: a rollout needs at least one")
    return ids, keep, lengths, s - r, r


def fields_of(per_token=(), per_sample=(), dtype="float32"):
    """The ``fields=`` declaration of samples_from_padded's fields: each per-token name a
    target field, each per-sample name a sample field, of ``dtype`` (a name or a dict of name
    -> dtype)."""
    def dt(name):
        return dtype.get(name, "float32") if isinstance(dtype, dict) else dtype
    out = {name: {"kind": "target", "dtype": dt(name)} for name in per_token}
    out.update({name: {"kind": "sample", "dtype": dt(name)} for name in per_sample})
    return out


def _response_positions(keep, lengths, p):
    """(kept response positions of the [B, R] block, row-major; where each lands in the rows'
    concatenated real tokens). O(B x R) in the mask, O(response tokens) in the rest."""
    resp = keep[:, p:]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) + keep[:, :p].sum(1)
    where = np.flatnonzero(resp)
    r = resp.shape[1]
    rows, cols = where // r, where % r
    return where, starts[rows] + cols


def samples_from_padded(batch, response_length, per_token=(), per_sample=()):
    """A padded batch's rows as thdpack samples, in row order (see the module's docstring).
    ``batch``: a mapping with input_ids and attention_mask [B, S], optional response_mask
    [B, R] (default: attention_mask's last R columns), and the named per-token [B, R] and
    per-sample [B] tensors or arrays (their dtypes kept)."""
    ids, keep, lengths, p, r = _layout(batch, response_length)
    b, s = ids.shape
    resp = batch.get("response_mask")
    resp = keep[:, p:] if resp is None else _np(resp, "response_mask").astype(bool)
    if resp.shape != (b, r):
        raise ValueError(f"response_mask: expected [B, R] = [{b}, {r}], got {tuple(resp.shape)}")
    split = np.cumsum(lengths)[:-1]
    total = int(lengths.sum())
    tokens = np.split(ids[keep], split)  # one gather; each sample a view of it
    src, dst = _response_positions(keep, lengths, p)
    loss = np.zeros(total, dtype=np.uint8)
    loss[dst] = resp.reshape(-1)[src]
    masks = np.split(loss, split)
    fields = {}
    for name in per_token:
        v = _np(batch[name], name)
        if v.shape[:2] != (b, r):
            raise ValueError(f"{name}: expected [B, R] = [{b}, {r}], got {tuple(v.shape)}")
        flat = np.zeros((total,) + v.shape[2:], dtype=v.dtype)
        flat[dst] = v.reshape((b * r,) + v.shape[2:])[src]
        fields[name] = np.split(flat, split)
    out = []
    for i in range(b):
        x = {"input_ids": tokens[i], "loss_mask": masks[i]}
        for name in per_token:
            x[name] = fields[name][i]
        out.append(x)
    for name in per_sample:
        v = _np(batch[name], name)
        if v.shape[:1] != (b,):
            raise ValueError(f"{name}: expected [B] = [{b}], got {tuple(v.shape)}")
        for i in range(b):
            out[i][name] = v[i]
    return out


def padded_from_unpacked(values, batch, response_length, fill=0):
    """``step.unpack``'s per-sample values (one [L] or [L, *row] tensor per row of ``batch``, in
    row order) as verl's [B, R] (or [B, R, *row]): each row's response values, ``fill`` past its
    response."""
    ids, keep, lengths, p, r = _layout(batch, response_length)
    b, s = ids.shape
    if len(values) != b:
        raise ValueError(f"values: {len(values)} samples, the batch has {b} rows")
    for i, v in enumerate(values):
        if v.shape[0] != lengths[i]:
            raise ValueError(f"values[{i}]: {v.shape[0]} entries, row {i} has {lengths[i]} "
                             f"tokens")
    flat = torch.cat([v.reshape(v.shape[0], -1) for v in values]) if b else torch.zeros(0, 1)
    row = tuple(values[0].shape[1:]) if b else ()
    src, dst = _response_positions(keep, lengths, p)
    out = flat.new_full((b * r, flat.shape[1]), fill)
    out[torch.from_numpy(src)] = flat[torch.from_numpy(dst)]
    return out.reshape((b, r) + row)
