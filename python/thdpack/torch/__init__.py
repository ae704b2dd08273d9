"""thdpack.torch: thdpack inside a PyTorch job.

  thdpack.torch.sharding  zigzag CP shards and SP ranges of torch tensors (shard, unshard, ...)
  thdpack.torch.loss      the CP-local token-mean loss and its topology-invariant statistics

The names below are re-exported so that ``import thdpack.torch as tt; tt.shard(...)`` works.
"""
from .sharding import partition_indices, shard, sp_split, unshard
from .loss import IGNORE_INDEX, LossStatistics, local_loss, token_statistics

__all__ = [
    "IGNORE_INDEX", "LossStatistics", "local_loss", "partition_indices", "shard", "sp_split",
    "token_statistics", "unshard",
]
