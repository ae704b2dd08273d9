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
per-sequence sums and the statistics (loss, ppl, entropy) are defined by C++
(thdpack._thdpack.LossTotals: AccumulateShardLoss, ReduceSequencesOverCp, Finalize of
thdpack/loss.h), with torch.distributed as the transport of the all-reduces. Per-token values
on the CPU go to C++ through NumPy; values on a GPU are summed per sequence and CP-reduced on
the GPU (_stats_device: the same definition, checked against C++), and only six sums per
LossStatistics reach the host, in summary().

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
from ._loss_common import IGNORE_INDEX, _accumulation_dtype, _check_inputs  # noqa: F401
from ._loss_cpu import _per_token_cpu
from ._loss_cpu import empty_grad_cache, grad_cache_info, set_grad_cache  # noqa: F401 (API)
from . import _loss_cuda
from . import _stats_device
from ._loss_torch import _per_token_chunked
from .sharding import _cu


_BACKENDS = ("auto", "cpu", "cuda", "torch")


def _backend_of(logits, backend, chunked, inplace):
    """The backend a call runs: "cpu" (the C++ kernel), "cuda" (the CUDA kernel) or "torch"
    (chunked torch operations)."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend = {backend!r}: expected one of {_BACKENDS}")
    if chunked:
        if backend not in ("auto", "torch"):
            raise ValueError(f"chunked=True is the torch backend, not {backend!r}")
        backend = "torch"
    if backend == "auto":
        if logits.device.type == "cpu":
            backend = "cpu"
        elif _loss_cuda.CUDA_KERNEL_BY_DEFAULT and _loss_cuda.kernel_takes(logits):
            backend = "cuda"
        else:
            backend = "torch"
    if backend == "cpu" and logits.device.type != "cpu":
        raise ValueError(f"backend 'cpu': the logits are on {logits.device}")
    if backend == "cuda" and not _loss_cuda.kernel_takes(logits):
        raise ValueError(f"backend 'cuda': {_loss_cuda.why_not(logits)}")
    if inplace and backend != "cuda":
        raise ValueError("inplace=True writes the gradient over the logits: the CUDA kernel "
                         f"only (backend 'cuda'), not {backend!r}")
    return backend


def _per_token(logits, labels, loss_mask, n, want_grad, grad_factor, chunked, chunk_tokens,
               backend="auto", inplace=False, validate=True, tp=None, checked=False):
    """(logprob, entropy, counted, grad): per-token values of the whole shard, float64 on the
    CPU kernel, float32 on the CUDA kernel, the accumulation dtype on the chunked path; grad
    None unless want_grad (the logits themselves with inplace). checked: the caller has checked
    the labels' and mask's values and N (linear_loss, once for all its chunks): nothing here
    reads the device back."""
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits: expected a [T, V] tensor, got {type(logits).__name__}")
    backend = _backend_of(logits, backend, chunked, inplace)
    tp_group, vocab_start, vocab_total = tp if tp is not None else (None, 0, 0)
    if tp_group is not None and backend != "cuda":
        raise ValueError("tp_group (vocab-parallel logits) needs backend 'cuda'")
    # The CUDA kernel checks the values on the device (validate), without a second sync.
    labels, loss_mask, counted, n_valid = _check_inputs(
        logits, labels, loss_mask, check_values=backend != "cuda" and not checked)
    if tp_group is not None and not (0 <= vocab_start and
                                     vocab_start + logits.shape[1] <= vocab_total):
        raise ValueError(f"vocab_start = {vocab_start}: this rank's {logits.shape[1]} columns "
                         f"must lie within vocab_total = {vocab_total}")
    scale = grad_factor / n if n else 0.0
    if backend == "cuda":
        logprob, entropy, counted, grad, n_valid = _loss_cuda.per_token_cuda(
            logits, labels, loss_mask, want_grad, scale, inplace, validate and not checked,
            tp_group, vocab_start, vocab_total)
    if n is not None and n_valid is not None and n < n_valid:
        # the share: N is global, never below this shard's count
        raise ValueError(f"n_loss_tokens = {n} is smaller than this shard's counted tokens "
                         f"({n_valid}): N must be the GLOBAL loss-token count of the step")
    if backend == "cuda":
        return logprob, entropy, counted, grad
    if backend == "cpu":
        return _per_token_cpu(logits, labels, loss_mask, n or 0, want_grad, grad_factor,
                              chunk_tokens)
    logprob, entropy, grad = _per_token_chunked(logits, labels, counted, want_grad, scale,
                                                chunk_tokens)
    return logprob, entropy, counted, grad


class _LocalLoss(torch.autograd.Function):
    """The share and its gradient, made in the forward pass into one buffer."""

    @staticmethod
    def forward(ctx, logits, labels, loss_mask, n, grad_factor, chunked, chunk_tokens, want_grad,
                backend, inplace, validate, tp, token_values):
        scale = float(grad_factor) / n if n > 0 else 0.0
        logprob, entropy, counted, grad = _per_token(logits, labels, loss_mask, n, want_grad,
                                                     float(grad_factor), chunked, chunk_tokens,
                                                     backend, inplace, validate, tp)
        if token_values is not None:  # the same pass feeds the statistics (add_shard)
            token_values.update(logprob=logprob, entropy=entropy, counted=counted)
        ctx.grad = grad
        acc = _accumulation_dtype(logits)
        # Summed in float64 (the CPU kernel's values are float64 already).
        total = logprob.sum(dtype=torch.float64).to(device=logits.device, dtype=acc)
        return -total * scale

    @staticmethod
    def backward(ctx, grad_output):
        grad = ctx.grad
        if grad is None:
            raise RuntimeError("local_loss: backward ran twice; the gradient buffer was handed "
                               "to autograd the first time (call local_loss again)")
        ctx.grad = None  # autograd may take the buffer as logits.grad without a copy
        if grad.device.type == "cpu":
            if float(grad_output) != 1.0:
                grad.mul_(grad_output.to(grad.dtype))
        elif _loss_cuda.kernel_takes(grad):
            # grad_output read on the device: no pass over the gradient when it is 1 (the
            # common loss.backward()), and no synchronisation either way.
            _loss_cuda.scale_grad(grad, grad_output)
        else:
            grad.mul_(grad_output.to(grad.dtype))
        return grad, None, None, None, None, None, None, None, None, None, None, None, None


def local_loss(logits, labels, loss_mask, n_loss_tokens, grad_factor=1.0, *, chunked=False,
               chunk_tokens=None, backend="auto", inplace=False, validate=True, tp_group=None,
               vocab_start=0, vocab_total=0, token_values=None):
    """This (dp, cp) rank's share of the step loss: -sum(counted log p) / N * grad_factor.

    n_loss_tokens: N, the GLOBAL loss-token count of the step (thdpack metadata). The shares
    summed over DP x CP (and microbatches) equal the step loss L, and so do their gradients;
    pass grad_factor = dp_size * cp_size when the framework averages gradients. N == 0 gives a
    zero loss (and zero gradients), never a division by zero; N below this shard's own count of
    loss tokens is a ValueError (N is global). With a dynamic step (PackedDataIterator,
    scheduler="dynamic") the same holds whatever CP group each microbatch had: the share takes
    no group.

    An autograd function: the gradient is made in the forward pass (when logits require it),
    in the logits' dtype, and handed to autograd in backward (which therefore runs once per
    call). backend: "auto" (CPU float32/bfloat16/float64 logits: the C++ kernel; other devices
    and dtypes: the chunked torch path), "cpu", "torch" (the chunked path; chunked=True says the
    same), or "cuda": thdpack's CUDA kernel (float32, bfloat16, float16 CUDA logits with unit
    column stride), where inplace=True writes the gradient over the logits (they are consumed:
    no copy of the logits' size is made) and validate=False skips the one device-to-host read
    that turns a bad label or mask into a ValueError (then nothing synchronises and the call can
    be captured in a CUDA graph; bad inputs give undefined values). With tp_group (the CUDA
    kernel), the logits are this TP rank's columns [vocab_start, vocab_start + V) of
    vocab_total: each row's partial state (16 bytes) is all-gathered over tp_group once and
    merged, and the gradient is that of this rank's columns. token_values: a dict that gets
    the pass's per-token logprob, entropy and counted tensors, for
    LossStatistics.add_shard(..., token_values=...) without a second pass over the logits (the
    only way with inplace=True, which consumes them). chunk_tokens sets the
    chunked path's rows per chunk (default: two float32 chunk buffers within 1/8 of the logits'
    bytes). The share is float32 (float64 for float64 logits) on the logits' device.
    """
    n = int(n_loss_tokens)
    if n < 0:
        raise ValueError(f"n_loss_tokens = {n}: must be >= 0")
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits: expected a [T, V] tensor, got {type(logits).__name__}")
    # No gradient buffer under torch.no_grad() or for logits that do not require one.
    want_grad = torch.is_grad_enabled() and logits.requires_grad
    tp = None if tp_group is None else (tp_group, int(vocab_start), int(vocab_total))
    if token_values is not None and not isinstance(token_values, dict):
        raise ValueError(f"token_values: expected a dict to fill, got "
                         f"{type(token_values).__name__}")
    return _LocalLoss.apply(logits, labels, loss_mask, n, float(grad_factor), bool(chunked),
                            chunk_tokens, want_grad, backend, bool(inplace), bool(validate), tp,
                            token_values)


def token_statistics(logits, labels, loss_mask=None, *, chunked=False, chunk_tokens=None,
                     backend="auto"):
    """Per-token (logprob, entropy, counted) of local logits [T, V] (any device and float dtype).

    logprob = log p(label) and entropy = -sum p log p, both 0 where the token is not counted;
    counted: bool [T]. Accumulated in float32 (float64 for float64 logits); float64 tensors on
    the CPU (the C++ kernel's output), the accumulation dtype elsewhere (float32 from the CUDA
    kernel, backend="cuda"). Not differentiable: local_loss is the differentiable share.
    ValueError for a counted label outside [0, V) or a loss_mask value other than 0/1.
    """
    with torch.no_grad():
        logprob, entropy, counted, _ = _per_token(logits, labels, loss_mask, None, False, 0.0,
                                                  chunked, chunk_tokens, backend)
    return logprob, entropy, counted


def _torch_all_reduce(group, device):
    """A float64 NumPy all-reduce (sum, in place) over `group` through torch.distributed."""
    def all_reduce(a):
        t = torch.from_numpy(a).to(device)
        dist.all_reduce(t, group=group)
        a[:] = t.cpu().numpy()
    return all_reduce


def _host_values(logprob, entropy, counted, cp_size, cp_group):
    """A shard's values as NumPy arrays for C++ (float64 log-probs and entropies, the counted
    flags) and the CP all-reduce C++ calls (None at CP = 1)."""
    f64 = torch.float64
    lp = logprob.to(device="cpu", dtype=f64).contiguous().numpy()
    en = entropy.to(device="cpu", dtype=f64).contiguous().numpy()
    ct = counted.to("cpu").contiguous().numpy()
    reduce = _torch_all_reduce(cp_group, logprob.device) if cp_size > 1 else None
    return lp, en, ct, reduce


class LossStatistics:
    """Step statistics that do not depend on CP, DP or the microbatching.

    Call add_shard once per microbatch on every (dp, cp) rank of the last pipeline stage (one TP
    rank only), then summary(group) with the DP x CP group (None: this process only). The
    figures are C++'s (thdpack/loss.h: AccumulateShardLoss, ReduceSequencesOverCp, Finalize),
    made on the host for CPU values; for values on a GPU, the per-sequence sums, their CP
    reduction and the additive sums are made on the device (same definition, in
    _stats_device) and reach C++ once, in summary().
    """

    def __init__(self):
        self._totals = _thdpack.LossTotals()
        self._device_sums = None  # float64 [6] on the device of the values on_device
        # By source (a blend's microbatches carry "sources"): float64 [D, 6] sums, on the host
        # and on the device of the values on_device.
        self._by_source = None
        self._device_by_source = None

    def add_shard(self, logits, labels, loss_mask, cu_seqlens, cu_seqlens_padded,
                  cp_size=1, cp_rank=0, cp_group=None, *, chunked=False, chunk_tokens=None,
                  token_values=None, on_device=None, sources=None):
        """Adds CP rank cp_rank's shard of one packed microbatch.

        cu_seqlens, cu_seqlens_padded: the microbatch's GLOBAL offsets [n+1] (host arrays, or
        tensors: a device tensor is read back, which waits for the device). With cp_size > 1,
        cp_group (the CP process group) is required: per-sequence sums are all-reduced over it
        (no rank holds a whole sequence). token_values: the dict local_loss(...,
        token_values=d) filled in its pass over these logits: its per-token values are used and
        the logits are not read again (logits may then be None). on_device: make the sums where
        the per-token values are, without moving them to the host or waiting for the device
        (None: when they are not on the CPU); False: C++ on the host. sources: [n] ints,
        each sequence's source (a blend: the microbatch's "sources"): the statistics are then
        also kept by source (summary()["sources"]), with the same one CP all-reduce.
        """
        if cp_size > 1 and cp_group is None:
            raise ValueError("add_shard: cp_size > 1 needs cp_group (per-sequence sums are "
                             "all-reduced over the CP group)")
        cu = _cu(cu_seqlens)
        cup = _cu(cu_seqlens_padded)
        if token_values is not None:
            if not isinstance(token_values, dict):
                raise ValueError(f"token_values: expected the dict local_loss filled, got "
                                 f"{type(token_values).__name__}")
            try:
                logprob, entropy, counted = (token_values[k] for k in
                                             ("logprob", "entropy", "counted"))
            except KeyError as e:
                raise ValueError(f"token_values: no {e.args[0]!r}: pass the dict local_loss("
                                 f"..., token_values=d) filled") from None
        else:
            logprob, entropy, counted = token_statistics(logits, labels, loss_mask,
                                                         chunked=chunked,
                                                         chunk_tokens=chunk_tokens)
        for name, x in (("logprob", logprob), ("entropy", entropy), ("counted", counted)):
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"token_values: {name} is a {type(x).__name__}: expected the "
                                 f"tensor local_loss put there")
        # Statistics are not differentiable: values that require grad are read detached.
        logprob, entropy, counted = logprob.detach(), entropy.detach(), counted.detach()
        if on_device is None:
            on_device = logprob.device.type != "cpu"
        if sources is not None:
            self._add_by_source(logprob, entropy, counted, cu, cup, cp_size, cp_rank, cp_group,
                                sources, on_device)
            return
        if on_device:
            local_cu, n_real = _stats_device.shard_layout(cu, cup, cp_size, cp_rank)
            self._add_device_sums(_stats_device.shard_sums(
                logprob, entropy, counted, local_cu, n_real, int(cp_size), int(cp_rank),
                cp_group))
            return
        lp, en, ct, reduce = _host_values(logprob, entropy, counted, cp_size, cp_group)
        self._totals.add_shard(lp, en, ct, cu, cup, int(cp_size), int(cp_rank), reduce)

    def _add_device_sums(self, sums):
        """Adds a shard's six sums (a float64 device tensor) to the device totals."""
        if self._device_sums is None:
            self._device_sums = sums
        elif self._device_sums.device != sums.device:
            raise ValueError(f"add_shard: these values are on {sums.device}, earlier ones "
                             f"on {self._device_sums.device}: one device per statistics")
        else:
            self._device_sums += sums

    def _add_by_source(self, logprob, entropy, counted, cu, cup, cp_size, cp_rank, cp_group,
                       sources, on_device):
        """The by-source sums of a shard; the totals are their sum over sources."""
        src = np.ascontiguousarray(np.asarray(sources), dtype=np.int64).reshape(-1)
        if on_device:
            rows = _stats_device.shard_sums_by_source(logprob, entropy, counted, cu, cup,
                                                      int(cp_size), int(cp_rank), cp_group, src)
            self._device_by_source = _grow_add(self._device_by_source, rows)
            self._add_device_sums(rows.sum(0))
            return
        lp, en, ct, reduce = _host_values(logprob, entropy, counted, cp_size, cp_group)
        rows = _thdpack.shard_sums_by_source(lp, en, ct, cu, cup, int(cp_size), int(cp_rank),
                                             src.astype(np.int32), reduce)
        self._by_source = _grow_add(self._by_source, rows)
        self._totals.add_sums(rows.sum(0))

    def add_microbatch(self, logits, mb, *, chunked=False, chunk_tokens=None,
                       token_values=None, on_device=None):
        """add_shard with one of PackedDataIterator's microbatches (a dict): its labels,
        loss_mask, offsets (the host copies: nothing waits for the device) and CP group
        (cp_size, cp_rank, cp_group: the topology's for a static step, the microbatch's own for
        a dynamic one). An idle microbatch (a dynamic step's rank in no group) adds nothing; its
        logits must have no rows."""
        if mb.get("idle", False):
            if logits is not None and logits.shape[0] != 0:
                raise ValueError(f"add_microbatch: the microbatch is idle on this rank, but the "
                                 f"logits have {logits.shape[0]} rows")
            return
        cu = mb.get("cu_seqlens_cpu", mb["cu_seqlens"])
        cup = mb.get("cu_seqlens_padded_cpu", mb["cu_seqlens_padded"])
        self.add_shard(logits, mb["labels"], mb["loss_mask"], cu, cup, cp_size=mb["cp_size"],
                       cp_rank=mb["cp_rank"], cp_group=mb["cp_group"], chunked=chunked,
                       chunk_tokens=chunk_tokens, token_values=token_values,
                       on_device=on_device, sources=mb.get("sources"))

    def summary(self, group=None):
        """{'n_tokens', 'n_loss_tokens', 'loss', 'ppl', 'entropy'} over everything added on every
        rank of `group` (all-reduced when a group is given). Sums made on a device come to the
        host here, once. When shards were added with their sources (a blend), 'sources' holds
        the same figures per source, [D] in the blend's order: each with the invariance of the
        totals (every rank of `group` calls summary, as for the totals)."""
        totals = self._totals.copy()
        if self._device_sums is not None:
            totals.add_sums(self._device_sums.cpu().numpy())
        device = "cpu"
        if group is not None:
            if dist.get_backend(group) == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            totals.all_reduce(_torch_all_reduce(group, device))
        out = totals.summary()
        rows = self._by_source
        if self._device_by_source is not None:
            rows = _grow_add(rows, self._device_by_source.cpu().numpy())
        if group is not None:
            # The ranks agree on D (one may never have seen the last sources), then sum.
            d = torch.tensor([0 if rows is None else rows.shape[0]], dtype=torch.int64,
                             device=device)
            dist.all_reduce(d, op=dist.ReduceOp.MAX, group=group)
            d = int(d.item())
            if d == 0:
                return out
            full = np.zeros((d, 6))
            if rows is not None:
                full[:rows.shape[0]] = rows
            t = torch.from_numpy(full).to(device)
            dist.all_reduce(t, group=group)
            rows = t.cpu().numpy()
        if rows is not None:
            per = []
            for r in rows:
                one = _thdpack.LossTotals()
                one.add_sums(r)
                per.append(one.summary())
            out["sources"] = per
        return out


def _grow_add(acc, rows):
    """acc + rows, each [D, 6], the shorter padded with zero rows (NumPy or torch)."""
    if acc is None:
        return rows.copy() if isinstance(rows, np.ndarray) else rows.clone()
    if rows.shape[0] > acc.shape[0]:
        if isinstance(acc, np.ndarray):
            acc = np.vstack([acc, np.zeros((rows.shape[0] - acc.shape[0], 6))])
        else:
            acc = torch.cat([acc, acc.new_zeros((rows.shape[0] - acc.shape[0], 6))])
    acc[:rows.shape[0]] += rows
    return acc
