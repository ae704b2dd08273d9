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
import json
import threading
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


def _to_sample(item, where):
    """A loader's sample (dict with input_ids, optional loss_mask) as (int32 tokens, uint8 mask
    or None). Values outside int32 or a mask that is not 0/1 are errors, never cast away."""
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
    return np.ascontiguousarray(tokens, dtype=np.int32), mask


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
    the global loss-token count: the loss denominator), seqlen_sum (global padded tokens),
    seqlen_squared_sum (sum of padded P^2 over the step), figures (``plan --json``'s step;
    per-replica detail on the ranks that planned only; a dynamic step adds groups_made,
    groups_reused, groups_evicted, groups_cached), microbatches (the list), dynamic,
    is_loader, first_stage, last_stage.
    """

    def __init__(self, raw, device, cp_group=None, copy_stream=None,
                 label_format="megatron"):
        self.step = raw["step"]
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
                self.microbatches = [_microbatch(m, device, cp_group, label_format)
                                     for m in raw["microbatches"]]
            torch.cuda.current_stream(device).wait_stream(copy_stream)
        else:
            self.microbatches = [_microbatch(m, device, cp_group, label_format)
                                 for m in raw["microbatches"]]
        self._state = raw["state"]

    def state_dict(self):
        """The run's state once this step is done (the iterator's state_dict() after it)."""
        return json.loads(self._state)

    def __iter__(self):
        return iter(self.microbatches)

    def __len__(self):
        return self.num_microbatches


def _tensor(a, device):
    if a is None:
        return None
    if isinstance(a, torch.Tensor):  # pinned by the prefetching thread
        return a.to(device, non_blocking=True)
    return torch.from_numpy(a).to(device)


_DEVICE_ARRAYS = ("tokens", "position_ids", "labels", "loss_mask", "padding_mask", "cu_seqlens",
                  "cu_seqlens_padded")


def _pin(raw):
    """A step's arrays as pinned host tensors (the prefetching thread, for a CUDA device)."""
    for m in raw["microbatches"]:
        for k in _DEVICE_ARRAYS:
            if m[k] is not None:
                m[k] = torch.from_numpy(m[k]).pin_memory()


def _host(a):
    return a if isinstance(a, torch.Tensor) else torch.from_numpy(a)


def _cp_group(m, topology_cp_group):
    """A microbatch's CP group: a dynamic one's comes with it (attached at the hand-over), a
    static one's is the caller's CP group; None for one rank."""
    if int(m["cp_size"]) == 1:
        return None
    return m["cp_group"] if m["cp_group"] is not None else topology_cp_group


def _microbatch(m, device, topology_cp_group, label_format="megatron"):
    cu = _tensor(m["cu_seqlens"], device)
    cup = _tensor(m["cu_seqlens_padded"], device)
    max_seqlen = int(m["max_seqlen"])
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
        # The same offsets in host memory, for whatever needs their values without waiting for
        # the device (LossStatistics.add_microbatch).
        "cu_seqlens_cpu": _host(m["cu_seqlens"]),
        "cu_seqlens_padded_cpu": _host(m["cu_seqlens_padded"]),
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
            "max_seqlen_q": max_seqlen, "max_seqlen_kv": max_seqlen,
        },
    }
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
    last sequence (docs/layout.md, "Rank multiple").

    label_format: "megatron" (default): labels already shifted, as thdpack's loss and Megatron
    take them. "hf": Hugging Face's (``thdpack.pack(label_format="hf")``): labels unshifted,
    -100 at each sequence's first token, where the target mask is 0 and at padding, loss_mask
    equal to labels != -100, plus ``input_ids``, ``cu_seq_lens_q/k`` and ``max_length_q/k``.
    It needs whole microbatches: CP = 1 and a static scheduler (ValueError otherwise: a model
    that shifts its labels inside a zigzag CP shard would pair tokens of different chunks).

    ``prefetch`` (default DEFAULT_PREFETCH = 1): steps prepared ahead of the caller, in a
    thread of each rank, over a gloo group of the iterator's own (made here, collectively):
    the caller's groups and every NCCL group are used on the caller's thread only, which takes
    a finished step, attaches a dynamic step's CP groups (made from the caller's world, on its
    thread) and moves the tensors to the device (pinned host memory, a non-blocking copy on a
    side stream that the current stream waits for). Every tensor and field is the one of
    prefetch=0, every error raises at the step where it would have (never earlier); a caller-
    fed iterable is read on that thread. ``last_wait`` is the seconds the last next() waited.
    0: the whole step runs in next(), on the caller's groups. ``close()`` is collective (every
    rank after the same step); an iterator still prefetching at interpreter exit is closed then.

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
                 prefetch=None, **options):
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
        self.groups = groups
        backend = dist.get_backend(groups.world)
        nccl = backend == "nccl"
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)
        # The world's collectives (and those of any NCCL group of the caller's) run on CUDA
        # tensors when the group is NCCL, on CPU tensors otherwise: a gloo world inside an NCCL
        # job stays on the CPU. Groups the step makes take the world's backend.
        cuda = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else None
        self._comm_device = cuda if nccl else None
        self._steps = steps
        self._done = 0
        self._finished = False
        self._state = None  # the JSON of the state after the last step handed out
        self.global_batch = global_batch
        if "rank_order" in options:
            raise TypeError("PackedDataIterator: the rank order is the groups' (Groups(..., "
                            "order=...)), not an option")
        opts = dict(options, tp=groups.sizes["tp"], cp=groups.sizes["cp"], dp=groups.sizes["dp"],
                    pp=groups.sizes["pp"], rank_order=groups.order, global_batch=global_batch,
                    max_tokens_per_rank=max_tokens_per_rank, scheduler=scheduler, cost=cost,
                    sp=sp, data_on=data_on)
        c = groups.coord
        self._fed = not isinstance(source, str)
        self._source = None
        self._share = None
        depth = DEFAULT_PREFETCH if prefetch is None else prefetch
        if not isinstance(depth, int) or isinstance(depth, bool) or not 0 <= depth <= 64:
            raise ValueError(f"prefetch: {prefetch!r} is not a number of steps in [0, 64]")
        self._depth = depth
        self.last_wait = 0.0
        self._thread = None
        self._ctl = _Prefetch(depth)
        self._bg_group = None
        self._cp_groups = None
        self._copy_stream = None
        world, known = groups.world, groups.known
        if depth > 0:
            # The data plane's own world: a gloo group over the same ranks (made here, on the
            # caller's thread, collectively); the caller's groups stay the caller's.
            self._bg_group = dist.new_group(ranks=list(groups.world_ranks), backend="gloo")
            world, known = self._bg_group, []
            if scheduler == "dynamic":
                self._cp_groups = _thdpack._TorchCpGroups(groups.world, groups.world_ranks,
                                                          groups.known, opts, cuda)
            if self.device.type == "cuda":
                self._copy_stream = torch.cuda.Stream(self.device)
        self._runner = _thdpack._TorchStepRunner(
            world, groups.world_ranks, known, opts,
            source if not self._fed else None, self._take_share if self._fed else None,
            cuda if depth == 0 else None, float(monitored_barrier_seconds),
            defer_cp_groups=depth > 0)
        # The ranks that read: the step runner's rule (it depends on the scheduler).
        self.is_loader = bool(self._runner.topology()["reader"])
        if self._fed:
            if self.is_loader and source is not None:
                self._source = iter(source)
            self._count = self._loader_count(global_batch, groups.sizes["dp"], c["dp"])

    @staticmethod
    def _loader_count(n, dp, d):
        return n // dp + (1 if d < n % dp else 0)

    def __iter__(self):
        return self

    def _read_share(self, group, device):
        """A caller-fed loader reads its share before the step, so that the end of the data is
        agreed by every rank (one all-reduce over `group`) before the step's collectives
        begin."""
        ended = 0
        self._share = None
        if self.is_loader:
            if self._source is None:
                self._share = ValueError("source: this rank is a loader but was given None "
                                         "(give each loader its iterable)")
            else:
                items = []
                dp = self.groups.sizes["dp"]
                first = self._runner.consumed() + self.groups.coord["dp"]
                try:
                    for k in range(self._count):
                        try:
                            item = next(self._source)
                        except StopIteration:
                            if k == 0:
                                ended = 1
                            else:
                                raise ValueError(f"the iterable ended after {k} of the "
                                                 f"{self._count} samples of this loader's share")
                            break
                        where = f"sample {k} of the share"
                        items.append(_to_sample(item, where))
                        if "position" in item:  # the caller says where it is: checked
                            want = first + k * dp
                            if int(item["position"]) != want:
                                raise ValueError(
                                    f"{where}: position {int(item['position'])}, expected "
                                    f"{want} (this loader's iterable must yield "
                                    f"loader_positions(state, global_batch, DP, dp) from the "
                                    f"run's state: it resumes after {first - self.groups.coord['dp']} samples)")
                    self._share = items
                except Exception as e:  # reported through the step, on every rank
                    self._share = e
        flags = torch.tensor([ended, 1 if self.is_loader and not ended else 0], dtype=torch.int64,
                             device=device or "cpu")
        dist.all_reduce(flags, group=group)
        # Released later, on a Python thread: freed by a gloo worker thread instead, at the
        # interpreter's exit it would abort the process (python/src/bind_torch_comm.cc).
        _thdpack._release_later(flags)
        ended_count, going = (int(v) for v in flags.cpu())
        if ended_count and not going:
            return False
        if ended_count:
            raise RuntimeError(f"PackedDataIterator: {ended_count} loader(s) ran out of samples "
                               f"at step {json.loads(self._runner.state())['next_step']} while "
                               f"{going} still had "
                               f"some: every loader must yield its share of every step")
        return True

    def _take_share(self, step):
        share = self._share
        self._share = None
        if isinstance(share, Exception):
            raise share
        return share

    def __next__(self):
        if self._finished or (self._steps is not None and self._done >= self._steps):
            raise StopIteration
        t0 = time.perf_counter()
        try:
            if self._depth > 0:
                raw = self._take()
            else:
                if self._fed and not self._read_share(self.groups.world, self._comm_device):
                    self._finished = True
                    raise StopIteration
                raw = self._runner.next()
        except StopIteration:
            self._finished = True
            raise
        except BaseException:
            self._finished = True
            raise
        self.last_wait = time.perf_counter() - t0
        self._done += 1
        if isinstance(raw, PackedStep):  # made by the prefetching thread
            self._state = raw._state
            return raw
        self._state = raw["state"]
        return PackedStep(raw, self.device, self.groups.cp, self._copy_stream,
                          self.label_format)

    # --- prefetching --------------------------------------------------------------------------

    def _produce_one(self):
        """One step of the prefetching thread: ("step", the step, the raw dict it was made
        from), or ("end", None, None) where the caller's next() would have ended. On the CPU
        the step is a PackedStep, with a CUDA device the raw dict (its arrays pinned)."""
        if self._steps is not None and self._ctl.made >= self._steps:
            return ("end", None, None)
        if self._fed and not self._read_share(self._bg_group, None):
            return ("end", None, None)
        raw = self._runner.next()
        self._ctl.made += 1
        if self._copy_stream is not None:
            # The copies to the GPU are queued by the caller's thread, ordered on its stream;
            # made here, they are pinned host tensors.
            _pin(raw)
            return ("step", raw, raw)
        # The whole step - tensors, dicts - made here, so that next() only takes it. A dynamic
        # step's CP groups are the caller's (made on its thread): set when it is taken.
        return ("step", PackedStep(raw, self.device, self.groups.cp, None, self.label_format),
                raw)

    def _take(self):
        ctl = self._ctl
        if self._thread is None:
            self._thread = threading.Thread(target=_produce, args=(weakref.ref(self), ctl),
                                            daemon=True, name="thdpack-prefetch")
            ctl.thread = self._thread
            _RUNNING.add(ctl)
            self._thread.start()
        with ctl.cond:
            ctl.cond.wait_for(lambda: len(ctl.items) > 0)
            kind, payload, raw = ctl.items.pop(0)
            ctl.cond.notify_all()
        if kind == "end":
            raise StopIteration
        if kind == "error":
            raise payload
        if self._cp_groups is not None and raw["dynamic"]:
            self._cp_groups.attach(raw)  # the caller's world, on the caller's thread
            if isinstance(payload, PackedStep):
                for mb, m in zip(payload.microbatches, raw["microbatches"]):
                    mb["cp_group"] = _cp_group(m, self.groups.cp)
        return payload

    def state_dict(self):
        """The run's state after the last step handed to the caller (before the first: where the
        run starts), a JSON-serialisable dict the same on every rank: next_step, consumed (the
        stream position), the source's cursor, and the fingerprint of the data and options that
        decide the samples (thdpack/run_state.h). Not collective."""
        if self._state is None:
            if self._runner is None:
                raise RuntimeError("state_dict: the iterator is closed")
            return json.loads(self._runner.state())
        return json.loads(self._state)

    def load_state_dict(self, state):
        """Continues the run from ``state`` (a state_dict(), from a run on any topology and
        global batch). Call it on every rank with the same state before the first step; it
        does not communicate. ValueError naming the field when the state does not fit (another
        data set, seed, shuffle, vocabulary, oversize rule), was cut or edited; RuntimeError
        after a step."""
        if self._runner is None:
            raise RuntimeError("load_state_dict: the iterator is closed")
        if self._done > 0:
            raise RuntimeError(f"load_state_dict: {self._done} step(s) were already handed out; "
                               f"load a state before the first step")
        self._runner.restore(state)
        self._state = None

    def loader_positions(self):
        """This rank's stream positions from the next step on (a caller-fed loader's iterable
        yields these samples next): ``loader_positions(state_dict(), global_batch, DP, dp)``."""
        return loader_positions(self.state_dict(), self.global_batch, self.groups.sizes["dp"],
                                self.groups.coord["dp"])

    def close(self):
        """Stops the prefetching thread, then drops the C++ step, the groups it made and the
        iterator's own group. Collective when prefetching: every rank closes after the same
        number of steps, and each rank's thread first finishes the ``prefetch`` steps ahead of
        that point (so that no rank's thread is left in a collective its peers never join)."""
        self._finished = True
        ctl = getattr(self, "_ctl", None)
        thread = getattr(self, "_thread", None)
        if ctl is not None:
            with ctl.cond:
                ctl.stop, ctl.fill = True, True
                ctl.cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._thread = None
        if ctl is not None:
            ctl.items = []
        self._runner = None
        self._cp_groups = None
        group = getattr(self, "_bg_group", None)
        if group is not None:
            self._bg_group = None
            if dist.is_initialized():
                dist.destroy_process_group(group)

    def __del__(self):
        # Freed without close(): the thread stops at its next step boundary, without waiting
        # (the collector may run this on any thread, the prefetching one included), and the
        # iterator's group is destroyed - here, or by the thread as it ends if it still runs.
        ctl = getattr(self, "_ctl", None)
        if ctl is None:
            return
        group = getattr(self, "_bg_group", None)
        self._bg_group = None
        with ctl.cond:
            ctl.stop = True
            if group is not None and getattr(self, "_thread", None) is not None \
                    and not ctl.exited:
                ctl.orphan, group = group, None
            ctl.cond.notify_all()
        _destroy(group)


# The prefetching threads still running, stopped at interpreter exit (_stop_at_exit).
_RUNNING = weakref.WeakSet()
# How long the exit waits for each thread to finish the steps it owes its peers.
_EXIT_JOIN_SECONDS = 60.0


@atexit.register
def _stop_at_exit():
    """A process that ends with an iterator still prefetching (never closed: a training script
    that just returns, or Megatron's entry points) stops its thread as close() would, before
    the interpreter finalises: a daemon thread still inside a torch collective then would be
    torn down mid-call (the C++ runtime aborts the process). atexit runs before that, and the
    thread's steps complete since every rank's thread makes the same ones; a thread whose peers
    are gone ends with their error."""
    for ctl in list(_RUNNING):
        with ctl.cond:
            ctl.stop, ctl.fill = True, True
            ctl.cond.notify_all()
    for ctl in list(_RUNNING):
        thread = ctl.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=_EXIT_JOIN_SECONDS)


class _Prefetch:
    """What the caller's thread and the prefetching thread share: the prepared items (in step
    order), how many steps the thread made, and how to stop."""

    def __init__(self, depth):
        self.depth = depth
        self.items = []  # (kind, payload, raw): _produce_one, _produce_items
        self.made = 0
        self.stop = False  # set by close() or the collector
        self.fill = False  # close(): finish the steps up to `depth` ahead first
        self.exited = False  # the thread has ended
        self.orphan = None  # the group of an iterator freed while the thread ran: its to destroy
        self.thread = None
        self.cond = threading.Condition()  # re-entrant: __del__ may run on the thread


def _destroy(group):
    if group is not None:
        try:
            if dist.is_initialized():
                dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - at interpreter exit torch may be half gone
            pass


def _produce(ref, ctl):
    """The prefetching thread: up to ``depth`` items ahead of the caller. It holds the iterator
    (through a weak reference) only while it makes a step, so that a dropped iterator is freed;
    an error ends the thread after it is queued, to raise at the caller's step."""
    try:
        _produce_items(ref, ctl)
    finally:
        with ctl.cond:
            ctl.exited = True
            group, ctl.orphan = ctl.orphan, None
        # Destroyed before the thread leaves _RUNNING: the interpreter's exit joins the threads
        # still in it (_stop_at_exit), and a thread still inside torch's C++ when the
        # interpreter finalises is ended there by pthread_exit, which aborts the process (a
        # dropped iterator's thread destroying its group as the script returned).
        try:
            _destroy(group)
        finally:
            _RUNNING.discard(ctl)


def _produce_items(ref, ctl):
    while True:
        with ctl.cond:
            ctl.cond.wait_for(lambda: ctl.stop or len(ctl.items) < ctl.depth)
            if ctl.stop and (not ctl.fill or len(ctl.items) >= ctl.depth):
                return
        it = ref()
        if it is None:
            return
        try:
            item = it._produce_one()
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
            item = ("error", e, None)
        del it
        with ctl.cond:
            ctl.items.append(item)
            ctl.cond.notify_all()
        if item[0] != "step":
            return
