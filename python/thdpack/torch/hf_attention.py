"""Any Hugging Face transformers model on thdpack's CP shards (docs/python.md, "Any
transformers model at DP x CP").

``register()`` adds an attention function to transformers' attention interface
(``AttentionInterface.register``, transformers 5.x) that runs on the zigzag shard of a
microbatch: each layer all-gathers K and V over the microbatch's CP group (its backward sums the
gradients of every rank's part back to their owner), puts them back in packed order, and attends
each local query to the keys of its own sequence at or before its position - varlen causal by
the step's cu_seqlens_padded - through ``torch.nn.functional.scaled_dot_product_attention``
(sdpa, any device) with GQA's key/value heads repeated. ``model_kwargs(mb)`` are the keyword
arguments of the model's forward for that microbatch: its shard's position ids (RoPE at each
token's position in its sequence), no mask of transformers' own, and the microbatch itself for
the attention.

    name = thdpack.torch.hf_attention.register()           # "thdpack_cp"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    for mb in step:
        logits = model(input_ids=mb["tokens"][None], **model_kwargs(mb)).logits[0]
        logp = tt.token_logprobs(logits, mb)

The mask is [T/CP, T] booleans a layer: this is the path for tests and small models (and a
reference for a fused one); each rank's attention work is that of its zigzag half-chunks.
"""
import torch

from .sharding import gather_cp, partition_indices, unshard

NAME = "thdpack_cp"


def _layout(mb, device):
    """(each local query's packed position, every key's packed position's sequence, the
    queries' sequences) of the microbatch's shard, cached on the microbatch."""
    key = ("_thdpack_cp_layout", device)
    if key not in mb:
        cup = mb["cu_seqlens_padded_cpu"] if "cu_seqlens_padded_cpu" in mb \
            else mb["cu_seqlens_padded"].cpu()
        cup = torch.as_tensor(cup, dtype=torch.long)
        total = int(cup[-1])
        seq = torch.repeat_interleave(torch.arange(len(cup) - 1), cup[1:] - cup[:-1])
        q_pos = partition_indices(cup.numpy(), int(mb["cp_size"]), int(mb["cp_rank"])).long()
        mb[key] = (q_pos.to(device), torch.arange(total, device=device), seq.to(device),
                   cup.numpy())
    return mb[key]


def cp_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                 thdpack_mb=None, **kwargs):
    """transformers' attention signature: query [B, Hq, t, D], key/value [B, Hkv, t, D] of this
    rank's shard (B = 1: the packed microbatch); returns ([B, t, Hq, D], None)."""
    mb = thdpack_mb
    if mb is None:
        raise ValueError(f"attention '{NAME}': the model was called without the microbatch "
                         f"(pass **thdpack.torch.hf_attention.model_kwargs(mb))")
    if query.shape[0] != 1:
        raise ValueError(f"attention '{NAME}': a batch of {query.shape[0]}; a packed microbatch "
                         f"is one row [1, T/CP]")
    size, rank, group = int(mb["cp_size"]), int(mb["cp_rank"]), mb.get("cp_group")
    q_pos, k_pos, seq, cup = _layout(mb, query.device)
    if size > 1:
        # [size, 1, H, t, D] -> each rank's shard back in packed order along t.
        def gather(x):
            parts = gather_cp(x, group, size, rank)
            flat = [p[0].transpose(0, 1) for p in parts]             # [t, H, D] each
            return unshard(flat, cup).transpose(0, 1)[None]          # [1, H, T, D]
        key, value = gather(key), gather(value)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # GQA: each key/value head serves `groups` query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    visible = (seq[q_pos][:, None] == seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=visible[None, None], dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register(name=NAME):
    """Registers cp_attention with transformers' attention interface (and transformers' mask
    interface, which then makes no mask: the attention makes its own) under ``name``."""
    from transformers import AttentionInterface
    AttentionInterface.register(name, cp_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface
        AttentionMaskInterface.register(name, lambda *args, **kwargs: None)
    except ImportError:
        pass
    return name


def model_kwargs(mb):
    """The forward's keyword arguments for microbatch ``mb``: its shard's position ids [1, T/CP]
    (each token's position in its sequence), no transformers mask, and the microbatch for
    cp_attention."""
    return {"position_ids": mb["position_ids"][None].long(), "thdpack_mb": mb}
