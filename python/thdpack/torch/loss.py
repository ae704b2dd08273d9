"""thdpack.torch.loss: thdpack's loss as a torch autograd function, and its statistics.

The logits of a rank's shard are the largest tensor of a step ([T/CP, V]: 37 GiB in float32 at
64K local tokens and V = 151,936), so nothing here holds a float32 copy, a softmax or a
log-softmax of the whole shard:

  * CPU tensors (float32, bfloat16, float64, C-contiguous) go to thdpack's fused C++ kernel
    (thdpack.cross_entropy): one read of the logits, the gradient written in the same pass into
    one buffer of the logits' dtype, handed to autograd as the logits' gradient;
  * every other device (and float16 or non-contiguous CPU logits) works in chunks of tokens with
    torch operations: per chunk a float32 (float64 for float64 logits) copy, its exponentials,
    and the chunk's gradient written into the one gradient buffer, so the extra memory is two
    chunk-sized buffers (at most 1/8 of the logits' bytes by default, `chunk_tokens` to choose).

Torch computes per-token values only; the per-sequence aggregation, the CP reduction of the
per-sequence sums and the statistics (loss, ppl, entropy) are C++'s (thdpack._thdpack.LossTotals:
AccumulateShardLoss, ReduceSequencesOverCp, Finalize of thdpack/loss.h), with torch.distributed
as the transport of the all-reduces. Only small per-token and per-sequence arrays go through
NumPy.

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
import torch
import torch.distributed as dist

from .. import _thdpack
from ._loss_common import IGNORE_INDEX, _accumulation_dtype, _check_inputs  # noqa: F401
from ._loss_cpu import _per_token_cpu
from ._loss_cpu import empty_grad_cache, grad_cache_info, set_grad_cache  # noqa: F401 (API)
from ._loss_torch import _per_token_chunked
from .sharding import _cu


def _per_token(logits, labels, loss_mask, n, want_grad, grad_factor, chunked, chunk_tokens):
    """(logprob, entropy, counted, grad): per-token values of the whole shard, float64 on the
    kernel path, the accumulation dtype on the chunked one; grad None unless want_grad."""
    labels, loss_mask, counted = _check_inputs(logits, labels, loss_mask)
    if n is not None:  # the share: N is global, never below this shard's count
        n_valid = int(counted.sum())
        if n < n_valid:
            raise ValueError(f"n_loss_tokens = {n} is smaller than this shard's counted tokens "
                             f"({n_valid}): N must be the GLOBAL loss-token count of the step")
    if logits.device.type == "cpu" and not chunked:
        return _per_token_cpu(logits, labels, loss_mask, n or 0, want_grad, grad_factor,
                              chunk_tokens)
    scale = grad_factor / n if n else 0.0
    logprob, entropy, grad = _per_token_chunked(logits, labels, counted, want_grad, scale,
                                                chunk_tokens)
    return logprob, entropy, counted, grad


class _LocalLoss(torch.autograd.Function):
    """The share and its gradient, made in the forward pass into one buffer."""

    @staticmethod
    def forward(ctx, logits, labels, loss_mask, n, grad_factor, chunked, chunk_tokens, want_grad):
        scale = float(grad_factor) / n if n > 0 else 0.0
        logprob, _, _, grad = _per_token(logits, labels, loss_mask, n, want_grad,
                                         float(grad_factor), chunked, chunk_tokens)
        ctx.grad = grad
        acc = _accumulation_dtype(logits)
        total = logprob.sum().to(device=logits.device, dtype=acc)
        return -total * scale

    @staticmethod
    def backward(ctx, grad_output):
        grad = ctx.grad
        if grad is None:
            raise RuntimeError("local_loss: backward ran twice; the gradient buffer was handed "
                               "to autograd the first time (call local_loss again)")
        ctx.grad = None  # autograd may take the buffer as logits.grad without a copy
        if grad.device.type != "cpu" or float(grad_output) != 1.0:
            grad.mul_(grad_output.to(grad.dtype))
        return grad, None, None, None, None, None, None, None


def local_loss(logits, labels, loss_mask, n_loss_tokens, grad_factor=1.0, *, chunked=False,
               chunk_tokens=None):
    """This (dp, cp) rank's share of the step loss: -sum(counted log p) / N * grad_factor.

    n_loss_tokens: N, the GLOBAL loss-token count of the step (thdpack metadata). The shares
    summed over DP x CP (and microbatches) equal the step loss L, and so do their gradients;
    pass grad_factor = dp_size * cp_size when the framework averages gradients. N == 0 gives a
    zero loss (and zero gradients), never a division by zero; N below this shard's own count of
    loss tokens is a ValueError (N is global).

    An autograd function: the gradient is made in the forward pass (when logits require it),
    in the logits' dtype, and handed to autograd in backward (which therefore runs once per
    call). CPU float32/bfloat16/float64 logits use the C++ kernel; other devices and dtypes
    the chunked torch path; chunked=True forces the chunked path on CPU too (tests, benchmark),
    chunk_tokens sets its rows per chunk (default: two float32 chunk buffers within 1/8 of the
    logits' bytes). The share is float32 (float64 for float64 logits) on the logits' device.
    """
    n = int(n_loss_tokens)
    if n < 0:
        raise ValueError(f"n_loss_tokens = {n}: must be >= 0")
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits: expected a [T, V] tensor, got {type(logits).__name__}")
    # No gradient buffer under torch.no_grad() or for logits that do not require one.
    want_grad = torch.is_grad_enabled() and logits.requires_grad
    return _LocalLoss.apply(logits, labels, loss_mask, n, float(grad_factor), bool(chunked),
                            chunk_tokens, want_grad)


def token_statistics(logits, labels, loss_mask=None, *, chunked=False, chunk_tokens=None):
    """Per-token (logprob, entropy, counted) of local logits [T, V] (any device and float dtype).

    logprob = log p(label) and entropy = -sum p log p, both 0 where the token is not counted;
    counted: bool [T]. Accumulated in float32 (float64 for float64 logits); float64 tensors on
    the CPU (the C++ kernel's output), the accumulation dtype elsewhere. Not differentiable:
    local_loss is the differentiable share. ValueError for a counted label outside [0, V) or a
    loss_mask value other than 0/1.
    """
    with torch.no_grad():
        logprob, entropy, counted, _ = _per_token(logits, labels, loss_mask, None, False, 0.0,
                                                  chunked, chunk_tokens)
    return logprob, entropy, counted


def _torch_all_reduce(group, device):
    """A float64 NumPy all-reduce (sum, in place) over `group` through torch.distributed."""
    def all_reduce(a):
        t = torch.from_numpy(a).to(device)
        dist.all_reduce(t, group=group)
        a[:] = t.cpu().numpy()
    return all_reduce


class LossStatistics:
    """Step statistics that do not depend on CP, DP or the microbatching.

    Call add_shard once per microbatch on every (dp, cp) rank of the last pipeline stage (one TP
    rank only), then summary(group) with the DP x CP group (None: this process only). The
    figures are C++'s (thdpack/loss.h: AccumulateShardLoss, ReduceSequencesOverCp, Finalize).
    """

    def __init__(self):
        self._totals = _thdpack.LossTotals()

    def add_shard(self, logits, labels, loss_mask, cu_seqlens, cu_seqlens_padded,
                  cp_size=1, cp_rank=0, cp_group=None, *, chunked=False, chunk_tokens=None):
        """Adds CP rank cp_rank's shard of one packed microbatch.

        cu_seqlens, cu_seqlens_padded: the microbatch's GLOBAL offsets [n+1]. With cp_size > 1,
        cp_group (the CP process group) is required: per-sequence sums are all-reduced over it
        (no rank holds a whole sequence).
        """
        if cp_size > 1 and cp_group is None:
            raise ValueError("add_shard: cp_size > 1 needs cp_group (per-sequence sums are "
                             "all-reduced over the CP group)")
        cu = _cu(cu_seqlens)
        cup = _cu(cu_seqlens_padded)
        logprob, entropy, counted = token_statistics(logits, labels, loss_mask, chunked=chunked,
                                                     chunk_tokens=chunk_tokens)
        f64 = torch.float64
        lp = logprob.to(device="cpu", dtype=f64).contiguous().numpy()
        en = entropy.to(device="cpu", dtype=f64).contiguous().numpy()
        ct = counted.to("cpu").contiguous().numpy()
        reduce = _torch_all_reduce(cp_group, logits.device) if cp_size > 1 else None
        self._totals.add_shard(lp, en, ct, cu, cup, int(cp_size), int(cp_rank), reduce)

    def add_microbatch(self, logits, mb, *, chunked=False, chunk_tokens=None):
        """add_shard with one of PackedDataIterator's microbatches (a dict): its labels,
        loss_mask, offsets and CP group (cp_size, cp_rank, cp_group: the topology's for a static
        step, the microbatch's own for a dynamic one). An idle microbatch (a dynamic step's rank
        in no group) adds nothing; its logits must have no rows."""
        if mb.get("idle", False):
            if logits.shape[0] != 0:
                raise ValueError(f"add_microbatch: the microbatch is idle on this rank, but the "
                                 f"logits have {logits.shape[0]} rows")
            return
        self.add_shard(logits, mb["labels"], mb["loss_mask"], mb["cu_seqlens"],
                       mb["cu_seqlens_padded"], cp_size=mb["cp_size"], cp_rank=mb["cp_rank"],
                       cp_group=mb["cp_group"], chunked=chunked, chunk_tokens=chunk_tokens)

    def summary(self, group=None):
        """{'n_tokens', 'n_loss_tokens', 'loss', 'ppl', 'entropy'} over everything added on every
        rank of `group` (all-reduced when a group is given)."""
        totals = self._totals.copy()
        if group is not None:
            device = "cpu"
            if dist.get_backend(group) == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            totals.all_reduce(_torch_all_reduce(group, device))
        return totals.summary()
