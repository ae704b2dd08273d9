"""Per-token log-probabilities and entropy on CP (and TP) shards, for RL trainers (docs/loss.md,
"Log-probs and entropy").

``token_logprobs(logits, mb, temperature=1.0, entropy=False)`` is what verl's
``logprobs_from_logits`` and ``entropy_from_logits`` (and, with TP, Megatron's
``vocab_parallel_log_probs_from_logits`` / verl's ``vocab_parallel_entropy``) give, on a
microbatch of a packed step: label-aligned [T/CP] like ``mb["loss_mask"]`` (in the step's label
format), 0 where a position has no target. Differentiable in both outputs; the softmax is never
held beyond a chunk of rows: the forward keeps three numbers a row (max, sum of exponentials, the
expected logit) and the backward recomputes each chunk's softmax.
``linear_token_logprobs(hidden, weight, mb, ...)`` does the same from hidden states [T/CP, H] and
the output layer [V, H] (or its vocabulary slice), never holding more than a chunk of logits.
``per_token(values, mb)``: per-sequence values [n] spread to the microbatch's tokens.
"""
import torch
import torch.distributed as dist

from ._loss_common import IGNORE_INDEX, _accumulation_dtype

# Rows per chunk when none is given: chunk x V elements of the accumulation dtype, ~64 MiB.
_CHUNK_BYTES = 64 << 20


def _rows_per_chunk(t, v, dtype, chunk_tokens):
    """Rows per chunk: chunk_tokens, or about _CHUNK_BYTES of the accumulation dtype of inputs
    of ``dtype`` a chunk of v columns."""
    if chunk_tokens is not None:
        if int(chunk_tokens) < 1:
            raise ValueError(f"chunk_tokens = {chunk_tokens}: must be >= 1")
        return int(chunk_tokens)
    elem = 8 if dtype == torch.float64 else 4  # _accumulation_dtype's element size
    return max(1, min(t, _CHUNK_BYTES // max(1, v * elem)))


def _targets(mb, t):
    """(labels int64 [T], source row of each label [T], counted bool [T]) of this shard: the
    label at position o predicts from logits row o (thdpack's shifted labels), or from row o-1
    (label_format="hf": Hugging Face's unshifted labels, position 0 of each sequence has none)."""
    labels = mb.get("labels") if isinstance(mb, dict) else None
    if labels is None:
        raise ValueError("mb['labels'] is None: log-probs are computed on the last pipeline "
                         "stage, which holds the labels")
    if labels.shape != (t,):
        raise ValueError(f"logits: {t} rows, the microbatch's shard holds {labels.shape[0]} "
                         f"labels (logits are [T/CP, V])")
    labels = labels.long()
    rows = torch.arange(t, device=labels.device)
    if mb.get("label_format", "megatron") == "hf":
        rows = rows - 1  # labels[0] is IGNORE_INDEX: each sequence's first position
    counted = labels != IGNORE_INDEX
    return labels, rows.clamp(min=0), counted


def _tp(tp_group):
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return None, 0, 1
    return tp_group, dist.get_rank(tp_group), dist.get_world_size(tp_group)


def _all_reduce(x, group, op=dist.ReduceOp.SUM):
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


class _TokenLogprobs(torch.autograd.Function):
    """Per-token (logprob, entropy) of rows produced chunk by chunk: ``logits_of(a, b)`` gives
    rows [a, b) of this rank's logits (a slice, or hidden @ weight.T); ``grad_of`` turns each
    chunk's logit gradient into the inputs' gradients."""

    @staticmethod
    def forward(ctx, producer, inv_temp, labels, rows, counted, tp, chunk, *inputs):
        group, rank, _ = tp
        logits_of = producer.logits_of
        t = labels.shape[0]
        acc = producer.acc
        dev = labels.device
        v = producer.columns
        start = rank * v  # Megatron's contiguous equal vocabulary slices, in TP-rank order
        m = torch.empty(t, dtype=acc, device=dev)
        s = torch.empty(t, dtype=acc, device=dev)
        ez = torch.empty(t, dtype=acc, device=dev)
        picked = torch.zeros(t, dtype=acc, device=dev)
        for a in range(0, t, chunk):
            b = min(t, a + chunk)
            z = logits_of(a, b).to(acc) * inv_temp  # [b-a, V/TP]
            mx = z.max(dim=1).values
            m[a:b] = mx
        _all_reduce(m, group, dist.ReduceOp.MAX)
        for a in range(0, t, chunk):
            b = min(t, a + chunk)
            z = logits_of(a, b).to(acc) * inv_temp
            e = torch.exp(z - m[a:b, None])
            s[a:b] = e.sum(dim=1)
            ez[a:b] = (e * z).sum(dim=1)
        _all_reduce(s, group)
        _all_reduce(ez, group)
        # The label's logit: from the row that predicts it, on the TP rank that holds its column.
        lab = labels - start
        mine = counted & (lab >= 0) & (lab < v)
        for a in range(0, t, chunk):
            b = min(t, a + chunk)
            sel = mine[a:b].nonzero().flatten() + a
            if sel.numel() == 0:
                continue
            lo, hi = int(rows[sel].min()), int(rows[sel].max()) + 1
            z = logits_of(lo, hi).to(acc) * inv_temp
            picked[sel] = z[rows[sel] - lo, lab[sel]]
        _all_reduce(picked, group)
        lse = m + torch.log(s)
        mean_z = ez / s
        # A target's log-prob is that of its predicting row; a row's entropy is its own.
        logprob = torch.where(counted, picked - lse[rows], torch.zeros_like(picked))
        entropy = torch.where(counted, lse[rows] - mean_z[rows], torch.zeros_like(picked))
        ctx.producer, ctx.inv_temp, ctx.tp, ctx.chunk = producer, inv_temp, tp, chunk
        ctx.save_for_backward(labels, rows, counted, m, s, mean_z, *inputs)
        return logprob, entropy

    @staticmethod
    def backward(ctx, g_lp, g_en):
        labels, rows, counted, m, s, mean_z, *inputs = ctx.saved_tensors
        producer, inv_temp, chunk = ctx.producer, ctx.inv_temp, ctx.chunk
        rank = ctx.tp[1]
        t = labels.shape[0]
        v = producer.columns
        acc = m.dtype
        zero = torch.zeros((), dtype=acc, device=m.device)
        g_lp = zero.expand(t) if g_lp is None else torch.where(counted, g_lp.to(acc), zero)
        g_en = zero.expand(t) if g_en is None else torch.where(counted, g_en.to(acc), zero)
        # Onto the rows that predict: row r gets the gradients of the targets it predicts.
        g_lp_row = torch.zeros(t, dtype=acc, device=m.device).index_add_(0, rows, g_lp)
        g_en_row = torch.zeros(t, dtype=acc, device=m.device).index_add_(0, rows, g_en)
        lab_row = torch.full((t,), -1, dtype=torch.long, device=m.device)
        lab = labels - rank * v
        mine = counted & (lab >= 0) & (lab < v)
        lab_row[rows[mine]] = lab[mine]
        if getattr(producer, "kernel", False):
            # thdpack's kernel: each logit read once, its gradient written once (fp32 math).
            lse = m + torch.log(s)
            return (None,) * 7 + (producer.kernel_grad(
                lab_row, lse, lse - mean_z, g_lp_row, g_en_row, inv_temp),)
        producer.begin_backward(inputs)
        for a in range(0, t, chunk):
            b = min(t, a + chunk)
            z = producer.logits_of(a, b).to(acc) * inv_temp
            p = torch.exp(z - m[a:b, None]) / s[a:b, None]
            # d logp / dz = onehot - p;  d H / dz = p * (E_p[z] - z)
            g = -p * g_lp_row[a:b, None] + p * (mean_z[a:b, None] - z) * g_en_row[a:b, None]
            hit = (lab_row[a:b] >= 0).nonzero().flatten()
            if hit.numel():
                g[hit, lab_row[a + hit]] += g_lp_row[a + hit]
            producer.add_grad(a, b, g * inv_temp)
        grads = producer.end_backward()
        return (None, None, None, None, None, None, None) + tuple(grads)


class _LogitsRows:
    """Rows of a logits tensor, and its gradient written chunk by chunk (or, with ``kernel``,
    by thdpack's CUDA kernel in one pass)."""

    def __init__(self, logits, kernel=False):
        self.logits = logits
        self.columns = logits.shape[1]
        self.acc = _accumulation_dtype(logits)
        self.kernel = kernel

    def kernel_grad(self, target, lse, entropy, g_lp, g_en, inv_temp):
        """The logits' gradient by LogprobEntropyBackward (None when they need none)."""
        if not self.logits.requires_grad:
            return None
        from ._loss_cuda import logprob_grad
        return logprob_grad(self.logits, target, lse, entropy, g_lp, g_en, inv_temp)

    def logits_of(self, a, b):
        return self.logits[a:b]

    def begin_backward(self, inputs):
        self.grad = torch.zeros_like(self.logits) if self.logits.requires_grad else None

    def add_grad(self, a, b, g):
        if self.grad is not None:
            self.grad[a:b] = g.to(self.grad.dtype)

    def end_backward(self):
        return (self.grad,)


class _LinearRows:
    """Rows of hidden @ weight.T, computed chunk by chunk; the gradients of hidden and weight."""

    def __init__(self, hidden, weight):
        self.hidden, self.weight = hidden, weight
        self.columns = weight.shape[0]
        self.acc = _accumulation_dtype(hidden)

    def logits_of(self, a, b):
        return self.hidden[a:b] @ self.weight.t()

    def begin_backward(self, inputs):
        h, w = self.hidden, self.weight
        acc = _accumulation_dtype(h)
        self.gh = torch.zeros_like(h) if h.requires_grad else None
        self.gw = torch.zeros(w.shape, dtype=acc, device=w.device) if w.requires_grad else None

    def add_grad(self, a, b, g):
        if self.gh is not None:
            self.gh[a:b] = (g @ self.weight.to(g.dtype)).to(self.gh.dtype)
        if self.gw is not None:
            self.gw += g.t() @ self.hidden[a:b].to(g.dtype)

    def end_backward(self):
        gw = None if self.gw is None else self.gw.to(self.weight.dtype)
        return (self.gh, gw)


def _check_temperature(temperature):
    t = float(temperature)
    if not (t > 0) or t == float("inf"):
        raise ValueError(f"temperature = {temperature}: must be a finite number > 0")
    return 1.0 / t


def token_logprobs(logits, mb, temperature=1.0, entropy=False, *, tp_group=None,
                   chunk_tokens=None, backend="auto"):
    """Per-token log-probability of each label of the microbatch's shard, label-aligned [T/CP]
    like ``mb["loss_mask"]`` (0 where a position has no target), of ``logits / temperature``;
    with ``entropy=True`` the tuple ``(logprobs, entropy)``, the entropy of the distribution that
    predicts each target (0 where none). Differentiable in both.

    logits: this rank's [T/CP, V] (any float dtype; accumulated in float32, float64 for float64
    logits, which is also the outputs' dtype). With ``tp_group`` (size > 1) they are
    vocab-parallel [T/CP, V/TP]: Megatron's contiguous equal vocabulary slices in TP-rank order;
    one all-reduce of three numbers a row and one of the picked logit, and the gradient is that
    of this rank's columns. With ``label_format="hf"`` the label at position o is predicted by
    row o - 1, as Hugging Face's models shift. ``chunk_tokens``: rows per chunk (default: about
    64 MiB of the accumulation dtype a chunk). ``backend``: the backward's - "torch" (chunked),
    "cuda" (thdpack's kernel, thdpack/cuda_loss.h LogprobEntropyBackward: each logit read once
    and its gradient written once, for CUDA float32, bfloat16 or float16 logits; an error saying
    why otherwise) or "auto" (the kernel where it takes the logits once it is the default, as the
    loss's: docs/loss.md "On the GPU"; the chunked path until then)."""
    inv = _check_temperature(temperature)
    if backend not in ("auto", "torch", "cuda"):
        raise ValueError(f"backend = {backend!r}: expected 'auto', 'torch' or 'cuda'")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or \
            not logits.dtype.is_floating_point:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits: expected a floating-point [T/CP, V] tensor, got {got}")
    labels, rows, counted = _targets(mb, logits.shape[0])
    labels, rows, counted = (x.to(logits.device) for x in (labels, rows, counted))
    tp = _tp(tp_group)
    _check_vocab(labels, counted, logits.shape[1] * tp[2])
    chunk = _rows_per_chunk(logits.shape[0], logits.shape[1], logits.dtype, chunk_tokens)
    from . import _loss_cuda
    takes = _loss_cuda.kernel_takes(logits)
    if backend == "cuda" and not takes:
        raise ValueError(f"backend='cuda': {_loss_cuda.why_not(logits)}")
    kernel = backend == "cuda" or (backend == "auto" and takes
                                   and _loss_cuda.CUDA_KERNEL_BY_DEFAULT)
    lp, en = _TokenLogprobs.apply(_LogitsRows(logits, kernel), inv, labels, rows, counted, tp,
                                  chunk, logits)
    return (lp, en) if entropy else lp


def linear_token_logprobs(hidden, weight, mb, temperature=1.0, entropy=False, *, tp_group=None,
                          chunk_tokens=None):
    """``token_logprobs`` of ``hidden @ weight.T`` without holding the logits: hidden
    [T/CP, H], weight [V, H] (with ``tp_group``, this rank's vocabulary slice [V/TP, H]). The
    gradients of hidden and weight are made chunk by chunk in the backward."""
    inv = _check_temperature(temperature)
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.dtype.is_floating_point:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected a floating-point 2-D tensor, got {got}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [T, {hidden.shape[1]}] and weight [V, {weight.shape[1]}]: "
                         f"the hidden sizes differ")
    labels, rows, counted = _targets(mb, hidden.shape[0])
    labels, rows, counted = (x.to(hidden.device) for x in (labels, rows, counted))
    tp = _tp(tp_group)
    _check_vocab(labels, counted, weight.shape[0] * tp[2])
    chunk = _rows_per_chunk(hidden.shape[0], weight.shape[0], hidden.dtype, chunk_tokens)
    lp, en = _TokenLogprobs.apply(_LinearRows(hidden, weight), inv, labels, rows, counted, tp,
                                  chunk, hidden, weight)
    return (lp, en) if entropy else lp


def _check_vocab(labels, counted, vocab):
    bad = counted & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"mb['labels'][{i}] = {int(labels[i])}: a label must lie in "
                         f"[0, {vocab}) (the vocabulary of the logits)")


def per_token(values, mb):
    """Per-sequence ``values`` ([n] or [n, *row], one per packed sequence of the microbatch, in
    ``mb["sample_ids"]`` order) spread to this rank's tokens: [T/CP] (or [T/CP, *row]) holding
    each real token's sequence's value and 0 on padding - a GRPO advantage on every token of its
    rollout, label-aligned like ``mb["loss_mask"]``. Differentiable in ``values``."""
    if not isinstance(values, torch.Tensor):
        values = torch.as_tensor(values)
    n = len(mb["sample_ids"])
    if values.dim() < 1 or values.shape[0] != n:
        raise ValueError(f"values: expected one per packed sequence ({n}), got shape "
                         f"{tuple(values.shape)}")
    seq = mb["seq_index"].to(values.device).long()
    keep = (seq >= 0).reshape((-1,) + (1,) * (values.dim() - 1))
    picked = values[seq.clamp(min=0)] if n else values.new_zeros((seq.shape[0],) +
                                                                   tuple(values.shape[1:]))
    return torch.where(keep, picked, torch.zeros_like(picked))
