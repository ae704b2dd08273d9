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

How each rank attends (``model_kwargs(mb, attention=...)``):
- ``"sdpa"``: a [T/CP, T] boolean mask a layer through sdpa - any device and dtype, the path of
  the tests and small models, and the reference of the others;
- ``"flash"``: flash-attn's ``flash_attn_varlen_func`` (CUDA, float16 or bfloat16), no mask: the
  shard's queries are one segment a chunk (one a sequence at CP 1, two at CP > 1: the zigzag's
  half-chunks), each against the keys of its sequence up to the chunk's end, causal aligned to
  the bottom right (flash-attn >= 2.1's rule, which is exactly "at or before its position");
- ``"torch"``: the same segments through torch's own ``torch.nn.attention.varlen.varlen_attn``
  (CUDA, float16 or bfloat16; no install beyond torch), causal as its window (-1, 0), without
  dropout - asked for by name only until a GPU has checked its alignment (the ``cuda`` test);
- a callable with flash_attn_varlen_func's signature (FA3's, or ``varlen_reference``): the same
  segments through it;
- ``"auto"`` (default): ``"flash"`` where flash-attn imports and the query is CUDA in float16 or
  bfloat16, else ``"sdpa"``.
The segments' keys are copies of the gathered K/V (each sequence's key prefix once a chunk: about
T * (1 + 1/(2 CP)) rows); each rank's attention work is that of its zigzag half-chunks.
"""
import numpy as np
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


def varlen_segments(cu_seqlens_padded, cp_size, cp_rank):
    """The varlen kernel's segments of CP rank cp_rank's zigzag shard: (cu_q, cu_k, k_index,
    max_q, max_k) as NumPy arrays and ints. Segment j is one chunk of one sequence - the whole
    sequence at CP 1, else its half-chunks cp_rank and 2 CP - 1 - cp_rank, in the shard's order -
    whose cu_q[j+1] - cu_q[j] queries attend, causal aligned to the bottom right, to the keys at
    packed positions k_index[cu_k[j]:cu_k[j+1]]: its sequence's from the first up to the chunk's
    end."""
    cup = np.asarray(cu_seqlens_padded, dtype=np.int64)
    size, rank = int(cp_size), int(cp_rank)
    first, padded = cup[:-1], cup[1:] - cup[:-1]
    if size == 1:
        q_len, k_end = padded, cup[1:]
        k_first = first
    else:
        c = padded // (2 * size)
        q_len = np.stack([c, c], axis=1).reshape(-1)
        k_end = np.stack([first + (rank + 1) * c, first + (2 * size - rank) * c],
                         axis=1).reshape(-1)
        k_first = np.repeat(first, 2)
    k_len = k_end - k_first
    cu_q = np.concatenate([[0], np.cumsum(q_len)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_len)]).astype(np.int32)
    k_index = np.arange(int(cu_k[-1]), dtype=np.int64) + np.repeat(k_first - cu_k[:-1], k_len)
    return cu_q, cu_k, k_index, int(q_len.max(initial=0)), int(k_len.max(initial=0))


def varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     dropout_p=0.0, softmax_scale=None, causal=True):
    """flash_attn_varlen_func's contract in plain torch, one segment at a time through sdpa: q
    [total_q, Hq, D], k/v [total_k, Hkv, D] (GQA: Hkv divides Hq), causal aligned to the bottom
    right (query i of a segment of n queries and m keys sees keys 0 .. m - n + i). The reference
    of the kernels the "flash" path calls (any device and dtype; slow)."""
    if dropout_p:
        raise ValueError("varlen_reference: dropout_p must be 0 (a reference is deterministic)")
    out = []
    groups = q.shape[1] // k.shape[1]
    for j in range(len(cu_seqlens_q) - 1):
        qa, qb = int(cu_seqlens_q[j]), int(cu_seqlens_q[j + 1])
        ka, kb = int(cu_seqlens_k[j]), int(cu_seqlens_k[j + 1])
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q[qa:qb], k[ka:kb], v[ka:kb]))
        if groups > 1:
            ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
        n, m = qb - qa, kb - ka
        mask = None
        if causal:
            mask = torch.arange(m, device=q.device)[None, :] <= \
                (torch.arange(n, device=q.device)[:, None] + (m - n))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                             scale=softmax_scale)
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


def _torch_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  dropout_p=0.0, softmax_scale=None, causal=True):
    """torch's varlen_attn under flash_attn_varlen_func's signature: causal is the window
    (-1, 0), GQA where the key/value heads are fewer."""
    from torch.nn.attention.varlen import varlen_attn
    if dropout_p:
        raise ValueError(f"attention '{NAME}': attention='torch' has no dropout (torch's "
                         f"varlen_attn takes none); dropout_p = {dropout_p}")
    return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       scale=softmax_scale, window_size=(-1, 0) if causal else (-1, -1),
                       enable_gqa=q.shape[1] != k.shape[1])


def _kernel(attention, query):
    """The varlen kernel `attention` names for this query, or None for the sdpa mask path."""
    if callable(attention):
        return attention
    if attention not in ("auto", "sdpa", "flash", "torch"):
        raise ValueError(f"attention '{NAME}': attention={attention!r}: expected 'auto', "
                         f"'sdpa', 'flash', 'torch' or a varlen kernel (flash_attn_varlen_func's "
                         f"signature)")
    if attention == "sdpa":
        return None
    half = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
    if attention == "torch":
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        except ImportError:
            raise ValueError(f"attention '{NAME}': attention='torch' needs torch's varlen_attn "
                             f"(torch.nn.attention.varlen), which torch {torch.__version__} "
                             f"has not") from None
        if not half:
            raise ValueError(f"attention '{NAME}': attention='torch' needs a CUDA query in "
                             f"float16 or bfloat16, got {query.dtype} on {query.device}")
        return _torch_varlen
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    if attention == "auto":
        return flash_attn_varlen_func if half else None
    if flash_attn_varlen_func is None:
        raise ValueError(f"attention '{NAME}': attention='flash' needs flash-attn "
                         f"(pip install flash-attn), which does not import here")
    if not half:
        raise ValueError(f"attention '{NAME}': attention='flash' needs a CUDA query in float16 "
                         f"or bfloat16, got {query.dtype} on {query.device}")
    return flash_attn_varlen_func


def _attend_varlen(query, key, value, mb, dropout, scaling, kernel):
    """The shard's queries [1, Hq, t, D] against the gathered key/value [1, Hkv, T, D] through a
    varlen kernel, segment by segment (varlen_segments); returns [1, t, Hq, D]."""
    key_ = ("_thdpack_cp_segments", query.device)
    if key_ not in mb:
        cu_q, cu_k, k_index, max_q, max_k = varlen_segments(_layout(mb, query.device)[3],
                                                            mb["cp_size"], mb["cp_rank"])
        mb[key_] = (torch.from_numpy(cu_q).to(query.device),
                    torch.from_numpy(cu_k).to(query.device),
                    torch.from_numpy(k_index).to(query.device), max_q, max_k)
    cu_q, cu_k, k_index, max_q, max_k = mb[key_]
    q = query[0].transpose(0, 1)                                # [t, Hq, D], the shard's order
    k = key[0].transpose(0, 1).index_select(0, k_index)         # [total_k, Hkv, D]
    v = value[0].transpose(0, 1).index_select(0, k_index)
    out = kernel(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout, softmax_scale=scaling,
                 causal=True)
    return out[None]


def _attend_sdpa(query, key, value, mb, dropout, scaling):
    """The shard's queries against the gathered key/value through sdpa with a [t, T] mask of
    "same sequence, at or before": returns [1, t, Hq, D]."""
    q_pos, k_pos, seq, _ = _layout(mb, query.device)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # GQA: each key/value head serves `groups` query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    visible = (seq[q_pos][:, None] == seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=visible[None, None], dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous()


def cp_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                 thdpack_mb=None, thdpack_attention="auto", **kwargs):
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
    kernel = _kernel(thdpack_attention, query)
    if kernel is None:
        return _attend_sdpa(query, key, value, mb, dropout, scaling), None
    return _attend_varlen(query, key, value, mb, dropout, scaling, kernel), None


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


def model_kwargs(mb, attention="auto"):
    """The forward's keyword arguments for microbatch ``mb``: its shard's position ids [1, T/CP]
    (each token's position in its sequence), no transformers mask, the microbatch for
    cp_attention, and how it attends (``attention``: "auto", "sdpa", "flash" or a varlen
    kernel; the module's docstring)."""
    return {"position_ids": mb["position_ids"][None].long(), "thdpack_mb": mb,
            "thdpack_attention": attention}
