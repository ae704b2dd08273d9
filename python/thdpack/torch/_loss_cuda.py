"""thdpack.torch._loss_cuda: the loss on CUDA tensors through thdpack's CUDA kernel
(thdpack/cuda_loss.h): per row one read for the statistics (online max and sum of exponentials,
target logit, entropy) and one read and one write for the gradient, fp32 arithmetic, the
gradient rounded once into a buffer of the logits' dtype or over the logits themselves
(inplace). Called with the tensors' data_ptr() and torch's current stream; no host
synchronisation unless validate (one read of a device flag, so that a bad label is a ValueError
naming the token)."""
import torch

from .. import _thdpack
from ._loss_common import IGNORE_INDEX

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# The kernel is chosen by default for CUDA logits only once its GPU tests
# (tests/cuda_loss_gpu_test.cc, python/tests/test_loss_cuda.py) have passed on a GPU; until then
# backend="cuda" asks for it and "auto" keeps the chunked torch path (docs/loss.md).
CUDA_KERNEL_BY_DEFAULT = False

# The one-read kernel (CrossEntropyOneRead: each row staged in shared memory, over a cluster of
# blocks when large) replaces the fused one where it can run, once its GPU tests have passed
# and bench/loss_cuda.py has measured it faster; until then it is asked for with
# per_token_cuda(..., kernel="one_read") (the benchmark's and the tests' way).
ONE_READ_BY_DEFAULT = False

# The kernels' version (thdpack/cuda_loss.h): 0 the latest (2), 1 the first, kept beside it so
# that the tests check both and bench/loss_cuda.py times them side by side.
KERNEL_VERSION = 0


def one_read_takes(logits):
    """Whether the one-read kernel can take these logits (kernel_takes's): a row within 8
    blocks' shared memory, and clusters (sm_90) for a row of more than one block's share."""
    if not kernel_takes(logits):
        return False
    cluster = _thdpack._cuda_one_read_plan(_DTYPES[logits.dtype], logits.shape[1])[0]
    if cluster == 0:
        return False
    return cluster == 1 or torch.cuda.get_device_capability(logits.device)[0] >= 9


def kernel_takes(logits):
    """Whether the CUDA kernel can take these logits: a CUDA [T, V] tensor of float32, bfloat16
    or float16 with unit column stride, in a build with the kernels."""
    return (isinstance(logits, torch.Tensor) and logits.is_cuda and logits.dim() == 2
            and logits.dtype in _DTYPES and logits.stride(1) == 1
            and (logits.shape[0] <= 1 or logits.stride(0) >= logits.shape[1])
            and _thdpack.cuda_loss_built())


def why_not(logits):
    """Why kernel_takes(logits) is False, for the error of backend="cuda"."""
    if not _thdpack.cuda_loss_built():
        return "this build of thdpack has no CUDA kernels (built without nvcc)"
    if not (isinstance(logits, torch.Tensor) and logits.is_cuda):
        return "the logits are not a CUDA tensor"
    if logits.dtype not in _DTYPES:
        return f"dtype {logits.dtype} (the kernel takes float32, bfloat16, float16)"
    return f"strides {tuple(logits.stride())} (the kernel needs unit column stride)"


def per_token_cuda(logits, labels, loss_mask, want_grad, scale, inplace, validate,
                   tp_group=None, vocab_start=0, vocab_total=0, kernel=None, version=None):
    """(logprob, entropy, counted, grad, n_valid): float32 [T] values (0 where not counted),
    counted bool [T], the gradient scale * (softmax - onehot) in the logits' dtype (the logits
    themselves when inplace), None unless want_grad or inplace; n_valid the counted tokens when
    validate (else None: nothing synchronises). labels: int64 [T], loss_mask: [T] or None
    (shapes checked by the caller). kernel: "fused" or "one_read" for the whole-row call (None:
    one_read where ONE_READ_BY_DEFAULT and one_read_takes, else fused); version: the kernels'
    version (None: KERNEL_VERSION)."""
    t, v = logits.shape
    dev = logits.device
    labels = labels.to(device=dev, dtype=torch.int64).contiguous()
    mask = None if loss_mask is None else loss_mask.to(device=dev, dtype=torch.float32).contiguous()
    logprob = torch.empty(t, dtype=torch.float32, device=dev)
    entropy = torch.empty(t, dtype=torch.float32, device=dev)
    grad = None
    if inplace:
        grad = logits.detach()
    elif want_grad:
        grad = torch.empty_strided(logits.shape, logits.stride(), dtype=logits.dtype, device=dev)
    error = torch.zeros(1, dtype=torch.int64, device=dev) if validate else None
    vocab = v if tp_group is None else int(vocab_total)
    # The row stride; a tensor of at most one row may have any (e.g. a transposed column).
    ld = logits.stride(0) if t > 1 else v
    version = KERNEL_VERSION if version is None else int(version)

    def call(which, stats):
        _thdpack._cuda_cross_entropy(
            which, _DTYPES[logits.dtype], logits.data_ptr(), t, v, ld,
            labels.data_ptr(), 0 if mask is None else mask.data_ptr(), int(vocab_start),
            vocab if tp_group is not None else 0, float(scale),
            0 if grad is None or which == "partials" else grad.data_ptr(),
            logprob.data_ptr(), entropy.data_ptr(), 0 if stats is None else stats.data_ptr(),
            0 if error is None else error.data_ptr(), torch.cuda.current_stream(dev).cuda_stream,
            version)

    if kernel is None:
        kernel = "one_read" if ONE_READ_BY_DEFAULT and one_read_takes(logits) else "fused"
    if kernel not in ("fused", "one_read"):
        raise ValueError(f"kernel = {kernel!r}: expected 'fused' or 'one_read'")
    if kernel == "one_read" and tp_group is not None:
        raise ValueError("kernel 'one_read' takes the whole vocabulary: vocab-parallel logits "
                         "(tp_group) go through the partials and finish kernels")
    with torch.cuda.device(dev):
        if tp_group is None:
            call(kernel, None)
        else:
            # Vocab-parallel: each row's 16-byte partial state, one all-gather over the TP
            # group, merged in rank order (every rank the same), then this rank's columns.
            tp = torch.distributed.get_world_size(tp_group)
            mine = torch.empty((t, 4), dtype=torch.float32, device=dev)
            call("partials", mine)
            gathered = torch.empty((tp, t, 4), dtype=torch.float32, device=dev)
            torch.distributed.all_gather_into_tensor(gathered, mine, group=tp_group)
            merged = torch.empty((t, 4), dtype=torch.float32, device=dev)
            _thdpack._cuda_combine_partials(gathered.data_ptr(), tp, t, merged.data_ptr(),
                                            torch.cuda.current_stream(dev).cuda_stream)
            call("finish", merged)
    counted = labels != IGNORE_INDEX
    if mask is not None:
        counted &= mask != 0
    n_valid = None
    if error is not None:  # the one sync of a validated call: the flag and the counted tokens
        flag, n_valid = torch.stack([error[0], counted.sum()]).tolist()
        _thdpack._cuda_loss_error(int(flag), vocab)
    return logprob, entropy, counted, grad, n_valid


def scale_grad(grad, factor):
    """grad *= factor on the device, for autograd's backward: factor (grad_output, a one-element
    tensor) is read by the kernel, which writes nothing when it is 1, so the common backward
    costs no pass over the [T, V] gradient and no synchronisation; another factor costs one
    read and one write, in fp32 with one rounding. grad: a tensor kernel_takes."""
    t, v = grad.shape
    f = factor.detach().to(device=grad.device, dtype=torch.float32).reshape(()).contiguous()
    ld = grad.stride(0) if t > 1 else v
    with torch.cuda.device(grad.device):
        _thdpack._cuda_scale_grad(_DTYPES[grad.dtype], grad.data_ptr(), t, v, ld, f.data_ptr(),
                                  torch.cuda.current_stream(grad.device).cuda_stream)
    return grad


def logprob_grad(logits, target, lse, entropy, g_logprob, g_entropy, inv_temp):
    """The gradient of per-row (log-probability, entropy) with respect to ``logits`` (a tensor of
    their dtype) by LogprobEntropyBackward (thdpack/cuda_loss.h): target [T] int64 (a column of
    these logits or -1), lse, entropy, g_logprob, g_entropy [T] (made float32 here), on torch's
    current stream."""
    f32 = [x.to(torch.float32).contiguous() for x in (lse, entropy, g_logprob, g_entropy)]
    target = target.to(torch.int64).contiguous()
    t, v = logits.shape
    ld = logits.stride(0) if t > 1 else v  # the kernel's one row stride, the gradient's too
    grad = torch.empty_strided((t, v), (ld, 1), dtype=logits.dtype, device=logits.device)
    _thdpack._cuda_logprob_grad(_DTYPES[logits.dtype], logits.data_ptr(), t, v, ld,
                                target.data_ptr(), *(x.data_ptr() for x in f32),
                                float(inv_temp), grad.data_ptr(),
                                torch.cuda.current_stream(logits.device).cuda_stream)
    return grad
