"""thdpack.torch.microbatch: a batch split into microbatches under a token cap (verl style).

RL trainers (verl, NeMo-RL) hold a batch per rank and split it into microbatches of at most
`max_token_len` real tokens. verl's rearrange_micro_batches takes ceil(total / max_token_len)
microbatches and balances them, which puts microbatches over the cap whenever the lengths do not
divide evenly (python/tests/test_microbatch.py measures it on data/ lengths). Here the split is
thdpack's scheduler (thdpack.schedule, one replica): it chooses how many microbatches it needs,
balances them by the cost model, and never exceeds the cap; a sample longer than the cap is an
error naming it.
"""
import numpy as np
import torch
import torch.distributed as dist

from .. import _thdpack


def _int_array(value, name, dtype):
    """A 1-D integer array (tensor on any device, NumPy array of any layout and byte order, or
    list) as a new C-contiguous NumPy array of `dtype`, every value checked to fit it: a value
    that does not is a ValueError naming it, never wrapped."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{name}: expected a 1-D integer tensor, got {value.dtype} of shape "
                             f"{tuple(value.shape)}")
        value = value.detach().cpu().to(torch.int64).numpy()
    elif not isinstance(value, (np.ndarray, list, tuple)):
        raise ValueError(f"{name}: expected a tensor, a NumPy array or a list of integers, got "
                         f"{type(value).__name__}")
    try:
        a = np.asarray(value)
    except ValueError as e:
        raise ValueError(f"{name}: not a rectangular list of integers ({e})") from None
    # An empty list is float64 to NumPy: an empty array of any number type is accepted.
    if a.ndim != 1 or a.dtype.kind not in ("iu" if a.size else "biuf"):
        raise ValueError(f"{name}: expected a 1-D integer array, got {a.dtype} of shape {a.shape}")
    if a.size:
        info = np.iinfo(dtype)
        bad = np.flatnonzero((a < info.min) | (a > info.max))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{name}[{i}] = {int(a[i])}: does not fit {np.dtype(dtype)} "
                             f"[{info.min}, {info.max}]")
    return np.array(a, dtype=dtype, order="C")


def _lengths(seqlens):
    return _int_array(seqlens, "seqlens", np.int64)


def micro_batch_indices(seqlens, max_token_len, *, num_micro_batches=None,
                        num_batches_divided_by=None, scheduler="balanced", cost="tokens"):
    """Sample indices of each microbatch: a list of lists, every index once, each microbatch's
    tokens (sum of seqlens) at most max_token_len.

    num_micro_batches: at least this many microbatches (None: as few as the scheduler needs).
    num_batches_divided_by: the count is rounded up to a multiple of it (virtual pipeline).
    scheduler, cost: thdpack.schedule's ("balanced" or "sequential"; "tokens" or a model).
    ValueError: a length < 1, a sample over the cap, or more microbatches asked than samples.
    """
    lengths = _lengths(seqlens)
    cap = int(max_token_len)
    if cap < 1:
        raise ValueError(f"max_token_len = {cap}: must be >= 1")
    if lengths.size == 0:
        raise ValueError("seqlens: the batch is empty")
    low = np.flatnonzero(lengths < 1)
    if low.size:
        i = int(low[0])
        raise ValueError(f"seqlens[{i}] = {int(lengths[i])}: every sample needs >= 1 token")
    over = np.flatnonzero(lengths > cap)
    if over.size:
        i = int(over[0])
        raise ValueError(f"seqlens[{i}] = {int(lengths[i])} tokens is over max_token_len = "
                         f"{cap}: no microbatch can hold it ({over.size} such samples)")
    multiple = 1 if num_batches_divided_by is None else int(num_batches_divided_by)
    if multiple < 1:
        raise ValueError(f"num_batches_divided_by = {multiple}: must be >= 1")
    want = 0 if num_micro_batches is None else int(num_micro_batches)

    def plan(k):
        return _thdpack.schedule(lengths, dp_size=1, max_tokens_per_rank=cap,
                                 scheduler=scheduler, cost=cost, num_microbatches=k,
                                 microbatch_multiple=multiple)

    p = plan(0)
    if want > p.num_microbatches:
        k = -(-want // multiple) * multiple
        if k > lengths.size:
            raise ValueError(f"num_micro_batches = {want} (rounded to {k}) is more than the "
                             f"{lengths.size} samples: a microbatch would be empty")
        p = plan(k)
    out = [p.microbatch(0, m).tolist() for m in range(p.num_microbatches)]
    if any(len(mb) == 0 for mb in out):
        raise ValueError(f"{len(out)} microbatches for {lengths.size} samples: one would be "
                         "empty (fewer samples than microbatches)")
    return out


def _batch_size_and_lengths(batch):
    if isinstance(batch, torch.Tensor) or isinstance(batch, np.ndarray) or \
            isinstance(batch, (list, tuple)):
        return None, _lengths(batch)
    if not hasattr(batch, "keys"):
        raise ValueError(f"batch: expected a dict, a TensorDict or a 1-D sequence of lengths, "
                         f"got {type(batch).__name__}")
    if "attention_mask" in batch.keys():
        mask = batch["attention_mask"]
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.is_complex():
            raise ValueError("batch['attention_mask']: expected a [B, S] tensor of 0/1")
        m = mask.detach()
        if not bool(((m == 0) | (m == 1)).all()):
            raise ValueError("batch['attention_mask']: holds values other than 0 and 1")
        return mask.shape[0], _lengths(m.to(torch.int64).sum(dim=1))
    if "seqlens" in batch.keys():
        lengths = _lengths(batch["seqlens"])
        return lengths.size, lengths
    raise ValueError("batch: expected an 'attention_mask' [B, S] tensor or 'seqlens' [B] "
                     f"(keys: {sorted(batch.keys())})")


def _select(batch, idx, size):
    if not isinstance(batch, dict) and hasattr(batch, "batch_size"):  # a TensorDict
        return batch[torch.as_tensor(idx, dtype=torch.int64)]
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == size:
            out[k] = v.index_select(0, torch.as_tensor(idx, dtype=torch.int64, device=v.device))
        elif isinstance(v, np.ndarray) and v.ndim >= 1 and v.shape[0] == size:
            out[k] = v[idx]
        elif isinstance(v, (list, tuple)) and len(v) == size:
            out[k] = [v[i] for i in idx]
        else:
            out[k] = v  # per-batch metadata, shared by every microbatch
    return out


def rearrange_micro_batches(batch, max_token_len, dp_group=None, num_batches_divided_by=None,
                            same_micro_num_in_dp=True, min_num_micro_batch=None, *,
                            scheduler="balanced", cost="tokens"):
    """verl's rearrange_micro_batches with a cap that holds: (micro_batches, micro_bsz_idx).

    batch: a dict (or TensorDict) with 'attention_mask' [B, S] (real tokens per row = its sum)
    or 'seqlens' [B]; its tensors, arrays and lists of B rows are split by row (others are
    shared), or a 1-D sequence of lengths (then micro_batches is None). Every microbatch holds
    at most max_token_len real tokens, every row appears exactly once; micro_bsz_idx[m] lists
    the rows of microbatch m. With torch.distributed initialised and same_micro_num_in_dp, the
    count is the maximum over dp_group (an all-reduce, as verl does). min_num_micro_batch:
    at least this many; num_batches_divided_by: a multiple of it. ValueError as
    micro_batch_indices.
    """
    size, lengths = _batch_size_and_lengths(batch)
    want = 0 if min_num_micro_batch is None else int(min_num_micro_batch)
    kwargs = dict(num_batches_divided_by=num_batches_divided_by, scheduler=scheduler, cost=cost)
    sync = same_micro_num_in_dp and dist.is_available() and dist.is_initialized()
    try:
        idx = micro_batch_indices(lengths, max_token_len, num_micro_batches=want or None, **kwargs)
        error = None
    except ValueError as e:
        if not sync:
            raise
        idx, error = [], e
    if sync:
        # The count is the maximum over the group; a failure on one rank fails every rank
        # (the flag travels with the count), so no rank waits on one that gave up.
        device = "cpu"
        if dist.get_backend(dp_group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        k = torch.tensor([len(idx), int(error is not None)], dtype=torch.int64, device=device)
        dist.all_reduce(k, op=dist.ReduceOp.MAX, group=dp_group)
        count, failed = int(k[0]), int(k[1])
        if error is not None:
            raise error
        if failed:
            raise ValueError("rearrange_micro_batches: another rank of dp_group failed to split "
                             "its batch (its error names the sample)")
        if count > len(idx):
            idx = micro_batch_indices(lengths, max_token_len, num_micro_batches=count, **kwargs)
    if size is None:
        return None, idx
    return [_select(batch, mb, size) for mb in idx], idx
