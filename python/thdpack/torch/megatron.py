"""thdpack.torch.megatron: Megatron-LM's two sequence-packing entry points
(``megatron/core/datasets/data_schedule.py``) over ``PackedDataIterator``, with their
signatures and return values, so that a Megatron user switches with one import::

    from thdpack.torch.megatron import (wrap_data_iterator,
                                        get_batch_on_this_rank_for_sequence_packing)

Unlike Megatron's, every rank (not only TP rank 0) holds an iterator, no global parallel state
is read (the groups come from ``pg_collection``: ``.tp``, ``.cp``, ``.dp``, ``.pp``), and no
tensor is broadcast over TP afterwards: thdpack's step already delivered every rank its own.

Config fields read (docs/python.md has the table): ``max_seqlen_per_dp_cp_rank`` ->
max_tokens_per_rank; ``sequence_packing_scheduler`` ("dp_balanced" -> "balanced";
"sequential", "balanced" and "dynamic" pass through); ``hybrid_context_parallel`` (True ->
"dynamic": a CP group per microbatch, as Megatron's hybrid CP); ``sequence_parallel`` -> sp;
``global_batch_size`` -> global_batch (else num_microbatches * ``micro_batch_size`` * DP);
``fp8`` with ``fp8_recipe`` -> rank_multiple ("delayed" and "tensorwise" 16, "mxfp8" 32,
"blockwise" 128: the tokens each rank's FP8 GEMMs see, docs/layout.md "Rank multiple"; a
"custom" recipe sets none: pass rank_multiple). Any keyword argument of PackedDataIterator
given to wrap_data_iterator (rank_multiple among them) overrides these.

With the dynamic scheduler each microbatch's PackedSeqParams carries its group as Megatron's
hybrid CP path expects it: local_cp_size the group's size, cp_group its torch group (None for a
group of one rank, which TransformerEngine reads as "CP off for this microbatch").

Resuming: Megatron keeps ``args.consumed_train_samples`` and ``args.iteration`` in its
checkpoint. ``consumed_train_samples(state)`` is that count for a thdpack state; given back
to ``wrap_data_iterator(..., consumed_train_samples=..., iteration=...)`` on the first call of
a restarted job, the iterator continues there (at any topology and global batch). A full
thdpack state (``iterator.state_dict()``, saved beside the checkpoint) is given as
``state=``: it also carries the source's cursor (an O(1) seek) and the fingerprint that
refuses other data, seed or shuffle.
"""
from __future__ import annotations

import torch

from .. import _thdpack
from .iterator import Groups, PackedDataIterator

_SCHEDULERS = {"dp_balanced": "balanced", "balanced": "balanced", "sequential": "sequential",
               "dynamic": "dynamic"}
# Megatron's fp8_recipe -> the rank multiple its GEMMs need (thdpack's presets).
_FP8_RANK_MULTIPLE = {"delayed": "fp8", "tensorwise": "fp8", "mxfp8": "mxfp8",
                      "blockwise": "blockwise"}

# Iterators built from a caller's source, by the source object (kept alive with it), so that
# wrap_data_iterator, which Megatron calls once per global batch, continues the same step loop.
_ITERATORS = {}


def _packed_seq_params_class():
    try:
        from megatron.core.packed_seq_params import PackedSeqParams
        return PackedSeqParams
    except ImportError:
        return None


def packed_seq_params(mb):
    """Megatron's PackedSeqParams of one of PackedDataIterator's microbatches, built as Megatron's
    own get_batch_on_this_rank_for_sequence_packing builds it for static CP: cu_seqlens_q/kv the
    real offsets, cu_seqlens_*_padded the padded ones (TransformerEngine reads the tokens at the
    padded offsets and attends over the real lengths), max_seqlen the largest padded length (T
    under pad_to_max_tokens; with max_seqs the offsets are max_seqs + 1 long),
    total_tokens the padded total, pad_between_seqs whether any sequence is padded;
    local_cp_size and cp_group the microbatch's group with the dynamic scheduler (cp_group None
    for a group of one rank), None for a static one (the CP group is the model's).
    Only the fields the installed class has are passed (megatron-core 0.16 has no total_tokens
    or pad_between_seqs). Without megatron.core, the dict of the same fields."""
    cu, cup = mb["cu_seqlens"], mb["cu_seqlens_padded"]
    # Static shapes: T, as the iterator's own packed_seq_params say (pad_to_max_tokens).
    max_seqlen = mb.get("packed_seq_params", {}).get("max_seqlen_q", mb["max_seqlen"])
    fields = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cup,
                  cu_seqlens_kv_padded=cup, max_seqlen_q=max_seqlen,
                  max_seqlen_kv=max_seqlen,
                  local_cp_size=mb["cp_size"] if mb.get("dynamic") else None,
                  cp_group=mb["cp_group"] if mb.get("dynamic") else None,
                  total_tokens=int(cup[-1]), pad_between_seqs=not torch.equal(cu, cup))
    cls = _packed_seq_params_class()
    if cls is None:
        return fields
    names = getattr(cls, "__dataclass_fields__", None)
    if names is not None:
        fields = {k: v for k, v in fields.items() if k in names}
    return cls(**fields)


def iterator_options(config, num_microbatches, dp_size):
    """PackedDataIterator keyword arguments from Megatron's config fields (mapping above)."""
    opts = {}
    cap = getattr(config, "max_seqlen_per_dp_cp_rank", None)
    if cap is not None:
        opts["max_tokens_per_rank"] = int(cap)
    name = getattr(config, "sequence_packing_scheduler", None)
    if name is not None:
        if name not in _SCHEDULERS:
            raise ValueError(f"config.sequence_packing_scheduler: {name!r} is not supported "
                             f"(expected one of {sorted(_SCHEDULERS)})")
        opts["scheduler"] = _SCHEDULERS[name]
    if getattr(config, "hybrid_context_parallel", False):
        opts["scheduler"] = "dynamic"
    if getattr(config, "sequence_parallel", None) is not None:
        opts["sp"] = bool(config.sequence_parallel)
    if getattr(config, "fp8", None):
        # Megatron's Fp8Recipe is a str enum; its value is the name.
        recipe = getattr(config, "fp8_recipe", None)
        recipe = getattr(recipe, "value", recipe)
        if recipe in _FP8_RANK_MULTIPLE:
            opts["rank_multiple"] = _FP8_RANK_MULTIPLE[recipe]
    gbs = getattr(config, "global_batch_size", None)
    if gbs is not None:
        opts["global_batch"] = int(gbs)
    elif num_microbatches is not None:
        opts["global_batch"] = int(num_microbatches) * int(getattr(config, "micro_batch_size", 1)) * dp_size
    return opts


def _groups(pg_collection):
    if pg_collection is None:
        raise ValueError("pg_collection: required (an object with .tp, .cp, .dp, .pp torch "
                         "groups); thdpack reads no global parallel state")
    return Groups(tp=getattr(pg_collection, "tp", None), cp=getattr(pg_collection, "cp", None),
                  dp=getattr(pg_collection, "dp", None), pp=getattr(pg_collection, "pp", None),
                  world=getattr(pg_collection, "world", None))


def consumed_train_samples(state):
    """Megatron's ``args.consumed_train_samples`` for a thdpack run state (a
    ``state_dict()``, or a PackedDataIterator): the samples the steps before
    ``state['next_step']`` consumed, whatever global batch each of them had."""
    if isinstance(state, PackedDataIterator):
        state = state.state_dict()
    return int(_thdpack.check_run_state(state)["consumed"])


def state_from_megatron(iterator, consumed_train_samples, iteration=None):
    """The thdpack state that continues ``iterator``'s run after a Megatron checkpoint which
    kept only ``consumed_train_samples`` and ``iteration`` (the next step; by default
    consumed / global_batch when that divides). Without a saved cursor, each reading rank
    finds the position itself (O(1) for every source but jsonl, which reads its line ends)."""
    consumed = int(consumed_train_samples)
    if iteration is None:
        if consumed % iterator.global_batch:
            raise ValueError(f"iteration: needed, since consumed_train_samples {consumed} is not "
                             f"a multiple of the global batch {iterator.global_batch}")
        iteration = consumed // iterator.global_batch
    return _thdpack.run_state_at(iterator.state_dict(), int(iteration), consumed)


def wrap_data_iterator(data_iterator, config, num_microbatches=None, pg_collection=None,
                       state=None, consumed_train_samples=None, iteration=None, **options):
    """One global batch: ``(iterator, num_microbatches, seqlen_sum, seqlen_squared_sum)``.

    data_iterator: a PackedDataIterator, or a source it is built from on the first call (a
    source spec string, or on each loader its iterable; see PackedDataIterator) with the groups
    of ``pg_collection`` and the config mapping above; later calls with the same object
    continue the same step loop. The returned iterator yields this rank's microbatches (the
    dicts of PackedDataIterator), which get_batch_on_this_rank_for_sequence_packing takes.
    seqlen_sum and seqlen_squared_sum are floats, as Megatron returns them: the global padded
    token count and sum of padded P^2 (its FLOPs inputs).

    On the call that builds the iterator, ``state`` (a saved ``state_dict()``) or
    ``consumed_train_samples`` with ``iteration`` (Megatron's checkpoint counters) make it
    continue a restarted run (module docstring); later calls ignore them.
    """
    if state is not None and consumed_train_samples is not None:
        raise ValueError("state and consumed_train_samples both say where the run continues: "
                         "give one")
    if isinstance(data_iterator, PackedDataIterator):
        it = data_iterator
    else:
        key = id(data_iterator)
        if key not in _ITERATORS:
            groups = _groups(pg_collection)
            opts = iterator_options(config, num_microbatches, groups.sizes["dp"])
            opts.update(options)
            it = PackedDataIterator(data_iterator, groups, **opts)
            if state is not None:
                it.load_state_dict(state)
            elif consumed_train_samples is not None:
                it.load_state_dict(state_from_megatron(it, consumed_train_samples, iteration))
            _ITERATORS[key] = (data_iterator, it)
        it = _ITERATORS[key][1]
    step = next(it)
    return (iter(step.microbatches), step.num_microbatches, float(step.seqlen_sum),
            float(step.seqlen_squared_sum))


def get_batch_on_this_rank_for_sequence_packing(data_iterator, vpp_size=None,
                                                mtp_on_this_rank=False, vp_stage=None,
                                                dynamic_cp=False, pg_collection=None, config=None):
    """Megatron's 7-tuple for the next microbatch: ``(tokens, labels, loss_mask, None,
    position_ids, packed_seq_params, padding_mask)``.

    tokens and position_ids (int64) on the first stage, labels (int64) and loss_mask (float32)
    on the last, None elsewhere; every tensor ``[1, T/CP]`` (CP-local; with SP as well).
    packed_seq_params is Megatron's PackedSeqParams when megatron.core imports (a dict of the same
    fields otherwise), built as Megatron builds it (``packed_seq_params`` above). padding_mask is
    bool ``[1, T/CP]``, True on padding.
    """
    if data_iterator is None:
        raise ValueError("data_iterator: every rank needs the iterator wrap_data_iterator "
                         "returned (thdpack delivers every rank its own tensors)")
    mb = next(data_iterator)
    if dynamic_cp and not mb.get("dynamic"):
        raise ValueError("dynamic_cp: True, but the iterator's scheduler is static (pass "
                         "scheduler=\"dynamic\" or config.hybrid_context_parallel)")
    first = vp_stage is None or vp_stage == 0
    last = vp_stage is None or vpp_size is None or vp_stage == vpp_size - 1

    def row(key, keep):
        t = mb[key]
        return None if t is None or not keep else t.view(1, -1)

    tokens = row("tokens", first or mtp_on_this_rank)
    position_ids = row("position_ids", first or mtp_on_this_rank)
    labels = row("labels", last or mtp_on_this_rank)
    loss_mask = row("loss_mask", last or mtp_on_this_rank)
    padding_mask = mb["padding_mask"].view(1, -1)
    return tokens, labels, loss_mask, None, position_ids, packed_seq_params(mb), padding_mask
