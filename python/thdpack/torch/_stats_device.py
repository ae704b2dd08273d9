"""thdpack.torch._stats_device: LossStatistics' sums made where the per-token values are.

The host definition is C++'s (thdpack/loss.h: AccumulateShardLoss, ReduceSequencesOverCp,
LossTotals::Add): it needs the per-token values in host memory, which for a GPU's values means
a device-to-host copy of three [T/CP] arrays and a synchronisation per microbatch. Here the same
figures are made on the values' device with torch operations:

  * the shard's sequences come from C++ (ShardSequenceLayout, on the small host offsets: local
    ranges and real-token counts, validated there);
  * per-sequence log-prob sums and loss-token counts are differences of float64 prefix sums at
    the sequences' bounds (deterministic, unlike atomics), and are all-reduced over the CP group
    on the device (torch.distributed: NCCL for CUDA tensors);
  * CP rank 0 keeps each sequence's perplexity term, as ReduceSequencesOverCp does;
  * the six additive sums (n_tokens, n_loss_tokens, loss_sum, entropy_sum, ppl_sum, n_ppl) are
    accumulated in one float64 tensor on the device.

Nothing here waits for the device: the offsets go to it with non-blocking copies, and the sums
come to the host once, when LossStatistics.summary() hands them to C++'s LossTotals
(FromSums, which checks the counts) for the reduction over DP x CP and Finalize.
"""
import numpy as np
import torch
import torch.distributed as dist

from .. import _thdpack


def shard_layout(cu_seqlens, cu_seqlens_padded, cp_size, cp_rank):
    """(local_cu int64 [n+1], real tokens of the shard): C++'s ShardSequenceLayout on host
    offsets (NumPy arrays, lists or CPU tensors)."""
    local_cu, real = _thdpack.shard_sequence_layout(cu_seqlens, cu_seqlens_padded,
                                                    int(cp_size), int(cp_rank))
    return local_cu, int(real.sum())


def shard_sums(logprob, entropy, counted, local_cu, n_real, cp_size, cp_rank, cp_group):
    """This shard's additive sums after the CP reduction: float64 [6] on the values' device.

    logprob, entropy, counted: [T/CP] tensors on one device (values of uncounted tokens are
    ignored); local_cu, n_real: shard_layout's. With cp_size > 1 every rank of cp_group calls
    this for the same microbatch (one all-reduce of 2n float64 values)."""
    t = int(local_cu[-1])
    for name, x in (("logprob", logprob), ("entropy", entropy), ("counted", counted)):
        if not isinstance(x, torch.Tensor) or x.shape != (t,):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"add_shard: {name} is {got}: the shard has T/CP = {t} tokens "
                             f"(cu_seqlens_padded[-1] / cp_size)")
    dev = logprob.device
    if entropy.device != dev or counted.device != dev:
        raise ValueError(f"add_shard: logprob ({dev}), entropy ({entropy.device}) and counted "
                         f"({counted.device}) must be on one device")
    f64 = torch.float64
    nil = torch.zeros((), dtype=f64, device=dev)
    mask = counted.to(torch.bool)
    lp = torch.where(mask, logprob.to(f64), nil)
    en = torch.where(mask, entropy.to(f64), nil)
    bounds = torch.from_numpy(np.ascontiguousarray(local_cu, dtype=np.int64))
    bounds = bounds.to(dev, non_blocking=True)
    lp_prefix = torch.cat([nil[None], torch.cumsum(lp, 0)])
    cnt_prefix = torch.cat([nil[None], torch.cumsum(mask.to(f64), 0)])  # exact below 2^53
    seq = torch.stack([lp_prefix[bounds[1:]] - lp_prefix[bounds[:-1]],
                       cnt_prefix[bounds[1:]] - cnt_prefix[bounds[:-1]]])  # [2, n]
    if cp_size > 1:  # add_shard has checked that cp_group is given
        dist.all_reduce(seq, group=cp_group)
    seq_lp, seq_cnt = seq[0], seq[1]
    if _thdpack.counts_whole_sequences(int(cp_rank)):  # each sequence once over CP
        has = seq_cnt > 0
        ppl = torch.where(has, torch.exp(-seq_lp / seq_cnt.clamp(min=1)), nil).sum()
        n_ppl = has.to(f64).sum()
    else:
        ppl = n_ppl = nil
    # The shard's loss tokens are the last prefix count.
    return torch.stack([nil + n_real, cnt_prefix[-1], -lp.sum(), en.sum(), ppl, n_ppl])


def shard_sums_by_source(logprob, entropy, counted, cu_seqlens, cu_seqlens_padded, cp_size,
                         cp_rank, cp_group, sources):
    """This shard's additive sums by source after the CP reduction: float64 [D, 6] on the
    values' device, D = max(sources) + 1 (AddShardBySource of thdpack/loss.h, made on the
    device). sources: [n] host ints, each sequence's source. Per sequence: its real tokens
    (host), and as differences of float64 prefix sums its loss tokens, -log-prob sum and
    entropy sum on this rank; the log-prob sums and counts all-reduced over the CP group (2n
    values) give each whole sequence's perplexity term on CP rank 0. Sequences are summed into
    their source in a fixed order (stable sort by source, prefix sums at the bounds):
    deterministic, no atomics."""
    local_cu, real = _thdpack.shard_sequence_layout(cu_seqlens, cu_seqlens_padded,
                                                    int(cp_size), int(cp_rank))
    src = np.ascontiguousarray(np.asarray(sources), dtype=np.int64).reshape(-1)
    n = len(real)
    if src.shape != (n,):
        raise ValueError(f"add_shard: sources has {src.size} entries, the microbatch {n} "
                         f"sequences")
    if n and src.min() < 0:
        raise ValueError(f"add_shard: sources[{int(np.argmin(src))}] = {int(src.min())} is "
                         f"negative")
    t = int(local_cu[-1])
    for name, x in (("logprob", logprob), ("entropy", entropy), ("counted", counted)):
        if not isinstance(x, torch.Tensor) or x.shape != (t,):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"add_shard: {name} is {got}: the shard has T/CP = {t} tokens")
    dev = logprob.device
    f64 = torch.float64
    nil = torch.zeros((), dtype=f64, device=dev)
    mask = counted.to(dev).to(torch.bool)
    lp = torch.where(mask, logprob.to(f64), nil)
    en = torch.where(mask, entropy.to(dev).to(f64), nil)
    bounds = torch.from_numpy(np.ascontiguousarray(local_cu, dtype=np.int64)).to(dev)

    def per_sequence(values):
        prefix = torch.cat([nil[None], torch.cumsum(values, 0)])
        return prefix[bounds[1:]] - prefix[bounds[:-1]]

    seq_lp = per_sequence(lp)
    seq_cnt = per_sequence(mask.to(f64))
    seq_en = per_sequence(en)
    reduced = torch.stack([seq_lp, seq_cnt])
    if cp_size > 1:
        dist.all_reduce(reduced, group=cp_group)
    whole_lp, whole_cnt = reduced[0], reduced[1]
    if cp_rank == 0:
        has = whole_cnt > 0
        seq_ppl = torch.where(has, torch.exp(-whole_lp / whole_cnt.clamp(min=1)), nil)
        seq_nppl = has.to(f64)
    else:
        seq_ppl = seq_nppl = torch.zeros(n, dtype=f64, device=dev)
    seq_real = torch.from_numpy(np.asarray(real, dtype=np.float64)).to(dev)
    rows = torch.stack([seq_real, seq_cnt, -seq_lp, seq_en, seq_ppl, seq_nppl], dim=1)  # [n, 6]
    d = int(src.max()) + 1 if n else 0
    out = torch.zeros((d, 6), dtype=f64, device=dev)
    if n == 0:
        return out
    order = np.argsort(src, kind="stable")
    sorted_src = src[order]
    starts = np.flatnonzero(np.r_[True, sorted_src[1:] != sorted_src[:-1]])
    ends = np.r_[starts[1:], n]
    perm = torch.from_numpy(order).to(dev)
    prefix = torch.cat([torch.zeros((1, 6), dtype=f64, device=dev),
                        torch.cumsum(rows[perm], 0)])
    s_idx = torch.from_numpy(starts).to(dev)
    e_idx = torch.from_numpy(ends).to(dev)
    out[torch.from_numpy(sorted_src[starts]).to(dev)] = prefix[e_idx] - prefix[s_idx]
    return out
