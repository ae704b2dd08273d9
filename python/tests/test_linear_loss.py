"""thdpack.torch.linear_loss (the lm-head GEMM fused with the loss, a chunk of tokens at a time)
against the unfused loss in float64 - logits = hidden @ weight.T, log_softmax, the masked sum
over N - on fresh random inputs: its value and the gradients of hidden and weight, every chunk
size from one row to all of them, both CPU backends (the C++ kernel and the chunked torch
path), float64, float32 and bfloat16, a grad_output other than 1, one input without a gradient,
N = 0, and the errors of bad shapes."""
import numpy as np
import pytest
import torch

import thdpack.torch as tt


def unfused(hidden, weight, labels, mask, n, factor):
    h = hidden.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    logp = torch.log_softmax(h @ w.t(), -1)
    counted = (labels != -100) & (mask != 0)
    lp = logp.gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1) * counted
    loss = -lp.sum() / n * factor if n > 0 else lp.sum() * 0
    loss.backward()
    return float(loss.detach()), h.grad, w.grad


def inputs(t, v, hdim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(t, hdim, generator=g) / hdim ** 0.25).to(dtype)
    weight = (torch.randn(v, hdim, generator=g) / hdim ** 0.25).to(dtype)
    labels = torch.randint(0, v, (t,), generator=g)
    labels[::5] = -100
    mask = (torch.rand(t, generator=g) > 0.2).float()
    return hidden, weight, labels, mask


TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("chunk", [1, 7, 29, None])
def test_equals_the_unfused_loss(dtype, backend, chunk):
    t, v, hdim = 29, 211, 24
    hidden, weight, labels, mask = inputs(t, v, hdim, dtype, seed=t + (chunk or 0))
    n = int(((labels != -100) & (mask != 0)).sum()) + 4
    want, gh_ref, gw_ref = unfused(hidden, weight, labels, mask, n, 2.0)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss = tt.linear_loss(h, w, labels, mask, n, 2.0, chunk_tokens=chunk, backend=backend)
    assert abs(float(loss.detach()) - want) <= TOL[dtype] * max(1.0, abs(want))
    (loss * 3).backward()
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    for got, ref in ((h.grad, gh_ref), (w.grad, gw_ref)):
        err = float((got.double() - 3 * ref).abs().max())
        assert err <= TOL[dtype] * float(3 * ref.abs().max()) * 4, err


def test_one_input_without_gradient_and_zero_n():
    hidden, weight, labels, mask = inputs(10, 50, 8, torch.float64, seed=1)
    w = weight.clone().requires_grad_(True)
    tt.linear_loss(hidden, w, labels, mask, 20).backward()
    _, _, gw_ref = unfused(hidden, weight, labels, mask, 20, 1.0)
    torch.testing.assert_close(w.grad, gw_ref)
    h = hidden.clone().requires_grad_(True)
    zero = tt.linear_loss(h, weight, labels, torch.zeros_like(mask), 0)
    zero.backward()
    assert float(zero.detach()) == 0.0 and float(h.grad.abs().max()) == 0.0


def test_bad_inputs_are_named():
    hidden, weight, labels, mask = inputs(4, 10, 8, torch.float32, seed=2)
    with pytest.raises(ValueError, match="H must agree"):
        tt.linear_loss(hidden, weight[:, :4], labels, mask, 4)
    with pytest.raises(ValueError, match="share dtype"):
        tt.linear_loss(hidden, weight.double(), labels, mask, 4)
    with pytest.raises(ValueError, match="chunk_tokens"):
        tt.linear_loss(hidden, weight, labels, mask, 4, chunk_tokens=0)
    with pytest.raises(ValueError, match="n_loss_tokens"):
        tt.linear_loss(hidden, weight, labels, mask, -1)
    with pytest.raises(ValueError, match="labels"):
        tt.linear_loss(hidden, weight, torch.full((4,), 10), mask, 4)
    # N below the shard's count, though above every one-row chunk's: the whole shard decides.
    y, m = torch.zeros(4, dtype=torch.long), torch.ones(4)
    with pytest.raises(ValueError, match="GLOBAL"):
        tt.linear_loss(hidden, weight, y, m, 3, chunk_tokens=1)
    # validate=False skips the check with the CUDA kernel only: the CPU backends still check.
    with pytest.raises(ValueError, match=r"labels\[0\] = 10"):
        tt.linear_loss(hidden, weight, torch.full((4,), 10), mask, 4, validate=False)
    with pytest.raises(ValueError, match="GLOBAL"):
        tt.linear_loss(hidden, weight, y, m, 3, chunk_tokens=1, validate=False)
    with pytest.raises(ValueError, match=r"loss_mask\[1\] = 0.5"):
        tt.linear_loss(hidden, weight, y, torch.tensor([1, 0.5, 1, 1]), 4)
    with pytest.raises(ValueError, match="needs backend 'cuda'"):
        tt.linear_loss(hidden, weight, y, m, 4, tp_group=object(), vocab_total=20)


@pytest.mark.parametrize("chunk", [1, 7, None])
def test_token_values_are_the_unfused_per_token_values(chunk):
    """linear_loss(..., token_values=d): the whole shard's per-token values, chunk by chunk, equal
    token_statistics of the unfused logits, and feed LossStatistics like local_loss's."""
    t, v, hdim = 23, 97, 16
    hidden, weight, labels, mask = inputs(t, v, hdim, torch.float64, seed=31)
    n = int(((labels != -100) & (mask != 0)).sum())
    d = {}
    tt.linear_loss(hidden.clone().requires_grad_(True), weight, labels, mask, n,
                   chunk_tokens=chunk, token_values=d).backward()
    assert set(d) == {"logprob", "entropy", "counted"}
    lp, ent, counted = tt.token_statistics(hidden @ weight.t(), labels, mask)
    torch.testing.assert_close(d["logprob"], lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(d["entropy"], ent, rtol=1e-12, atol=1e-12)
    assert torch.equal(d["counted"], counted)
    cu = np.array([0, 5, 17, 23], np.int32)
    one, two = tt.LossStatistics(), tt.LossStatistics()
    one.add_shard(None, labels, mask, cu, cu, token_values=d)
    two.add_shard(hidden @ weight.t(), labels, mask, cu, cu)
    assert one.summary() == pytest.approx(two.summary(), rel=1e-12)
    with pytest.raises(ValueError, match="token_values"):
        tt.linear_loss(hidden, weight, labels, mask, n, token_values=[])
    empty = {}
    tt.linear_loss(hidden[:0], weight, labels[:0], mask[:0], 0, token_values=empty)
    assert empty["logprob"].shape == (0,) and empty["counted"].shape == (0,)
