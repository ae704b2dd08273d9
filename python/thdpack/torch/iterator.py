"""thdpack.torch.iterator: the distributed step inside a torch job.

``PackedDataIterator`` runs thdpack's C++ step (read, exchange lengths, plan, move tokens, pack,
CP-shard, deliver to every stage: ``thdpack/step_runner.h``) with every collective issued
through ``torch.distributed`` on the caller's process groups (gloo on CPU tensors, NCCL on CUDA
tensors), from the thread that iterates, taking the GIL for each call. There is one
implementation of the step; nothing of it is repeated here. This module only turns the
caller's groups into a topology, feeds a caller's iterable to the C++ step, and wraps the
arrays each rank receives as torch tensors. docs/python.md documents the interface.
"""
from __future__ import annotations

import atexit
import functools
import json
import time
import weakref

import numpy as np
import torch
import torch.distributed as dist

from .. import _thdpack

_LABEL_FORMATS = ("megatron", "hf")


def _group_ranks(group, world_ranks):
    """Positions in the world of the members of a torch group, in group order."""
    position = {r: i for i, r in enumerate(world_ranks)}
    ranks = dist.get_process_group_ranks(group)
    try:
        return [position[r] for r in ranks]
    except KeyError as e:
        raise ValueError(f"Groups: group with ranks {ranks} holds rank {e.args[0]}, "
                         f"which is not in the world {world_ranks}") from None


class Groups:
    """The caller's torch process groups: which ranks form TP, CP, DP and PP.

    ``Groups(tp=..., cp=..., dp=..., pp=..., world=None, order="tp-cp-dp-pp")``: each a torch
    ProcessGroup containing this rank (None: a dimension of size 1). ``world`` (default: the
    default group) holds them all; ``order`` is the rank order of the world, fastest first
    (Megatron's by default; any permutation of tp, cp, dp, pp). The groups are checked against
    the topology they define (``self.topology``, a thdpack.Topology: the C++ rule of ranks and
    groups): each must hold exactly the ranks the order gives this rank (ValueError naming the
    group). The iterator's step runs on the same topology, order included.
    """

    def __init__(self, tp=None, cp=None, dp=None, pp=None, world=None, order="tp-cp-dp-pp"):
        if not dist.is_initialized():
            raise RuntimeError("Groups: torch.distributed is not initialised "
                               "(call dist.init_process_group first)")
        self.world = dist.group.WORLD if world is None else world
        self.tp, self.cp, self.dp, self.pp = tp, cp, dp, pp
        self.order = order
        self.world_ranks = list(dist.get_process_group_ranks(self.world))
        self.rank = dist.get_rank(self.world)
        groups = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        self.sizes = {k: (1 if g is None else dist.get_world_size(g)) for k, g in groups.items()}
        try:
            self.topology = _thdpack.Topology(**self.sizes, order=order)
        except ValueError as e:
            raise ValueError(f"Groups: {e}") from None
        world_size = len(self.world_ranks)
        if self.topology.world_size != world_size:
            raise ValueError(f"Groups: TP*CP*DP*PP = {self.sizes} = {self.topology.world_size} "
                             f"ranks, the world has {world_size}")
        self.order = self.topology.order
        self.coord = self.topology.coord_of(self.rank)
        self.known = []
        for k, g in groups.items():
            if g is None:
                continue
            expected = self.topology.group_of(k, self.rank)
            got = _group_ranks(g, self.world_ranks)
            if got != expected:
                raise ValueError(f"Groups: the {k} group of rank {self.rank} holds world ranks "
                                 f"{got}; order {order} with sizes {self.sizes} puts it at "
                                 f"{expected}")
            self.known.append((k, got, g))

    def __repr__(self):
        return f"Groups({self.sizes}, order={self.order!r}, rank={self.rank}, coord={self.coord})"


def _as_array(value, name):
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


# The keys of a fed sample that are not fields: the tokens, their target mask, and the stream
# position the caller says the sample has (checked).
_SAMPLE_KEYS = ("input_ids", "loss_mask", "position")
_FIELD_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                 "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8,
                 "bool": torch.bool}


_NUMPY_NAMES = {np.dtype(n): n for n in ("float32", "float64", "int32", "int64", "uint8", "bool")}


def _dtype_name(dtype, where):
    if isinstance(dtype, torch.dtype):
        return str(dtype).replace("torch.", "")
    if isinstance(dtype, str):
        return dtype
    try:
        return np.dtype(dtype).name
    except TypeError:
        raise TypeError(f"{where}: dtype {dtype!r} is not a dtype name, a NumPy or a torch "
                        f"dtype") from None


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
        if isinstance(spec, str):
            spec = {"kind": spec}
        if not isinstance(spec, dict) or "kind" not in spec:
            raise TypeError(f"{where}: expected a kind ('input', 'target', 'sample') or a dict "
                            f"with 'kind' (and optional 'dtype', 'shape', 'fill')")
        unknown = sorted(set(spec) - {"kind", "dtype", "shape", "fill"})
        if unknown:
            raise TypeError(f"{where}: unknown keys {unknown} (kind, dtype, shape, fill)")
        shape = spec.get("shape", ())
        shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        out.append((str(name), str(spec["kind"]), _dtype_name(spec.get("dtype", "float32"), where),
                    shape, float(spec.get("fill", 0))))
    return out


def _field_value(value, dtype, where):
    """A fed field value as (dtype name, shape, uint8 bytes) for the C++ to check. Arrays and
    tensors keep their dtype (a different one is an error there: never cast); a list or a
    Python number has none and is made the declared dtype, if its values fit it exactly (or,
    for a float dtype, are numbers)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        got, shape = _dtype_name(t.dtype, where), tuple(t.shape)
        a = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    elif isinstance(value, (np.ndarray, np.generic)):
        # asarray keeps a NumPy scalar 0-d (shape []); ascontiguousarray would make it [1].
        a = np.asarray(value)
        a = a if a.flags.c_contiguous else np.ascontiguousarray(a)
        got = _NUMPY_NAMES.get(a.dtype) or a.dtype.name  # dtype.name is slow (NumPy 1.24)
        shape = a.shape
    else:
        given = np.asarray(value)
        if given.dtype.kind not in "biuf":
            raise ValueError(f"{where}: holds {given.dtype} values, declared {dtype}")
        if dtype == "bfloat16":
            t = torch.tensor(given.tolist(), dtype=torch.bfloat16)
            a, got = t.view(torch.int16).numpy(), "bfloat16"
        else:
            a = given.astype(dtype)
            exact = _FIELD_DTYPES[dtype].is_floating_point or np.array_equal(a, given)
            got = dtype if exact else given.dtype.name
        shape = given.shape
    return got, tuple(int(d) for d in shape), np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _to_sample(item, where, fields=()):
    """A loader's sample (dict with input_ids, optional loss_mask, and the run's fields) as
    (int32 tokens, uint8 mask or None, fields). Values outside int32 or a mask that is not 0/1
    are errors, never cast away; every other key goes to the C++ as a field, which refuses one
    not declared."""
    if not isinstance(item, dict) or "input_ids" not in item:
        raise ValueError(f"{where}: expected a dict with 'input_ids', got {type(item).__name__}")
    tokens = _as_array(item["input_ids"], "input_ids").reshape(-1)
    if tokens.size == 0:
        raise ValueError(f"{where}: input_ids is empty")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{where}: input_ids has dtype {tokens.dtype}, expected integers")
    if tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max:
        raise ValueError(f"{where}: input_ids holds {int(tokens.min())}..{int(tokens.max())}, "
                         f"outside [0, 2^31)")
    mask = item.get("loss_mask")
    if mask is not None:
        mask = _as_array(mask, "loss_mask").reshape(-1)
        if mask.shape != tokens.shape:
            raise ValueError(f"{where}: loss_mask has {mask.size} entries, input_ids "
                             f"{tokens.size} (the mask is token-aligned)")
        if not np.all((mask == 0) | (mask == 1)):
            raise ValueError(f"{where}: loss_mask holds values other than 0 and 1")
        mask = np.ascontiguousarray(mask, dtype=np.uint8)
    declared = {f[0]: f[2] for f in fields}
    values = {k: _field_value(v, declared.get(k, "float32"), f"{where}, field {k!r}")
              for k, v in item.items() if k not in _SAMPLE_KEYS}
    return np.ascontiguousarray(tokens, dtype=np.int32), mask, values


def loader_positions(start, global_batch, dp_size, loader):
    """The stream positions loader ``loader`` yields, in order, from position ``start`` on.

    A step of ``global_batch`` samples takes the stream positions ``p .. p + global_batch - 1``
    (``p``: the samples consumed before it) and loader ``d`` yields ``p + d, p + d + DP, ...``
    of them; the next step starts at ``p + global_batch``. ``start`` is a position or a run
    state (``state_dict()``: its ``consumed``). This is where each loader's iterable continues
    after ``load_state_dict``, at any DP size and global batch: a caller's resumable sampler
    yields these positions (an infinite generator).
    """
    if isinstance(start, dict):
        start = start["consumed"]
    start, global_batch, dp_size, loader = int(start), int(global_batch), int(dp_size), int(loader)
    if start < 0 or global_batch < 1 or dp_size < 1 or not 0 <= loader < dp_size:
        raise ValueError(f"loader_positions: start {start} >= 0, global_batch {global_batch} >= 1, "
                         f"dp_size {dp_size} >= 1 and 0 <= loader {loader} < dp_size required")
    p = start
    while True:
        yield from range(p + loader, p + global_batch, dp_size)
        p += global_batch


class PackedStep:
    """One global batch as this rank holds it; iterate for its microbatches (dicts of tensors).

    Attributes: step, epoch, num_microbatches (M, the same on every rank), n_loss_tokens (N,
    the global loss-token count: the loss denominator), n_loss_sequences (the step's sequences
    with at least one loss token, over every replica: a per-sequence mean's), bytes_sent (this
    rank's bytes sent per phase: read, lengths, plan, exchange, pack, deliver, agree),
    field_bytes (the bytes of the fields this rank holds), seqlen_sum (global padded tokens),
    seqlen_squared_sum (sum of padded P^2 over the step), figures (``plan --json``'s step;
    per-replica detail on the ranks that planned only; a dynamic step adds groups_made,
    groups_reused, groups_evicted, groups_cached), microbatches (the list), dynamic,
    is_loader, first_stage, last_stage.
    """

    def __init__(self, raw, device, cp_group=None, copy_stream=None,
                 label_format="megatron", fields=()):
        self.step = raw["step"]
        self.n_loss_sequences = raw["n_loss_sequences"]
        self.bytes_sent = dict(raw["bytes_sent"])  # this rank's, per phase of the step
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
        if copy_stream is not None:
            # Pinned host tensors to the device on a side stream; the caller's stream waits
            # for the copies before it uses them.
            with torch.cuda.stream(copy_stream):
                self.microbatches = [_microbatch(m, device, cp_group, label_format, fields)
                                     for m in raw["microbatches"]]
            torch.cuda.current_stream(device).wait_stream(copy_stream)
        else:
            self.microbatches = [_microbatch(m, device, cp_group, label_format, fields)
                                 for m in raw["microbatches"]]
        self._state = raw["state"]
        self._unpack = raw["unpack"]
        self._label_format = label_format  # how unpack's values are aligned
        # The iterator whose world unpack() communicates over (a weak reference, set by
        # __next__: a step the iterator's data thread frees must not keep the iterator alive).
        self._iterator = None

    def unpack(self, values, fill=0):
        """The model's per-token outputs back to the samples, in each loader's order.

        Collective over the world. ``values``: one tensor per microbatch of this rank's outputs,
        [T/CP] or [T/CP, *row], label-aligned as the step's ``mb["labels"]`` are (position o of
        a sequence: the prediction of its token o + 1; with ``label_format="hf"``, token o's own
        value, as Hugging Face's unshifted labels and target fields hold it, position 0 of each
        sequence ignored); needed on the ranks tp = 0 of the last stage, None (or any)
        elsewhere. Returns, on each rank that read samples, a list in the order it gave
        them of one tensor per sample, [L] or [L, *row] of the values' dtype, token-aligned like
        a target field: entry j (1 <= j < L) the value that predicted token j, entry 0 ``fill``;
        on other ranks []. Only for samples fed by the caller (the iterator's iterables,
        pack_batch)."""
        it = None if self._iterator is None else self._iterator()
        if self._unpack is None or it is None or it._src is None:
            raise RuntimeError("unpack: needs a step of samples fed by the caller, from an "
                               "iterator that is still open, or pack_batch")
        if len(values) != self.num_microbatches:
            raise ValueError(f"unpack: {len(values)} value tensors for {self.num_microbatches} "
                             f"microbatches")
        sends = [v for v in values if v is not None]
        desc = _agree_row(sends, it._nccl_device, it.groups.world)
        dtype, shape = _DTYPE_OF_CODE[desc[0]], tuple(desc[1:])
        raw = []
        for v in values:
            if v is None:
                raw.append(None)
                continue
            t = v.detach().contiguous().cpu()
            if t.dtype != dtype or tuple(t.shape[1:]) != shape:
                raise ValueError(f"unpack: values of {t.dtype} {tuple(t.shape)}, other "
                                 f"microbatches' are {dtype} [T/CP, {shape}]")
            raw.append(t.reshape(-1).view(torch.uint8).numpy())
        fill_row = torch.full((1, *shape), fill, dtype=dtype).reshape(-1).view(torch.uint8)
        out = it._src.unpack(self.microbatches, raw, self._unpack, fill_row.numpy(),
                             self._label_format)
        return [torch.from_numpy(b).view(dtype).reshape(-1, *shape) for b in out]

    def state_dict(self):
        """The run's state once this step is done (the iterator's state_dict() after it)."""
        return json.loads(self._state)

    def __iter__(self):
        return iter(self.microbatches)

    def __len__(self):
        return self.num_microbatches


_DTYPE_CODES = {torch.float32: 1, torch.float64: 2, torch.bfloat16: 3, torch.float16: 4,
                torch.int32: 5, torch.int64: 6, torch.uint8: 7, torch.bool: 8}
_DTYPE_OF_CODE = {c: d for d, c in _DTYPE_CODES.items()}
_MAX_ROW_DIMS = 4


def _agree_row(values, nccl_device, world):
    """The dtype and row shape of the values every sending rank holds, told to every rank (the
    loaders that receive them may hold none): (dtype code, *row shape), by one all-reduce (max)
    over the world."""
    desc = [0] * (2 + _MAX_ROW_DIMS)
    if values:
        v = values[0]
        if v.dtype not in _DTYPE_CODES or v.dim() - 1 > _MAX_ROW_DIMS or v.dim() < 1:
            raise ValueError(f"unpack: values of {v.dtype} with {v.dim()} dimensions ([T/CP] or "
                             f"[T/CP, *row], at most {_MAX_ROW_DIMS} row dimensions)")
        desc = [_DTYPE_CODES[v.dtype], v.dim() - 1] + list(v.shape[1:]) + \
            [0] * (_MAX_ROW_DIMS - v.dim() + 1)
    t = torch.tensor(desc, dtype=torch.int64,
                     device=nccl_device if nccl_device is not None else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world)
    desc = t.cpu().tolist()
    if desc[0] == 0:
        raise ValueError("unpack: no rank passed values (the ranks tp = 0 of the last stage "
                         "pass theirs)")
    return [desc[0]] + desc[2:2 + desc[1]]


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
    t = t.view(_FIELD_DTYPES[dtype]).reshape(-1, *shape)
    return t.to(device, non_blocking=True) if t.is_pinned() else t.to(device)


def _host(a):
    return a if isinstance(a, torch.Tensor) else torch.from_numpy(a)


def _cp_group(m, topology_cp_group):
    """A microbatch's CP group: a dynamic one's comes with it (attached at the hand-over), a
    static one's is the caller's CP group; None for one rank."""
    if int(m["cp_size"]) == 1:
        return None
    return m["cp_group"] if m["cp_group"] is not None else topology_cp_group


def _microbatch(m, device, topology_cp_group, label_format="megatron", fields=()):
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
    if hf:
        # transformers' names (DataCollatorWithFlattening), over the padded sequences.
        out.update(input_ids=tokens, cu_seq_lens_q=cup, cu_seq_lens_k=cup,
                   max_length_q=max_seqlen, max_length_k=max_seqlen)
    return out


# Steps a PackedDataIterator prepares ahead unless told (docs/python.md, "Prefetching").
DEFAULT_PREFETCH = 1


class PackedDataIterator:
    """Global batches packed, sharded and delivered by thdpack's C++ step over torch.distributed.

    ``PackedDataIterator(source, groups, global_batch=256, max_tokens_per_rank=16384,
    scheduler="balanced", cost="llama2-7b", sp=False, data_on="tp0", device=None, **options)``

    source: a data source spec (``jsonl:FILE``, ``megatron:PREFIX``, ``mock:FILE.json``,
    ``mock``; every reading rank opens it), or on each loader an iterable yielding that
    loader's own share in order (dicts with ``input_ids`` and an optional token-aligned
    ``loss_mask``: NumPy arrays, tensors or lists; None on other ranks). With an iterable, the
    k-th sample of loader d in step s has id ``s*global_batch + k*DP + d``; iteration ends when
    every loader's iterable ends at a step boundary (one that ends while another still yields,
    or mid-step, is an error on every rank). Loaders: ranks (tp=0, cp=0, pp=0) with
    data_on="tp0", every rank with "all" (each reads its replica's share).
    groups: ``Groups``. device: where tensors go (default cuda with NCCL, else cpu).
    scheduler: "balanced", "sequential", or "dynamic" (a CP group per microbatch and sequence,
    over the DP x CP ranks; needs a model ``cost``; its loaders are the ranks cp = 0 of the
    ranks that read, and with data_on="all" every rank cp = 0 reads).
    Other options (job options of ``thdpack plan``, same names): seed, shuffle, vocab,
    mock_samples, align, microbatch_multiple, num_microbatches, oversize, pad_id,
    check_plan_hash, hw and cp_sizes (dynamic), max_cp_groups (dynamic: the CP groups kept
    across steps, default 32; those unused longest are destroyed first, never one of the
    current step); ``steps`` (default None: no limit) stops after that many steps;
    ``monitored_barrier_seconds`` (default 0: off) makes the backend's barrier gloo's
    monitored_barrier, which names a rank that stopped answering; ``start_step`` (default 0)
    starts at that step of a run that read ``global_batch`` samples a step from step 0;
    ``rank_multiple`` (default 1; an int or "fp8" 16, "mxfp8" 32, "blockwise" 128) makes every
    rank's tokens of a microbatch (T/CP, T/(CP*TP) with sp) a multiple of it, the tail on the
    last sequence (docs/layout.md, "Rank multiple"); ``keep_groups`` ("microbatch": every group
    in one microbatch, its samples side by side - DPO pairs; "replica": every group on one
    replica - GRPO groups; dynamic CP: one CP group of one microbatch) with ``group_field`` the
    name of a declared int32/int64 ``sample`` field holding each sample's group id
    (docs/scheduling.md, "Groups"); ``global_batch_tokens`` (replaces ``global_batch``: each
    step takes samples in stream order while their tokens stay within it; a source spec only,
    not a caller-fed iterable); static shapes for CUDA graphs (static schedulers):
    ``pad_to_max_tokens`` (every microbatch holds exactly CP * max_tokens_per_rank tokens, the
    padding on the last sequence, and packed_seq_params' max_seqlen is that T) and ``max_seqs``
    (at most that many sequences a microbatch; ``cu_seqlens``, ``cu_seqlens_padded`` and
    packed_seq_params' offsets are max_seqs + 1 long, the unused tail repeating the last
    offset; ``num_seqs`` says how many are real, and ``cu_seqlens_cpu``/``cu_seqlens_padded_cpu``
    keep the real [num_seqs + 1] ones) - docs/layout.md, "Static shapes".

    label_format: "megatron" (default): labels already shifted, as thdpack's loss and Megatron
    take them. "hf": Hugging Face's (``thdpack.pack(label_format="hf")``): labels unshifted,
    -100 at each sequence's first token, where the target mask is 0 and at padding, loss_mask
    equal to labels != -100, plus ``input_ids``, ``cu_seq_lens_q/k`` and ``max_length_q/k``.
    It needs whole microbatches: CP = 1 and a static scheduler (ValueError otherwise: a model
    that shifts its labels inside a zigzag CP shard would pair tokens of different chunks).

    ``prefetch`` (default DEFAULT_PREFETCH = 1): steps prepared ahead of the caller by the C++
    step source (thdpack/step_runner.h, ``StepSource``) on a thread of each rank, over a gloo
    group of its own (made here, collectively): the caller's groups and every NCCL group are
    used on the caller's thread only. That thread makes the whole step - the step, its figures,
    a caller-fed iterable's share, the tensors and dicts (on a CUDA device, pinned host arrays)
    - so that next() takes a finished step, attaches a dynamic step's CP groups (made from the
    caller's world, on its thread) and, for a GPU, moves the tensors (a non-blocking copy on a
    side stream that the current stream waits for). Every tensor and field is the one of
    prefetch=0, every error raises at the step where it would have (never earlier).
    ``last_wait`` is the seconds the last next() took. 0: the whole step runs in next(), on the
    caller's groups. ``close()`` is collective (every rank after the same step); an iterator
    dropped without it closes the same way, and one still alive at interpreter exit is closed
    then.

    Resuming: ``state_dict()`` is the run's state after the last step handed to the caller (a
    JSON-serialisable dict, the same on every rank: save it with the checkpoint, from any
    rank); ``load_state_dict(state)``, on every rank before the first step, continues there -
    on any topology (DP, CP, TP, PP, SP, scheduler) and any global batch, since the samples of
    a step depend only on the stream position. A state of other data, seed or shuffle is a
    ValueError naming the field. With a caller-fed source each loader's iterable must continue
    at the saved position: ``loader_positions(state, global_batch, DP, dp)`` gives the stream
    positions it yields next; a sample dict may carry its ``position``, which is then checked.

    Collective: every rank of the world builds it (groups beyond the caller's are made here, once,
    on every rank in the same order) and iterates it in step. An error on any rank (bad sample,
    budget overflow, a failing source) raises on every rank; the iterator is then finished.
    """

    def __init__(self, source, groups, global_batch=256, max_tokens_per_rank=16384,
                 scheduler="balanced", cost="llama2-7b", sp=False, data_on="tp0", device=None,
                 steps=None, monitored_barrier_seconds=0.0, label_format="megatron",
                 prefetch=None, fields=None, _kept_groups=None, **options):
        self._src = None
        if not isinstance(groups, Groups):
            raise TypeError(f"groups: expected thdpack.torch.Groups, got {type(groups).__name__}")
        if label_format not in _LABEL_FORMATS:
            raise ValueError(f"label_format: {label_format!r} is not 'megatron' (labels already "
                             f"shifted) or 'hf' (unshifted, as Hugging Face models take them)")
        if label_format == "hf" and (groups.sizes["cp"] > 1 or scheduler == "dynamic"):
            what = (f"CP = {groups.sizes['cp']}" if groups.sizes["cp"] > 1
                    else "the dynamic scheduler (a CP group per microbatch)")
            raise ValueError(f"label_format='hf' needs whole microbatches (CP = 1, a static "
                             f"scheduler), got {what}: a Hugging Face model shifts its labels "
                             f"inside the tokens it is given, and a zigzag CP shard puts tokens "
                             f"of different chunks side by side, so the shift would pair a "
                             f"token with one from another chunk. Use label_format='megatron' "
                             f"(labels already shifted) with a CP-aware model")
        self.label_format = label_format
        self.fields = field_specs(fields)
        if self.fields and isinstance(source, str):
            raise ValueError(f"fields: the samples of {source!r} carry none; fields come with "
                             f"samples fed by the caller (an iterable of dicts)")
        self.groups = groups
        nccl = dist.get_backend(groups.world) == "nccl"
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)
        # The world's collectives (and those of any NCCL group of the caller's) run on CUDA
        # tensors when the group is NCCL, on CPU tensors otherwise: a gloo world inside an NCCL
        # job stays on the CPU. Groups the step makes take the world's backend.
        cuda = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else None
        self._finished = False
        self._held = []  # the last two steps handed out (__next__)
        self._state = None  # the JSON of the state after the last step handed out
        self.global_batch = global_batch
        if "rank_order" in options:
            raise TypeError("PackedDataIterator: the rank order is the groups' (Groups(..., "
                            "order=...)), not an option")
        opts = dict(options, tp=groups.sizes["tp"], cp=groups.sizes["cp"], dp=groups.sizes["dp"],
                    pp=groups.sizes["pp"], rank_order=groups.order, global_batch=global_batch,
                    max_tokens_per_rank=max_tokens_per_rank, scheduler=scheduler, cost=cost,
                    sp=sp, data_on=data_on)
        fed = not isinstance(source, str)
        depth = DEFAULT_PREFETCH if prefetch is None else prefetch
        if not isinstance(depth, int) or isinstance(depth, bool) or not 0 <= depth <= 64:
            raise ValueError(f"prefetch: {prefetch!r} is not a number of steps in [0, 64]")
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool)
                                  or steps < 0):
            raise ValueError(f"steps: {steps!r} is not a number of steps >= 0 (or None)")
        self._depth = depth
        self.last_wait = 0.0
        self._copy_stream = None
        self._nccl_device = cuda if nccl else None
        if self.device.type == "cuda" and depth > 0:
            self._copy_stream = torch.cuda.Stream(self.device)
        # Where the step is made (the caller's thread at depth 0, the data plane's otherwise):
        # the whole PackedStep on the CPU; for a GPU pinned host arrays, copied by next() on
        # the caller's stream. Holds nothing of the iterator, so a dropped iterator is freed.
        prepare = functools.partial(_prepare, self.device, groups.cp, label_format,
                                    self.device.type == "cuda" and depth > 0, self.fields)
        # Freed without close(), the iterator's source closes as close() would (the C++
        # destructor; on the data plane's own thread, where a collector may free it, it returns
        # at once and the thread ends after its steps).
        self._shares = _FedShares(groups.sizes["dp"], self.fields) if fed else None
        self._src = _thdpack._TorchStepSource(
            groups.world, groups.world_ranks, groups.known, opts,
            None if fed else source, self._shares, prepare, cuda if nccl else None,
            float(monitored_barrier_seconds), depth, steps, self.fields, _kept_groups)
        # The ranks that read: the step runner's rule (it depends on the scheduler).
        self.is_loader = bool(self._src.reads)
        if fed:
            self._shares.start(source if self.is_loader else None)

    def __iter__(self):
        return self

    def __next__(self):
        if self._finished:
            raise StopIteration
        t0 = time.perf_counter()
        try:
            payload, cp_groups, counts, _ = self._src.next()
        except BaseException:
            self._finished = True
            raise
        if isinstance(payload, PackedStep):  # made on the data plane's thread
            step = payload
            for mb, g in zip(step.microbatches, cp_groups):
                if g is not None:
                    mb["cp_group"] = g
        else:  # pinned arrays (a GPU), or depth 0: the tensors made here
            for m, g in zip(payload["microbatches"], cp_groups):
                if g is not None:
                    m["cp_group"] = g
            step = PackedStep(payload, self.device, self.groups.cp, self._copy_stream,
                              self.label_format, self.fields)
        if counts is not None:
            step.figures.update(counts)
        step._iterator = weakref.ref(self)
        # The step before the last is the caller's no more (it let it go when it took the last
        # one): freed by the data plane's thread as it makes the next step, not by the caller
        # as it drops it.
        if len(self._held) == 2:
            self._src.drop_later(self._held.pop(0))
        self._held.append(step)
        self.last_wait = time.perf_counter() - t0
        self._state = step._state
        return step

    def state_dict(self):
        """The run's state after the last step handed to the caller (before the first: where the
        run starts), a JSON-serialisable dict the same on every rank: next_step, consumed (the
        stream position), the source's cursor, and the fingerprint of the data and options that
        decide the samples (thdpack/run_state.h). Not collective."""
        if self._state is None:
            if self._src is None:
                raise RuntimeError("state_dict: the iterator is closed")
            return json.loads(self._src.state())
        return json.loads(self._state)

    def load_state_dict(self, state):
        """Continues the run from ``state`` (a state_dict(), from a run on any topology and
        global batch). Call it on every rank with the same state before the first step; it
        does not communicate. ValueError naming the field when the state does not fit (another
        data set, seed, shuffle, vocabulary, oversize rule), was cut or edited; RuntimeError
        after a step."""
        if self._src is None:
            raise RuntimeError("load_state_dict: the iterator is closed")
        if self._state is not None:
            raise RuntimeError("load_state_dict: steps were already handed out; load a state "
                               "before the first step")
        self._src.restore(state)

    def loader_positions(self):
        """This rank's stream positions from the next step on (a caller-fed loader's iterable
        yields these samples next): ``loader_positions(state_dict(), global_batch, DP, dp)``."""
        return loader_positions(self.state_dict(), self.global_batch, self.groups.sizes["dp"],
                                self.groups.coord["dp"])

    def close(self):
        """Stops the data plane's thread, then drops the C++ step, the groups it made and the
        iterator's own group. Collective when prefetching: every rank closes after the same
        number of steps, and each rank's thread first finishes the ``prefetch`` steps ahead of
        that point (so that no rank's thread is left in a collective its peers never join)."""
        self._finished = True
        self._held = []
        src, self._src = self._src, None
        if src is not None:
            src.close()


# How long the interpreter's exit waits for each data plane's thread to finish the steps it
# owes its peers.
_EXIT_JOIN_SECONDS = 60.0


@atexit.register
def _stop_at_exit():
    """A process that ends with an iterator still alive (never closed: a training script that
    just returns, or Megatron's entry points) closes its source as close() would, before the
    interpreter finalises: a thread still inside a torch collective then would be torn down
    mid-call (the C++ runtime aborts the process). atexit runs before that, and the thread's
    steps complete since every rank's thread makes the same ones; a thread whose peers are gone
    ends with their error."""
    _thdpack._close_step_sources(_EXIT_JOIN_SECONDS)


class _FedShares:
    """A caller-fed loader's iterable, read one share at a time by the step source (on the
    thread that makes the step): ``count`` samples as (tokens, mask, fields), None where the
    iterable ended at the step boundary (the C++ step agrees the end over every loader). A
    sample dict's ``position``, when given, is checked against the stream position it must
    have."""

    def __init__(self, dp, fields=()):
        self._dp = dp
        self._fields = fields
        self._it = None
        # pack_batch: (samples this loader holds, samples of the batch); its share must be all.
        self.exact = None

    def start(self, source):
        self._it = None if source is None else iter(source)

    def __call__(self, step, first_position, loader, count):
        if self._it is None:
            raise ValueError("source: this rank is a loader but was given None (give each "
                             "loader its iterable)")
        if self.exact is not None and self.exact[0] != count:
            raise ValueError(f"pack_batch: loader dp={loader} holds {self.exact[0]} samples; its "
                             f"share of the batch of {self.exact[1]} (the samples every rank "
                             f"passed) is {count}: loader d holds samples d, d + DP, d + 2 DP, "
                             f"... of the batch, the other ranks pass None")
        items = []
        for k in range(count):
            try:
                item = next(self._it)
            except StopIteration:
                if k == 0:
                    return None
                raise ValueError(f"the iterable ended after {k} of the {count} samples of this "
                                 f"loader's share") from None
            where = f"sample {k} of the share"
            items.append(_to_sample(item, where, self._fields))
            if isinstance(item, dict) and "position" in item:  # the caller says where: checked
                want = first_position + loader + k * self._dp
                if int(item["position"]) != want:
                    raise ValueError(
                        f"{where}: position {int(item['position'])}, expected {want} (this "
                        f"loader's iterable must yield loader_positions(state, global_batch, "
                        f"DP, dp) from the run's state: it resumes after {first_position} "
                        f"samples)")
        return items


def _prepare(device, cp_group, label_format, pin, fields, raw):
    """What the step source keeps of a step where it is made: a PackedStep, or (``pin``: a
    GPU, ahead of the caller) the raw step with its arrays pinned, copied by next()."""
    if pin:
        _pin(raw)
        return raw
    if device.type == "cuda":  # depth 0: made on the caller's thread, copied by next()
        return raw
    return PackedStep(raw, device, cp_group, None, label_format, fields)


# pack_batch's process groups, kept across calls: {id(world): (world, {lists: torch groups})}
# (the world held, so that its id is not reused by another).
_BATCH_GROUPS = {}


def pack_batch(samples, groups, fields=None, **options):
    """One in-memory batch through the C++ step: the PackedStep of ``samples``.

    Collective over ``groups``: each loader (the ranks PackedDataIterator reads on: tp = cp =
    pp = 0 with data_on="tp0") passes its own list of sample dicts (input_ids, loss_mask, the
    ``fields``), None on the other ranks; loader d holds samples d, d + DP, d + 2 DP, ... of the
    batch (its share: the count is checked, on every rank together). The options are
    PackedDataIterator's (max_tokens_per_rank, scheduler, cost, sp, label_format, ...); the
    batch is one step of ``global_batch`` = every rank's samples together. What an RL trainer
    calls once per mini-batch on the rollouts it holds; ``step.unpack(values)`` gives each
    loader the model's per-token outputs back in its order. The step's process groups are made
    by the first call and kept for the later ones (never destroyed before the process ends).
    """
    if not isinstance(groups, Groups):
        raise TypeError(f"groups: expected thdpack.torch.Groups, got {type(groups).__name__}")
    for key in ("global_batch", "prefetch", "steps", "start_step"):
        if key in options:
            raise TypeError(f"pack_batch: {key} is the batch's own (one step of every sample)")
    held = None if samples is None else list(samples)
    nccl = dist.get_backend(groups.world) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
    count = torch.tensor([0 if held is None else len(held)], dtype=torch.int64, device=device)
    dist.all_reduce(count, group=groups.world)
    total = int(count.item())
    if total == 0:
        raise ValueError("pack_batch: no rank passed samples (each loader passes its list)")
    # The step's process groups are made by the first call and kept for the next ones (per
    # world and backend): a new_group per call cost 0.1 s of a 0.14 s call at 4 gloo ranks, and
    # NCCL communicators far more.
    entry = _BATCH_GROUPS.get(id(groups.world))
    if entry is None or entry[0] is not groups.world:
        entry = _BATCH_GROUPS[id(groups.world)] = (groups.world, {})
    kept = entry[1]
    it = PackedDataIterator(held if held is not None else [], groups, global_batch=total,
                            prefetch=0, steps=1, fields=fields, _kept_groups=kept, **options)
    it._shares.exact = (0 if held is None else len(held), total)
    step = next(it)
    step._batch_iterator = it  # the world step.unpack communicates over
    return step
