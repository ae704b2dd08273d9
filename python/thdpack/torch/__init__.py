"""thdpack.torch: thdpack inside a PyTorch job.

  thdpack.torch.sharding    zigzag CP shards and SP ranges of torch tensors (shard, unshard, ...)
  thdpack.torch.loss        the CP-local token-mean loss and its topology-invariant statistics
  thdpack.torch.linear_loss the lm-head GEMM fused with the loss (never [T, V] logits)
  thdpack.torch.iterator    PackedDataIterator: the C++ distributed step over torch.distributed
  thdpack.torch.rows        SampleRows: samples held as columns, made into the step's in one call
  thdpack.torch.megatron    Megatron-LM's sequence-packing entry points over the iterator
  thdpack.torch.microbatch  a batch split into microbatches under a token cap (verl style)
  thdpack.torch.calibrate   a cost profile measured by timing the user's step on packed microbatches
                            (calibrate_encoder: a vision encoder's term added to it)
  thdpack.torch.seqloss     per-sequence sums over CP, post-training loss aggregation (verl's modes)

The names below are re-exported so that ``import thdpack.torch as tt; tt.shard(...)`` works.
"""
from .sharding import gather_cp, partition_indices, shard, sp_split, unshard
from .loss import (IGNORE_INDEX, LossStatistics, empty_grad_cache, grad_cache_info, local_loss,
                   set_grad_cache, token_statistics)
from .linear_loss import linear_loss
from .iterator import Groups, PackedDataIterator, PackedStep, loader_positions, pack_batch
from .microbatch import micro_batch_indices, rearrange_micro_batches
from .calibrate import calibrate, calibrate_encoder
from .rows import SampleRows
from .logprobs import linear_token_logprobs, per_token, token_logprobs
from .media import (media_microbatch, media_specs, mrope_microbatch, mrope_positions,
                    route_media)
from .encoders import EncoderIterator, encoder_batch
from .seqloss import RLStatistics, aggregate_loss, sequence_means, sequence_sums

__all__ = [
    "IGNORE_INDEX", "LossStatistics", "gather_cp", "local_loss", "micro_batch_indices",
    "partition_indices",
    "rearrange_micro_batches", "shard", "sp_split", "token_statistics", "unshard",
]
__all__ += ["Groups", "PackedDataIterator", "PackedStep", "loader_positions", "pack_batch"]
__all__ += ["empty_grad_cache", "grad_cache_info", "set_grad_cache"]
__all__ += ["calibrate", "calibrate_encoder", "linear_loss", "SampleRows"]
__all__ += ["linear_token_logprobs", "per_token", "token_logprobs"]
__all__ += ["media_microbatch", "media_specs", "mrope_microbatch", "mrope_positions",
            "route_media"]
__all__ += ["EncoderIterator", "encoder_batch"]
__all__ += ["RLStatistics", "aggregate_loss", "sequence_means", "sequence_sums"]
