"""thdpack.torch._loss_cpu: the loss on CPU tensors through thdpack's C++ kernel
(thdpack.cross_entropy: one read of the logits, the gradient written in the same pass into a
buffer of the logits' dtype from thdpack's gradient cache); float16 and non-contiguous logits go
through it in float32 chunks."""
import numpy as np
import torch

from .. import _thdpack
from ._loss_common import _accumulation_dtype, _chunk_rows


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _use_kernel(logits, chunked):
    return (not chunked and logits.device.type == "cpu" and logits.dtype in _KERNEL_DTYPES
            and logits.is_contiguous())


def _kernel_numpy(x):
    """A zero-copy NumPy view of a contiguous CPU tensor (bfloat16 as its int16 bits)."""
    x = x.detach()
    return x.view(torch.int16).numpy() if x.dtype == torch.bfloat16 else x.numpy()


def _mask_numpy(loss_mask):
    if loss_mask is None:
        return None
    m = loss_mask.detach()
    if m.dtype == torch.bool:
        return m.contiguous().numpy()
    return m.to(torch.float32).contiguous().numpy()


_GRAD_NUMPY_DTYPE = {torch.float32: np.float32, torch.float64: np.float64,
                     torch.bfloat16: np.int16}


def _cached_grad_like(logits):
    """An uninitialised contiguous tensor of the logits' shape and dtype from thdpack's gradient
    cache (bind_grad_cache.cc): its pages are mapped already when a training loop frees the
    previous microbatch's gradient before the next loss call, and it returns to the cache only
    when nothing (autograd included) holds it any more."""
    t, v = logits.shape
    g = torch.from_numpy(_thdpack.grad_buffer(t, v, np.dtype(_GRAD_NUMPY_DTYPE[logits.dtype])))
    return g.view(torch.bfloat16) if logits.dtype == torch.bfloat16 else g


def set_grad_cache(max_blocks):
    """Keep at most max_blocks freed CPU gradient buffers of local_loss for reuse (default 1;
    0 disables the cache and frees what it holds)."""
    _thdpack.set_grad_cache(int(max_blocks))


def empty_grad_cache():
    """Free the CPU gradient buffers the cache holds (buffers in use are not touched)."""
    keep = _thdpack.grad_cache_info()["max_blocks"]
    _thdpack.set_grad_cache(0)
    _thdpack.set_grad_cache(keep)


def grad_cache_info():
    """The gradient cache: max_blocks, cached_blocks, cached_bytes, in_use_bytes, hits, misses."""
    return dict(_thdpack.grad_cache_info())


def _kernel_call(z, labels_np, mask_np, n, want_grad, scale, grad_out):
    """thdpack.cross_entropy on one contiguous CPU block; grad_out: a tensor of z's dtype."""
    return _thdpack.cross_entropy(
        _kernel_numpy(z), labels_np, mask_np, n, with_grad=want_grad, grad_scale=scale,
        num_threads=torch.get_num_threads(),
        grad_out=_kernel_numpy(grad_out) if want_grad else None)


def _per_token_cpu(logits, labels, loss_mask, n, want_grad, scale, chunk_tokens):
    """The C++ kernel: float64 (logprob, entropy) [T], counted bool [T] and the gradient
    scale * (softmax - onehot) / n on counted rows."""
    labels_np = labels.numpy()
    mask_np = _mask_numpy(loss_mask)
    if _use_kernel(logits, False):
        grad = _cached_grad_like(logits) if want_grad else None
        out = _kernel_call(logits, labels_np, mask_np, n, want_grad, scale, grad)
        return (torch.from_numpy(out["logprobs"]), torch.from_numpy(out["entropy"]),
                torch.from_numpy(out["counted"]).bool(), grad)
    # float16 or a non-contiguous view: the kernel on chunks of tokens staged in float32
    # (float64 for float64 logits), the gradient copied back in the logits' dtype.
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format) if want_grad else None
    t = logits.shape[0]
    acc = _accumulation_dtype(logits)
    rows = _chunk_rows(logits, chunk_tokens)
    logprob = torch.zeros(t, dtype=torch.float64)
    entropy = torch.zeros(t, dtype=torch.float64)
    counted = torch.zeros(t, dtype=torch.bool)
    for s in range(0, t, rows):
        e = min(t, s + rows)
        z = logits[s:e].detach().to(acc, memory_format=torch.contiguous_format, copy=True)
        g = torch.empty_like(z) if want_grad else None
        out = _kernel_call(z, labels_np[s:e], None if mask_np is None else mask_np[s:e], n,
                           want_grad, scale, g)
        del z
        logprob[s:e] = torch.from_numpy(out["logprobs"])
        entropy[s:e] = torch.from_numpy(out["entropy"])
        counted[s:e] = torch.from_numpy(out["counted"]).bool()
        if want_grad:
            grad[s:e].copy_(g)
    return logprob, entropy, counted, grad
