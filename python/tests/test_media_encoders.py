"""Encoders on ranks of their own (``encoder_ranks``; thdpack.torch.encoders, docs/media.md):
the language ranks' step hands each item to one encoder rank and routes its output rows back
to the ranks whose shards hold its tokens. Every item is encoded exactly once, each language
rank's token positions are the colocated path's, and a model trained that way has one
process's loss and gradients - at DP x CP, CP 4, TP 2 with and without SP, under the dynamic
scheduler (ranks idle in a microbatch still in its bridge), through pack_batch and the iterator
with prefetch. A language rank's failure, and each refusal, is raised on every
rank, named."""
import inspect

import numpy as np
import pytest
import torch
import torch.distributed as dist

from test_media import MEDIA, MERGE, encoder, make_samples, params
from test_media_step import N, one_process, place_rows, weighted_sum
from test_torch_iterator import join_gloo, make_groups
from worlds import spawn

LOCAL = "use_local_synchronization" in inspect.signature(dist.new_group).parameters
needs_local = pytest.mark.skipif(not LOCAL, reason="torch without new_group("
                                 "use_local_synchronization=True): encoder ranks are refused")


def worker(rank, port, tp, cp, dp, sp, n_enc, prefetch, out_dir, scheduler="balanced"):
    from thdpack.torch import (EncoderIterator, PackedDataIterator, encoder_batch,
                               media_microbatch, pack_batch, route_media)
    n = tp * cp * dp
    join_gloo(rank, n + n_enc, port, timeout=60)
    groups = make_groups(tp, cp, dp, 1, world=tp * cp * dp)
    enc = list(range(n, n + n_enc))
    samples = make_samples(21, n=N)
    E, W, W2 = (p.requires_grad_() for p in params())
    # Dynamic: the budget of test_media_step's, groups of one rank and of more.
    kw = dict(media=MEDIA, spatial_merge_size=MERGE, mrope="qwen2.5-vl",
              max_tokens_per_rank=16 if scheduler == "dynamic" else 512, sp=sp,
              encoder_ranks=enc, scheduler=scheduler)
    if rank in enc:  # the vision tower's rank: its items, encoded, the rows sent
        steps = ([encoder_batch(enc, MEDIA)] if prefetch is None
                 else list(EncoderIterator(enc, MEDIA)))
        loss, items = 0, []
        for mbs in steps:
            for mb in mbs:
                for name in MEDIA:
                    m = mb["media"][name]
                    at = 0
                    for t, h, w in m["grid_thw"].tolist():
                        rows = m["pixel_values"][at:at + t * h * w]
                        at += t * h * w
                        items.append((name, t, h, w, float(rows.sum()), rows[0].tolist()))
                    assert at == m["pixel_values"].shape[0]
                    rows = route_media(encoder(m["pixel_values"], m["grid_thw"], W, W2), mb,
                                       name)
                    assert rows.shape[0] == 0
                    loss = loss + rows.sum()
        loss.backward()
        torch.save((0.0, None, W.grad, W2.grad, 0, items, 0), f"{out_dir}/r{rank}.pt")
        dist.destroy_process_group()
        return
    tp_rank, cp_rank, dp_rank = rank % tp, (rank // tp) % cp, rank // (tp * cp)
    loader = tp_rank == 0 and cp_rank == 0
    mine = samples[dp_rank::dp] if loader else None
    if prefetch is None:
        steps = [pack_batch(mine, groups, **kw)]
    else:  # two steps of N/2
        steps = list(PackedDataIterator(mine if loader else None, groups, global_batch=N // 2,
                                        prefetch=prefetch, steps=2, **kw))
    loss, checked, idle = 0, 0, 0
    for step in steps:
        for mb in step:
            if mb.get("idle"):  # the dynamic scheduler: in no group here, still in the bridge
                for name in MEDIA:
                    m = mb["media"][name]
                    assert m["token_index"].numel() == 0 and m["grid_thw"].shape == (0, 3)
                    rows = route_media(E.new_zeros(0, E.shape[1]), mb, name)
                    assert rows.shape == (0, E.shape[1])
                    loss = loss + 0 * rows.sum()
                idle += 1
                continue
            ids = mb["sample_ids"].tolist()
            whole = [samples[i] for i in ids]
            cu, cup = mb["cu_seqlens_cpu"].numpy(), mb["cu_seqlens_padded_cpu"].numpy()
            sp_size, sp_rank = (tp, tp_rank) if sp else (1, 0)
            c_size, c_rank = mb["cp_size"], mb["cp_rank"]  # the microbatch's group (dynamic)
            want = media_microbatch(whole, MEDIA, cu, cup, c_size, c_rank, sp_size, sp_rank,
                                    MERGE)
            lo, cnt = mb["sp_range"]
            embeds = E[mb["tokens"].long()]
            for name in MEDIA:
                m = mb["media"][name]
                # Nothing to encode here; the colocated path's token positions.
                assert m["pixel_values"].shape[0] == 0 and m["grid_thw"].shape == (0, 3)
                assert torch.equal(m["token_index"], want[name]["token_index"]), name
                rows = route_media(encoder(m["pixel_values"], m["grid_thw"], W, W2), mb, name)
                assert rows.shape[0] == len(m["token_index"])
                embeds = place_rows(embeds, m, rows, sp, (lo, cnt))
            checked += 1
            # Without SP every TP rank holds the whole shard: TP rank 0's term counts.
            if sp or tp_rank == 0:
                keep = slice(lo, lo + cnt) if sp else slice(None)
                loss = loss + weighted_sum(embeds, mb, samples, keep)
            else:
                loss = loss + 0 * embeds.sum()
    loss.backward()
    torch.save((float(loss.detach()), E.grad, W.grad, W2.grad, checked, None, idle),
               f"{out_dir}/r{rank}.pt")
    dist.destroy_process_group()


CONFIGS = [  # (tp, cp, dp, sp, encoder ranks, prefetch: None = pack_batch, scheduler)
    (1, 1, 2, False, 1, 0, "balanced"),
    pytest.param(1, 2, 2, False, 2, None, "balanced", marks=pytest.mark.no_sanitizer),
    pytest.param(1, 4, 1, False, 3, 1, "balanced", marks=pytest.mark.no_sanitizer),
    pytest.param(2, 2, 1, True, 2, 1, "balanced", marks=pytest.mark.no_sanitizer),
    pytest.param(2, 1, 1, False, 1, None, "balanced", marks=pytest.mark.no_sanitizer),
    # The dynamic scheduler: a CP group a microbatch, ranks idle in some (in the bridge still).
    (1, 2, 2, False, 2, None, "dynamic"),
    pytest.param(1, 4, 1, False, 1, 1, "dynamic", marks=pytest.mark.no_sanitizer),
]


def items_of(samples):
    out = []
    for s in samples:
        for name, spec in MEDIA.items():
            at = 0
            for t, h, w in s[spec["grid"]].tolist():
                rows = s[spec["payload"]][at:at + t * h * w]
                at += t * h * w
                out.append((name, t, h, w, float(rows.sum()), rows[0].tolist()))
    return sorted(out)


@needs_local
@pytest.mark.parametrize("tp,cp,dp,sp,n_enc,prefetch,scheduler", CONFIGS)
def test_encoder_ranks_train_as_one_process(tmp_path, tp, cp, dp, sp, n_enc, prefetch,
                                            scheduler):
    from test_torch_iterator import free_port
    n = tp * cp * dp
    spawn(worker, args=(free_port(), tp, cp, dp, sp, n_enc, prefetch, str(tmp_path), scheduler),
          nprocs=n + n_enc)
    got = [torch.load(f"{tmp_path}/r{r}.pt") for r in range(n + n_enc)]
    assert all(g[4] > 0 for g in got[:n])
    if scheduler == "dynamic" and cp == 4:  # a rank idle in a microbatch, in its bridge still
        assert sum(g[6] for g in got[:n]) > 0, [g[6] for g in got[:n]]
    samples = make_samples(21, n=N)
    # Every item of the batch encoded exactly once, over the encoder ranks.
    encoded = sorted(x for g in got[n:] for x in g[5])
    assert encoded == items_of(samples)
    assert all(g[5] for g in got[n:]) or len(encoded) < n_enc  # each encoder rank had work
    loss, gE, gW, gW2 = one_process(samples)
    assert abs(sum(g[0] for g in got) - loss) <= 1e-11 * max(1.0, abs(loss))

    def total(k):
        return sum(g[k] for g in got if g[k] is not None)
    for k, want in ((1, gE), (2, gW), (3, gW2)):
        assert torch.allclose(total(k), want, rtol=1e-11, atol=1e-11), \
            (k, (total(k) - want).abs().max())


def error_worker(rank, port, case, out_dir):
    from test_job_agreement import error_of
    from thdpack.torch import EncoderIterator, PackedDataIterator
    join_gloo(rank, 3, port, timeout=60)
    pp = 2 if case == "pp" else 1
    if pp == 2:  # DP 1 x PP 2 language ranks
        world = dist.new_group([0, 1])
        pp_group = dist.new_group([0, 1])
        from thdpack.torch import Groups
        groups = Groups(pp=pp_group, world=world) if rank < 2 else None
    else:
        groups = make_groups(1, 1, 2, 1, world=2)
    enc = [2]
    samples = make_samples(21, n=4)
    kw = dict(media=MEDIA, spatial_merge_size=MERGE, max_tokens_per_rank=512,
              encoder_ranks=enc, prefetch=0, global_batch=2)
    if case == "bad sample" and rank == 1:  # a payload with a row too few
        k = next(i for i in range(1, 4, 2) if samples[i]["pixel_values"].shape[0] > 0)
        samples[k] = dict(samples[k], pixel_values=samples[k]["pixel_values"][1:])
    if case == "lm rank as encoder":
        kw["encoder_ranks"] = [1, 2]

    def run():
        if rank in enc:
            for _ in EncoderIterator(enc, MEDIA):
                pass
            return
        loader = pp == 1 or rank == 0
        share = iter(samples[rank::2] if pp == 1 else samples) if loader else None
        for _ in PackedDataIterator(share, groups, steps=2, **kw):
            pass
    torch.save(error_of(run), f"{out_dir}/r{rank}.pt")
    dist.destroy_process_group()


ERRORS = {  # case: what every rank's error names
    "bad sample": "payload",
    "pp": "encoder_group",
    "lm rank as encoder": "encoder_ranks",
}


@needs_local
@pytest.mark.parametrize("case", sorted(ERRORS))
def test_a_language_ranks_failure_is_every_ranks(tmp_path, case):
    from test_torch_iterator import free_port
    spawn(error_worker, args=(free_port(), case, str(tmp_path)), nprocs=3)
    got = [torch.load(f"{tmp_path}/r{r}.pt") for r in range(3)]
    for r, e in enumerate(got):
        assert e is not None and ERRORS[case] in e, (case, r, e)


@pytest.mark.skipif(LOCAL, reason="refused only where torch cannot make a group of some ranks")
def test_encoder_ranks_refused_where_torch_cannot(tmp_path):
    from test_torch_iterator import free_port
    spawn(error_worker, args=(free_port(), "old torch", str(tmp_path)), nprocs=3)
    got = [torch.load(f"{tmp_path}/r{r}.pt") for r in range(3)]
    for r, e in enumerate(got):
        assert e is not None and "use_local_synchronization" in e, (r, e)


def killed_worker(rank, port, out_dir):
    """DP 2 + 1 encoder rank, whose process is killed (SIGKILL) as it holds its first step."""
    import os
    import signal
    import time
    from thdpack.torch import EncoderIterator, PackedDataIterator, route_media
    join_gloo(rank, 3, port, timeout=60)
    groups = make_groups(1, 1, 2, 1, world=2)
    samples = make_samples(21, n=N)
    E, W, W2 = (p.requires_grad_() for p in params())
    if rank == 2:
        for _ in EncoderIterator([2], MEDIA):
            os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    error = None
    try:
        for step in PackedDataIterator(samples[rank::2], groups, global_batch=N // 2, steps=2,
                                       media=MEDIA, spatial_merge_size=MERGE, prefetch=1,
                                       max_tokens_per_rank=512, encoder_ranks=[2]):
            for mb in step:
                for name in MEDIA:
                    m = mb["media"][name]
                    route_media(encoder(m["pixel_values"], m["grid_thw"], W, W2), mb, name)
    except Exception as e:  # noqa: BLE001 - what a rank sees when its peer dies
        error = f"{type(e).__name__}: {e}"
    torch.save((error, time.monotonic() - t0), f"{out_dir}/r{rank}.pt")
    os._exit(0)  # the dead peer leaves gloo's teardown nothing to agree with


@needs_local
@pytest.mark.no_sanitizer
def test_a_killed_encoder_rank_fails_the_language_ranks_promptly(tmp_path):
    """No language rank waits for an encoder rank that died: each raises within seconds (not
    the group's 60 s timeout)."""
    import multiprocessing
    from test_torch_iterator import free_port
    ctx = multiprocessing.get_context("forkserver")
    port = free_port()
    procs = [ctx.Process(target=killed_worker, args=(r, port, str(tmp_path))) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert procs[2].exitcode == -9
    for r in range(2):
        error, seconds = torch.load(f"{tmp_path}/r{r}.pt")
        assert error is not None and "over the encoder bridge" in error, (r, error)
        assert seconds < 30, (r, seconds, error)


def resume_worker(rank, port, out_dir):
    """DP 2 x CP 2 + 1 encoder rank: four steps uninterrupted, then two steps, the state saved,
    both sides' iterators closed, and two more resumed from the state (a new EncoderIterator
    beside them). What each rank holds and routes, and what the encoder encodes, per step."""
    from test_media_step import stream_sample
    from thdpack.torch import EncoderIterator, PackedDataIterator, loader_positions, route_media
    join_gloo(rank, 5, port, timeout=60)
    groups = make_groups(1, 2, 2, 1, world=4)
    E, W, W2 = params()
    G = 8
    kw = dict(media=MEDIA, spatial_merge_size=MERGE, max_tokens_per_rank=512, global_batch=G,
              prefetch=1, encoder_ranks=[4])

    def encode(steps):  # the encoder rank: per step its items (grid, payload sum)
        out = []
        for mbs in steps:
            got = []
            for mb in mbs:
                for name in MEDIA:
                    m = mb["media"][name]
                    got += [(name, g, round(float(m["pixel_values"].sum()), 9))
                            for g in m["grid_thw"].tolist()] if len(m["grid_thw"]) else []
                    route_media(encoder(m["pixel_values"], m["grid_thw"], W, W2), mb, name)
            out.append(sorted(got))
        return out

    def train(it):  # a language rank: per step its samples and the rows it was routed
        out = []
        for step in it:
            got = []
            for mb in step:
                rows = [route_media(encoder(m["pixel_values"], m["grid_thw"], W, W2), mb, n)
                        for n, m in mb["media"].items()]
                got.append((mb["sample_ids"].tolist(),
                            [round(float(r.sum()), 9) for r in rows],
                            [mb["media"][n]["token_index"].tolist() for n in MEDIA]))
            out.append(got)
        return out

    if rank == 4:
        whole = encode(EncoderIterator([4], MEDIA))
        again = encode(EncoderIterator([4], MEDIA)) + encode(EncoderIterator([4], MEDIA))
    else:
        dp_rank, cp_rank = rank // 2, rank % 2

        def sample(p):
            x = stream_sample(p)
            x.pop("uid")  # a field this run does not declare
            return x

        def share(positions):
            return (sample(p) for p in positions) if cp_rank == 0 else None
        whole = train(PackedDataIterator(share(loader_positions(0, G, 2, dp_rank)), groups,
                                         steps=4, **kw))
        it = PackedDataIterator(share(loader_positions(0, G, 2, dp_rank)), groups, steps=2, **kw)
        first = train(it)
        state = it.state_dict()
        it.close()
        it = PackedDataIterator(share(loader_positions(state, G, 2, dp_rank)), groups, steps=2,
                                **kw)
        it.load_state_dict(state)
        again = first + train(it)
    torch.save((whole, again), f"{out_dir}/r{rank}.pt")
    dist.destroy_process_group()


@needs_local
@pytest.mark.no_sanitizer
def test_encoder_ranks_stop_and_resume_as_the_uninterrupted_run(tmp_path):
    """A run with an encoder rank stopped after two steps and resumed from its state hands
    every language rank the uninterrupted run's samples, token positions and routed rows, and
    the encoder rank the same items, each sample of the four steps once."""
    from test_torch_iterator import free_port
    spawn(resume_worker, args=(free_port(), str(tmp_path)), nprocs=5)
    seen = []
    for rank in range(5):
        whole, again = torch.load(f"{tmp_path}/r{rank}.pt")
        assert again == whole, rank
        assert len(whole) == 4
        if rank == 4:
            assert any(whole), "the encoder rank encoded nothing"
        elif rank % 2 == 0:
            seen += [i for step in whole for ids, _, _ in step for i in ids]
    assert sorted(seen) == list(range(32))
