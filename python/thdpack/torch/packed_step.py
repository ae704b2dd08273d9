"""thdpack.torch.packed_step: a step as one rank holds it, in torch tensors.

``PackedStep`` wraps the arrays the C++ step gives a rank (thdpack/step_runner.h, RankStep, as
bind_torch_iter.cc's dicts) as torch tensors on the rank's device, one dict a microbatch
(``_microbatch``; ``_pin`` and ``_prepare`` where the step is made ahead of the caller), and
``PackedStep.unpack`` turns the model's per-token outputs into bytes, dtype name and shape for
the C++ ``UnpackStep`` (which agrees them over the world) and its answer back into tensors.
"""
from __future__ import annotations

import json

import torch

from .. import _thdpack
from ._dtypes import TORCH, torch_name
from .media import _media_entry


class StepOptions(dict):
    """Every effective option of a step's job by name (a dict), given or defaulted; ``defaulted``
    is the frozenset of those the C++ job defaulted (thdpack/job.h, Job::defaulted)."""

    def __init__(self, values, defaulted):
        super().__init__(values)
        self.defaulted = frozenset(defaulted)

    def __repr__(self):
        return f"StepOptions({dict.__repr__(self)}, defaulted={sorted(self.defaulted)})"


class PackedStep:
    """One global batch as this rank holds it; iterate for its microbatches (dicts of tensors).

    Attributes: step, epoch, num_microbatches (M, the same on every rank), n_loss_tokens (N,
    the global loss-token count: the loss denominator), n_loss_sequences (the step's sequences
    with at least one loss token, over every replica: a per-sequence mean's), bytes_sent (this
    rank's bytes sent per phase: read, lengths, plan, exchange, pack, deliver, agree),
    phase_seconds (this rank's wall time in each of those phases), field_bytes (the bytes of
    the fields this rank holds), seqlen_sum (global padded tokens),
    seqlen_squared_sum (sum of padded P^2 over the step), figures (``plan --json``'s step;
    per-replica detail on the ranks that planned only; a dynamic step adds groups_made,
    groups_reused, groups_evicted, groups_cached), microbatches (the list), dynamic,
    is_loader, first_stage, last_stage, options (the job's effective options, ``StepOptions``:
    ``options.defaulted`` names those not given), sp (activations split over TP), media_cost
    (with media: the encoder's (per_patch, per_frame_sq) term that placed the items; None
    without).
    """

    def __init__(self, raw, device, cp_group=None, copy_stream=None,
                 label_format="megatron", fields=(), media_names=()):
        self.step = raw["step"]
        self.options = None  # the iterator's StepOptions, set as it hands the step out
        self.n_loss_sequences = raw["n_loss_sequences"]
        self.bytes_sent = dict(raw["bytes_sent"])  # this rank's, per phase of the step
        self.phase_seconds = dict(raw["phase_seconds"])  # this rank's wall time, per phase
        self.field_bytes = raw["field_bytes"]      # the bytes of the fields this rank holds
        self.epoch = raw["epoch"]
        self.is_loader = raw["is_loader"]
        self.first_stage = raw["first_stage"]
        self.last_stage = raw["last_stage"]
        self.num_microbatches = raw["num_microbatches"]
        self.n_loss_tokens = raw["n_loss_tokens"]
        self.figures = raw["figures"]
        self.seqlen_sum = self.figures["padded_tokens"]
        self.seqlen_squared_sum = self.figures["sum_sq"]
        self.skipped_ids = list(raw["skipped_ids"])
        self.dynamic = raw["dynamic"]
        self.sp = bool(raw["sp"])  # activations split over TP (sequence parallelism)
        # With media: the encoder's (per_patch, per_frame_sq) term that placed the items.
        self.media_cost = raw["media_cost"]
        if copy_stream is not None:
            # Pinned host tensors to the device on a side stream; the caller's stream waits
            # for the copies before it uses them.
            with torch.cuda.stream(copy_stream):
                self.microbatches = [_microbatch(m, device, cp_group, label_format, fields,
                                                 media_names) for m in raw["microbatches"]]
            torch.cuda.current_stream(device).wait_stream(copy_stream)
        else:
            self.microbatches = [_microbatch(m, device, cp_group, label_format, fields,
                                             media_names) for m in raw["microbatches"]]
        self._state = raw["state"]
        self._unpack = raw["unpack"]
        self._label_format = label_format  # how unpack's values are aligned
        # The iterator whose world unpack() communicates over (a weak reference, set by
        # __next__: a step the iterator's data thread frees must not keep the iterator alive).
        self._iterator = None

    def unpack(self, values, fill=0, flat=False):
        """The model's per-token outputs back to the samples, in each loader's order.

        Collective over the world. ``values``: one tensor per microbatch of this rank's outputs,
        [T/CP] or [T/CP, *row], label-aligned as the step's ``mb["labels"]`` are (position o of
        a sequence: the prediction of its token o + 1; with ``label_format="hf"``, token o's own
        value, as Hugging Face's unshifted labels and target fields hold it, position 0 of each
        sequence ignored); needed on the ranks tp = 0 of the last stage, None (or any)
        elsewhere. Returns, on each rank that read samples, a list in the order it gave
        them of one tensor per sample, [L] or [L, *row] of the values' dtype, token-aligned like
        a target field: entry j (1 <= j < L) the value that predicted token j, entry 0 ``fill``;
        on other ranks []. With ``flat=True``, the same as one tensor and its offsets,
        ``(values [sum of L, *row], offsets int64 [samples + 1])`` (sample k: rows
        offsets[k]:offsets[k+1]; the list's tensors are views of that one), which
        ``adapters.padded_from_unpacked`` also takes. Only for samples fed by the caller (the
        iterator's iterables, pack_batch). The values' dtype is one of the fields'
        (``_thdpack.field_dtypes()``: float32, float64, bfloat16, int32, int64, uint8, bool,
        float16), the same with the same
        row shape on every rank, and ``fill`` a value it holds exactly; the C++ agrees them over
        the world, so that a rank with values of another dtype or shape, or any other error of
        one rank, is a ValueError on every rank."""
        it = None if self._iterator is None else self._iterator()
        if self._unpack is None or it is None or it._src is None:
            raise RuntimeError("unpack: needs a step of samples fed by the caller, from an "
                               "iterator that is still open, or pack_batch")
        # Every check of the values (their count, dtypes and row shapes on every rank, the
        # fill) is UnpackStep's, agreed over the world: an error on one rank raises on all.
        raw = [None if v is None else _values_bytes(v) for v in values]
        dtype, shape, out, offsets = it._src.unpack(self.microbatches, raw, self._unpack, fill,
                                                    self._label_format)
        rows = torch.from_numpy(out).view(TORCH[dtype]).reshape(-1, *shape) if out.size else \
            torch.zeros((0, *shape), dtype=TORCH[dtype])
        offsets = torch.from_numpy(offsets)
        if flat:
            return rows, offsets
        return list(rows.split(offsets.diff().tolist())) if len(offsets) > 1 else []

    def state_dict(self):
        """The run's state once this step is done (the iterator's state_dict() after it)."""
        return json.loads(self._state)

    def __iter__(self):
        return iter(self.microbatches)

    def __len__(self):
        return self.num_microbatches


def _values_bytes(v):
    """A tensor of step.unpack's values as (dtype name, shape, uint8 bytes) for the C++; anything
    else as given (the C++ names it)."""
    if not isinstance(v, torch.Tensor):
        return v
    t = v.detach().contiguous().cpu()
    if t.dtype not in _VIEWABLE:  # refused by name in the C++
        return torch_name(t.dtype), tuple(t.shape), torch.zeros(0, dtype=torch.uint8).numpy()
    return torch_name(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy()


_VIEWABLE = frozenset(TORCH.values())


def _tensor(a, device):
    if a is None:
        return None
    if isinstance(a, torch.Tensor):  # pinned by the prefetching thread
        return a.to(device, non_blocking=True)
    return torch.from_numpy(a).to(device)


_DEVICE_ARRAYS = ("tokens", "position_ids", "labels", "loss_mask", "padding_mask", "cu_seqlens",
                  "cu_seqlens_padded", "cu_seqlens_fixed", "cu_seqlens_padded_fixed")


def _pin(raw):
    """A step's arrays as pinned host tensors (the prefetching thread, for a CUDA device)."""
    for m in raw["microbatches"]:
        for k in _DEVICE_ARRAYS:
            if m[k] is not None:
                m[k] = torch.from_numpy(m[k]).pin_memory()
        for k, a in m["fields"].items():
            if a is not None:
                m["fields"][k] = torch.from_numpy(a).pin_memory()


def _field(raw, spec, device):
    """A field's bytes as the tensor of its dtype, [rows, *shape]."""
    _, _, dtype, shape, _ = spec
    t = raw if isinstance(raw, torch.Tensor) else torch.from_numpy(raw)
    t = t.view(TORCH[dtype]).reshape(-1, *shape)
    return t.to(device, non_blocking=True) if t.is_pinned() else t.to(device)


def _host(a):
    return a if isinstance(a, torch.Tensor) else torch.from_numpy(a)


def _cp_group(m, topology_cp_group):
    """A microbatch's CP group: a dynamic one's comes with it (attached at the hand-over), a
    static one's is the caller's CP group; None for one rank."""
    if int(m["cp_size"]) == 1:
        return None
    return m["cp_group"] if m["cp_group"] is not None else topology_cp_group


def _media(parts, names, device):
    """The step's media of a microbatch (MediaShard, thdpack/step_wire.h) by modality name: the
    payload rows this rank encodes as a tensor of their own dtype [rows, D], their grids, the
    local token positions taking each modality's rows, and route_media's tables."""
    out = {}
    for name, p in zip(names, parts):
        raw = p["payload"]
        t = raw if isinstance(raw, torch.Tensor) else torch.from_numpy(raw)
        width = int(p["width"])
        if t.numel() == 0:  # none here: empty rows of the modality's width (0 when unknown)
            pixels = torch.zeros((0, width), dtype=TORCH[p["dtype"]])
        else:
            pixels = t.view(TORCH[p["dtype"]]).reshape(-1, width)
        out[name] = _media_entry(pixels, p, device)
    return out


def _microbatch(m, device, topology_cp_group, label_format="megatron", fields=(),
                media_names=()):
    # What attention reads: with max_seqs, the offsets padded to max_seqs + 1 (made in C++).
    fixed = m["cu_seqlens_fixed"] is not None
    cu = _tensor(m["cu_seqlens_fixed" if fixed else "cu_seqlens"], device)
    cup = _tensor(m["cu_seqlens_padded_fixed" if fixed else "cu_seqlens_padded"], device)
    max_seqlen = int(m["max_seqlen"])
    # What attention is told: with pad_to_max_tokens, T (one value for every microbatch).
    attn_max = max_seqlen if m["max_seqlen_fixed"] is None else int(m["max_seqlen_fixed"])
    cp_size = int(m["cp_size"])
    cp_group = _cp_group(m, topology_cp_group)
    labels, loss_mask = m["labels"], m["loss_mask"]
    hf = label_format == "hf"
    if hf and labels is not None:
        if cp_size != 1:  # refused when the iterator is made; a whole microbatch only
            raise RuntimeError(f"label_format='hf': a microbatch of CP size {cp_size}")
        # The arrays the prefetching thread pinned are tensors: back to NumPy for the rule.
        labels, loss_mask, cup_host = (a.numpy() if isinstance(a, torch.Tensor) else a
                                       for a in (labels, loss_mask, m["cu_seqlens_padded"]))
        labels, loss_mask = _thdpack.hf_labels(labels, loss_mask, cup_host)
    tokens = _tensor(m["tokens"], device)
    out = {
        "tokens": tokens,
        "position_ids": _tensor(m["position_ids"], device),
        "labels": _tensor(labels, device),
        "loss_mask": _tensor(loss_mask, device),
        "padding_mask": _tensor(m["padding_mask"], device),
        "cu_seqlens": cu,
        "cu_seqlens_padded": cup,
        # The offsets of the num_seqs real sequences [n+1] in host memory, for whatever needs
        # their values without waiting for the device (LossStatistics.add_microbatch); with
        # max_seqs these are the unpadded ones.
        "cu_seqlens_cpu": _host(m["cu_seqlens"]),
        "cu_seqlens_padded_cpu": _host(m["cu_seqlens_padded"]),
        "num_seqs": int(m["num_seqs"]),
        "max_seqlen": max_seqlen,
        "n_valid": int(m["n_valid"]),
        # A blend: [n] int32 (CPU), each sequence's source in the blend's list; None otherwise.
        # LossStatistics.add_microbatch keeps its statistics by source with it.
        "sources": None if m["sources"] is None else torch.from_numpy(m["sources"]),
        "sp_range": tuple(m["sp_range"]),
        "cp_group": cp_group,
        "cp_size": cp_size,
        "cp_rank": int(m["cp_rank"]),
        "cp_ranks": list(m["cp_ranks"]),
        "idle": bool(m["idle"]),
        "dynamic": bool(m["dynamic"]),
        # How labels and target fields are aligned (token_logprobs reads it).
        "label_format": label_format,
        "packed_seq_params": {
            "qkv_format": "thd",
            "cu_seqlens_q": cu, "cu_seqlens_kv": cu,
            "cu_seqlens_q_padded": cup, "cu_seqlens_kv_padded": cup,
            "max_seqlen_q": attn_max, "max_seqlen_kv": attn_max,
        },
    }
    # Where each local token comes from, and the samples of the microbatch's sequences.
    out["seq_index"] = torch.from_numpy(m["seq_index"]).to(device)
    out["sample_ids"] = torch.from_numpy(m["sample_ids"])
    out["seq_n_targets"] = torch.from_numpy(m["seq_n_targets"])
    for spec in fields:
        name, kind, dtype, shape, fill = spec
        raw = m["fields"][name]
        if raw is not None and hf and kind == "target":  # shifted as the labels are
            host = raw.numpy() if isinstance(raw, torch.Tensor) else raw
            cup_host = m["cu_seqlens_padded"]
            cup_host = cup_host.numpy() if isinstance(cup_host, torch.Tensor) else cup_host
            raw = _thdpack.hf_field(host, cup_host, dtype, shape, fill)
        out[name] = None if raw is None else _field(raw, spec, device)
    # Media (first stage, media declared): mb["media"][name] (route_media reads it) and the
    # shard's mRoPE positions [3, T/CP].
    if m.get("media") is not None:
        out["media"] = _media(m["media"], media_names, device)
    if m.get("mrope_position_ids") is not None:
        out["mrope_position_ids"] = _tensor(m["mrope_position_ids"], device)
    if hf:
        # transformers' names (DataCollatorWithFlattening), over the padded sequences.
        out.update(input_ids=tokens, cu_seq_lens_q=cup, cu_seq_lens_k=cup,
                   max_length_q=max_seqlen, max_length_k=max_seqlen)
    return out


def _prepare(device, cp_group, label_format, pin, fields, raw, media_names=()):
    """What the step source keeps of a step where it is made: a PackedStep, or (``pin``: a
    GPU, ahead of the caller) the raw step with its arrays pinned, copied by next()."""
    if pin:
        _pin(raw)
        return raw
    if device.type == "cuda":  # depth 0: made on the caller's thread, copied by next()
        return raw
    return PackedStep(raw, device, cp_group, None, label_format, fields, media_names)
