"""thdpack: the data plane of packed-sequence (THD) distributed LLM training.

Scheduling over DP replicas and microbatches, THD packing, CP zigzag and SP sharding, the step
metadata wire format and the CP-local cross-entropy, on NumPy arrays (no copies of the
arguments; dtypes and contiguity are checked and a ValueError names what is wrong).
``thdpack.torch`` holds the same loss semantics and sharding as torch operations on any device.

Communication stays in the framework (torch.distributed): thdpack computes who gets what.
"""
from ._thdpack import (  # noqa: F401
    IGNORE_INDEX,
    ParallelLayout,
    Plan,
    Topology,
    __version__,
    blend_weights,
    cost_model,
    check_run_state,
    cp_partition_indices,
    cross_entropy,
    decode_metadata,
    encode_metadata,
    fit_cost_profile,
    flops,
    flops_coefficients,
    gradient_factor,
    hf_labels,
    local_cu_seqlens_padded,
    local_position_ids,
    mock_lengths,
    mock_tokens,
    pack,
    pack_shard,
    plan_job,
    read_jsonl,
    read_lengths,
    read_cost_profile,
    read_megatron,
    read_run_state,
    read_timings_csv,
    resolve_job,
    run_job,
    run_state_at,
    schedule,
    shard,
    sp_range,
    sp_split,
    unshard,
    write_run_state,
)

# Parquet and Arrow files are opened by pyarrow when the C++ first meets a parquet: or arrow:
# spec in this process (thdpack/arrow.h); pyarrow is imported only then.
from . import arrow as _arrow  # noqa: E402
from .arrow import arrow_source  # noqa: E402,F401

_thdpack._set_arrow_readers(_arrow._parquet_columns, _arrow._parquet_to_ipc, _arrow._read_ipc)
