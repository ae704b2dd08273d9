"""Media through the step (docs/media.md): pack_batch and PackedDataIterator with media=MEDIA
give every first-stage rank its part of each microbatch's media - the same as
media_microbatch/mrope_microbatch computed from the whole samples - and a model that encodes
its items, routes the rows and places them trains with the loss and gradients of one process,
at DP x CP, with SP, and with prefetch. The step's errors for bad media are named on every
rank."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from test_media import D, H, MEDIA, MERGE, encoder, make_samples, params
from test_torch_iterator import join_gloo
from worlds import spawn

N = 12  # samples in the batch


def sample_weights(sample_id, length):
    """Each sample's per-token weights of the loss, [L, H], the same in any packing."""
    g = torch.Generator().manual_seed(1000 + int(sample_id))
    return torch.randn(length, H, generator=g, dtype=torch.float64)


def one_process(samples):
    """The loss sum over samples of sum(embeds * weights) - each sample's text embeddings with
    its encoder rows placed at its placeholders - and the gradients of E, W, W2."""
    E, W, W2 = (p.requires_grad_() for p in params())
    loss = 0
    for i, s in enumerate(samples):
        ids = torch.from_numpy(s["input_ids"])
        emb = E[ids]
        for name, spec in MEDIA.items():
            out = encoder(s[spec["payload"]], torch.from_numpy(s[spec["grid"]]), W, W2)
            emb = emb.masked_scatter((ids == spec["token_id"])[:, None].expand_as(emb), out)
        loss = loss + (emb * sample_weights(i, len(ids))).sum()
    loss.backward()
    return float(loss.detach()), E.grad, W.grad, W2.grad


def place_rows(embeds, m, rows, sp, sp_range):
    """embeds with one modality's routed rows at its token_index; with SP the positions are
    local to this TP rank's part (sp_range)."""
    if not sp:
        return embeds.index_put((m["token_index"],), rows)
    lo, n = sp_range
    part = embeds[lo:lo + n].index_put((m["token_index"],), rows)
    return torch.cat([embeds[:lo], part, embeds[lo + n:]])


def weighted_sum(embeds, mb, samples, keep):
    """sum(embeds * sample_weights) over the rows `keep`: each token's weight row of its sample
    (stream position mb["sample_ids"][seq]) at its position, 0 on padding."""
    ids = mb["sample_ids"].tolist()
    seq, pos = mb["seq_index"].long(), mb["position_ids"].long()
    weights = torch.zeros_like(embeds)
    for k in range(len(seq)):
        if seq[k] >= 0:
            sid = ids[int(seq[k])]
            weights[k] = sample_weights(sid, len(samples[sid]["input_ids"]))[pos[k]]
    return (embeds[keep] * weights[keep]).sum()


def worker(rank, port, tp, cp, dp, sp, prefetch, out_dir, scheduler="balanced"):
    from test_torch_iterator import make_groups
    from thdpack.torch import (PackedDataIterator, media_microbatch, mrope_microbatch,
                               pack_batch, route_media)
    world = tp * cp * dp
    join_gloo(rank, world, port, timeout=60)
    groups = make_groups(tp, cp, dp, 1)
    tp_rank, cp_rank, dp_rank = rank % tp, (rank // tp) % cp, rank // (tp * cp)
    samples = make_samples(21, n=N)
    loader = tp_rank == 0 and cp_rank == 0
    mine = samples[dp_rank::dp] if loader else None
    # Dynamic: a budget that makes the longer samples take groups of 2 and more, beside groups
    # of one rank.
    kw = dict(media=MEDIA, spatial_merge_size=MERGE, mrope="qwen2.5-vl",
              max_tokens_per_rank=16 if scheduler == "dynamic" else 512, sp=sp,
              scheduler=scheduler)
    if prefetch is None:
        steps = [pack_batch(mine, groups, **kw)]
    else:  # the iterator, two steps of N/2, a step prepared ahead
        it = PackedDataIterator(mine if loader else None, groups, global_batch=N // 2,
                                prefetch=prefetch, steps=2, **kw)
        steps = list(it)
    E, W, W2 = (p.requires_grad_() for p in params())
    loss, checked, sizes, group_of = 0, 0, set(), {}
    for step in steps:
        for mb in step:
            if mb.get("idle"):  # a dynamic step's rank in no group of this microbatch
                assert "media" not in mb
                continue
            sizes.add(mb["cp_size"])
            for i in mb["sample_ids"].tolist():  # each sample's group size
                group_of[i] = mb["cp_size"]
            ids = mb["sample_ids"].tolist()  # stream positions: indices into samples
            whole = [samples[i] for i in ids]
            cu, cup = mb["cu_seqlens_cpu"].numpy(), mb["cu_seqlens_padded_cpu"].numpy()
            sp_size, sp_rank = (tp, tp_rank) if sp else (1, 0)
            c_size, c_rank = mb["cp_size"], mb["cp_rank"]  # the microbatch's group (dynamic)
            want = media_microbatch(whole, MEDIA, cu, cup, c_size, c_rank, sp_size, sp_rank,
                                    MERGE)
            for name in MEDIA:
                got, exp = mb["media"][name], want[name]
                assert torch.equal(got["pixel_values"], exp["pixel_values"]), name
                assert torch.equal(got["grid_thw"], exp["grid_thw"]), name
                assert torch.equal(got["token_index"], exp["token_index"]), name
                for key in ("send_index", "recv_index"):
                    assert torch.equal(got["route"][key], exp["route"][key]), (name, key)
            import thdpack._thdpack as _t  # every key of the microbatch is a reserved name
            assert not set(mb) - set(_t.microbatch_keys()), set(mb) - set(_t.microbatch_keys())
            rope = mrope_microbatch(whole, MEDIA, cu, cup, c_size, c_rank, MERGE, "qwen2.5-vl")
            assert torch.equal(mb["mrope_position_ids"], rope)
            checked += 1
            # The model: text embeddings, each modality's rows encoded here and routed.
            lo, n = mb["sp_range"]
            embeds = E[mb["tokens"].long()]
            for name in MEDIA:
                m = mb["media"][name]
                rows = route_media(encoder(m["pixel_values"], m["grid_thw"], W, W2), mb, name)
                embeds = place_rows(embeds, m, rows, sp, (lo, n))
            keep = slice(lo, lo + n) if sp else slice(None)
            loss = loss + weighted_sum(embeds, mb, samples, keep)
    loss.backward()
    sent = sum(step.bytes_sent["exchange"] for step in steps)
    torch.save((float(loss.detach()), E.grad, W.grad, W2.grad, checked, sorted(sizes), sent,
                group_of, len(steps)), f"{out_dir}/r{rank}.pt")
    dist.destroy_process_group()


CONFIGS = [  # (tp, cp, dp, sp, prefetch, scheduler)
    (1, 1, 2, False, None, "balanced"),
    (1, 2, 1, False, None, "balanced"),
    pytest.param(1, 2, 2, False, None, "balanced", marks=pytest.mark.no_sanitizer),
    pytest.param(1, 4, 1, False, None, "balanced", marks=pytest.mark.no_sanitizer),
    pytest.param(2, 2, 1, True, None, "balanced", marks=pytest.mark.no_sanitizer),
    pytest.param(1, 2, 2, False, 1, "balanced", marks=pytest.mark.no_sanitizer),
    # The dynamic scheduler: a CP group per microbatch, each head placing its group's items.
    (1, 2, 2, False, None, "dynamic"),
    pytest.param(1, 4, 1, False, 1, "dynamic", marks=pytest.mark.no_sanitizer),
]


@pytest.mark.parametrize("tp,cp,dp,sp,prefetch,scheduler", CONFIGS)
def test_the_steps_media_train_as_one_process(tmp_path, tp, cp, dp, sp, prefetch, scheduler):
    from test_torch_iterator import free_port
    world = tp * cp * dp
    spawn(worker, args=(free_port(), tp, cp, dp, sp, prefetch, str(tmp_path), scheduler),
          nprocs=world)
    got = [torch.load(f"{tmp_path}/r{r}.pt") for r in range(world)]
    assert all(g[4] > 0 for g in got)
    if scheduler == "dynamic":  # groups of one rank and of more, both with media
        assert {1, 2} <= set().union(*(g[5] for g in got)), [g[5] for g in got]
        # Each payload row crosses the exchange at most once (to the head that encodes its
        # item), whatever its group's size: the exchange's bytes stay under the payload's plus,
        # for every head of each sample's group, its tokens (int32 and a mask byte) and its
        # media's headers (5 words a modality, 4 an item), and 64 bytes of frames a pair of
        # heads a step. Sending each payload to every head of its group breaks it.
        samples = make_samples(21, n=N)
        group = {i: c for g in got for i, c in g[7].items()}
        payload, each = 0, 0
        for i, s in enumerate(samples):
            keys = ("pixel_values", "pixel_values_videos")
            payload += sum(s[k].numel() * s[k].element_size() for k in keys)
            items = len(s["image_grid_thw"]) + len(s["video_grid_thw"])
            each += group[i] * (5 * len(s["input_ids"]) + 80 + 32 * items)
        bound = payload + each + 64 * world * world * got[0][8]
        assert sum(g[6] for g in got) <= bound, (sum(g[6] for g in got), payload, bound)
    loss, gE, gW, gW2 = one_process(make_samples(21, n=N))
    assert abs(sum(g[0] for g in got) - loss) <= 1e-11 * max(1.0, abs(loss))
    for k, want in ((1, gE), (2, gW), (3, gW2)):
        total = sum(g[k] for g in got)
        assert torch.allclose(total, want, rtol=1e-11, atol=1e-11), (k, (total - want).abs().max())


def error_worker(rank, port, out_dir):
    from test_torch_iterator import make_groups
    from thdpack.torch import PackedDataIterator, pack_batch
    from test_job_agreement import error_of
    join_gloo(rank, 2, port, timeout=60)
    groups = make_groups(1, 1, 2, 1)
    samples = make_samples(21, n=4)
    mine = samples[rank::2]
    got = {}
    kw = dict(media=MEDIA, spatial_merge_size=MERGE, max_tokens_per_rank=512)
    # Rank 1's first sample: an image grid that takes more placeholders than it has.
    bad = [dict(x) for x in mine]
    if rank == 1:
        ids = bad[0]["input_ids"]
        bad[0] = dict(bad[0], input_ids=np.concatenate([ids, [MEDIA["image"]["token_id"]] * 4,
                                                        [3]]),
                      image_grid_thw=np.concatenate([bad[0]["image_grid_thw"], [[1, 4, 8]]]),
                      pixel_values=torch.cat([bad[0]["pixel_values"],
                                              torch.zeros(32, bad[0]["pixel_values"].shape[1],
                                                          dtype=torch.float64)]))
    got["count"] = error_of(lambda: pack_batch(bad, groups, **kw))
    # A payload with a row too few.
    short = [dict(x) for x in mine]
    k = next(i for i, x in enumerate(short) if x["pixel_values"].shape[0] > 0)
    short[k] = dict(short[k], pixel_values=short[k]["pixel_values"][1:])
    got["rows"] = error_of(lambda: pack_batch(short, groups, **kw))
    got["file source"] = error_of(lambda: PackedDataIterator("mock", groups, global_batch=4,
                                                             prefetch=0, **kw))
    got["truncate"] = error_of(lambda: pack_batch(mine, groups, oversize="truncate", **kw))
    got["mrope alone"] = error_of(lambda: pack_batch(mine, groups, mrope="qwen2-vl",
                                                     max_tokens_per_rank=512))
    got["cost unit"] = error_of(lambda: pack_batch(mine, groups, cost="tokens", **kw))
    # Token batches need a source of the whole stream; media need one fed by the caller.
    got["token batches"] = error_of(lambda: PackedDataIterator(
        iter(mine), groups, global_batch_tokens=2048, prefetch=0, **kw))
    got["zero cost"] = error_of(lambda: pack_batch(mine, groups, media_cost=(0, 0), **kw))
    # A measured profile: without an encoder term refused, with one its term is the default.
    got["profile without encoder"] = error_of(
        lambda: pack_batch(mine, groups, cost=f"profile:{out_dir}/lm.json", **kw))
    step = pack_batch(mine, groups, cost=f"profile:{out_dir}/lm_enc.json", **kw)
    got["profile encoder_cost"] = step.figures["encoder_cost"]
    t = torch.ones(1)
    dist.all_reduce(t)  # the world still works
    torch.save((got, float(t)), f"{out_dir}/e{rank}.pt")
    dist.destroy_process_group()


def test_bad_media_is_named_on_every_rank(tmp_path):
    import thdpack.torch as tt
    from test_calibrate import FakeClock
    from test_torch_iterator import free_port
    clock = FakeClock()  # a language model's profile, then one with a vision encoder's term
    tt.calibrate(clock.step, 8192, clock=clock, out=tmp_path / "lm.json", warmup=0, repeats=1)

    def tower(pixels, grid):
        t, h, w = (int(v) for v in grid[0])
        clock.now += 3e-8 * t * h * w + 5e-13 * t * (h * w) ** 2
    enc = tt.calibrate_encoder(tower, tmp_path / "lm.json", out=tmp_path / "lm_enc.json",
                               width=4, dtype=torch.float32, clock=clock, warmup=0,
                               repeats=1)["encoder"]
    spawn(error_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        got, total = torch.load(f"{tmp_path}/e{rank}.pt")
        assert total == 2
        for case, text in (("count", "'image' item 1 (grid [1, 4, 8]) takes 8 'image' tokens "
                                     "(id 900), only 4 are left"),
                           ("rows", "payload has"),
                           ("file source", "media: the samples of 'mock' carry none"),
                           ("truncate", "oversize 'truncate'"),
                           ("mrope alone", "mrope 'qwen2-vl' needs media"),
                           ("cost unit", "with cost 'tokens' (unit: tokens): the encoder's "
                                         "default term"),
                           ("zero cost", "not both 0"),
                           ("token batches", "with a caller-fed source: a token step's size"),
                           ("profile without encoder", "a measured profile with an encoder term "
                                                       "(thdpack.torch.calibrate_encoder)")):
            assert got[case] is not None and text in got[case], (rank, case, got[case])
        # The step charged the profile's term: its encoder cost is the items' under it.
        want = sum(enc["per_patch"] * t * h * w + enc["per_frame_sq"] * t * (h * w) ** 2
                   for x in make_samples(21, n=4)
                   for key in ("image_grid_thw", "video_grid_thw") for t, h, w in x[key])
        assert want > 0 and got["profile encoder_cost"] == pytest.approx(want, rel=1e-12)


# Qwen2-VL's vision tower in training FLOPs (docs/media.md): the step's default encoder term.
QWEN2_VL_TOWER = (3 * 2 * 32 * (4 * 1280 ** 2 + 2 * 1280 * 5120), 3 * 4 * 32 * 1280)


def balance_samples():
    """Eight samples of 4,200 tokens; two (0 and 2) hold a 128 x 128-patch image (4,096
    placeholders) in place of text: equal for the language model, not for the encoder."""
    out = []
    for i in range(8):
        image = i in (0, 2)
        n_img = 4096 if image else 0
        ids = np.concatenate([np.full(38, 7), np.full(n_img, MEDIA["image"]["token_id"]),
                              np.full(4200 - 38 - n_img, 8)]).astype(np.int64)
        out.append({"input_ids": ids,
                    "image_grid_thw": np.asarray([[1, 128, 128]] if image else [],
                                                 dtype=np.int64).reshape(-1, 3),
                    "video_grid_thw": np.zeros((0, 3), dtype=np.int64),
                    "second_per_grid_ts": [],
                    "pixel_values": torch.zeros((16384 if image else 0, D), dtype=torch.float64),
                    "pixel_values_videos": torch.zeros((0, D), dtype=torch.float64)})
    return out


def balance_worker(rank, port, out_dir):
    from test_torch_iterator import make_groups
    from thdpack.torch import pack_batch
    join_gloo(rank, 2, port, timeout=60)
    samples = balance_samples()
    step = pack_batch(samples[rank::2], make_groups(1, 1, 2, 1), media=MEDIA,
                      spatial_merge_size=MERGE, max_tokens_per_rank=8192)
    torch.save(step.figures, f"{out_dir}/b{rank}.pt")
    dist.destroy_process_group()


def test_the_step_balances_the_encoder_over_replicas(tmp_path):
    """The step's plan is the scheduler's with each sample's encoder work (its lengths frame's
    media column) and Qwen2-VL's tower: the two image samples go to different replicas, where
    the language model alone puts them on one; the figures carry the encoder's part."""
    import thdpack
    from test_torch_iterator import free_port
    spawn(balance_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    figures = torch.load(f"{tmp_path}/b0.pt")
    samples = balance_samples()
    order = list(range(0, 8, 2)) + list(range(1, 8, 2))  # loader 0's samples, then loader 1's
    lengths = [len(samples[i]["input_ids"]) for i in order]
    work = np.asarray([[0, 0] if i not in (0, 2) else [16384, 16384 ** 2] for i in order])
    aware = thdpack.schedule(lengths, ids=order, dp_size=2, max_tokens_per_rank=8192,
                             encoder_work=work, encoder_cost=QWEN2_VL_TOWER)
    blind = thdpack.schedule(lengths, ids=order, dp_size=2, max_tokens_per_rank=8192)
    got = [[list(mb["samples"]) for mb in r["microbatches"]] for r in figures["replicas"]]
    want = [[aware.microbatch(d, m).tolist() for m in range(aware.num_microbatches)]
            for d in range(2)]
    assert got == want

    def replica(plan, sample):
        return next(d for d in range(2) for m in range(plan.num_microbatches)
                    if sample in plan.microbatch(d, m).tolist())
    assert replica(aware, 0) != replica(aware, 2)
    assert replica(blind, 0) == replica(blind, 2)  # what the encoder's term is for
    # The encoder's part of each replica's cost, summed plainly from the formula.
    image = QWEN2_VL_TOWER[0] * 16384 + QWEN2_VL_TOWER[1] * 16384 ** 2
    for d, r in enumerate(figures["replicas"]):
        ids = [i for mb in r["microbatches"] for i in mb["samples"]]
        want_enc = image * sum(i in (0, 2) for i in ids)
        assert r["encoder_cost"] == pytest.approx(want_enc, rel=1e-12)
        assert all("encoder_cost" in mb for mb in r["microbatches"])
    assert figures["encoder_cost"] == pytest.approx(2 * image, rel=1e-12)
    assert figures["imbalance"] < 1.01
    # Blind, the replica with both images carries their whole work on top of its half.
    costs = [r["cost"] for r in blind.figures["replicas"]]
    both = replica(blind, 0)
    blind_max = max(costs[both] + 2 * image, costs[1 - both])
    assert blind_max / figures["max_replica_cost"] > 1.15  # 1.22 by the formula


def ranks_worker(rank, port, out_dir):
    from test_torch_iterator import make_groups
    import thdpack._thdpack as _t
    from thdpack.torch import pack_batch
    join_gloo(rank, 4, port, timeout=60)
    samples = make_samples(21, n=N)
    step = pack_batch(samples[rank // 2::2] if rank % 2 == 0 else None, make_groups(1, 2, 2, 1),
                      media=MEDIA, spatial_merge_size=MERGE, max_tokens_per_rank=512)
    mine = []  # per microbatch: this rank's payload bytes and its items' encoder cost
    for mb in step:
        m = mb["media"]
        mine.append((sum(m[n]["pixel_values"].numel() * m[n]["pixel_values"].element_size()
                         for n in MEDIA),
                     sum(_t.media_item_cost([int(v) for v in g]) for n in MEDIA
                         for g in m[n]["grid_thw"])))
    torch.save((step.figures, mine), f"{out_dir}/m{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.no_sanitizer
def test_the_steps_figures_give_each_ranks_media(tmp_path):
    """At DP 2 x CP 2, each loader's figures give, per microbatch of its replica, each CP rank's
    encoder cost and payload bytes - what that rank was handed - and their balance."""
    from test_torch_iterator import free_port
    spawn(ranks_worker, args=(free_port(), str(tmp_path)), nprocs=4)
    got = [torch.load(f"{tmp_path}/m{r}.pt") for r in range(4)]
    for dp in range(2):
        figures = got[2 * dp][0]
        media = figures["media_ranks"]
        assert media["replica"] == dp
        for m in range(len(got[2 * dp][1])):
            for cp in range(2):
                nbytes, cost = got[2 * dp + cp][1][m]
                assert media["payload_bytes"][m][cp] == nbytes
                assert media["encoder_cost"][m][cp] == pytest.approx(cost, rel=1e-12)
            c = media["encoder_cost"][m]
            want = max(c) * 2 / sum(c) if sum(c) > 0 else 1.0
            assert media["encoder_max_over_mean"][m] == pytest.approx(want)
            # The replica's microbatch cost holds its encoder's part: the ranks' sum over CP.
            part = figures["replicas"][dp]["microbatches"][m]["encoder_cost"]
            assert part == pytest.approx(sum(c) / 2, rel=1e-9)
    assert "media_ranks" not in got[1][0]  # a rank that did not plan has the summary only


def stream_sample(i):
    """Stream position i: a sample of text and media (make_samples' mix), its pair id."""
    x = make_samples(3000 + i, n=1)[0]
    x["uid"] = i // 2
    return x


def media_record(step):
    """What a rank holds of a step's media: per microbatch its samples and, per modality, its
    payload's sum, grids and token positions."""
    out = []
    for mb in step:
        m = mb.get("media") or {}
        out.append((mb["sample_ids"].tolist(),
                    [(float(m[n]["pixel_values"].sum()), m[n]["grid_thw"].tolist(),
                      m[n]["token_index"].tolist()) for n in MEDIA if n in m]))
    return out


def everywhere_worker(rank, port, out_dir):
    from test_torch_iterator import make_groups
    from thdpack.torch import PackedDataIterator, loader_positions
    join_gloo(rank, 4, port, timeout=60)
    groups = make_groups(1, 2, 2, 1)
    cp_rank, dp_rank = rank % 2, rank // 2
    G = 8
    kw = dict(media=MEDIA, spatial_merge_size=MERGE, mrope="qwen2-vl", max_tokens_per_rank=512,
              fields={"uid": {"kind": "sample", "dtype": "int64"}}, keep_groups="replica",
              group_field="uid", global_batch=G)

    def share(positions):
        return (stream_sample(p) for p in positions) if cp_rank == 0 else None

    # Uninterrupted: four steps, a step prepared ahead.
    it = PackedDataIterator(share(loader_positions(0, G, 2, dp_rank)), groups, steps=4,
                            prefetch=1, **kw)
    whole = [media_record(step) for step in it]
    # Two steps, the state saved, a new iterator resumed from it for the other two.
    it = PackedDataIterator(share(loader_positions(0, G, 2, dp_rank)), groups, steps=2,
                            prefetch=1, **kw)
    first = [media_record(step) for step in it]
    state = it.state_dict()
    it = PackedDataIterator(share(loader_positions(state, G, 2, dp_rank)), groups, steps=2,
                            prefetch=1, **kw)
    it.load_state_dict(state)
    resumed = [media_record(step) for step in it]
    torch.save((whole, first + resumed), f"{out_dir}/w{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.no_sanitizer
def test_media_under_groups_prefetch_and_resume(tmp_path):
    """Media under keep_groups='replica' (a pair on one replica, its media with it), a step
    prepared ahead, and a run stopped after two steps and resumed from its state: every rank's
    microbatches and media equal the uninterrupted run's, and every sample of the four steps
    is trained exactly once."""
    from test_torch_iterator import free_port
    spawn(everywhere_worker, args=(free_port(), str(tmp_path)), nprocs=4)
    seen, replica_of = [], {}
    for rank in range(4):
        whole, again = torch.load(f"{tmp_path}/w{rank}.pt")
        assert again == whole, rank
        # The first stage holds items (grids) in some microbatch: the media are compared too.
        assert any(grid for step in whole for _, parts in step for _, grid, _ in parts), rank
        for step in whole:
            for ids, _ in step:
                if rank % 2 == 0:  # each sample once, on its CP rank 0
                    seen += ids
                for i in ids:
                    replica_of.setdefault(i // 2, set()).add(rank // 2)
    assert sorted(seen) == list(range(32))
    assert all(len(r) == 1 for r in replica_of.values()), replica_of


def pp_worker(rank, port, out_dir):
    from test_torch_iterator import make_groups
    from thdpack.torch import media_microbatch, mrope_microbatch, pack_batch
    join_gloo(rank, 4, port, timeout=60)
    groups = make_groups(1, 2, 1, 2)  # CP 2 x PP 2: ranks 0, 1 the first stage
    cp_rank, stage = rank % 2, rank // 2
    samples = make_samples(21, n=N)
    step = pack_batch(samples if rank == 0 else None, groups, media=MEDIA,
                      spatial_merge_size=MERGE, mrope="qwen2-vl", max_tokens_per_rank=512)
    seen = []
    for mb in step:
        if stage == 1:  # the last stage holds no media, and no mRoPE
            seen.append(("media" in mb, "mrope_position_ids" in mb))
            continue
        whole = [samples[i] for i in mb["sample_ids"].tolist()]
        cu, cup = mb["cu_seqlens_cpu"].numpy(), mb["cu_seqlens_padded_cpu"].numpy()
        want = media_microbatch(whole, MEDIA, cu, cup, 2, cp_rank, 1, 0, MERGE)
        same = all(torch.equal(mb["media"][n][k], want[n][k]) for n in MEDIA
                   for k in ("pixel_values", "grid_thw", "token_index"))
        rope = mrope_microbatch(whole, MEDIA, cu, cup, 2, cp_rank, MERGE, "qwen2-vl")
        seen.append((same, torch.equal(mb["mrope_position_ids"], rope)))
    torch.save(seen, f"{out_dir}/pp{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.no_sanitizer
def test_media_goes_to_the_first_stage_only(tmp_path):
    from test_torch_iterator import free_port
    spawn(pp_worker, args=(free_port(), str(tmp_path)), nprocs=4)
    for rank in range(4):
        seen = torch.load(f"{tmp_path}/pp{rank}.pt")
        assert seen, rank
        want = (True, True) if rank < 2 else (False, False)
        assert all(s == want for s in seen), (rank, seen)
