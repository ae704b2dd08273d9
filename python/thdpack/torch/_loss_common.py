"""thdpack.torch._loss_common: what every backend of thdpack.torch.loss shares - the input
checks, the accumulation dtype and the chunk size of the paths that stage rows in float32."""
import torch

from .. import _thdpack

IGNORE_INDEX = _thdpack.IGNORE_INDEX

# Extra memory of the chunked path: its two float32 (float64) chunk buffers stay within this
# fraction of the logits' bytes (and at least one token per chunk).


_CHUNK_FRACTION = 8


def _accumulation_dtype(logits):
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _check_inputs(logits, labels, loss_mask, check_values=True, vocab=None):
    """Shapes; labels and mask on the logits' device; with check_values (one device sync) the
    label range [0, vocab) (vocab: the logits' V unless given, e.g. the whole vocabulary of
    vocab-parallel columns) and the mask's 0/1 values, and the counted tokens. Returns (labels,
    loss_mask, counted, n_valid); n_valid is None without check_values."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits: expected a [T, V] tensor, got {shape}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits: expected a floating-point tensor, got {logits.dtype}")
    t, v = logits.shape
    if v < 1:
        raise ValueError(f"logits: V = {v} columns: expected at least one")
    if vocab is None:
        vocab = v
    if not isinstance(labels, torch.Tensor) or labels.shape != (t,):
        got = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"labels: expected a tensor of shape ({t},), got {got}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels: expected an integer tensor, got {labels.dtype}")
    labels = labels.to(device=logits.device, dtype=torch.int64).contiguous()
    counted = labels != IGNORE_INDEX
    if loss_mask is not None:
        if not isinstance(loss_mask, torch.Tensor) or loss_mask.shape != (t,):
            got = (tuple(loss_mask.shape) if isinstance(loss_mask, torch.Tensor)
                   else type(loss_mask).__name__)
            raise ValueError(f"loss_mask: expected a tensor of shape ({t},), got {got}")
        loss_mask = loss_mask.to(logits.device)
        counted = counted & (loss_mask != 0)
    if not check_values:
        return labels, loss_mask, counted, None
    bad_label = counted & ((labels < 0) | (labels >= vocab))
    checks = [counted.sum(), bad_label.any().long()]
    if loss_mask is not None:
        bad_mask = (loss_mask != 0) & (loss_mask != 1)
        checks.append(bad_mask.any().long())
    # One device sync, for a clear error instead of a wrong loss, and the counted tokens.
    n_valid, any_label, *any_mask = (int(x) for x in torch.stack(checks).tolist())
    if any(any_mask):
        i = int(bad_mask.nonzero()[0])
        raise ValueError(f"loss_mask[{i}] = {float(loss_mask[i])}: must be 0 or 1")
    if any_label:
        i = int(bad_label.nonzero()[0])
        raise ValueError(f"labels[{i}] = {int(labels[i])}: a counted label must lie in "
                         f"[0, {vocab})")
    return labels, loss_mask, counted, n_valid


def _chunk_rows(logits, chunk_tokens):
    t, v = logits.shape
    if chunk_tokens is not None:
        if int(chunk_tokens) < 1:
            raise ValueError(f"chunk_tokens = {chunk_tokens}: must be >= 1")
        return int(chunk_tokens)
    acc = 8 if logits.dtype == torch.float64 else 4
    budget = t * v * logits.element_size() // _CHUNK_FRACTION  # bytes for the two buffers
    return max(1, budget // (2 * v * acc))
