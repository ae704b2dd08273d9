"""thdpack.torch.seqloss: per-sequence reductions and post-training loss aggregation on CP shards.

Every function takes this rank's per-token values of one microbatch ([T/CP], label-aligned like
``mb["labels"]`` and ``mb["loss_mask"]``: position o of a sequence is the prediction of its token
o + 1) and the microbatch dict of ``PackedDataIterator`` / ``pack_batch``, whose ``seq_index``
(the packed sequence of each local token, -1 on padding: thdpack/fields.h ShardSequenceIndex),
``seq_n_targets`` (each sequence's loss tokens over the WHOLE sequence) and the step's global
counts (``step.n_loss_tokens``, ``step.n_loss_sequences``) make every quantity global before any
rank divides.

The gradient convention is ``local_loss``'s (docs/loss.md): each rank's share of the step loss is
what it returns, and the shares SUMMED over every microbatch and every DP x CP rank are the loss
of the step's whole batch computed in one process, with its gradient. No mode of
``aggregate_loss`` communicates: each is linear in the per-token losses once the global counts
are known. ``sequence_sums`` all-reduces over the microbatch's CP group, for what is not linear
in them (a GSPO sequence ratio, a DPO pair's log-probability sum).
"""
import torch
import torch.distributed as dist

from .. import _thdpack

AGGREGATE_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                   "seq-mean-token-sum-norm")


def _values(values, name, integers=False):
    """A per-token tensor the reductions take: a torch tensor with values (not on the meta
    device) of a floating dtype (or int64 with ``integers``). Sums of bool would be an OR, of
    int8 wrap, of complex values are no loss: each a named error instead."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name}: expected a torch tensor, got {type(values).__name__}")
    if values.device.type == "meta":
        raise ValueError(f"{name}: a meta tensor holds no values")
    ok = values.dtype.is_floating_point or (integers and values.dtype == torch.int64)
    if not ok:
        want = "a floating dtype or int64" if integers else "a floating dtype"
        raise ValueError(f"{name}: dtype {values.dtype}, expected {want}")
    return values


def _positions(values, mb, over):
    """(local positions that count, their sequence) for ``over`` = "loss" (loss_mask != 0) or
    "all" (every real token of a sequence)."""
    seq = mb["seq_index"].to(values.device).long()
    if values.shape[0] != seq.shape[0]:
        raise ValueError(f"values: {values.shape[0]} local tokens, the microbatch's shard holds "
                         f"{seq.shape[0]} (values are [T/CP], as mb['loss_mask'])")
    if over == "loss":
        mask = mb["loss_mask"]
        if mask is None:
            raise ValueError("over='loss' needs the loss mask: call on the last stage")
        keep = (mask.to(values.device) != 0) & (seq >= 0)
    elif over == "all":
        keep = seq >= 0
    else:
        raise ValueError(f"over: {over!r} is not 'loss' or 'all'")
    return keep, seq


class _SequenceSums(torch.autograd.Function):
    """Per-sequence sums all-reduced over the CP group; backward all-reduces the gradient too, so
    that a term computed alike on every CP rank and divided by its size (or a per-token term,
    which each rank computes for its own tokens) has its true gradient when shares are summed."""

    @staticmethod
    def forward(ctx, values, seq, keep, n, group, cp_size, grad_factor):
        ctx.save_for_backward(seq, keep)
        ctx.group, ctx.cp_size, ctx.grad_factor = group, cp_size, grad_factor
        flat = values.reshape(values.shape[0], -1)
        sums = torch.zeros((n, flat.shape[1]), dtype=values.dtype, device=values.device)
        sums.index_add_(0, seq[keep], flat[keep])
        if cp_size > 1:
            dist.all_reduce(sums, group=group)
        return sums.reshape((n,) + values.shape[1:])

    @staticmethod
    def backward(ctx, grad):
        seq, keep = ctx.saved_tensors
        g = grad.contiguous().reshape(grad.shape[0], -1).clone()
        if ctx.cp_size > 1:
            dist.all_reduce(g, group=ctx.group)
        out = torch.zeros((seq.shape[0], g.shape[1]), dtype=g.dtype, device=g.device)
        out[keep] = g[seq[keep]]
        if ctx.grad_factor != 1.0:
            out = out * ctx.grad_factor
        return out.reshape((seq.shape[0],) + grad.shape[1:]), None, None, None, None, None, None


def _factor(value, name):
    """A gradient factor or loss scale: a finite number > 0 (ValueError naming it otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not (
            isinstance(value, torch.Tensor) and value.numel() == 1):
        raise ValueError(f"{name} = {value!r}: expected a number")
    v = float(value)
    if not (v > 0) or v == float("inf"):
        raise ValueError(f"{name} = {value!r}: must be a finite number > 0")
    return v


def sequence_sums(values, mb, over="loss", grad_factor=1.0):
    """[n] (or [n, *row]) sums of this rank's per-token ``values`` ([T/CP] or [T/CP, *row]) over
    each packed sequence's loss positions (``over="loss"``) or all its real tokens (``"all"``),
    summed over the microbatch's CP group: every CP rank of the microbatch gets the same sums,
    those of the whole sequences. Differentiable. A per-token term built from them (GSPO's
    sequence ratio applied to each token) needs nothing more; a per-sequence term computed alike
    on every CP rank (a DPO pair's loss) is the step's once when each rank adds
    ``term / mb["cp_size"]`` to its share. An idle microbatch (dynamic CP) gives [0].
    ``grad_factor`` multiplies the gradient that flows back through the sums, not their values
    (a loss built from them may be non-linear): DP x CP where the framework averages gradients
    over DP x CP (Megatron's DDP with CP, FSDP over the same ranks), as local_loss's and
    aggregate_loss's ``grad_factor``."""
    factor = _factor(grad_factor, "grad_factor")
    _values(values, "sequence_sums: values", integers=True)
    n = len(mb["sample_ids"])
    if mb["idle"] or n == 0:
        return values.new_zeros((0,) + tuple(values.shape[1:]))
    keep, seq = _positions(values, mb, over)
    cp_size = int(mb["cp_size"])
    return _SequenceSums.apply(values, seq, keep, n, mb["cp_group"], cp_size, factor)


def sequence_means(values, mb, over="loss", grad_factor=1.0):
    """``sequence_sums`` divided by each sequence's loss-token count (``over="loss"``, 0 where a
    sequence has none) or its real length (``"all"``): the same [n] on every CP rank;
    ``grad_factor`` as sequence_sums'."""
    sums = sequence_sums(values, mb, over, grad_factor)
    if sums.shape[0] == 0:
        return sums
    if over == "loss":
        count = mb["seq_n_targets"].to(values.device, values.dtype)
    else:
        cu = mb["cu_seqlens_cpu"] if "cu_seqlens_cpu" in mb else mb["cu_seqlens"]
        count = (cu[1:] - cu[:-1]).to(values.device, values.dtype)
    count = count.reshape((-1,) + (1,) * (sums.dim() - 1))
    return torch.where(count > 0, sums / count.clamp(min=1), torch.zeros_like(sums))


def aggregate_loss(per_token_loss, mb, step, mode="token-mean", loss_scale_factor=None,
                   grad_factor=1.0):
    """This rank's share of one microbatch's loss under verl's aggregation ``mode``
    (verl/trainer/ppo/core_algos.py ``agg_loss``), such that the shares summed over every
    microbatch and every DP x CP rank equal, for the step's whole batch in one process:

      token-mean               sum over loss tokens of l / N (N = step.n_loss_tokens)
      seq-mean-token-sum       sum over sequences with a loss token of (sum of its l) / G
      seq-mean-token-mean      sum over sequences with a loss token of (mean of its l) / G
                               (G = step.n_loss_sequences, the global count)
      seq-mean-token-sum-norm  sum over loss tokens of l / loss_scale_factor (required)

    ``per_token_loss``: [T/CP] of this rank's shard, label-aligned like mb["loss_mask"] (the
    last stage). Differentiable; no mode communicates. A step with no loss token (N = 0 or G = 0)
    gives 0. Where verl differs: it divides token-mean by the local or given token count times
    dp_size, and the seq-mean modes by the given global_batch_size (every sequence, fully masked
    ones included) or the local count, and adds 1e-8 to a sequence's token count; here the
    divisors are the global counts of the step, fully masked sequences excluded, so the value
    does not depend on DP, CP, PP or the microbatching. ``grad_factor`` multiplies the share
    (its value and its gradient) as local_loss's does: DP x CP where the framework averages
    gradients over DP x CP (Megatron's DDP with CP, FSDP over the same ranks), 1 where it sums
    them; ``loss_scale_factor`` and ``grad_factor`` must be finite numbers > 0."""
    factor = _factor(grad_factor, "grad_factor")
    if loss_scale_factor is not None:
        loss_scale_factor = _factor(loss_scale_factor, "loss_scale_factor")
    if factor != 1.0:
        return aggregate_loss(per_token_loss, mb, step, mode, loss_scale_factor) * factor
    if mode not in AGGREGATE_MODES:
        raise ValueError(f"mode: {mode!r} is not one of {', '.join(AGGREGATE_MODES)}")
    if mode == "seq-mean-token-sum-norm" and loss_scale_factor is None:
        raise ValueError("mode 'seq-mean-token-sum-norm' needs loss_scale_factor: verl's default "
                         "is the padded response length of its [B, S] batch, and a packed (THD) "
                         "batch has no such padding, so no default would mean the same thing; "
                         "pass the constant you normalise by (e.g. the maximum response length)")
    _values(per_token_loss, "aggregate_loss: per_token_loss")
    if per_token_loss.dim() != 1:
        raise ValueError(f"per_token_loss: expected [T/CP], got {tuple(per_token_loss.shape)}")
    if mb["idle"] or len(mb["sample_ids"]) == 0:
        return per_token_loss.sum() * 0
    keep, seq = _positions(per_token_loss, mb, "loss")
    masked = torch.where(keep, per_token_loss, torch.zeros_like(per_token_loss))
    if mode == "token-mean":
        n = int(step.n_loss_tokens)
        return masked.sum() / n if n > 0 else masked.sum() * 0
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / float(loss_scale_factor)
    g = int(step.n_loss_sequences)
    if g == 0:
        return masked.sum() * 0
    if mode == "seq-mean-token-sum":
        return masked.sum() / g
    count = mb["seq_n_targets"].to(per_token_loss.device, per_token_loss.dtype)
    per_token_count = count[seq.clamp(min=0)]
    weights = torch.where(keep, 1.0 / per_token_count.clamp(min=1), torch.zeros_like(masked))
    return (masked * weights).sum() / g


class RLStatistics:
    """The per-step figures a post-training run logs, reduced over the topology so that they
    equal one process's: each a mean over the step's loss tokens (token means), or over its
    sequences with a loss token (sequence means), whatever DP, CP, PP or the microbatching.

    ``add_microbatch(mb, **values)`` (collective over the microbatch's CP group: every member
    adds it): per-token tensors of this rank's shard ([T/CP],
    label-aligned like mb["loss_mask"], the last stage), by name - e.g. ratio=exp(new - old),
    clipped=(ratio outside the clip range), kl=the k3 estimate exp(ref - new) - (ref - new) - 1,
    entropy=...; only loss positions count. ``summary(group)``: one all-reduce of the sums over
    ``group`` (the DP x CP ranks of one TP rank of the last stage: each loss token on exactly one
    of them), then for every name ``name`` (sum / N, N the loss tokens added over the group) and
    ``name_seq_mean`` (the mean over sequences with a loss token of each sequence's token mean,
    its per-sequence sums CP-reduced first). ``n_loss_tokens`` and ``n_loss_sequences`` are the
    counts: the step's, when every microbatch of the step was added on every rank of the group.
    Every member of ``group`` must have added microbatches with the same names: checked over the
    group before the all-reduce (a ValueError or RuntimeError naming the rank and the rule on
    every member, never a wait or an abort in the collective).
    """

    def __init__(self):
        self._names = None
        self._sums = None       # [names] token sums
        self._seq_sums = None   # [names] sums over sequences of (sequence sum / n_i)
        self._tokens = 0
        self._sequences = 0

    def add_microbatch(self, mb, **values):
        if not values:
            raise ValueError("add_microbatch: give the per-token values by name")
        names = sorted(values)
        if self._names is None:
            self._names = names
            self._sums = torch.zeros(len(names), dtype=torch.float64)
            self._seq_sums = torch.zeros(len(names), dtype=torch.float64)
        elif names != self._names:
            raise ValueError(f"add_microbatch: values {names}, earlier microbatches gave "
                             f"{self._names}")
        clash = sorted(set(names) & {"n_loss_tokens", "n_loss_sequences"} |
                       {k for k in names if k.endswith("_seq_mean")})
        if clash:
            raise ValueError(f"add_microbatch: {clash} would overwrite the summary's own "
                             f"entries (n_loss_tokens, n_loss_sequences, <name>_seq_mean)")
        local = mb["seq_index"].shape[0]
        for k in names:
            v = _values(values[k], f"add_microbatch: {k}")
            if tuple(v.shape) != (local,):
                raise ValueError(f"add_microbatch: {k} has shape {tuple(v.shape)}, expected "
                                 f"[T/CP] = ({local},), one value per local token")
        if mb["idle"] or len(mb["sample_ids"]) == 0:
            return
        stacked = torch.stack([values[k].detach().to(torch.float64).reshape(-1)
                               for k in names], 1)
        keep, _ = _positions(stacked[:, 0], mb, "loss")
        self._sums += stacked[keep].sum(0).cpu()
        self._tokens += int(keep.sum())
        # Per-sequence means over the whole sequences: sums reduced over the CP group, each
        # sequence then counted on one CP rank only (counts_whole_sequences: the C++ rule).
        with torch.no_grad():
            seq_sums = sequence_sums(stacked, mb)
        n = mb["seq_n_targets"].to(torch.float64)
        has = n > 0
        if _thdpack.counts_whole_sequences(int(mb["cp_rank"])):
            self._seq_sums += (seq_sums.cpu()[has] / n[has].unsqueeze(1)).sum(0)
            self._sequences += int(has.sum())

    def summary(self, group=None):
        if group is not None:
            # The sums' size is the names': agreed before the all-reduce, with this rank's own
            # check, so that a rank that added nothing or other names fails every rank, named.
            error = None if self._names is not None else (
                "RLStatistics.summary: this rank added no microbatch (call add_microbatch for "
                "every microbatch of the step, idle ones included)")
            _thdpack._agree_checks(group, error, [("names", ",".join(self._names or []))],
                                   "RLStatistics.summary")
        if self._names is None:
            return {"n_loss_tokens": 0, "n_loss_sequences": 0}
        flat = torch.cat([self._sums, self._seq_sums,
                          torch.tensor([self._tokens, self._sequences], dtype=torch.float64)])
        if group is not None:
            device = "cpu"
            if dist.get_backend(group) == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            flat = flat.to(device)
            dist.all_reduce(flat, group=group)
            flat = flat.cpu()
        k = len(self._names)
        tokens, sequences = int(flat[2 * k]), int(flat[2 * k + 1])
        out = {"n_loss_tokens": tokens, "n_loss_sequences": sequences}
        for i, name in enumerate(self._names):
            out[name] = float(flat[i]) / tokens if tokens else None
            out[name + "_seq_mean"] = float(flat[k + i]) / sequences if sequences else None
        return out
