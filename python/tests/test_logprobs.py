"""token_logprobs, linear_token_logprobs and per_token (thdpack.torch.logprobs): against the plain
rules verl and Megatron use - log_softmax gathered at the label (verl's logprobs_from_logits
naive path), logsumexp - sum(softmax * logits) (verl's entropy_from_logits) - on the whole
vocabulary in float64, gradients too; chunked, with temperature, in both label formats, at TP 2
(vocab-parallel over gloo) and on a real step's CP shards."""
import datetime
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from worlds import spawn

IGNORE = -100


def reference(logits, labels, rows, temperature):
    """verl's rules, per target: log_softmax(logits / T)[row, label], and the entropy of that
    row's distribution; 0 where there is no target."""
    z = logits.double() / temperature
    logp = torch.log_softmax(z, dim=-1)
    ent = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    counted = labels != IGNORE
    lp = logp[rows, labels.clamp(min=0)]
    return torch.where(counted, lp, torch.zeros_like(lp)), \
        torch.where(counted, ent[rows], torch.zeros_like(lp))


def case(seed, t=23, v=17, hf=False, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(t, v, generator=g, dtype=torch.float64)).to(dtype)
    labels = torch.randint(0, v, (t,), generator=g)
    labels[torch.rand(t, generator=g) < 0.3] = IGNORE
    if hf:
        labels[0] = IGNORE
    mb = {"labels": labels, "label_format": "hf" if hf else "megatron"}
    rows = torch.arange(t) - (1 if hf else 0)
    return logits, labels, rows.clamp(min=0), mb


@pytest.mark.parametrize("hf", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, None])
def test_token_logprobs_and_entropy_equal_verls_rules_and_gradients(hf, chunk):
    from thdpack.torch import token_logprobs
    for seed in range(5):
        logits, labels, rows, mb = case(seed, hf=hf)
        temp = [1.0, 0.7, 1.3][seed % 3]
        w1 = torch.randn(len(labels), dtype=torch.float64)
        w2 = torch.randn(len(labels), dtype=torch.float64)
        x = logits.clone().requires_grad_()
        lp, en = token_logprobs(x, mb, temp, entropy=True, chunk_tokens=chunk)
        (lp * w1 + en * w2).sum().backward()
        y = logits.clone().requires_grad_()
        rlp, ren = reference(y, labels, rows, temp)
        (rlp * w1 + ren * w2).sum().backward()
        assert torch.allclose(lp, rlp, rtol=0, atol=1e-12)
        assert torch.allclose(en, ren, rtol=0, atol=1e-12)
        assert torch.allclose(x.grad, y.grad, rtol=0, atol=1e-12)
        # The log-probs alone: a tensor, and its own gradient.
        x2 = logits.clone().requires_grad_()
        token_logprobs(x2, mb, temp, chunk_tokens=chunk).sum().backward()
        y2 = logits.clone().requires_grad_()
        reference(y2, labels, rows, temp)[0].sum().backward()
        assert torch.allclose(x2.grad, y2.grad, rtol=0, atol=1e-12)


def test_low_precision_logits_accumulate_in_float32():
    from thdpack.torch import token_logprobs
    logits, labels, rows, mb = case(3, t=40, v=300)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-4)):
        x = logits.to(dtype)
        lp, en = token_logprobs(x, mb, entropy=True)
        assert lp.dtype == torch.float32
        rlp, ren = reference(x.double(), labels, rows, 1.0)
        assert torch.allclose(lp.double(), rlp, atol=tol), (dtype, (lp.double() - rlp).abs().max())
        assert torch.allclose(en.double(), ren, atol=tol)


def test_linear_token_logprobs_equal_the_logits_path_with_gradients():
    from thdpack.torch import linear_token_logprobs, token_logprobs
    g = torch.Generator().manual_seed(2)
    _, labels, rows, mb = case(4, t=19, v=13)
    h0 = torch.randn(19, 6, generator=g, dtype=torch.float64)
    w0 = torch.randn(13, 6, generator=g, dtype=torch.float64)
    wl = torch.randn(19, dtype=torch.float64)
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    lp, en = linear_token_logprobs(h, w, mb, 0.8, entropy=True, chunk_tokens=5)
    (lp * wl + en).sum().backward()
    h2, w2 = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    rlp, ren = reference(h2 @ w2.t(), labels, rows, 0.8)
    (rlp * wl + ren).sum().backward()
    assert torch.allclose(lp, rlp, atol=1e-12) and torch.allclose(en, ren, atol=1e-12)
    assert torch.allclose(h.grad, h2.grad, atol=1e-12)
    assert torch.allclose(w.grad, w2.grad, atol=1e-12)
    # Same as token_logprobs on the logits it never holds.
    assert torch.allclose(lp, token_logprobs(h0 @ w0.t(), mb, 0.8), atol=1e-12)


def tp_worker(rank, port, out_dir):
    from thdpack.torch import linear_token_logprobs, token_logprobs
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    logits, labels, rows, mb = case(8, t=21, v=16)
    cols = slice(rank * 8, rank * 8 + 8)
    x = logits[:, cols].clone().requires_grad_()
    lp, en = token_logprobs(x, mb, 0.9, entropy=True, tp_group=dist.group.WORLD, chunk_tokens=6)
    w1 = torch.randn(21, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (lp * w1 + en).sum().backward()
    g = torch.Generator().manual_seed(5)
    h0 = torch.randn(21, 4, generator=g, dtype=torch.float64)
    w0 = torch.randn(16, 4, generator=g, dtype=torch.float64)
    h, w = h0.clone().requires_grad_(), w0[cols].clone().requires_grad_()
    llp = linear_token_logprobs(h, w, mb, tp_group=dist.group.WORLD, chunk_tokens=4)
    (llp * w1).sum().backward()
    torch.save((lp.detach(), en.detach(), x.grad, llp.detach(), h.grad, w.grad),
               f"{out_dir}/tp{rank}.pt")
    dist.destroy_process_group()


def test_vocab_parallel_at_tp2_equals_the_whole_vocabulary(tmp_path):
    from test_torch_iterator import free_port
    spawn(tp_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    got = [torch.load(f"{tmp_path}/tp{r}.pt") for r in range(2)]
    logits, labels, rows, _ = case(8, t=21, v=16)
    w1 = torch.randn(21, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = logits.clone().requires_grad_()
    rlp, ren = reference(y, labels, rows, 0.9)
    (rlp * w1 + ren).sum().backward()
    g = torch.Generator().manual_seed(5)
    h0 = torch.randn(21, 4, generator=g, dtype=torch.float64).requires_grad_()
    w0 = torch.randn(16, 4, generator=g, dtype=torch.float64).requires_grad_()
    llp, _ = reference(h0 @ w0.t(), labels, rows, 1.0)
    (llp * w1).sum().backward()
    for r in range(2):
        lp, en, gx, tlp, gh, gw = got[r]
        assert torch.allclose(lp, rlp, atol=1e-12) and torch.allclose(en, ren, atol=1e-12)
        assert torch.allclose(gx, y.grad[:, r * 8:r * 8 + 8], atol=1e-12)
        assert torch.allclose(tlp, llp, atol=1e-12)
        assert torch.allclose(gw, w0.grad[r * 8:r * 8 + 8], atol=1e-12)
    # The hidden states' gradient is the sum of the TP ranks' shares (Megatron's all-reduce).
    assert torch.allclose(got[0][4] + got[1][4], h0.grad, atol=1e-12)


def test_per_token_spreads_each_sequences_value_to_its_tokens():
    from thdpack.torch import per_token
    mb = {"sample_ids": torch.tensor([5, 9, 2]),
          "seq_index": torch.tensor([0, 0, 1, -1, 2, 2, -1], dtype=torch.int32)}
    v = torch.tensor([1.5, -2.0, 4.0], requires_grad=True)
    out = per_token(v, mb)
    assert out.tolist() == [1.5, 1.5, -2.0, 0.0, 4.0, 4.0, 0.0]
    out.sum().backward()
    assert v.grad.tolist() == [2.0, 1.0, 2.0]
    rows = per_token(torch.arange(6.0).reshape(3, 2), mb)
    assert rows.shape == (7, 2) and rows[3].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match=r"one per packed sequence \(3\), got shape \(2,\)"):
        per_token(torch.zeros(2), mb)


def test_errors_are_named():
    from thdpack.torch import token_logprobs
    logits, _, _, mb = case(1)
    with pytest.raises(ValueError, match="temperature = 0: must be a finite number > 0"):
        token_logprobs(logits, mb, 0)
    with pytest.raises(ValueError, match=r"logits: 22 rows, the microbatch's shard holds 23"):
        token_logprobs(logits[:22], mb)
    bad = dict(mb, labels=mb["labels"].clone())
    bad["labels"][2] = 40
    with pytest.raises(ValueError, match=r"mb\['labels'\]\[2\] = 40: a label must lie in "
                                         r"\[0, 17\)"):
        token_logprobs(logits, bad)
    with pytest.raises(ValueError, match="last pipeline stage"):
        token_logprobs(logits, dict(mb, labels=None))


def step_worker(rank, port, world, cp, out_dir):
    """A real step at DP x CP: each rank's log-probs of its shard, given back per sample by
    step.unpack."""
    from test_torch_iterator import make_groups
    from thdpack.torch import pack_batch, token_logprobs
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    groups = make_groups(1, cp, world // cp, 1)
    rng = np.random.default_rng(3)
    samples = [{"input_ids": rng.integers(0, 50, size=int(rng.integers(5, 40)))}
               for _ in range(8)]
    dp, dp_rank, cp_rank = world // cp, rank // cp, rank % cp
    mine = samples[dp_rank::dp] if cp_rank == 0 else None
    step = pack_batch(mine, groups, max_tokens_per_rank=256)
    table = torch.randn(50, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    values = []
    for mb in step:
        values.append(token_logprobs(table[mb["tokens"].long()], mb))
    back = step.unpack(values)
    ids = None if mine is None else [torch.as_tensor(x["input_ids"]) for x in mine]
    torch.save((back, ids), f"{out_dir}/step{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("world,cp", [(2, 2), (4, 2), (4, 4)])
def test_on_a_steps_cp_shards_each_sample_gets_its_own_logprobs(tmp_path, world, cp):
    """token_logprobs on every rank's shard, given back by step.unpack: each sample's log-probs
    as one process computes them on the sample alone (a bigram model, a table of logits)."""
    from test_torch_iterator import free_port
    spawn(step_worker, args=(free_port(), world, cp, str(tmp_path)), nprocs=world)
    table = torch.randn(50, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logp = torch.log_softmax(table, -1)
    seen = 0
    for r in range(world):
        back, mine = torch.load(f"{tmp_path}/step{r}.pt")
        if mine is None:
            assert back == []
            continue
        assert len(back) == len(mine)
        for x, got in zip(mine, back):
            ids = x.long()
            want = torch.zeros(len(ids), dtype=torch.float64)
            want[1:] = logp[ids[:-1], ids[1:]]
            assert torch.allclose(got, want, atol=1e-12)
            seen += 1
    assert seen == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cuda_backward_kernels_arithmetic_equals_autograd_on_the_cpu(dtype):
    """LogprobEntropyBackward's arithmetic (the CUDA kernel's own code, run on the CPU by
    LogprobEntropyBackwardHost with the kernel's column split) against torch's autograd of
    g_lp * log p(target) + g_en * entropy in float64, on random rows: widths around the 16-byte
    vectors and the block sizes, targets or none, rows with no incoming gradient, a
    temperature."""
    from thdpack import _thdpack
    code = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[dtype]
    g = torch.Generator().manual_seed(7 + code)
    for v, threads, inv_temp in [(1, 32, 1.0), (7, 32, 0.7), (64, 256, 1.0), (1031, 256, 1.3),
                                 (4096, 1024, 1.0)]:
        t = 23
        x = (torch.randn(t, v, generator=g) * 3).to(dtype)
        target = torch.randint(0, v, (t,), generator=g)
        target[::5] = -1  # no target on this rank's columns
        g_lp = torch.randn(t, generator=g, dtype=torch.float64)
        g_en = torch.randn(t, generator=g, dtype=torch.float64)
        g_lp[3] = g_en[3] = 0.0  # nothing comes back to this row: zeros, unread
        g_en[4] = 0.0
        g_lp[6] = 0.0
        # A row without a target here has it on another TP rank's columns: the reference holds
        # one more column (that rank's), whose row statistics the kernel is given.
        other = (torch.randn(t, 1, generator=g) * 3).to(dtype)
        xd = torch.cat([x, other], dim=1).to(torch.float64).requires_grad_(True)
        logp = torch.log_softmax(xd * inv_temp, dim=1)
        ent = -(logp.exp() * logp).sum(dim=1)
        where = torch.where(target >= 0, target, torch.full_like(target, v))
        picked = logp.gather(1, where[:, None])[:, 0]
        (g_lp * picked + g_en * ent).sum().backward()
        lse = torch.logsumexp(xd.detach() * inv_temp, dim=1)
        bits = x.numpy() if dtype == torch.float32 else x.view(torch.int16).numpy().view(np.uint16)
        got = _thdpack._cuda_logprob_grad_host(
            bits, target.numpy(), lse.float().numpy(), ent.detach().float().numpy(),
            g_lp.float().numpy(), g_en.float().numpy(), inv_temp, threads, code)
        got = torch.from_numpy(got) if dtype == torch.float32 else \
            torch.from_numpy(got.view(np.int16)).view(dtype)
        want = xd.grad[:, :v]
        assert torch.all(got[3] == 0), v
        # fp32 arithmetic, one rounding to the dtype at the end.
        rel = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
        # Relative to the row's largest gradient, or (V = 1: every gradient 0 but fp32 noise)
        # to the incoming gradients' size.
        floor = ((g_lp.abs() + g_en.abs()) * inv_temp)[:, None]
        scale = torch.maximum(want.abs().amax(dim=1, keepdim=True), floor).clamp(min=1e-30)
        err = ((got.to(torch.float64) - want).abs() / scale).max().item()
        assert err < rel, (dtype, v, err)


def test_the_cuda_backward_needs_cuda_logits_and_names_why():
    from thdpack.torch import _loss_cuda, token_logprobs
    mb = {"labels": torch.tensor([1, 2, -100]), "label_format": "megatron"}
    with pytest.raises(ValueError, match=r"backend='cuda': .*(no CUDA kernels|not a CUDA)"):
        token_logprobs(torch.randn(3, 5), mb, backend="cuda")
    with pytest.raises(ValueError, match=r"backend = 'gpu': expected"):
        token_logprobs(torch.randn(3, 5), mb, backend="gpu")
    from thdpack import _thdpack
    with pytest.raises(ValueError, match=r"target\[0\] = 5: expected -1 or a column"):
        _thdpack._cuda_logprob_grad_host(
            np.zeros((1, 5), np.float32), np.array([5]), *(np.zeros(1, np.float32),) * 4, 1.0,
            32, 0)
    with pytest.raises(ValueError, match=r"lse: expected a contiguous \[T\] array of float32"):
        _thdpack._cuda_logprob_grad_host(
            np.zeros((2, 5), np.float32), np.array([0, 1]), np.zeros(3, np.float32),
            *(np.zeros(2, np.float32),) * 3, 1.0, 32, 0)
    assert _loss_cuda.CUDA_KERNEL_BY_DEFAULT is False  # "auto" keeps the chunked path
