"""thdpack.torch.sharding: zigzag CP shards and SP ranges of torch tensors, with thdpack's indices,
and the CP group's differentiable all-gather of them (gather_cp)."""
import torch
import torch.distributed as dist

from .. import _thdpack

def _cu(cu_seqlens):
    """A small metadata array (tensor on any device, NumPy array, list) as the C++ bindings take
    it: a tensor is moved to the CPU; dtype, layout and the range of every value are checked
    there (common.h: IntView1D), naming the argument."""
    if isinstance(cu_seqlens, torch.Tensor):
        return cu_seqlens.detach().cpu()
    return cu_seqlens


def _tensor_arg(tensor, name):
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a torch tensor, got {type(tensor).__name__}")
    return tensor


def _dim_arg(tensor, dim, name):
    if not -tensor.dim() <= dim < max(tensor.dim(), 1) or tensor.dim() == 0:
        raise ValueError(f"{name}: dim = {dim} is not a dimension of a tensor of shape "
                         f"{tuple(tensor.shape)}")
    return dim


def partition_indices(cu_seqlens_padded, cp_size, cp_rank, device=None):
    """Global positions CP rank cp_rank keeps (int64 tensor [T/CP] on `device`)."""
    idx = _thdpack.cp_partition_indices(_cu(cu_seqlens_padded),
                                        cp_size, cp_rank)
    return torch.from_numpy(idx).to(device=device, dtype=torch.int64)


def shard(tensor, cu_seqlens_padded, cp_size, cp_rank, dim=0):
    """CP rank cp_rank's zigzag shard of `tensor` along `dim` ([T] -> [T/CP]); differentiable."""
    _dim_arg(_tensor_arg(tensor, "tensor"), dim, "tensor")
    if int(cp_size) < 1:
        raise ValueError(f"cp_size = {cp_size}: must be >= 1")
    if tensor.shape[dim] % cp_size != 0:
        raise ValueError(f"shard: tensor has {tensor.shape[dim]} tokens along dim {dim}, "
                         f"not divisible by cp_size {cp_size}")
    idx = partition_indices(cu_seqlens_padded, cp_size, cp_rank, tensor.device)
    if idx.numel() * cp_size != tensor.shape[dim]:
        raise ValueError(f"shard: tensor has {tensor.shape[dim]} tokens along dim {dim}, "
                         f"cu_seqlens_padded describes {idx.numel() * cp_size}")
    return tensor.index_select(dim, idx)


def unshard(shards, cu_seqlens_padded, dim=0):
    """The inverse of shard: every CP rank's shard in rank order -> the full tensor."""
    if not isinstance(shards, (list, tuple)):
        raise ValueError(f"shards: expected a list of tensors, got {type(shards).__name__}")
    cp_size = len(shards)
    if cp_size == 0:
        raise ValueError("unshard: shards is empty; one shard per CP rank expected")
    for r, s in enumerate(shards):
        _dim_arg(_tensor_arg(s, f"shards[{r}]"), dim, f"shards[{r}]")
    device = shards[0].device
    perm = torch.cat([partition_indices(cu_seqlens_padded, cp_size, r, device)
                      for r in range(cp_size)])
    local = shards[0].shape[dim]
    for r, s in enumerate(shards):
        if s.shape[dim] != local:
            raise ValueError(f"unshard: shards[{r}] has {s.shape[dim]} tokens, shards[0] has "
                             f"{local}: every shard must have T/CP tokens")
        if s.dtype != shards[0].dtype or s.device != device or \
                s.shape[:dim] + s.shape[dim + 1:] != shards[0].shape[:dim] + shards[0].shape[dim + 1:]:
            raise ValueError(f"unshard: shards[{r}] is a {s.dtype} tensor of shape "
                             f"{tuple(s.shape)} on {s.device}, shards[0] a {shards[0].dtype} "
                             f"one of shape {tuple(shards[0].shape)} on {device}: every shard "
                             f"must have the same dtype, device and other dimensions")
    if perm.numel() != local * cp_size:
        raise ValueError(f"unshard: shards hold {local * cp_size} tokens, cu_seqlens_padded "
                         f"describes {perm.numel()}")
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=device)
    return torch.cat(list(shards), dim).index_select(dim, inverse)


def sp_split(tensor, tp_size, tp_rank, dim=0):
    """TP rank tp_rank's contiguous part of the CP-local tensor along `dim` (a view)."""
    _dim_arg(_tensor_arg(tensor, "tensor"), dim, "tensor")
    offset, count = _thdpack.sp_range(tensor.shape[dim], tp_size, tp_rank)
    return tensor.narrow(dim, offset, count)


class _GatherCp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, cp_size, cp_rank):
        parts = [torch.empty_like(x) for _ in range(cp_size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.cp_rank = group, cp_rank
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.cp_rank], None, None, None


def gather_cp(x, group, cp_size, cp_rank):
    """Every CP rank's ``x`` (same shape on each), stacked in CP-rank order: [cp_size, *x.shape].
    Collective over ``group``; differentiable: the backward sums the group's gradients of each
    part and gives rank ``cp_rank`` those of its own (what attention over the gathered K/V of a
    zigzag shard needs; ``unshard`` puts the parts back in packed order)."""
    return _GatherCp.apply(x, group, int(cp_size), int(cp_rank))
