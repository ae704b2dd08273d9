"""thdpack.torch.sharding: zigzag CP shards and SP ranges of torch tensors, with thdpack's indices."""
import numpy as np
import torch

from .. import _thdpack

def _cu(cu_seqlens, name):
    """int32 NumPy copy of a small metadata array (tensor, array or list)."""
    if isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = cu_seqlens.detach().cpu().numpy()
    a = np.asarray(cu_seqlens)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected a 1-D integer array, got {a.dtype} of shape {a.shape}")
    return np.ascontiguousarray(a, dtype=np.int32)


def partition_indices(cu_seqlens_padded, cp_size, cp_rank, device=None):
    """Global positions CP rank cp_rank keeps (int64 tensor [T/CP] on `device`)."""
    idx = _thdpack.cp_partition_indices(_cu(cu_seqlens_padded, "cu_seqlens_padded"),
                                        cp_size, cp_rank)
    return torch.from_numpy(idx).to(device=device, dtype=torch.int64)


def shard(tensor, cu_seqlens_padded, cp_size, cp_rank, dim=0):
    """CP rank cp_rank's zigzag shard of `tensor` along `dim` ([T] -> [T/CP]); differentiable."""
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
    cp_size = len(shards)
    if cp_size == 0:
        raise ValueError("unshard: shards is empty; one shard per CP rank expected")
    device = shards[0].device
    perm = torch.cat([partition_indices(cu_seqlens_padded, cp_size, r, device)
                      for r in range(cp_size)])
    local = shards[0].shape[dim]
    for r, s in enumerate(shards):
        if s.shape[dim] != local:
            raise ValueError(f"unshard: shards[{r}] has {s.shape[dim]} tokens, shards[0] has "
                             f"{local}: every shard must have T/CP tokens")
    if perm.numel() != local * cp_size:
        raise ValueError(f"unshard: shards hold {local * cp_size} tokens, cu_seqlens_padded "
                         f"describes {perm.numel()}")
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=device)
    return torch.cat(list(shards), dim).index_select(dim, inverse)


def sp_split(tensor, tp_size, tp_rank, dim=0):
    """TP rank tp_rank's contiguous part of the CP-local tensor along `dim` (a view)."""
    offset, count = _thdpack.sp_range(tensor.shape[dim], tp_size, tp_rank)
    return tensor.narrow(dim, offset, count)
