"""Media through CP shards (thdpack.torch.media, docs/media.md): mRoPE positions against
transformers' own get_rope_index, and route_media at CP 1, 2, 4 and CP 2 x SP 2 against one
process that places every encoder row by Megatron's alignment rule (Megatron's own
align_embeddings_by_token_positions where megatron-core is installed): the loss and every gradient
equal. And the named errors."""
import datetime
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from worlds import spawn

IMG, VID = 900, 901
MEDIA = {"image": {"token_id": IMG, "payload": "pixel_values", "grid": "image_grid_thw"},
         "video": {"token_id": VID, "payload": "pixel_values_videos", "grid": "video_grid_thw",
                   "seconds": "second_per_grid_ts"}}
MERGE, D, H, V = 2, 6, 5, 50


def make_samples(seed, n=5, max_items=3):
    """Samples of text (ids 1..V-1) and 0-3 items, each between text tokens as a processor
    writes them, with payload rows of width D (float64) and grids."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids, grids, payload = [], {"image": [], "video": []}, {"image": [], "video": []}
        seconds = []
        ids += list(rng.integers(1, V, size=int(rng.integers(1, 6))))
        for _ in range(int(rng.integers(0, max_items + 1))):
            kind = "image" if rng.random() < 0.6 else "video"
            t = 1 if kind == "image" else int(rng.integers(1, 4))
            h, w = MERGE * int(rng.integers(1, 4)), MERGE * int(rng.integers(1, 4))
            grids[kind].append([t, h, w])
            payload[kind].append(rng.standard_normal((t * h * w, D)))
            if kind == "video":
                seconds.append(float(rng.choice([0.5, 1.0, 2.0 / 3])))
            ids += [IMG if kind == "image" else VID] * (t * (h // MERGE) * (w // MERGE))
            ids += list(rng.integers(1, V, size=int(rng.integers(1, 5))))
        s = {"input_ids": np.asarray(ids, dtype=np.int64),
             "image_grid_thw": np.asarray(grids["image"], dtype=np.int64).reshape(-1, 3),
             "video_grid_thw": np.asarray(grids["video"], dtype=np.int64).reshape(-1, 3),
             "second_per_grid_ts": seconds}
        for kind, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
            s[key] = torch.from_numpy(np.concatenate(payload[kind]) if payload[kind]
                                      else np.zeros((0, D)))
        out.append(s)
    return out


# ---- mRoPE against transformers ----

def _rope_model(kind):
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the mRoPE rule followed is transformers 5.x's")
    import types
    if kind == "qwen2-vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel as M
    else:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as M
    vision = types.SimpleNamespace(spatial_merge_size=MERGE, tokens_per_second=2)
    self = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=vision))
    self.get_vision_position_ids = lambda *a, **k: M.get_vision_position_ids(self, *a, **k)
    return lambda **k: M.get_rope_index(self, **k)


@pytest.mark.parametrize("kind", ["qwen2-vl", "qwen2.5-vl"])
def test_mrope_positions_equal_transformers_get_rope_index(kind):
    from thdpack.torch import mrope_positions
    rope = _rope_model(kind)
    for seed in range(40):
        for s in make_samples(seed, n=3):
            ids = torch.from_numpy(s["input_ids"])[None]
            types_ = torch.zeros_like(ids, dtype=torch.int32)
            types_[ids == IMG] = 1
            types_[ids == VID] = 2
            kw = dict(input_ids=ids, mm_token_type_ids=types_,
                      image_grid_thw=torch.from_numpy(s["image_grid_thw"]),
                      video_grid_thw=torch.from_numpy(s["video_grid_thw"]))
            if kind == "qwen2.5-vl":
                kw["second_per_grid_ts"] = s["second_per_grid_ts"]
            want, _ = rope(**kw)
            got = mrope_positions(s["input_ids"], s, MEDIA, MERGE, kind, tokens_per_second=2)
            assert torch.equal(got, want[:, 0]), (kind, seed, got, want[:, 0])


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_mrope_microbatch_is_each_samples_positions_packed_and_sharded(cp):
    """The [3, T/CP] shard against the whole [3, T] built here from each sample's own positions
    (padding counting on), gathered by the zigzag's partition indices."""
    import thdpack._thdpack as _t
    from thdpack.torch import mrope_microbatch, mrope_positions
    samples = make_samples(7, n=4)
    cu, cup = layout_of(samples, cp, 1)
    whole = np.zeros((3, int(cup[-1])), dtype=np.int64)
    for i, s in enumerate(samples):
        p = mrope_positions(s["input_ids"], s, MEDIA, MERGE, "qwen2.5-vl").numpy()
        n, P = p.shape[1], int(cup[i + 1] - cup[i])
        whole[:, cup[i]:cup[i] + n] = p
        whole[:, cup[i] + n:cup[i + 1]] = p.max() + 1 + np.arange(P - n)
    for r in range(cp):
        idx = np.asarray(_t.cp_partition_indices(cup.astype(np.int32), cp, r))
        got = mrope_microbatch(samples, MEDIA, cu, cup, cp, r, MERGE, "qwen2.5-vl")
        assert np.array_equal(got.numpy(), whole[:, idx])


# ---- route_media against one process ----

def layout_of(samples, cp, sp):
    q = 2 * cp * sp
    lengths = [len(s["input_ids"]) for s in samples]
    padded = [(n + q - 1) // q * q for n in lengths]
    return np.concatenate([[0], np.cumsum(lengths)]), np.concatenate([[0], np.cumsum(padded)])


def encoder(pixel_values, grid_thw, W, W2):
    """A toy vision tower, per item: each merged block's mean row @ W, plus the item's mean row
    @ W2 on every token (a term that mixes the whole item, as attention does)."""
    outs, at = [], 0
    for t, h, w in grid_thw.tolist():
        rows = pixel_values[at:at + t * h * w]
        at += t * h * w
        blocks = rows.reshape(-1, MERGE * MERGE, rows.shape[1]).mean(1)
        outs.append(blocks @ W + rows.mean(0) @ W2)
    return torch.cat(outs) if outs else pixel_values.new_zeros((0, W.shape[1]))


def params(seed=1):
    g = torch.Generator().manual_seed(seed)
    E = torch.randn(V + 1000, H, generator=g, dtype=torch.float64)
    W = torch.randn(D, H, generator=g, dtype=torch.float64)
    W2 = torch.randn(D, H, generator=g, dtype=torch.float64)
    return E, W, W2


def reference(samples, cp, sp):
    """One process: each sample's encoder rows placed at its placeholders (masked_scatter, the
    rule of Megatron's align_embeddings_by_token_positions), packed with zero-id padding; the
    loss sum(embeds * R) and the gradients of E, W, W2."""
    E, W, W2 = (p.requires_grad_() for p in params())
    _, cup = layout_of(samples, cp, sp)
    T = int(cup[-1])
    R = torch.randn(T, H, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    rows = []
    for i, s in enumerate(samples):
        ids = torch.from_numpy(s["input_ids"])
        emb = E[ids]
        for name, spec in MEDIA.items():
            out = encoder(s[spec["payload"]], torch.from_numpy(s[spec["grid"]]), W, W2)
            mask = (ids == spec["token_id"])[:, None].expand_as(emb)
            emb = emb.masked_scatter(mask, out)
        pad = int(cup[i + 1] - cup[i]) - len(ids)
        rows += [emb, E[torch.zeros(pad, dtype=torch.long)]]
    loss = (torch.cat(rows) * R).sum()
    loss.backward()
    return float(loss.detach()), E.grad, W.grad, W2.grad


def route_worker(rank, port, cp, sp, seed, out_dir):
    import thdpack._thdpack as _t
    from thdpack.torch import media_microbatch, route_media
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=cp * sp,
                            timeout=datetime.timedelta(seconds=60))
    # Ranks (cp, sp) = (rank // sp, rank % sp): the CP group of this SP rank.
    cp_rank, sp_rank = rank // sp, rank % sp
    groups = [dist.new_group([c * sp + s for c in range(cp)]) for s in range(sp)]
    samples = make_samples(seed)
    cu, cup = layout_of(samples, cp, sp)
    mb = {"cp_group": groups[sp_rank],
          "media": media_microbatch(samples, MEDIA, cu, cup, cp, cp_rank, sp, sp_rank, MERGE)}
    E, W, W2 = (p.requires_grad_() for p in params())
    T = int(cup[-1])
    R = torch.randn(T, H, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    tokens = np.zeros(T, dtype=np.int64)
    for i, s in enumerate(samples):
        tokens[cup[i]:cup[i] + len(s["input_ids"])] = s["input_ids"]
    idx = _t.cp_partition_indices(cup.astype(np.int32), cp, cp_rank)
    part = len(idx) // sp
    mine = torch.from_numpy(np.asarray(idx[sp_rank * part:(sp_rank + 1) * part], dtype=np.int64))
    embeds = E[torch.from_numpy(tokens)[mine]]
    for name in MEDIA:  # every rank, every declared modality, in order
        m = mb["media"][name]
        rows = route_media(encoder(m["pixel_values"], m["grid_thw"], W, W2), mb, name)
        embeds = embeds.index_put((m["token_index"],), rows)
    loss = (embeds * R[mine]).sum()
    loss.backward()
    payload_rows = sum(int(mb["media"][n]["pixel_values"].shape[0]) for n in MEDIA)
    torch.save((float(loss.detach()), E.grad, W.grad, W2.grad, payload_rows),
               f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("cp,sp", [(1, 1), (2, 1),
                                   pytest.param(4, 1, marks=pytest.mark.no_sanitizer),
                                   pytest.param(2, 2, marks=pytest.mark.no_sanitizer)])
def test_route_media_equals_one_process(tmp_path, cp, sp):
    from test_torch_iterator import free_port
    seed = 10 * cp + sp
    spawn(route_worker, args=(free_port(), cp, sp, seed, str(tmp_path)), nprocs=cp * sp)
    got = [torch.load(f"{tmp_path}/rank{r}.pt") for r in range(cp * sp)]
    loss, gE, gW, gW2 = reference(make_samples(seed), cp, sp)
    assert abs(sum(g[0] for g in got) - loss) <= 1e-12 * max(1.0, abs(loss))
    for k, want in ((1, gE), (2, gW), (3, gW2)):
        total = sum(g[k] for g in got)
        assert torch.allclose(total, want, rtol=1e-12, atol=1e-12), (k, (total - want).abs().max())
    # Each payload row on exactly one CP rank (every SP rank of it holds its CP rank's rows).
    samples = make_samples(seed)
    whole = sum(int(s["pixel_values"].shape[0] + s["pixel_values_videos"].shape[0])
                for s in samples)
    assert sum(got[c * sp][4] for c in range(cp)) == whole


def test_the_reference_rule_is_megatrons_alignment():
    """The one-process rule above (masked_scatter per modality) against Megatron's own function,
    sample by sample."""
    pytest.importorskip("megatron.core")
    from megatron.core.models.mimo.model.base import MimoModel
    E, W, W2 = params()
    for s in make_samples(4, n=8):
        ids = torch.from_numpy(s["input_ids"])
        text = ~((ids == IMG) | (ids == VID))
        embs = {"text": E[ids][text]}
        mine = E[ids]
        for name, spec in MEDIA.items():
            out = encoder(s[spec["payload"]], torch.from_numpy(s[spec["grid"]]), W, W2)
            embs[name] = out
            mine = mine.masked_scatter((ids == spec["token_id"])[:, None].expand_as(mine), out)
        theirs = MimoModel.align_embeddings_by_token_positions(
            None, embs, ids[None], {"image": IMG, "video": VID})
        assert torch.equal(theirs[:, 0], mine)


# ---- errors ----

def test_errors_name_the_sample_the_modality_and_the_counts():
    from thdpack.torch import media_microbatch, media_specs, mrope_positions
    s = make_samples(3, n=1, max_items=0)[0]
    s["input_ids"] = np.concatenate([s["input_ids"], [IMG] * 4, [7]])
    s["image_grid_thw"] = np.asarray([[1, 4, 8]])
    with pytest.raises(ValueError, match=r"samples\[0\]: 'image' item 0 \(grid \[1, 4, 8\]\) "
                                         r"takes 8 'image' tokens \(id 900\), only 4 are left"):
        media_microbatch([s], MEDIA, [0, len(s["input_ids"])], [0, 32], 1, 0)
    s["image_grid_thw"] = np.asarray([[1, 3, 4]])
    with pytest.raises(ValueError, match="divisible by spatial_merge_size 2"):
        mrope_positions(s["input_ids"], s, MEDIA, 2)
    with pytest.raises(ValueError, match="'grid' is missing"):
        media_specs({"image": {"token_id": 1, "payload": "p"}})
    with pytest.raises(ValueError, match=r"unknown keys \['token'\]"):
        media_specs({"image": {"token": 1, "token_id": 1, "payload": "p", "grid": "g"}})
    twice = {"a": {"token_id": 1, "payload": "p", "grid": "g"},
             "b": {"token_id": 1, "payload": "q", "grid": "h"}}
    with pytest.raises(ValueError, match="token_id 1 is another modality's placeholder"):
        mrope_positions([1], {}, twice)
    with pytest.raises(ValueError, match=r"mrope \"qwen3\" is not one of"):
        mrope_positions([1, 2], {}, MEDIA, 2, "qwen3")


def test_route_media_refuses_rows_that_do_not_match():
    from thdpack.torch import media_microbatch, route_media
    s = make_samples(3, n=1, max_items=0)[0]
    s["input_ids"] = np.concatenate([s["input_ids"], [IMG] * 4, [7]])
    s["image_grid_thw"] = np.asarray([[1, 4, 4]])
    s["pixel_values"] = torch.zeros(16, D)
    n = len(s["input_ids"])
    mb = {"media": media_microbatch([s], MEDIA, [0, n], [0, n], 1, 0)}
    with pytest.raises(ValueError, match=r"out has 3 rows, this rank's items have 4 tokens"):
        route_media(torch.zeros(3, H), mb, "image")
    with pytest.raises(ValueError,
                       match=r"'audio' is not a declared modality.*\['image', 'video'\]"):
        route_media(torch.zeros(4, H), mb, "audio")
    assert mb["media"]["video"]["pixel_values"].shape == (0, D)
