"""thdpack.torch.loss: thdpack's loss semantics and sharding as torch operations on any device.

Real training keeps the logits on the GPU; these functions compute the CP-local loss and its
topology-invariant statistics there with plain torch operations, driven by thdpack's metadata
(the global loss-token count N and the sequence boundaries of the local shard), and shard or
unshard tensors with thdpack's indices (thdpack.torch.sharding). Only the small int32 metadata
goes through NumPy.

Loss semantics (docs/design.md section 8):
  * per token -log p(label), accumulated in float32 (float64 for float64 logits); a token counts
    when its label is not -100 and its loss_mask is not 0;
  * the step loss is L = (sum over the DP x CP grid and all microbatches of masked token
    losses) / N, N the GLOBAL loss-token count of the step (known before any forward pass);
  * each (dp, cp) rank's share is local_sum / N: the gradients of the shares SUMMED over DP x CP
    are those of L. A framework that AVERAGES gradients over DP x CP (Megatron DDP) passes
    grad_factor = dp_size * cp_size (thdpack.gradient_factor);
  * statistics: loss = sum / N (0 when N == 0), ppl = mean over sequences with at least one loss
    token of exp(-(sum of its log-probs) / its loss tokens) (None when there is none), with the
    per-sequence sums all-reduced over the CP group; entropy = token mean.
"""
import numpy as np
import torch
import torch.distributed as dist

from .. import _thdpack
from .sharding import _cu, partition_indices

IGNORE_INDEX = _thdpack.IGNORE_INDEX


def _accumulation_dtype(logits):
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def token_statistics(logits, labels, loss_mask=None):
    """Per-token (logprob, entropy, counted) of local logits [T, V] (any device and float dtype).

    logprob = log p(label) and entropy = -sum p log p, both 0 where the token is not counted;
    counted: bool [T]. Computed in float32 (float64 for float64 logits). Differentiable in the
    logits. ValueError for a counted label outside [0, V) or a loss_mask value other than 0/1.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [T, V], got shape {tuple(logits.shape)}")
    t, v = logits.shape
    if labels.shape != (t,):
        raise ValueError(f"labels: expected shape ({t},), got {tuple(labels.shape)}")
    labels = labels.to(logits.device)
    counted = labels != IGNORE_INDEX
    if loss_mask is not None:
        if loss_mask.shape != (t,):
            raise ValueError(f"loss_mask: expected shape ({t},), got {tuple(loss_mask.shape)}")
        loss_mask = loss_mask.to(logits.device)
        bad_mask = (loss_mask != 0) & (loss_mask != 1)
        counted = counted & (loss_mask != 0)
    else:
        bad_mask = None
    bad_label = counted & ((labels < 0) | (labels >= v))
    bad = bad_label.any() if bad_mask is None else (bad_label.any() | bad_mask.any())
    if bool(bad):  # one device sync, for a clear error instead of a wrong loss
        if bad_mask is not None and bool(bad_mask.any()):
            i = int(bad_mask.nonzero()[0])
            raise ValueError(f"loss_mask[{i}] = {float(loss_mask[i])}: must be 0 or 1")
        i = int(bad_label.nonzero()[0])
        raise ValueError(f"labels[{i}] = {int(labels[i])}: a counted label must lie in [0, {v})")
    z = logits.to(_accumulation_dtype(logits))
    lse = torch.logsumexp(z, dim=-1)
    safe = torch.where(counted, labels, torch.zeros_like(labels)).to(torch.int64)
    target = z.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    logprob = torch.where(counted, target - lse, zero)
    p = torch.softmax(z, dim=-1)
    entropy = torch.where(counted, lse - (p * z).sum(-1), zero)
    return logprob, entropy, counted


def local_loss(logits, labels, loss_mask, n_loss_tokens, grad_factor=1.0):
    """This (dp, cp) rank's share of the step loss: -sum(counted log p) / N * grad_factor.

    n_loss_tokens: N, the GLOBAL loss-token count of the step (thdpack metadata). The shares
    summed over DP x CP (and microbatches) equal the step loss L, and so do their gradients;
    pass grad_factor = dp_size * cp_size when the framework averages gradients. N == 0 gives a
    zero loss (and zero gradients), never a division by zero.
    """
    n = int(n_loss_tokens)
    if n < 0:
        raise ValueError(f"n_loss_tokens = {n}: must be >= 0")
    logprob, _, counted = token_statistics(logits, labels, loss_mask)
    if n == 0:
        return logprob.sum() * 0.0
    return -logprob.sum() * (float(grad_factor) / n)


class LossStatistics:
    """Step statistics that do not depend on CP, DP or the microbatching.

    Call add_shard once per microbatch on every (dp, cp) rank of the last pipeline stage (one TP
    rank only), then summary(group) with the DP x CP group (None: this process only).
    """

    def __init__(self):
        self._sums = None  # float64 [6]: n_tokens, n_loss, loss_sum, entropy_sum, ppl_sum, n_ppl

    def add_shard(self, logits, labels, loss_mask, cu_seqlens, cu_seqlens_padded,
                  cp_size=1, cp_rank=0, cp_group=None):
        """Adds CP rank cp_rank's shard of one packed microbatch.

        cu_seqlens, cu_seqlens_padded: the microbatch's GLOBAL offsets [n+1]. With cp_size > 1,
        cp_group (the CP process group) is required: per-sequence sums are all-reduced over it
        (no rank holds a whole sequence).
        """
        cu = _cu(cu_seqlens, "cu_seqlens")
        cup = _cu(cu_seqlens_padded, "cu_seqlens_padded")
        if cu.shape != cup.shape:
            raise ValueError(f"cu_seqlens has {cu.size} entries, cu_seqlens_padded {cup.size}")
        if cp_size > 1 and cp_group is None:
            raise ValueError("add_shard: cp_size > 1 needs cp_group (per-sequence sums are "
                             "all-reduced over the CP group)")
        device = logits.device
        idx = partition_indices(cup, cp_size, cp_rank, device)
        if idx.numel() != logits.shape[0]:
            raise ValueError(f"logits hold {logits.shape[0]} tokens, the shard of "
                             f"cu_seqlens_padded holds {idx.numel()}")
        n = cu.size - 1
        with torch.no_grad():
            logprob, entropy, counted = token_statistics(logits, labels, loss_mask)
            padded = torch.from_numpy(np.diff(cup).astype(np.int64)).to(device)
            real = torch.from_numpy(np.diff(cu).astype(np.int64)).to(device)
            seq = torch.repeat_interleave(torch.arange(n, device=device), padded // cp_size)
            start = torch.from_numpy(cup[:-1].astype(np.int64)).to(device)
            is_real = (idx - start[seq]) < real[seq]
            f64 = torch.float64
            per_seq = torch.zeros(2, n, dtype=f64, device=device)
            per_seq[0].index_add_(0, seq, logprob.to(f64))
            per_seq[1].index_add_(0, seq, counted.to(f64))
            if cp_size > 1:
                dist.all_reduce(per_seq, group=cp_group)
            has = per_seq[1] > 0
            terms = torch.exp(-per_seq[0][has] / per_seq[1][has])
            once = 1.0 if cp_rank == 0 else 0.0  # every CP rank now holds the same sums
            sums = torch.stack([
                is_real.sum().to(f64), counted.sum().to(f64), -logprob.sum().to(f64),
                entropy.sum().to(f64), terms.sum() * once, has.sum().to(f64) * once])
        self._sums = sums if self._sums is None else self._sums + sums

    def summary(self, group=None):
        """{'n_tokens', 'n_loss_tokens', 'loss', 'ppl', 'entropy'} over everything added on every
        rank of `group` (all-reduced when a group is given)."""
        sums = self._sums if self._sums is not None else torch.zeros(6, dtype=torch.float64)
        sums = sums.clone()
        if group is not None:
            dist.all_reduce(sums, group=group)
        n_tokens, n_loss, loss_sum, entropy_sum, ppl_sum, n_ppl = sums.tolist()
        return {
            "n_tokens": int(n_tokens),
            "n_loss_tokens": int(n_loss),
            "loss": loss_sum / n_loss if n_loss > 0 else 0.0,
            "ppl": ppl_sum / n_ppl if n_ppl > 0 else None,
            "entropy": entropy_sum / n_loss if n_loss > 0 else 0.0,
        }
