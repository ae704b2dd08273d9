"""Images and video in packed, CP-sharded microbatches (docs/media.md).

A run declares its modalities once, by name::

    MEDIA = {"image": {"token_id": 151655, "payload": "pixel_values", "grid": "image_grid_thw"},
             "video": {"token_id": 151656, "payload": "pixel_values_videos",
                       "grid": "video_grid_thw", "seconds": "second_per_grid_ts"}}

Item j of a modality takes t*h*w / merge**2 consecutive placeholder tokens of its token id, the
items in order (Qwen2-VL's processor; Megatron's align_embeddings_by_token_positions). Every rule
here is the C++ library's (thdpack/media.h): the check of a sample's items against its tokens,
mRoPE positions, the placement of whole items over a replica's CP ranks by the encoder's cost,
and the routing tables; this module converts and moves tensors.

- ``mrope_positions(input_ids, sample, MEDIA, ...)``: one sample's [3, L] positions, equal to
  transformers' ``Qwen2VLModel.get_rope_index`` (5.x) / ``Qwen2_5_VLModel``'s on the sample alone.
- ``mrope_microbatch(samples, MEDIA, cu_seqlens, cu_seqlens_padded, cp_size, cp_rank, ...)``:
  the [3, T/CP] positions of this rank's shard of a packed microbatch.
- ``media_microbatch(samples, MEDIA, cu_seqlens, cu_seqlens_padded, cp_size, cp_rank, ...)``:
  this rank's ``mb["media"]`` for a packed microbatch of ``samples`` (in packed order): per
  modality ``pixel_values`` (the rows this rank encodes), ``grid_thw`` (their items),
  ``token_index`` (the local token positions that take that modality's rows, ascending) and the
  route.
- ``route_media(out, mb, name)``: the encoder's output rows [rows, H] for this rank's items,
  each sent to the CP rank whose shard holds its token (one all-to-all over ``mb["cp_group"]``);
  returns ``[len(token_index), H]``, so that ``embeds.index_put_((token_index,), rows)`` (or
  ``masked_scatter``) places them. Its backward is the reverse all-to-all.
"""
import numpy as np
import torch
import torch.distributed as dist

from .. import _thdpack

_KEYS = ("token_id", "payload", "grid", "seconds")


def media_specs(media):
    """The declared modalities as the library takes them: [(name, token_id, timed)], in the
    dict's order. TypeError/ValueError naming the modality and the key otherwise."""
    if not isinstance(media, dict) or not media:
        raise TypeError(f"media: expected a dict of modality name -> its declaration, got "
                        f"{type(media).__name__}")
    specs = []
    for name, spec in media.items():
        if not isinstance(name, str):
            raise TypeError(f"media: a modality's name must be a str, got {name!r}")
        if not isinstance(spec, dict):
            raise TypeError(f"media['{name}']: expected a dict with token_id, payload, grid")
        unknown = sorted(set(spec) - set(_KEYS))
        if unknown:
            raise ValueError(f"media['{name}']: unknown keys {unknown}; the keys are "
                             f"{list(_KEYS)}")
        for key in ("token_id", "payload", "grid"):
            if key not in spec:
                raise ValueError(f"media['{name}']: '{key}' is missing (token_id, payload and "
                                 f"grid are required, seconds is optional)")
        token = spec["token_id"]
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
            raise TypeError(f"media['{name}']['token_id']: expected an int, got {token!r}")
        specs.append((name, int(token), "seconds" in spec))
    return specs


def _grid_rows(value, where):
    if value is None:
        return np.zeros((0, 3), dtype=np.int64)
    a = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if a.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if a.ndim != 2 or a.shape[1] != 3:
        raise ValueError(f"{where}: expected [k, 3] rows of (t, h, w), got shape "
                         f"{tuple(a.shape)}")
    return a


def _sample_media(sample, media, where):
    """(grids, seconds) of one sample, per declared modality in order."""
    grids, seconds = [], []
    for name, spec in media.items():
        grids.append(_grid_rows(sample.get(spec["grid"]), f"{where} {spec['grid']}"))
        if "seconds" in spec and sample.get(spec["seconds"]) is not None:
            s = sample[spec["seconds"]]
            s = s.detach().cpu().tolist() if isinstance(s, torch.Tensor) else list(s)
            seconds.append([float(v) for v in s])
        else:
            seconds.append([])
    return grids, seconds


def _ids(input_ids):
    if isinstance(input_ids, torch.Tensor):
        return input_ids.detach().cpu().numpy()
    return np.asarray(input_ids)


def mrope_positions(input_ids, sample, media, spatial_merge_size=2, mrope="qwen2-vl",
                    tokens_per_second=2.0, where="sample"):
    """One sample's mRoPE positions, int64 [3, L] (temporal, height, width rows): transformers
    5.x's rule (thdpack/media.h SampleMropePositions). ``sample`` holds the grids (and
    seconds) under the names ``media`` declares; ``tokens_per_second`` is Qwen2.5-VL's
    ``vision_config.tokens_per_second`` (its released configs: 2)."""
    specs = media_specs(media)
    grids, seconds = _sample_media(sample, media, where)
    pos = _thdpack.mrope_positions(str(mrope), specs, int(spatial_merge_size), _ids(input_ids),
                                   grids, seconds, float(tokens_per_second), where)
    return torch.from_numpy(pos)


def mrope_microbatch(samples, media, cu_seqlens, cu_seqlens_padded, cp_size, cp_rank,
                     spatial_merge_size=2, mrope="qwen2-vl", tokens_per_second=2.0):
    """CP rank cp_rank's mRoPE positions of a packed microbatch, int64 [3, T/CP]: each sequence's
    positions computed on its whole sample (mrope_positions: text restarts at 0 in every
    sequence), its padding counting on from its largest position + 1, sharded like the tokens
    (thdpack/media.h MropeShard)."""
    per = [mrope_positions(s["input_ids"], s, media, spatial_merge_size, mrope,
                           tokens_per_second, f"samples[{i}]").numpy()
           for i, s in enumerate(samples)]
    return torch.from_numpy(_thdpack.mrope_shard(per, np.asarray(cu_seqlens, dtype=np.int64),
                                                 np.asarray(cu_seqlens_padded, dtype=np.int64),
                                                 int(cp_size), int(cp_rank)))


def media_microbatch(samples, media, cu_seqlens, cu_seqlens_padded, cp_size, cp_rank, sp_size=1,
                     sp_rank=0, spatial_merge_size=2, device=None):
    """This rank's ``mb["media"]`` for a packed microbatch whose sequences are ``samples`` (dicts
    with input_ids and the declared payloads and grids, in packed order): for each declared
    modality a dict of ``pixel_values`` (the payload rows of the items this CP rank encodes,
    concatenated, in the payload's own dtype), ``grid_thw`` (int64 [k, 3]), ``token_index`` (int64
    [m]) and ``route`` (route_media's tables). The items are placed on the CP ranks by the
    library (whole items, the encoder's cost balanced); every rank of the CP group computes the
    same placement from the same samples."""
    specs = media_specs(media)
    merge = int(spatial_merge_size)
    items = []
    for i, s in enumerate(samples):
        where = f"samples[{i}]"
        grids, seconds = _sample_media(s, media, where)
        items.append(_thdpack.media_items(specs, merge, _ids(s["input_ids"]), grids, seconds,
                                          where))
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    cup = np.asarray(cu_seqlens_padded, dtype=np.int64)
    out = {}
    for m, (name, spec) in enumerate(media.items()):
        r = _thdpack.media_route(cu, cup, int(cp_size), int(cp_rank), int(sp_size), int(sp_rank),
                                 m, items, None)
        rows = []
        for i, j in r["encodes"].tolist():
            x = items[i][j]
            payload = samples[i][spec["payload"]]
            if not isinstance(payload, torch.Tensor):
                payload = torch.as_tensor(payload)
            rows.append(payload[x[7]:x[7] + x[2] * x[3] * x[4]])
        if rows:
            pixel_values = torch.cat(rows)
        else:  # none here: an empty payload of the modality's width and dtype, where known
            like = next((s[spec["payload"]] for s in samples
                         if s.get(spec["payload"]) is not None), None)
            like = torch.as_tensor(like) if like is not None else torch.zeros(0, 0)
            pixel_values = like.new_zeros((0,) + tuple(like.shape[1:]))
        out[name] = _media_entry(pixel_values, r, device)
    return out


def _media_entry(pixel_values, r, device):
    """One modality's ``mb["media"][name]``: the rows this rank encodes and, from ``r`` (the
    NumPy arrays of a route: grid_thw, token_index, output_rows, send/recv index and counts),
    their grids, the token positions that take them and route_media's tables. The one layout
    of it, for media_microbatch and for the step's microbatches (packed_step.py). ``device``
    None: the arrays on the CPU, the rows where they are."""
    if device is not None:
        pixel_values = pixel_values.to(device)
    device = device or "cpu"
    return {
        "pixel_values": pixel_values,
        "grid_thw": torch.from_numpy(r["grid_thw"]).to(device),
        "token_index": torch.from_numpy(r["token_index"]).to(device),
        "route": {
            "output_rows": int(r["output_rows"]),
            "send_index": torch.from_numpy(r["send_index"]).to(device),
            "send_counts": r["send_counts"].tolist(),
            "recv_counts": r["recv_counts"].tolist(),
            "recv_index": torch.from_numpy(r["recv_index"]).to(device),
        },
    }


class _RouteMedia(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, anchor, send_index, send_counts, recv_counts, recv_index, group):
        ctx.route = (send_index, send_counts, recv_counts, recv_index, group, out.shape[0])
        send = out.index_select(0, send_index)
        recv = _exchange(send, send_counts, recv_counts, group)
        return recv.index_select(0, recv_index)

    @staticmethod
    def backward(ctx, grad):
        send_index, send_counts, recv_counts, recv_index, group, rows = ctx.route
        g_recv = grad.new_zeros((sum(recv_counts),) + tuple(grad.shape[1:]))
        g_recv.index_copy_(0, recv_index, grad)
        g_send = _exchange(g_recv, recv_counts, send_counts, group)
        g_out = grad.new_zeros((rows,) + tuple(grad.shape[1:]))
        g_out.index_copy_(0, send_index, g_send)
        return g_out, None, None, None, None, None, None


def _exchange(send, send_counts, recv_counts, group):
    """One all-to-all-v of rows: send_counts[r] rows to CP rank r, recv_counts[r] from it."""
    if group is None or dist.get_world_size(group) == 1:
        return send
    recv = send.new_empty((sum(recv_counts),) + tuple(send.shape[1:]))
    dist.all_to_all_single(recv, send.contiguous(), list(recv_counts), list(send_counts),
                           group=group)
    return recv


def route_media(out, mb, name):
    """The encoder's output rows ``out`` ([rows, H], the tokens of this rank's items of modality
    ``name`` in ``mb["media"][name]["grid_thw"]`` order) to the ranks whose shards hold their
    tokens: returns [len(token_index), H], row k for local token ``token_index[k]``.
    Collective over ``mb["cp_group"]`` (every CP rank calls it for each declared modality, in
    order, with or without items, and uses the result in its loss); differentiable, its
    backward the reverse all-to-all, run by every rank of the group."""
    media = mb.get("media") if isinstance(mb, dict) else None
    if not media or name not in media:
        declared = sorted(media) if media else []
        raise ValueError(f"route_media: '{name}' is not a declared modality of this microbatch "
                         f"(declared: {declared})")
    route = media[name]["route"]
    if not isinstance(out, torch.Tensor) or out.dim() < 1:
        raise TypeError(f"route_media: out must be a tensor [rows, H], got {type(out).__name__}")
    if out.shape[0] != route["output_rows"]:
        # A language rank beside encoder ranks: a bridge and the colocated route's tables.
        where = (" (the encoder ranks encode them: pass [0, H])"
                 if "bridge" in route and "send_index" in route else "")
        raise ValueError(f"route_media('{name}'): out has {out.shape[0]} rows, this rank's items "
                         f"have {route['output_rows']} tokens (t*h*w / merge**2 each){where}")
    bridge = route.get("bridge")
    if bridge is not None:  # encoders on ranks of their own (encoders.py)
        from .encoders import bridge_rows
        out = bridge_rows(out, bridge)
        if "send_index" not in route:  # an encoder rank: its rows have left
            return out
    cp_group = mb.get("cp_group")
    dev = out.device
    # The backward is collective too: a rank whose rows need no gradient (no items here, so
    # an encoder output made of nothing) must still take part in its peers' backward. The
    # anchor, a leaf that asks for a gradient, gives every rank the node whenever autograd is on.
    anchor = torch.empty(0, device=dev, requires_grad=torch.is_grad_enabled())
    return _RouteMedia.apply(out, anchor, route["send_index"].to(dev), route["send_counts"],
                             route["recv_counts"], route["recv_index"].to(dev), cp_group)
