"""cross_entropy (C++) and thdpack.torch's loss against torch.nn.functional.cross_entropy."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import thdpack
import thdpack.torch as tt


def random_case(seed, t=37, v=53, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, v, generator=g, dtype=torch.float64) * 3).to(dtype)
    labels = torch.randint(0, v, (t,), generator=g)
    labels[torch.rand(t, generator=g) < 0.2] = -100
    mask = (torch.rand(t, generator=g) < 0.7).float()
    return logits, labels, mask


def reference(logits, labels, mask, normalizer):
    """Plain torch: per-token loss in float64 of the given logits' values, masked; the
    gradient of sum(masked loss) / N by autograd."""
    z = logits.detach().double().requires_grad_(True)
    per_token = F.cross_entropy(z, labels, reduction="none", ignore_index=-100)
    counted = (labels != -100) & (mask != 0)
    per_token = torch.where(counted, per_token, torch.zeros_like(per_token))
    total = per_token.sum()
    (total / normalizer).backward()
    logp = torch.log_softmax(z.detach(), -1)
    entropy = -(logp.exp() * logp).sum(-1)
    return total.item(), per_token.detach(), z.grad, counted, torch.where(counted, entropy, 0 * entropy)


def as_numpy(logits):
    if logits.dtype == torch.bfloat16:
        return logits.view(torch.int16).numpy()
    return logits.numpy()


def grad_to_torch(grad, dtype):
    g = torch.from_numpy(grad)
    return g.view(torch.bfloat16) if dtype == torch.bfloat16 else g


# (dtype, relative tolerance of the loss, of the gradient): fp32/bf16 accumulate in fp32; the
# bf16 gradient is rounded to bf16 (8 bits of mantissa).
CASES = [(torch.float64, 1e-12, 1e-12), (torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-5, 2**-7)]


@pytest.mark.parametrize("dtype,rtol,grad_rtol", CASES, ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_cross_entropy_matches_torch(dtype, rtol, grad_rtol, seed):
    logits, labels, mask = random_case(seed, dtype=dtype)
    normalizer = int(((labels != -100) & (mask != 0)).sum()) + 5  # a global N > local count
    ref_sum, ref_tok, ref_grad, counted, ref_ent = reference(logits, labels, mask, normalizer)
    for label_dtype in (torch.int64, torch.int32):
        out = thdpack.cross_entropy(as_numpy(logits), labels.to(label_dtype).numpy(), mask.numpy(),
                                    normalizer, with_grad=True)
        assert out["n_valid"] == int(counted.sum())
        assert out["loss_sum"] == pytest.approx(ref_sum, rel=rtol)
        np.testing.assert_allclose(-out["logprobs"], ref_tok.numpy(), rtol=rtol, atol=rtol)
        np.testing.assert_allclose(out["entropy"], ref_ent.numpy(), rtol=rtol, atol=rtol)
        grad = grad_to_torch(out["grad"], dtype)
        assert grad.dtype == dtype and grad.shape == logits.shape
        np.testing.assert_allclose(grad.double().numpy(), ref_grad.numpy(),
                                   rtol=grad_rtol, atol=grad_rtol / normalizer * 1e-3)


def test_cross_entropy_without_grad_and_mask_kinds():
    logits, labels, mask = random_case(7)
    base = thdpack.cross_entropy(logits.numpy(), labels.numpy(), mask.numpy(), 0)
    assert "grad" not in base
    for m in (mask.numpy().astype(np.uint8), mask.numpy().astype(bool)):
        out = thdpack.cross_entropy(logits.numpy(), labels.numpy(), m, 0)
        assert out["loss_sum"] == base["loss_sum"]
    no_mask = thdpack.cross_entropy(logits.numpy(), labels.numpy(), None, 0)
    assert no_mask["n_valid"] == int((labels != -100).sum())


def test_cross_entropy_reads_any_layout_as_its_contiguous_copy():
    # A transposed, strided, byte-swapped or misaligned array is read through NumPy's conversion,
    # never as if it were contiguous: the result equals that of the contiguous copy.
    logits, labels, mask = random_case(9)
    x = logits.numpy()
    want = thdpack.cross_entropy(x, labels.numpy(), mask.numpy(), 100, with_grad=True)
    wide = np.zeros((x.shape[0], 2 * x.shape[1]), np.float32)
    wide[:, ::2] = x
    transposed = np.ascontiguousarray(x.T).T
    swapped = x.astype(x.dtype.newbyteorder(">"))
    raw = np.zeros(x.nbytes + 1, np.uint8)
    misaligned = raw[1:].view(np.float32).reshape(x.shape)
    misaligned[:] = x
    for name, given in (("strided", wide[:, ::2]), ("transposed", transposed),
                        ("byte-swapped", swapped), ("misaligned", misaligned),
                        ("read-only", np.lib.stride_tricks.as_strided(x, writeable=False))):
        got = thdpack.cross_entropy(given, labels.numpy()[::-1][::-1], mask.numpy(), 100,
                                    with_grad=True)
        assert got["loss_sum"] == want["loss_sum"], name
        np.testing.assert_array_equal(got["grad"], want["grad"], err_msg=name)
    # A strided grad_out receives the gradient through its strides.
    out = np.zeros((x.shape[0], 2 * x.shape[1]), np.float32)
    thdpack.cross_entropy(x, labels.numpy(), mask.numpy(), 100, with_grad=True,
                          grad_out=out[:, 1::2])
    np.testing.assert_array_equal(out[:, 1::2], want["grad"])
    assert not out[:, ::2].any()
    with pytest.raises(ValueError, match="grad_out: the array is read-only"):
        thdpack.cross_entropy(x, labels.numpy(), mask.numpy(), 100, with_grad=True,
                              grad_out=np.lib.stride_tricks.as_strided(np.empty_like(x),
                                                                       writeable=False))
    y = x.copy()
    with pytest.raises(ValueError, match="grad_out: shares memory with logits"):
        thdpack.cross_entropy(y, labels.numpy(), mask.numpy(), 100, with_grad=True, grad_out=y)
    with pytest.raises(ValueError, match="grad_out: shares memory with logits"):
        thdpack.cross_entropy(wide[:, ::2], labels.numpy(), mask.numpy(), 100, with_grad=True,
                              grad_out=wide[:, 1::2])


def test_cross_entropy_errors_are_value_errors():
    logits, labels, mask = random_case(8)
    with pytest.raises(ValueError, match="logits.*float16"):
        thdpack.cross_entropy(logits.half().numpy(), labels.numpy(), mask.numpy(), 10)
    with pytest.raises(ValueError, match="logits.*expected a 2-D"):
        thdpack.cross_entropy(logits.numpy()[0], labels.numpy(), mask.numpy(), 10)
    bad = labels.clone()
    bad[0], mask[0] = 1000, 1.0
    with pytest.raises(ValueError, match="label"):
        thdpack.cross_entropy(logits.numpy(), bad.numpy(), mask.numpy(), 100)
    with pytest.raises(ValueError, match="labels"):
        thdpack.cross_entropy(logits.numpy(), labels.float().numpy(), mask.numpy(), 100)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_torch_local_loss_matches_torch(dtype):
    logits, labels, mask = random_case(11, dtype=dtype)
    n = int(((labels != -100) & (mask != 0)).sum()) + 3
    ref_sum, _, ref_grad, _, _ = reference(logits, labels, mask, n)
    z = logits.clone().requires_grad_(True)
    share = tt.local_loss(z, labels, mask, n, grad_factor=1.0)
    share.backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert share.item() == pytest.approx(ref_sum / n, rel=tol)
    grad_tol = tol if dtype != torch.bfloat16 else 2**-7
    np.testing.assert_allclose(z.grad.double().numpy(), ref_grad.numpy(), rtol=grad_tol,
                               atol=grad_tol / n * 1e-3)
    # grad_factor multiplies the share and its gradient; N = 0 gives 0, not a division by zero.
    assert tt.local_loss(logits, labels, mask, n, grad_factor=4.0).item() == \
        pytest.approx(4 * ref_sum / n, rel=tol)
    none = torch.zeros_like(mask)
    z0 = logits.clone().requires_grad_(True)
    zero = tt.local_loss(z0, labels, none, 0)
    zero.backward()
    assert zero.item() == 0.0 and float(z0.grad.abs().sum()) == 0.0


def test_torch_statistics_single_rank_by_hand():
    # Two sequences of lengths 3 and 2 (padded 4 and 2 at CP=1): per-token log-probs chosen by
    # building logits whose log-softmax is known.
    v = 4
    logits = torch.zeros(6, v, dtype=torch.float64)   # uniform: log p = -log 4 everywhere
    logits[1, 2] = np.log(3.0)                         # p(2) = 3/6 = 0.5 on token 1
    labels = torch.tensor([1, 2, -100, -100, 3, -100])
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    stats = tt.LossStatistics()
    stats.add_shard(logits, labels, mask, [0, 3, 5], [0, 4, 6])
    s = stats.summary()
    lp0, lp1 = np.log(0.25), np.log(0.5)
    assert s["n_tokens"] == 5 and s["n_loss_tokens"] == 2
    assert s["loss"] == pytest.approx(-(lp0 + lp1) / 2, rel=1e-14)
    assert s["ppl"] == pytest.approx(np.exp(-(lp0 + lp1) / 2), rel=1e-14)  # sequence 1 has none
    ent_uniform = np.log(4.0)
    p = np.array([1, 1, 3, 1]) / 6.0
    assert s["entropy"] == pytest.approx((ent_uniform - (p * np.log(p)).sum()) / 2, rel=1e-14)
    empty = tt.LossStatistics()
    empty.add_shard(logits, labels, torch.zeros(6), [0, 3, 5], [0, 4, 6])
    e = empty.summary()
    assert e["loss"] == 0.0 and e["ppl"] is None and e["n_loss_tokens"] == 0


def test_torch_loss_errors():
    logits, labels, mask = random_case(12)
    bad = mask.clone()
    bad[3] = 0.5
    with pytest.raises(ValueError, match="loss_mask\\[3\\]"):
        tt.local_loss(logits, labels, bad, 10)
    with pytest.raises(ValueError, match="cp_group"):
        tt.LossStatistics().add_shard(logits[:36], labels[:36], mask[:36], [0, 36], [0, 36], 2, 0)
