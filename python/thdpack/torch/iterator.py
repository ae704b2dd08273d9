"""thdpack.torch.iterator: the distributed step inside a torch job.

``PackedDataIterator`` runs thdpack's C++ step (read, exchange lengths, plan, move tokens, pack,
CP-shard, deliver to every stage: ``thdpack/step_runner.h``) with every collective issued
through ``torch.distributed`` on the caller's process groups (gloo on CPU tensors, NCCL on CUDA
tensors), from the thread that iterates, taking the GIL for each call. There is one
implementation of the step; nothing of it is repeated here. The iterator only hands the
caller's groups, options and iterables to the C++ step source and the steps it makes to the
caller. docs/python.md documents the interface.

The parts, each in a module of its own (every name keeps this module's import path too):

  groups.py       Groups: the caller's torch process groups as a thdpack topology
  fed.py          samples fed by the caller: field_specs, a sample dict as the C++ takes it,
                  a loader's iterable read a share at a time, loader_positions
  packed_step.py  PackedStep: a step as one rank holds it, in torch tensors; step.unpack
  iterator.py     PackedDataIterator (here), and the interpreter's exit
  batch.py        pack_batch: one in-memory batch through the same step
"""
from __future__ import annotations

import atexit
import functools
import gc
import inspect
import json
import time
import weakref

import torch
import torch.distributed as dist

from .. import _thdpack
# The parts' names, each also under this module's path (tests and tools import some).
from .batch import _release_batch_groups, pack_batch  # noqa: F401
from .media import media_specs
from .fed import _FedShares, _field_value, _to_sample, field_specs, loader_positions  # noqa
from .groups import Groups, _group_ranks  # noqa: F401
from .packed_step import PackedStep, StepOptions, _microbatch, _pin, _prepare  # noqa: F401

__all__ = ["Groups", "PackedDataIterator", "PackedStep", "field_specs", "loader_positions",
           "pack_batch"]

_LABEL_FORMATS = ("megatron", "hf")


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

    Defaults are the C++ job's (thdpack/job.h), said there only: an option left out (or None)
    is defaulted. ``it.options`` (and every step's ``step.options``) maps every effective
    option to its value, given or not (``options["max_tokens_per_rank"] == 16384`` when not
    given), and ``options.defaulted`` names those the job defaulted; an error about a defaulted
    option says so ("... (max_tokens_per_rank defaulted)"). Every rank must give the same
    options and fields: the step agrees them over the world when it is made, and a difference is
    a ValueError on every rank naming the option and both values.

    label_format: "megatron" (default): labels already shifted, as thdpack's loss and Megatron
    take them. "hf": Hugging Face's (``thdpack.pack(label_format="hf")``): labels unshifted,
    -100 at each sequence's first token, where the target mask is 0 and at padding, loss_mask
    equal to labels != -100, plus ``input_ids``, ``cu_seq_lens_q/k`` and ``max_length_q/k``.
    It needs whole microbatches: CP = 1 and a static scheduler (ValueError otherwise: a model
    that shifts its labels inside a zigzag CP shard would pair tokens of different chunks).

    Media (docs/media.md): ``media`` declares the modalities (``{"image": {"token_id": ...,
    "payload": "pixel_values", "grid": "image_grid_thw"}, ...}``, optional "seconds"); each fed
    sample then carries, under those names, its payload rows [sum t*h*w, D] (own float dtype)
    and its grid rows [k, 3]. ``spatial_merge_size`` (2) is m: item j takes t*h*w/m^2
    placeholder tokens. Every first-stage microbatch then holds ``mb["media"][name]``
    (``pixel_values`` this rank encodes, ``grid_thw``, ``token_index`` and the route that
    ``route_media`` takes) and, with ``mrope`` ("qwen2-vl", "qwen2.5-vl"; its
    ``mrope_tokens_per_second``, 2), ``mb["mrope_position_ids"]`` [3, T/CP]. ``media_cost``:
    (per_patch, per_frame_sq) of the encoder in the cost's unit: it places items over CP and
    the schedulers balance it with the language model over the replicas (default: Qwen2-VL's
    tower in training FLOPs, with a model cost; required with ``cost="tokens"`` or a profile).
    ``encoder_ranks`` (world ranks outside ``groups.world``): the vision tower runs there
    instead of on the CP ranks (thdpack.torch.encoders): after each step the items go to those
    ranks, placed over them by ``media_cost``, and each rank's ``mb["media"][name]`` holds no
    ``pixel_values`` (pass ``route_media`` an empty ``[0, H]``) but the same ``token_index``;
    the encoder ranks iterate ``EncoderIterator(encoder_ranks, media)``. ``encoder_group``:
    the group of both (default: the default group, which must hold exactly these ranks and
    the language ranks).
    With PP the media reach the first stage alone: ``encoder_group`` is then required, of the
    first stage's ranks and the encoder ranks. Static schedulers, torch >= 2.2 (others refused
    by name).

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

    def __init__(self, source, groups, global_batch=None, max_tokens_per_rank=None,
                 scheduler=None, cost=None, sp=None, data_on=None, device=None, steps=None,
                 monitored_barrier_seconds=0.0, label_format="megatron", prefetch=None,
                 fields=None, media=None, spatial_merge_size=2, mrope=None,
                 mrope_tokens_per_second=2.0, media_cost=None, encoder_ranks=None,
                 encoder_group=None, _kept_groups=None, **options):
        self._src = None
        self._bridge = None
        # Encoders on ranks of their own (encoders.py): the step over the language ranks, then
        # the bridge agreed with the encoder ranks - or this rank's failure, which every
        # language rank shares (the step agrees it), sent to them.
        try:
            if encoder_ranks is not None:
                _check_encoder_options(groups, media, encoder_group)
            self._make(source, groups, global_batch, max_tokens_per_rank, scheduler, cost, sp,
                       data_on, device, steps, monitored_barrier_seconds, label_format,
                       prefetch, fields, media, spatial_merge_size, mrope,
                       mrope_tokens_per_second, media_cost, _kept_groups, options)
        except BaseException as e:
            if encoder_ranks is None:
                raise
            from .encoders import make_bridge
            # The bridge group's language ranks (every one of the default group, or the first
            # stage's in encoder_group) send it; the others are not in it.
            in_bridge = (encoder_group is None or dist.get_rank() in
                         dist.get_process_group_ranks(encoder_group))
            try:
                if in_bridge:
                    make_bridge(encoder_ranks, media if isinstance(media, dict) else {},
                                encoder_group, None, error=e)
            except BaseException:  # noqa: BLE001 - this rank raises its own, below
                pass
            raise
        if encoder_ranks is None or groups.coord["pp"] != 0:  # media: the first stage alone
            return
        from .encoders import make_bridge
        topo = groups.topology
        first_stage = [groups.world_ranks[r] for r in range(topo.world_size)
                       if topo.coord_of(r)["pp"] == 0]
        self._bridge = make_bridge(encoder_ranks, media, encoder_group, first_stage)
        self._bridge_where = (groups.coord["tp"], self._bridge.group_ranks.index(
            groups.world_ranks[topo.group_of("tp", groups.rank)[0]]), int(spatial_merge_size))

    def _make(self, source, groups, global_batch, max_tokens_per_rank, scheduler, cost, sp,
              data_on, device, steps, monitored_barrier_seconds, label_format, prefetch, fields,
              media, spatial_merge_size, mrope, mrope_tokens_per_second, media_cost,
              _kept_groups, options):
        if not isinstance(groups, Groups):
            raise TypeError(f"groups: expected thdpack.torch.Groups, got {type(groups).__name__}")
        # This rank's own checks, agreed over the world before it makes the step (a collective
        # the others are about to enter): a bad argument on one rank raises on every rank.
        try:
            if label_format not in _LABEL_FORMATS:
                raise ValueError(f"label_format: {label_format!r} is not 'megatron' (labels "
                                 f"already shifted) or 'hf' (unshifted, as Hugging Face models "
                                 f"take them)")
            # None: not given (the C++ job's default, said once there; step.options shows it).
            named = dict(global_batch=global_batch, max_tokens_per_rank=max_tokens_per_rank,
                         scheduler=scheduler, cost=cost, sp=sp, data_on=data_on)
            options.update({k: v for k, v in named.items() if v is not None})
            if label_format == "hf" and (groups.sizes["cp"] > 1
                                         or options.get("scheduler") == "dynamic"):
                what = (f"CP = {groups.sizes['cp']}" if groups.sizes["cp"] > 1
                        else "the dynamic scheduler (a CP group per microbatch)")
                raise ValueError(f"label_format='hf' needs whole microbatches (CP = 1, a static "
                                 f"scheduler), got {what}: a Hugging Face model shifts its "
                                 f"labels inside the tokens it is given, and a zigzag CP shard "
                                 f"puts tokens of different chunks side by side, so the shift "
                                 f"would pair a token with one from another chunk. Use "
                                 f"label_format='megatron' (labels already shifted) with a "
                                 f"CP-aware model")
            self.label_format = label_format
            # Fields come with fed samples, or from a columnar source's columns; the C++ names
            # a source whose samples carry none.
            self.fields = field_specs(fields)
            # Media (docs/media.md): the declaration as the C++ takes it; every rule is there.
            self.media = media
            media_arg = None
            if media is not None or mrope is not None:
                specs = media_specs(media) if media is not None else []
                if isinstance(source, str) and specs:
                    raise ValueError(f"media: the samples of {source!r} carry none; media come "
                                     f"with samples fed by the caller (an iterable of dicts)")
                media_arg = (specs, int(spatial_merge_size), mrope,
                             float(mrope_tokens_per_second),
                             None if media_cost is None else tuple(float(c)
                                                                   for c in media_cost))
            self.groups = groups
            nccl = dist.get_backend(groups.world) == "nccl"
            if device is None:
                device = (torch.device("cuda", torch.cuda.current_device()) if nccl
                          else torch.device("cpu"))
            self.device = torch.device(device)
            # The world's collectives (and those of any NCCL group of the caller's) run on CUDA
            # tensors when the group is NCCL, on CPU tensors otherwise: a gloo world inside an NCCL
            # job stays on the CPU. Groups the step makes take the world's backend.
            cuda = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else None
            self._finished = False
            self._held = []  # the last two steps handed out (__next__)
            self._state = None  # the JSON of the state after the last step handed out
            for key in ("tp", "cp", "dp", "pp", "rank_order"):
                if key in options:
                    raise TypeError(f"PackedDataIterator: {key} is the groups' (Groups(...)), "
                                    f"not an option")
            # The options go to C++ as given, once: their defaults are the C++ job's (JobOptions),
            # and step.options shows the effective ones and which were defaulted.
            opts = dict(options, tp=groups.sizes["tp"], cp=groups.sizes["cp"],
                        dp=groups.sizes["dp"], pp=groups.sizes["pp"], rank_order=groups.order)
            fed = not isinstance(source, str)
            depth = DEFAULT_PREFETCH if prefetch is None else prefetch
            # Its range is the C++ step source's (StepSourceOptions::kMaxDepth): refused there,
            # before any collective.
            if not isinstance(depth, int) or isinstance(depth, bool):
                raise ValueError(f"prefetch: {prefetch!r} is not a number of steps")
            if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool)
                                      or steps < 0):
                raise ValueError(f"steps: {steps!r} is not a number of steps >= 0 (or None)")
        except (TypeError, ValueError) as e:
            try:
                _thdpack._agree_checks(groups.world, f"{type(e).__name__}: {e}", [],
                                       "making PackedDataIterator")
            except (ValueError, RuntimeError):
                pass
            raise
        self._depth = depth
        self.last_wait = 0.0
        self._copy_stream = None
        self._nccl_device = cuda if nccl else None
        if self.device.type == "cuda" and depth > 0:
            self._copy_stream = torch.cuda.Stream(self.device)
        # Where the step is made (the caller's thread at depth 0, the data plane's otherwise):
        # the whole PackedStep on the CPU; for a GPU pinned host arrays, copied by next() on
        # the caller's stream. Holds nothing of the iterator, so a dropped iterator is freed.
        names = tuple(media) if media else ()
        prepare = functools.partial(_prepare, self.device, groups.cp, label_format,
                                    self.device.type == "cuda" and depth > 0, self.fields,
                                    media_names=names)
        # Freed without close(), the iterator's source closes as close() would (the C++
        # destructor; on the data plane's own thread, where a collector may free it, it returns
        # at once and the thread ends after its steps).
        self._shares = _FedShares(self.fields, media) if fed else None
        self._src = _thdpack._TorchStepSource(
            groups.world, groups.world_ranks, groups.known, opts,
            None if fed else source, self._shares, prepare, cuda if nccl else None,
            float(monitored_barrier_seconds), depth, steps, self.fields, _kept_groups,
            media_arg)
        # The ranks that read: the step runner's rule (it depends on the scheduler).
        self.is_loader = bool(self._src.reads)
        values, defaulted = self._src.options
        self.options = StepOptions(values, defaulted)
        self.global_batch = values["global_batch"]
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
        except StopIteration:
            self._finished = True
            if self._bridge is not None:
                self._bridge.stop()
            raise
        except BaseException as e:
            self._finished = True
            if self._bridge is not None:
                self._bridge.fail(f"{type(e).__name__}: {e}")
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
                              self.label_format, self.fields,
                              tuple(self.media) if self.media else ())
        if counts is not None:
            step.figures.update(counts)
        if self._bridge is not None:  # the items to the encoder ranks (encoders.py)
            tp_rank, staging, merge = self._bridge_where
            try:
                self._bridge.send_step(step, tp_rank, step.sp, staging, merge)
            except BaseException:
                self._finished = True
                raise
        step._iterator = weakref.ref(self)
        step.options = self.options
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
        if self._bridge is not None:  # the encoder ranks' iteration ends with this one
            self._bridge.stop()


def _check_encoder_options(groups, media, encoder_group):
    """What encoder ranks of their own need of the language ranks' step (ValueError naming
    the rule otherwise)."""
    if media is None:
        raise ValueError("encoder_ranks: without media (declare the modalities)")
    if "use_local_synchronization" not in inspect.signature(dist.new_group).parameters:
        raise ValueError(f"encoder_ranks: torch {torch.__version__} makes a group only "
                         f"with every rank of the default group, and the language "
                         f"ranks' step makes groups the encoder ranks do not (torch "
                         f">= 2.2: new_group(use_local_synchronization=True))")
    if groups.sizes["pp"] > 1 and encoder_group is None:
        raise ValueError(f"encoder_ranks with PP = {groups.sizes['pp']}: give "
                         f"encoder_group, a group of the first stage's ranks and the "
                         f"encoder ranks (the media reach the first stage alone)")


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
    ends with their error. Then the process groups pack_batch kept are released (batch.py).
    Garbage is collected first and last: a step that pack_batch returned and its iterator hold
    each other (step._batch_iterator, the iterator's last steps), so without a collection they,
    the C++ source and its torch groups lived until the collection inside the interpreter's
    finalisation, and a rank aborted there ("terminate called without an active exception": 10
    and 7 of 100 rank processes after pack_batch, 0 of 100 with the collections,
    bench/exit_paths.py)."""
    gc.collect()
    _thdpack._close_step_sources(_EXIT_JOIN_SECONDS)
    _release_batch_groups()
    gc.collect()
