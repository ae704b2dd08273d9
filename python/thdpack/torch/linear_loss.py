"""thdpack.torch.linear_loss: the lm-head GEMM fused with the loss, never holding [T, V] logits.

``linear_loss(hidden, weight, labels, loss_mask, n_loss_tokens, ...)`` is
``local_loss(hidden @ weight.T, labels, loss_mask, n_loss_tokens, ...)`` computed a chunk of
tokens at a time: per chunk the logits ``[rows, V]`` (one GEMM), the loss and their gradient by
thdpack's kernel of the backend (in place on the chunk with the CUDA kernel), then
``grad_hidden[chunk] = grad_logits @ weight`` and ``grad_weight += grad_logits.T @ hidden[chunk]``
(accumulated in float32, float64 for float64 inputs; on CUDA one bfloat16/float16 GEMM with a
float32 output added into the accumulator). Extra memory: one chunk of logits (two with the CPU
kernel, which writes the gradient beside them; a float32 copy of the chunk's gradient for the
weight's accumulation where torch's GEMM has no float32 output: the CPU, torch < 2.8), the
float32 weight gradient, and nothing of size T x V. Everything is computed in the forward pass, as for
local_loss; backward hands the gradients to autograd, scaled by the incoming gradient.

Vocab-parallel (``tp_group`` with the CUDA kernel): ``weight`` is this TP rank's rows
``[vocab_start, vocab_start + V/TP)`` of ``vocab_total``; each chunk's row states are
all-gathered over the TP group (16 bytes a row), and ``grad_hidden`` is all-reduced over it
(the sum of every rank's part, as Megatron's column-parallel linear does in its backward) unless
``reduce_grad_hidden=False``. Context parallelism needs nothing here: ``hidden`` is the rank's
CP shard and N the step's global loss-token count, as for local_loss.
"""
import torch
import torch.distributed as dist

from . import loss as _loss
from ._loss_common import _check_inputs


def _chunk_rows(hidden, weight, chunk_tokens):
    """Rows per chunk: the given count, else H/2 (between 1 and 8192): a chunk's logits are at
    most half the weight's bytes, and the weight-gradient GEMM reduces over H/2 rows per chunk.
    Fewer rows would make that GEMM memory-bound: each chunk reads and writes the float32
    [V, H] accumulator (8VH bytes for 2 * rows * VH flops, so at 512 rows on an H100 the
    accumulator's traffic takes longer than the arithmetic)."""
    if chunk_tokens is not None:
        if int(chunk_tokens) < 1:
            raise ValueError(f"chunk_tokens = {chunk_tokens}: must be >= 1")
        return int(chunk_tokens)
    return max(1, min(8192, weight.shape[1] // 2))


# Whether torch.addmm takes out_dtype here (torch >= 2.8, CUDA): a bfloat16/float16 GEMM whose
# float32 output accumulates into a float32 tensor. None until the first try.
_FP32_OUT_GEMM = None


def _accumulate(grad_w, g, h):
    """grad_w += g.T @ h, grad_w in float32 (float64 for float64 inputs). On CUDA with
    bfloat16/float16 operands: one tensor-core GEMM with a float32 output added into grad_w
    (torch.addmm's out_dtype), no widened copy of the chunk's gradient. Elsewhere, or where
    torch has no out_dtype, the operands are widened first (a float32 copy of the chunk, and a
    float32 GEMM)."""
    global _FP32_OUT_GEMM
    if (g.is_cuda and g.dtype in (torch.bfloat16, torch.float16)
            and grad_w.dtype == torch.float32 and _FP32_OUT_GEMM is not False):
        try:
            torch.addmm(grad_w, g.t(), h, out_dtype=torch.float32, out=grad_w)
            _FP32_OUT_GEMM = True
            return
        except (TypeError, NotImplementedError):  # no such overload in this torch
            _FP32_OUT_GEMM = False
    grad_w.addmm_(g.t().to(grad_w.dtype), h.to(grad_w.dtype))


class _LinearLoss(torch.autograd.Function):

    @staticmethod
    def forward(ctx, hidden, weight, labels, loss_mask, n, grad_factor, chunk_tokens, backend,
                tp, reduce_grad_hidden, want_h, want_w, mm, token_values):
        t, hdim = hidden.shape
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        rows = _chunk_rows(hidden, weight, chunk_tokens)
        scale = float(grad_factor) / n if n > 0 else 0.0
        want = want_h or want_w
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        total = torch.zeros((), dtype=torch.float64, device=hidden.device)
        # The GEMMs on contiguous operands (a result must not depend on the inputs' layout).
        w = weight.detach().to(mm).contiguous()
        # The CUDA kernel writes the chunk's gradient over its logits.
        inplace = want and backend == "cuda"
        with torch.no_grad():
            for s in range(0, t, rows):
                e = min(t, s + rows)
                h = hidden[s:e].detach().to(mm).contiguous()
                z = h @ w.t()  # [rows, V]: the one chunk of logits
                mask = None if loss_mask is None else loss_mask[s:e]
                # Values checked once for the whole shard (linear_loss): no sync per chunk.
                logprob, entropy, _, g = _loss._per_token(z, labels[s:e], mask, n, want,
                                                          float(grad_factor), False, None,
                                                          backend, inplace, False, tp,
                                                          checked=True)
                total += logprob.sum(dtype=torch.float64)
                if token_values is not None:
                    if s == 0:  # the backend's per-token dtype, for the whole shard
                        lp_all = torch.empty(t, dtype=logprob.dtype, device=logprob.device)
                        en_all = torch.empty(t, dtype=entropy.dtype, device=entropy.device)
                    lp_all[s:e] = logprob
                    en_all[s:e] = entropy
                if want:
                    if want_h:
                        grad_h[s:e] = g @ w
                    if want_w:
                        _accumulate(grad_w, g, h)
                del z, g
        if token_values is not None:
            if t == 0:
                lp_all = en_all = torch.zeros(0, dtype=acc, device=hidden.device)
            token_values.update(logprob=lp_all, entropy=en_all)
        if want_h and tp is not None and reduce_grad_hidden:
            dist.all_reduce(grad_h, group=tp[0])
        ctx.grads = (grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return (-total * scale).to(acc)

    @staticmethod
    def backward(ctx, grad_output):
        grad_h, grad_w = ctx.grads
        if grad_h is None and grad_w is None:
            raise RuntimeError("linear_loss: backward ran twice; its gradients were handed to "
                               "autograd the first time (call linear_loss again)")
        ctx.grads = (None, None)
        # Reading a CUDA scalar back would synchronise: there, always scale.
        one = grad_output.device.type == "cpu" and float(grad_output) == 1.0
        gh = gw = None
        if grad_h is not None:
            gh = grad_h if one else grad_h * grad_output.to(grad_h.dtype)
        if grad_w is not None:
            gw = (grad_w if one else grad_w * grad_output.to(grad_w.dtype)).to(ctx.weight_dtype)
        return gh, gw, None, None, None, None, None, None, None, None, None, None, None, None


def linear_loss(hidden, weight, labels, loss_mask, n_loss_tokens, grad_factor=1.0, *,
                chunk_tokens=None, backend="auto", tp_group=None, vocab_start=0, vocab_total=0,
                reduce_grad_hidden=True, validate=True, token_values=None):
    """This (dp, cp) rank's share of the step loss from hidden states and the lm-head weight,
    without [T, V] logits: -sum(counted log p) / N * grad_factor with logits = hidden @ weight.T.

    hidden: [T, H] (this rank's CP shard), weight: [V, H] (V/TP rows with tp_group), labels and
    loss_mask as local_loss's, N the step's GLOBAL loss-token count. backend: local_loss's
    ("cuda": the CUDA kernel, in place on each chunk). The weight's gradient is accumulated in
    float32 (float64 for float64 inputs) and handed to autograd in that dtype's cast to the
    weight's dtype. chunk_tokens: rows per chunk (default: H/2, at most 8192: a chunk's logits
    within half the weight's bytes). The labels' and mask's values and N are checked once for the
    whole shard (one device synchronisation, none per chunk); validate=False skips that with
    the CUDA kernel, so that nothing synchronises (bad values then give undefined results; the
    other backends always check). token_values: a dict that gets the per-token logprob,
    entropy and counted tensors of the whole shard, as local_loss's (for RL, and for
    LossStatistics.add_shard(None, ..., token_values=d)).
    """
    n = int(n_loss_tokens)
    if n < 0:
        raise ValueError(f"n_loss_tokens = {n}: must be >= 0")
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected a 2-d tensor, got {got}")
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not x.dtype.is_floating_point:
            raise ValueError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden is [T, {hidden.shape[1]}] but weight is "
                         f"[V, {weight.shape[1]}]: H must agree")
    if hidden.dtype != weight.dtype or hidden.device != weight.device:
        raise ValueError(f"hidden ({hidden.dtype}, {hidden.device}) and weight ({weight.dtype}, "
                         f"{weight.device}) must share dtype and device")
    tp = None if tp_group is None else (tp_group, int(vocab_start), int(vocab_total))
    # The GEMMs' dtype: float32 for float16 on the CPU (which has no float16 GEMM). The backend
    # is the one a chunk of logits [rows, V] of that dtype gets.
    mm = torch.float32 if hidden.dtype == torch.float16 and hidden.device.type == "cpu" \
        else hidden.dtype
    chunk_like = torch.empty((1, weight.shape[0]), dtype=mm, device=hidden.device)
    backend = _loss._backend_of(chunk_like, backend, False, False)
    if tp is not None:
        if backend != "cuda":
            raise ValueError("tp_group (vocab-parallel logits) needs backend 'cuda'")
        if not (0 <= tp[1] and tp[1] + weight.shape[0] <= tp[2]):
            raise ValueError(f"vocab_start = {tp[1]}: this rank's {weight.shape[0]} weight rows "
                             f"must lie within vocab_total = {tp[2]}")
    # Labels and mask checked once for the whole shard (shapes, and values against the whole
    # vocabulary), against a logits-shaped view that holds no memory.
    like = torch.empty((), dtype=hidden.dtype, device=hidden.device).expand(
        hidden.shape[0], weight.shape[0])
    check = bool(validate) or backend != "cuda"
    labels, loss_mask, counted, n_valid = _check_inputs(
        like, labels, loss_mask, check_values=check, vocab=None if tp is None else tp[2])
    if check and n < n_valid:  # N is global: never below the whole shard's count
        raise ValueError(f"n_loss_tokens = {n} is smaller than this shard's counted tokens "
                         f"({n_valid}): N must be the GLOBAL loss-token count of the step")
    if token_values is not None:
        if not isinstance(token_values, dict):
            raise ValueError(f"token_values: expected a dict to fill, got "
                             f"{type(token_values).__name__}")
        token_values["counted"] = counted
    grad_on = torch.is_grad_enabled()
    want_h = grad_on and hidden.requires_grad
    want_w = grad_on and weight.requires_grad
    return _LinearLoss.apply(hidden, weight, labels, loss_mask, n, float(grad_factor),
                             chunk_tokens, backend, tp, bool(reduce_grad_hidden), want_h, want_w,
                             mm, token_values)
