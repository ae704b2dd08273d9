"""thdpack.torch.batch: one in-memory batch through the C++ step (``pack_batch``).

An RL trainer's rollouts, held by the loaders, packed and sharded as one step of
``PackedDataIterator``'s (the same C++ step source, at depth 0, one step); the step's process
groups are made by the first call and kept for the later ones, and released at the process's
exit before the interpreter finalises (``_release_batch_groups``, called by the iterator's exit
hook after every step source is closed).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _thdpack
from .groups import Groups

# pack_batch's process groups, kept across calls: {id(world): (world, {lists: torch groups})}
# (the world held, so that its id is not reused by another).
_BATCH_GROUPS = {}


def _release_batch_groups():
    """The process groups pack_batch kept, destroyed (while torch.distributed is initialised)
    and let go of, at the interpreter's exit: left to the interpreter's finalisation, a gloo
    group's worker threads and the tensors they hold were freed while Python was being torn
    down, and a rank ended with "terminate called without an active exception"
    (bench/exit_paths.py counts it)."""
    entries = list(_BATCH_GROUPS.values())
    _BATCH_GROUPS.clear()
    for _, kept in entries:
        for made in kept.values():
            for group in made:
                _destroy(group)
    entries.clear()


def _destroy(group):
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        return
    try:
        if dist.is_initialized():
            dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - at exit; one destroyed already needs no release
        pass


def pack_batch(samples, groups, fields=None, **options):
    """One in-memory batch through the C++ step: the PackedStep of ``samples``.

    Collective over ``groups``: each loader (the ranks PackedDataIterator reads on: tp = cp =
    pp = 0 with data_on="tp0") passes its own list of sample dicts (input_ids, loss_mask, the
    ``fields``) or a ``SampleRows`` (the same samples as columns, made into the step's in one
    C++ call), None on the other ranks; loader d holds samples d, d + DP, d + 2 DP, ... of the
    batch (its share: the count is checked, on every rank together). The options are
    PackedDataIterator's (max_tokens_per_rank, scheduler, cost, sp, label_format, ...); the
    batch is one step of ``global_batch`` = every rank's samples together. What an RL trainer
    calls once per mini-batch on the rollouts it holds; ``step.unpack(values)`` gives each
    loader the model's per-token outputs back in its order. The step's process groups are made
    by the first call and kept for the later ones until the process ends (released at its exit,
    before the interpreter finalises).
    """
    from .iterator import PackedDataIterator  # which imports this module
    from .rows import SampleRows, rows_of_dicts
    if not isinstance(groups, Groups):
        raise TypeError(f"groups: expected thdpack.torch.Groups, got {type(groups).__name__}")
    error = None  # this rank's own, agreed over the world with the batch's size
    held = None
    try:
        for key in ("global_batch", "prefetch", "steps", "start_step"):
            if key in options:
                raise TypeError(f"pack_batch: {key} is the batch's own (one step of every "
                                f"sample)")
        held = None if samples is None else \
            samples if isinstance(samples, SampleRows) else list(samples)
        if isinstance(held, list) and options.get("media") is None:
            # Alike dicts as columns: one C++ call makes the step's samples (rows.py).
            held = rows_of_dicts(held, fields) or held
    except (TypeError, ValueError) as e:
        error = e
    nccl = dist.get_backend(groups.world) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
    count = torch.tensor([0 if held is None else len(held), error is not None],
                         dtype=torch.int64, device=device)
    dist.all_reduce(count, group=groups.world)
    total, failed = int(count[0].item()), int(count[1].item())
    _thdpack._release_later(count)  # let go of once gloo's workers have (bind_torch_comm.cc)
    if failed:  # the failing rank's error, named on every rank (a second agreement, only now)
        try:
            _thdpack._agree_checks(groups.world, None if error is None else
                                   f"{type(error).__name__}: {error}", None, "pack_batch")
        except (ValueError, RuntimeError):
            if error is None:
                raise
        raise error
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
    it._shares.whole = True  # a loader's list is its whole share: FedShares checks its count
    step = next(it)
    if it._bridge is not None:  # one batch: the encoder ranks took one (encoder_batch)
        it._bridge.closed = True
    step._batch_iterator = it  # the world step.unpack communicates over
    return step
