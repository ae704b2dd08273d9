"""thdpack.torch's loss as an autograd function: the C++ kernel path (CPU) and the chunked torch
path (any device; forced on CPU here) against plain float64 torch and against each other, on
fresh random inputs; the statistics (C++ aggregation, CP all-reduce over gloo) at several world
sizes against a per-sequence float64 reference."""
import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist

import thdpack.torch as tt
from worlds import spawn

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp64", "fp32", "bf16", "fp16"]
# Relative tolerance of the loss and of the gradient: float32 accumulation; the gradient is
# rounded to the logits' dtype (bf16: 8 bits of mantissa, fp16: 11).
TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5),
       torch.bfloat16: (1e-5, 2**-7), torch.float16: (1e-5, 2**-10)}


def random_case(seed, t, v, dtype, ninf=False):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, v, generator=g, dtype=torch.float64) * 3).to(dtype)
    labels = torch.randint(0, v, (t,), generator=g)
    labels[torch.rand(t, generator=g) < 0.2] = -100
    mask = (torch.rand(t, generator=g) < 0.7).float()
    if ninf:  # padded vocabulary columns, and an uncounted row of -inf only
        logits[:, -3:] = float("-inf")
        labels = torch.where(labels >= v - 3, torch.full_like(labels, -100), labels)
        logits[1] = float("-inf")
        labels[1] = -100
    return logits, labels, mask


def reference(logits, labels, mask, n, factor):
    """Plain float64 torch: the share, its gradient, per-token log p and entropy."""
    z = logits.detach().double().requires_grad_(True)
    counted = (labels != -100) & (mask != 0)
    # Uncounted rows (some all -inf) contribute nothing: zeros in their place.
    lp = torch.log_softmax(torch.where(counted[:, None], z, torch.zeros_like(z)), -1)
    tok = torch.where(counted, lp.gather(-1, labels.clamp(min=0)[:, None])[:, 0],
                      torch.zeros((), dtype=torch.float64))
    share = -tok.sum() * factor / n if n > 0 else tok.sum() * 0.0
    share.backward()
    with torch.no_grad():
        p = lp.exp()
        ent = -torch.where(p > 0, p * lp, torch.zeros_like(p)).sum(-1)
        ent = torch.where(counted, ent, torch.zeros_like(ent))
    return share.item(), z.grad, tok.detach(), ent, counted


def run_share(logits, labels, mask, n, factor, **kw):
    z = logits.clone().requires_grad_(True)
    share = tt.local_loss(z, labels, mask, n, grad_factor=factor, **kw)
    share.backward()
    return share, z.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("seed", [1, 2])
def test_local_loss_paths_match_reference_and_each_other(dtype, seed):
    rng = np.random.default_rng(seed)
    t, v = int(rng.integers(20, 90)), int(rng.integers(40, 3000))
    logits, labels, mask = random_case(seed, t, v, dtype, ninf=seed == 2)
    n = int(((labels != -100) & (mask != 0)).sum()) + 3  # a global N above the local count
    factor = [1.0, 4.0][seed % 2]
    ref, ref_grad, _, _, _ = reference(logits, labels, mask, n, factor)
    rtol, gtol = TOL[dtype]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    results = {
        "kernel": run_share(logits, labels, mask, n, factor),
        "chunked": run_share(logits, labels, mask, n, factor, chunked=True, chunk_tokens=7),
        "chunked-default": run_share(logits, labels, mask, n, factor, chunked=True),
    }
    for name, (share, grad) in results.items():
        assert share.dtype == acc, name
        assert share.item() == pytest.approx(ref, rel=rtol), name
        assert grad.dtype == dtype and grad.shape == logits.shape, name
        np.testing.assert_allclose(grad.double().numpy(), ref_grad.numpy(), rtol=gtol,
                                   atol=gtol * factor / n * 1e-2, err_msg=name)
    # The two paths agree with each other more tightly than with the reference.
    k, c = results["kernel"][0].item(), results["chunked"][0].item()
    assert k == pytest.approx(c, rel=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_token_statistics_chunked_matches_kernel(dtype):
    logits, labels, mask = random_case(5, 61, 517, dtype, ninf=True)
    kl, ke, kc = tt.token_statistics(logits, labels, mask)
    cl, ce, cc = tt.token_statistics(logits, labels, mask, chunked=True, chunk_tokens=9)
    _, _, rl, re, rc = reference(logits, labels, mask, 1, 1.0)
    assert torch.equal(kc, rc) and torch.equal(cc, rc)
    rtol = TOL[dtype][0] * 10
    for got in (kl, cl):
        np.testing.assert_allclose(got.double().numpy(), rl.numpy(), rtol=rtol, atol=rtol)
    for got in (ke, ce):
        np.testing.assert_allclose(got.double().numpy(), re.numpy(), rtol=rtol, atol=rtol)
    np.testing.assert_allclose(cl.double().numpy(), kl.numpy(), rtol=rtol, atol=rtol)


def test_local_loss_grad_output_views_and_zero_n():
    logits, labels, mask = random_case(3, 40, 300, torch.float32)
    n = int(((labels != -100) & (mask != 0)).sum())
    _, ref_grad, _, _, _ = reference(logits, labels, mask, n, 1.0)
    # A non-contiguous view goes through the staged kernel path; the gradient reaches the base.
    base = logits.t().contiguous().requires_grad_(True)
    (tt.local_loss(base.t(), labels, mask, n) * 3.0).backward()
    np.testing.assert_allclose(base.grad.t().double().numpy(), 3 * ref_grad.numpy(),
                               rtol=1e-5, atol=1e-9)
    # The share inside a larger graph: the gradient reaches logits through other operations.
    x = logits.clone().requires_grad_(True)
    (tt.local_loss(x * 1.0, labels, mask, n, chunked=True) * 0.5).backward()
    np.testing.assert_allclose(x.grad.double().numpy(), 0.5 * ref_grad.numpy(), rtol=1e-5,
                               atol=1e-9)
    # Under no_grad (or without requires_grad) no gradient is made or kept.
    with torch.no_grad():
        free = tt.local_loss(logits.clone().requires_grad_(True), labels, mask, n)
    assert not free.requires_grad
    with pytest.raises(ValueError, match="GLOBAL loss-token count"):
        tt.local_loss(logits, labels, mask, n - 1)
    # N = 0 with nothing counted: 0 and zero gradients.
    assert tt.local_loss(logits, labels, mask, n).item() == pytest.approx(
        reference(logits, labels, mask, n, 1.0)[0], rel=1e-5)
    for chunked in (False, True):
        z0 = logits.clone().requires_grad_(True)
        zero = tt.local_loss(z0, labels, torch.zeros_like(mask), 0, chunked=chunked)
        zero.backward()
        assert zero.item() == 0.0 and float(z0.grad.abs().sum()) == 0.0



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=["fp32", "bf16", "fp64"])
def test_grad_cache_reuses_only_released_buffers(dtype):
    """The kernel path's gradient buffers come from a cache (bind_grad_cache.cc): a buffer that
    something still holds is never handed out again, a released one is, dirty, and the kernel
    overwrites every element of it; a small call does not take a much larger block."""
    tt.empty_grad_cache()
    tt.set_grad_cache(1)
    try:
        logits, labels, mask = random_case(11, 64, 700, dtype)
        n = int(((labels != -100) & (mask != 0)).sum()) + 2
        _, ref_grad, _, _, _ = reference(logits, labels, mask, n, 1.0)
        gtol = TOL[dtype][1]

        def check(grad):
            np.testing.assert_allclose(grad.double().numpy(), ref_grad.numpy(), rtol=gtol,
                                       atol=gtol / n * 1e-2)

        def grad_of(*case):  # the share is dropped: its graph keeps the leaf and its .grad
            return run_share(*case, n, 1.0)[1]

        g1 = grad_of(logits, labels, mask)
        g2 = grad_of(logits, labels, mask)  # g1 still held: a second block
        assert g1.data_ptr() != g2.data_ptr()
        check(g1)
        check(g2)
        ptr = g2.data_ptr()
        g2.fill_(float("nan"))  # dirty, then released: the next call takes it back
        del g2
        info = tt.grad_cache_info()
        assert info["cached_blocks"] == 1
        hits = info["hits"]
        g3 = grad_of(logits, labels, mask)
        assert g3.data_ptr() == ptr and tt.grad_cache_info()["hits"] == hits + 1
        check(g3)
        del g3
        # A call needing less than half of the cached block gets a block of its own.
        small = grad_of(logits[:8], labels[:8], mask[:8])
        assert small.data_ptr() != ptr
        del small
        # Disabled: released buffers are freed, nothing is cached.
        tt.set_grad_cache(0)
        assert tt.grad_cache_info()["cached_bytes"] == 0
        del g1
        assert tt.grad_cache_info()["cached_blocks"] == 0
        check(grad_of(logits, labels, mask))
        with pytest.raises(ValueError, match="max_blocks"):
            tt.set_grad_cache(-1)
    finally:
        tt.set_grad_cache(1)

def test_local_loss_errors():
    logits, labels, mask = random_case(4, 30, 50, torch.float32)
    n_local = int(((labels != -100) & (mask != 0)).sum())
    for chunked in (False, True):
        z = logits.clone().requires_grad_(True)
        with pytest.raises(ValueError, match="GLOBAL loss-token count"):
            tt.local_loss(z, labels, mask, n_local - 1, chunked=chunked)
        bad = labels.clone()
        bad[(mask != 0) & (labels != -100)] = 50
        with pytest.raises(ValueError, match="labels\\[.*must lie in \\[0, 50\\)"):
            tt.local_loss(z, bad, mask, 100, chunked=chunked)
        nan = logits.clone()
        i = int(((labels != -100) & (mask != 0)).nonzero()[0])
        nan[i, 0] = float("nan")
        with pytest.raises(ValueError, match=f"row {i} has a non-finite"):
            tt.local_loss(nan.requires_grad_(True), labels, mask, 100, chunked=chunked)
        share = tt.local_loss(z, labels, mask, 100, chunked=chunked)
        share.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="backward ran twice"):
            share.backward()
    with pytest.raises(ValueError, match="labels: expected a tensor of shape"):
        tt.local_loss(logits, labels[:5], mask, 10)
    with pytest.raises(ValueError, match="chunk_tokens"):
        tt.local_loss(logits, labels, mask, 100, chunked=True, chunk_tokens=0)


# ---------------------------------------------------------------------------------------------
# Statistics over gloo: every (dp, cp) rank adds its zigzag shards; summary over the world.

def make_microbatch(seed, cp, v):
    """Random sequences packed with padding to multiples of 2*cp: logits [T, V], labels with
    -100 on padding, a 0/1 mask, cu_seqlens, cu_seqlens_padded."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 30, size=int(rng.integers(1, 6)))
    padded = -(-lengths // (2 * cp)) * (2 * cp)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cup = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    t = int(cup[-1])
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, v, generator=g, dtype=torch.float64) * 2
    labels = torch.full((t,), -100, dtype=torch.int64)
    mask = torch.zeros(t)
    for i, (L, s) in enumerate(zip(lengths, cup[:-1])):
        labels[s:s + L] = torch.randint(0, v, (int(L),), generator=g)
        mask[s:s + L] = (torch.rand(int(L), generator=g) < 0.8).float()
    mask[labels == -100] = 0
    return logits, labels, mask, cu, cup


def expected_summary(microbatches):
    """Per sequence in float64, without sharding: the figures of docs/design.md section 8."""
    loss = ent = ppl = 0.0
    n_tok = n_loss = n_seq = 0
    for logits, labels, mask, cu, cup in microbatches:
        lp = torch.log_softmax(logits, -1)
        tok_lp = lp.gather(-1, labels.clamp(min=0)[:, None])[:, 0]
        tok_ent = -(lp.exp() * lp).sum(-1)
        counted = (labels != -100) & (mask != 0)
        for i in range(len(cu) - 1):
            s, L = int(cup[i]), int(cu[i + 1] - cu[i])
            n_tok += L
            c = counted[s:s + L]
            k = int(c.sum())
            if k == 0:
                continue
            seq = float(tok_lp[s:s + L][c].sum())
            loss -= seq
            ent += float(tok_ent[s:s + L][c].sum())
            n_loss += k
            ppl += np.exp(-seq / k)
            n_seq += 1
    return {"n_tokens": n_tok, "n_loss_tokens": n_loss, "loss": loss / n_loss,
            "entropy": ent / n_loss, "ppl": ppl / n_seq}


# (dp, cp) layouts of one spawned world of 4; the world is the DP x CP group.
LAYOUTS = [(2, 2), (1, 4), (4, 1)]


def stats_worker(rank, world, init, out_dir):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    results = {}
    for dp, cp in LAYOUTS:
        d, c = rank // cp, rank % cp
        cp_groups = [dist.new_group(list(range(r * cp, r * cp + cp))) if cp > 1 else None
                     for r in range(dp)]
        # The host path (C++) and the device path (_stats_device, here on CPU tensors).
        for on_device in (False, True):
            stats = tt.LossStatistics()
            for step in range(3):  # microbatches of replica d
                logits, labels, mask, cu, cup = make_microbatch(100 * d + step, cp, 37)
                args = [tt.shard(x, cup, cp, c) for x in (logits, labels, mask)]
                stats.add_shard(*args, cu, cup, cp, c, cp_groups[d], on_device=on_device)
            results[f"{dp}x{cp}" + ("dev" if on_device else "")] = stats.summary(
                group=dist.group.WORLD)
    torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def test_statistics_over_gloo_match_unsharded_reference():
    with tempfile.TemporaryDirectory() as out:
        init = "file://" + os.path.join(out, "rendezvous")
        spawn(stats_worker, args=(4, init, out), nprocs=4)
        got = [torch.load(os.path.join(out, f"{r}.pt")) for r in range(4)]
    for dp, cp in LAYOUTS:
        want = expected_summary([make_microbatch(100 * d + step, cp, 37)
                                 for d in range(dp) for step in range(3)])
        for r in range(4):
            for key in (f"{dp}x{cp}", f"{dp}x{cp}dev"):
                s = got[r][key]
                assert s["n_tokens"] == want["n_tokens"], key
                assert s["n_loss_tokens"] == want["n_loss_tokens"], key
                for k in ("loss", "entropy", "ppl"):
                    assert s[k] == pytest.approx(want[k], rel=1e-12), (key, r, k)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_sums_match_the_host_definition(seed):
    """_stats_device (on_device=True) against C++'s AccumulateShardLoss and LossTotals
    (on_device=False) on fresh random shards of CP rank r of a CP = 1..4 layout with no other
    rank (cp_size 1 each, as CP rank 0 sees it): counted padding tokens, uncounted tokens with
    garbage values, sequences without a loss token, several microbatches added."""
    rng = np.random.default_rng(seed)
    host, dev = tt.LossStatistics(), tt.LossStatistics()
    for _ in range(4):
        lengths = rng.integers(1, 40, size=int(rng.integers(1, 8)))
        padded = lengths + rng.integers(0, 5, size=lengths.size)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        cup = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
        t = int(cup[-1])
        logprob = torch.from_numpy(-rng.exponential(3.0, t))
        entropy = torch.from_numpy(rng.exponential(2.0, t)).float()
        counted = torch.from_numpy(rng.random(t) < 0.6)
        counted[int(cup[1]) - 1] = True  # a padding position may count (the labels say so)
        if lengths.size > 1:
            counted[int(cup[1]):int(cup[2])] = False  # a sequence without a loss token
        d = {"logprob": logprob, "entropy": entropy, "counted": counted}
        host.add_shard(None, None, None, cu, cup, token_values=d, on_device=False)
        dev.add_shard(None, None, None, torch.from_numpy(cu), cup, token_values=d,
                      on_device=True)
    h, g = host.summary(), dev.summary()
    assert g["n_tokens"] == h["n_tokens"] and g["n_loss_tokens"] == h["n_loss_tokens"]
    for k in ("loss", "entropy", "ppl"):
        assert g[k] == pytest.approx(h[k], rel=1e-13), k


def test_device_sums_errors():
    cu = np.array([0, 3, 8], np.int32)
    cup = np.array([0, 4, 8], np.int32)
    d = {"logprob": torch.zeros(8), "entropy": torch.zeros(8),
         "counted": torch.ones(8, dtype=torch.bool)}
    stats = tt.LossStatistics()
    with pytest.raises(ValueError, match="sequence 1 has real length 5"):
        stats.add_shard(None, None, None, cu, cup, token_values=d, on_device=True)
    cu = np.array([0, 3, 7], np.int32)
    with pytest.raises(ValueError, match=r"logprob is \(7,\): the shard has T/CP = 8"):
        stats.add_shard(None, None, None, cu, cup, on_device=True,
                        token_values=dict(d, logprob=torch.zeros(7)))
    with pytest.raises(ValueError, match="cp_group"):
        stats.add_shard(None, None, None, cu, cup, 2, 0, token_values=d, on_device=True)
    with pytest.raises(ValueError, match="token_values: expected the dict"):
        stats.add_shard(None, None, None, cu, cup, token_values=[1], on_device=True)
    stats.add_shard(None, None, None, cu, cup, token_values=d, on_device=True)
    assert stats.summary()["n_tokens"] == 7 and stats.summary()["n_loss_tokens"] == 8
    from thdpack import _thdpack
    with pytest.raises(ValueError, match="n_loss_tokens"):
        _thdpack.LossTotals().add_sums(np.array([1.0, 0.5, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="takes 6"):
        _thdpack.LossTotals().add_sums(np.array([1.0, 2.0]))


def test_loss_totals_raise_the_transports_exception():
    from thdpack import _thdpack
    lp, en = np.array([-1.0, -2.0]), np.array([0.5, 0.25])
    ct = np.array([1, 1], dtype=np.uint8)
    cu, cup = np.array([0, 3], np.int32), np.array([0, 4], np.int32)  # one sequence, CP = 2

    def down(a):
        raise KeyError("transport down")

    t = _thdpack.LossTotals()
    with pytest.raises(KeyError, match="transport down"):
        t.add_shard(lp, en, ct, cu, cup, 2, 0, down)
    with pytest.raises(ValueError, match="cp_all_reduce"):
        t.add_shard(lp, en, ct, cu, cup, 2, 0)
    with pytest.raises(KeyError, match="transport down"):
        t.all_reduce(down)
    # A transport of two identical ranks: the sequence's sums double, its term counts once.
    t.add_shard(lp, en, ct, cu, cup, 2, 0, lambda a: a.__imul__(2))
    s = t.summary()
    assert s["n_loss_tokens"] == 2 and s["n_tokens"] == 1  # zigzag positions 0 and 3 of 3 real
    assert s["ppl"] == pytest.approx(np.exp(6.0 / 4))


@pytest.mark.parametrize("chunked", [False, True])
def test_one_pass_feeds_the_statistics(chunked):
    """local_loss(..., token_values=d) then add_shard(None, ..., token_values=d): the same
    statistics, bit for bit, as add_shard reading the logits again (two shards of one CP
    group of one process each: cp_size 1)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(40, 33, generator=g, dtype=torch.float32, requires_grad=True)
    labels = torch.randint(0, 33, (40,), generator=g)
    labels[::6] = -100
    mask = (torch.rand(40, generator=g) > 0.3).float()
    cu = np.array([0, 11, 25, 40], np.int32)
    one, two = tt.LossStatistics(), tt.LossStatistics()
    d = {}
    tt.local_loss(logits, labels, mask, 60, chunked=chunked, token_values=d).backward()
    assert set(d) == {"logprob", "entropy", "counted"}
    one.add_shard(None, labels, mask, cu, cu, token_values=d)
    two.add_shard(logits.detach(), labels, mask, cu, cu, chunked=chunked)
    assert one.summary() == two.summary()
    three = tt.LossStatistics()  # the same values summed by the device path
    three.add_shard(None, labels, mask, cu, cu, token_values=d, on_device=True)
    assert three.summary() == pytest.approx(one.summary(), rel=1e-13)
    with pytest.raises(ValueError, match="token_values"):
        one.add_shard(None, labels, mask, cu, cu, token_values={"logprob": d["logprob"]})
    with pytest.raises(ValueError, match="token_values"):
        tt.local_loss(logits, labels, mask, 60, token_values=[])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=IDS[:3])
@pytest.mark.parametrize("chunked", [False, True])
def test_logits_masked_with_the_lowest_finite_value(dtype, chunked):
    """masked_fill(mask, finfo.min), scattered and in runs across the C++ kernel's 2048-logit
    chunks: the exps underflow while the shifted logits do not. Entropy and log-probabilities
    against float64 on the same logits."""
    g = torch.Generator().manual_seed(9)
    t, v = 6, 5031
    z = (torch.randn(t, v, generator=g, dtype=torch.float64) * 2).to(dtype)
    low = torch.finfo(dtype).min
    z[:, ::3] = low
    z[0, :4000] = low
    z[1, 2048:4096] = low
    labels = torch.arange(t) * 3 + 4001
    lp, ent, _ = tt.token_statistics(z, labels, chunked=chunked)
    ref = torch.log_softmax(z.double(), -1)
    ref_ent = -(ref.exp() * ref).sum(-1)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(ent.double(), ref_ent, rtol=tol, atol=tol)
    torch.testing.assert_close(lp.double(), ref.gather(1, labels[:, None])[:, 0], rtol=tol,
                               atol=tol)
