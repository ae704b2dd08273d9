"""thdpack.torch: thdpack inside a PyTorch job.

  thdpack.torch.sharding  zigzag CP shards and SP ranges of torch tensors (shard, unshard, ...)
  thdpack.torch.loss      the CP-local token-mean loss and its topology-invariant statistics
  thdpack.torch.microbatch  a batch split into microbatches under a token cap (verl style)

The names below are re-exported so that ``import thdpack.torch as tt; tt.shard(...)`` works.
"""
from .sharding import partition_indices, shard, sp_split, unshard
from .loss import IGNORE_INDEX, LossStatistics, local_loss, token_statistics
from .microbatch import micro_batch_indices, rearrange_micro_batches

__all__ = [
    "IGNORE_INDEX", "LossStatistics", "local_loss", "micro_batch_indices", "partition_indices",
    "rearrange_micro_batches", "shard", "sp_split", "token_statistics", "unshard",
]
