"""thdpack's CUDA cross-entropy through thdpack.torch.local_loss(backend="cuda") and
token_statistics: the values and gradients against F.cross_entropy in float64 on the same
(rounded) logits, every dtype, V not a multiple of any block size, masked and ignored tokens,
N = 0, rows with a stride, in place, without validation, a bad label named, the
vocab-parallel path (partials, one all-gather, combine, finish) over a one-process gloo-free
split, both kernel versions, and the backward's scaling by grad_output on the device. The tests
marked `cuda` run wherever torch sees a GPU (those of the one-read kernel also carry `one_read`,
so that scripts/device_check.sh can run them in a process of their own); the others run
everywhere and check what a machine without one must say."""
import pytest
import torch
import torch.nn.functional as F

import thdpack
import thdpack.torch as tt
from thdpack import _thdpack

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-6, torch.float16: 2e-6}
GRAD_REL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


def reference(logits, labels, mask, n, factor):
    """float64 per-token log p, entropy and the gradient of the share -sum(log p)/N*factor."""
    z = logits.detach().double().requires_grad_(True)
    counted = (labels != -100) & (mask != 0)
    logp = torch.log_softmax(z, -1)
    lp = torch.where(counted, -F.cross_entropy(z, labels.clamp(min=0), reduction="none"),
                     torch.zeros_like(z[:, 0]))
    ent = torch.where(counted, -(logp.exp() * logp).sum(-1), torch.zeros_like(lp))
    share = -lp.sum() / n * factor if n > 0 else lp.sum() * 0
    share.backward()
    return lp.detach(), ent.detach(), z.grad


def make(t, v, dtype, seed, ld=None):
    g = torch.Generator(device="cpu").manual_seed(seed)
    full = torch.randn(t, ld or v, generator=g) * 3
    logits = full.to(dtype).cuda()[:, :v]
    labels = torch.randint(0, v, (t,), generator=g)
    labels[::7] = -100
    mask = (torch.rand(t, generator=g) > 0.2).float()
    return logits, labels.cuda(), mask.cuda()


def test_backend_cuda_is_a_clear_error_where_it_cannot_run():
    x = torch.randn(4, 10)
    with pytest.raises(ValueError, match="backend 'cuda'"):
        tt.local_loss(x, torch.zeros(4, dtype=torch.long), None, 4, backend="cuda")
    with pytest.raises(ValueError, match="inplace=True"):
        tt.local_loss(x, torch.zeros(4, dtype=torch.long), None, 4, inplace=True)
    with pytest.raises(ValueError, match="backend = 'gpu'"):
        tt.token_statistics(x, torch.zeros(4, dtype=torch.long), backend="gpu")
    with pytest.raises(ValueError, match="tp_group"):
        tt.local_loss(x, torch.zeros(4, dtype=torch.long), None, 4, tp_group=object(),
                      vocab_total=20)
    # The module is built with the kernels wherever nvcc was at build time; a call without a GPU
    # is an error that says why, never a crash.
    if _thdpack.cuda_loss_built() and not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CrossEntropyFused: CUDA error"):
            _thdpack._cuda_cross_entropy("fused", 1, 1, 2, 3, 3, 1, 0, 0, 0, 1.0, 0, 0, 0, 0, 0,
                                         0)
    with pytest.raises(ValueError, match="labels\\[5\\]"):
        _thdpack._cuda_loss_error((1 << 48) | 5, 100)
    # The version is checked on the host, before any launch, in every build.
    with pytest.raises(ValueError, match="version = 7"):
        _thdpack._cuda_cross_entropy("fused", 1, 1, 2, 3, 3, 1, 0, 0, 0, 1.0, 0, 0, 0, 0, 0, 0,
                                     version=7)
    with pytest.raises(ValueError, match="ld = 2"):
        _thdpack._cuda_scale_grad(1, 1, 2, 3, 2, 1, 0)
    if _thdpack.cuda_loss_built() and not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="ScaleGradient: CUDA error"):
            _thdpack._cuda_scale_grad(1, 1, 2, 3, 3, 1, 0)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,v,ld", [(37, 1000, None), (64, 32000, None), (9, 151936, None),
                                    (13, 4099, 4104), (5, 7, None)])
def test_kernel_equals_float64(dtype, t, v, ld, version, monkeypatch):
    from thdpack.torch import _loss_cuda
    monkeypatch.setattr(_loss_cuda, "KERNEL_VERSION", version)
    logits, labels, mask = make(t, v, dtype, seed=t * v, ld=ld)
    n = int(((labels != -100) & (mask != 0)).sum()) + 3
    lp_ref, ent_ref, grad_ref = reference(logits, labels, mask, n, 2.0)
    lp, ent, counted = tt.token_statistics(logits, labels, mask, backend="cuda")
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), lp_ref, rtol=TOL[dtype], atol=TOL[dtype] * 10)
    torch.testing.assert_close(ent.double(), ent_ref, rtol=TOL[dtype], atol=TOL[dtype] * 10)
    x = logits.clone().requires_grad_(True)
    share = tt.local_loss(x, labels, mask, n, 2.0, backend="cuda")
    torch.testing.assert_close(share.double(), -lp_ref.sum() / n * 2.0, rtol=1e-6, atol=1e-6)
    share.backward()
    assert x.grad.dtype == dtype
    err = (x.grad.double() - grad_ref).abs()
    # float16 gradients of a large V are subnormal, where one step is 2^-24.
    floor = 2 ** -24 if dtype == torch.float16 else 0.0
    bound = GRAD_REL[dtype] * grad_ref.abs() + 1e-6 * 2.0 / n + floor
    assert bool((err <= bound).all()), float((err - bound).max())


@cuda
@pytest.mark.cuda
def test_in_place_without_validation_and_zero_n():
    logits, labels, mask = make(50, 5000, torch.bfloat16, seed=5)
    n = int(((labels != -100) & (mask != 0)).sum())
    _, _, grad_ref = reference(logits, labels, mask, n, 1.0)
    x = logits.clone()
    ptr = x.data_ptr()
    lp, _, _, grad = thdpack.torch.loss._per_token(x, labels, mask, n, True, 1.0, False, None,
                                                  "cuda", True, False)
    assert grad.data_ptr() == ptr  # the logits became their gradient
    err = (x.double() - grad_ref).abs()
    assert bool((err <= 2 ** -7 * grad_ref.abs() + 1e-6 / n).all())
    zero = tt.local_loss(logits.clone().requires_grad_(True), labels, torch.zeros_like(mask), 0,
                         backend="cuda")
    assert float(zero.detach()) == 0.0


@cuda
@pytest.mark.cuda
def test_bad_label_names_the_token():
    logits, labels, mask = make(8, 100, torch.float32, seed=1)
    labels[3] = 100
    mask[3] = 1
    with pytest.raises(ValueError, match="labels\\[3\\]"):
        tt.local_loss(logits, labels, mask, 8, backend="cuda")


@cuda
@pytest.mark.cuda
def test_vocab_parallel_pieces_equal_the_whole_row():
    """The partials of uneven column ranges, combined, equal the whole row (one process: the
    all-gather is a stack)."""
    t, v = 33, 3001
    logits, labels, mask = make(t, v, torch.bfloat16, seed=9)
    n = int(((labels != -100) & (mask != 0)).sum())
    lp_ref, _, grad_ref = reference(logits, labels, mask, n, 1.0)
    cuts = [0, 1000, 1001, 2500, v]
    parts = []
    stream = torch.cuda.current_stream().cuda_stream
    for a, b in zip(cuts[:-1], cuts[1:]):
        cols = logits[:, a:b].contiguous()
        stats = torch.empty(t, 4, device="cuda")
        lp = torch.empty(t, device="cuda")
        _thdpack._cuda_cross_entropy("partials", 1, cols.data_ptr(), t, b - a, b - a,
                                     labels.data_ptr(), mask.data_ptr(), a, v, 0.0, 0,
                                     lp.data_ptr(), 0, stats.data_ptr(), 0, stream)
        parts.append((a, b, cols, stats))
    gathered = torch.stack([p[3] for p in parts])
    merged = torch.empty(t, 4, device="cuda")
    _thdpack._cuda_combine_partials(gathered.data_ptr(), len(parts), t, merged.data_ptr(), stream)
    for a, b, cols, _ in parts:
        grad = torch.empty_like(cols)
        lp = torch.empty(t, device="cuda")
        _thdpack._cuda_cross_entropy("finish", 1, cols.data_ptr(), t, b - a, b - a,
                                     labels.data_ptr(), mask.data_ptr(), a, v, 1.0 / n,
                                     grad.data_ptr(), lp.data_ptr(), 0, merged.data_ptr(), 0,
                                     stream)
        torch.testing.assert_close(lp.double(), lp_ref, rtol=2e-6, atol=2e-5)
        err = (grad.double() - grad_ref[:, a:b]).abs()
        assert bool((err <= 2 ** -7 * grad_ref[:, a:b].abs() + 1e-6 / n).all())


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_loss_on_the_kernel_equals_float64(dtype):
    g = torch.Generator().manual_seed(4)
    t, v, h = 300, 5003, 64
    hidden = (torch.randn(t, h, generator=g) / 3).to(dtype).cuda().requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) / 3).to(dtype).cuda().requires_grad_(True)
    labels = torch.randint(0, v, (t,), generator=g).cuda()
    mask = torch.ones(t, device="cuda")
    hd, wd = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    ref = -torch.log_softmax(hd @ wd.t(), -1).gather(-1, labels[:, None]).sum() / t
    ref.backward()
    loss = tt.linear_loss(hidden, weight, labels, mask, t, chunk_tokens=64, backend="cuda")
    loss.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert abs(float(loss.detach()) - float(ref.detach())) <= tol * abs(float(ref.detach()))
    for got, want in ((hidden.grad, hd.grad), (weight.grad, wd.grad)):
        assert float((got.double() - want).abs().max()) <= 4 * tol * float(want.abs().max())
    # Without validation the same values, and nothing read back from the device.
    h2 = hidden.detach().clone().requires_grad_(True)
    again = tt.linear_loss(h2, weight.detach(), labels, mask, t, chunk_tokens=64,
                           backend="cuda", validate=False)
    again.backward()
    assert float(again.detach()) == float(loss.detach())
    assert torch.equal(h2.grad, hidden.grad)
    # The weight's gradient through the float32-output GEMM equals the widened path's.
    from thdpack.torch import linear_loss as ll
    if ll._FP32_OUT_GEMM and dtype != torch.float32:
        saved = ll._FP32_OUT_GEMM
        try:
            ll._FP32_OUT_GEMM = False
            w2 = weight.detach().clone().requires_grad_(True)
            tt.linear_loss(hidden.detach(), w2, labels, mask, t, chunk_tokens=64,
                           backend="cuda").backward()
        finally:
            ll._FP32_OUT_GEMM = saved
        torch.testing.assert_close(weight.grad.float(), w2.grad.float(), rtol=1e-2, atol=1e-6)
    bad = labels.clone()
    bad[7] = v
    with pytest.raises(ValueError, match=r"labels\[7\]"):
        tt.linear_loss(hidden, weight, bad, mask, t, chunk_tokens=64, backend="cuda")


@cuda
@pytest.mark.cuda
def test_statistics_on_the_device_equal_the_host_ones():
    """The kernel's per-token values summed per sequence on the GPU (LossStatistics picks the
    device path for CUDA values) against the same values summed by C++ on the host."""
    import numpy as np
    logits, labels, mask = make(96, 5003, torch.bfloat16, 21)
    cu = np.array([0, 10, 40, 41, 90], np.int32)
    cup = np.array([0, 16, 48, 56, 96], np.int32)
    d = {}
    tt.local_loss(logits.detach().requires_grad_(True), labels, mask, 200, backend="cuda",
                  token_values=d).backward()
    assert d["logprob"].is_cuda
    dev, host = tt.LossStatistics(), tt.LossStatistics()
    dev.add_shard(None, labels, mask, cu, cup, token_values=d)
    assert dev._device_sums is not None and dev._device_sums.is_cuda
    host.add_shard(None, labels, mask, cu, cup, token_values=d, on_device=False)
    got, want = dev.summary(), host.summary()
    assert got["n_tokens"] == want["n_tokens"] and got["n_loss_tokens"] == want["n_loss_tokens"]
    for k in ("loss", "entropy", "ppl"):
        assert got[k] == pytest.approx(want[k], rel=1e-12), k


@cuda
@pytest.mark.cuda
def test_nothing_synchronises_without_validation():
    """local_loss (its backward scaled by grad_output too) and linear_loss with validate=False,
    and the statistics' device path, make no host synchronisation (torch's sync debug mode
    turns one into an error)."""
    import numpy as np
    logits, labels, mask = make(64, 5003, torch.bfloat16, 3)
    cu = np.array([0, 30, 64], np.int32)
    hidden = (torch.randn(64, 32, device="cuda") / 4).bfloat16().requires_grad_(True)
    weight = (torch.randn(5003, 32, device="cuda") / 4).bfloat16().requires_grad_(True)
    stats = tt.LossStatistics()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        d = {}
        x = logits.detach().clone().requires_grad_(True)
        tt.local_loss(x, labels, mask, 100, backend="cuda", validate=False,
                      token_values=d).backward()
        # A scaled loss: grad_output (0.5) is read on the device, not on the host.
        x2 = logits.detach().clone().requires_grad_(True)
        (tt.local_loss(x2, labels, mask, 100, backend="cuda", validate=False) * 0.5).backward()
        stats.add_shard(None, labels, mask, cu, cu, token_values=d)
        tt.linear_loss(hidden, weight, labels, mask, 100, chunk_tokens=16, backend="cuda",
                       validate=False).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert stats.summary()["n_tokens"] == 64


@cuda
@pytest.mark.cuda
def test_the_kernel_call_is_captured_in_a_cuda_graph():
    """With validate=False the kernel's call records into a CUDA graph; a replay on new logits
    gives what a direct call gives."""
    from thdpack.torch.loss import _per_token
    logits, labels, mask = make(40, 3001, torch.bfloat16, 8)
    x = logits.clone()

    def call():
        return _per_token(x, labels, mask, 50, True, 1.0, False, None, "cuda", False, False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lp, ent, _, grad = call()
    fresh, _, _ = make(40, 3001, torch.bfloat16, 9)
    x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    want_lp, want_ent, _, want_grad = _per_token(fresh, labels, mask, 50, True, 1.0, False, None,
                                                 "cuda", False, False)
    assert torch.equal(lp, want_lp) and torch.equal(ent, want_ent)
    assert torch.equal(grad, want_grad)


@cuda
@pytest.mark.cuda
def test_backward_scales_by_grad_output_on_the_device():
    """A loss scaled after local_loss (grad_output != 1) gets its gradient multiplied on the
    device in fp32 and rounded once; grad_output = 1 leaves the forward's gradient as it was
    (the kernel reads it and writes nothing). Every dtype, rows with a stride (a column slice
    of a leaf, so the gradient buffer has the slice's row stride)."""
    t, v, ld = 21, 3001, 3008
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits, labels, mask = make(t, v, dtype, seed=13, ld=ld)
        full = logits._base if logits._base is not None else logits
        assert logits.stride(0) == ld
        n = int(((labels != -100) & (mask != 0)).sum())
        _, _, _, g_forward = thdpack.torch.loss._per_token(
            logits, labels, mask, n, True, 1.0, False, None, "cuda", False, True)

        def grad_of(factor):
            leaf = full.detach().clone().requires_grad_(True)
            share = tt.local_loss(leaf[:, :v], labels, mask, n, backend="cuda")
            (share if factor == 1 else share * factor).backward()
            return leaf.grad[:, :v]

        assert torch.equal(grad_of(1), g_forward), dtype
        for factor in (3.0, 0.5, -0.37):
            want = (g_forward.float() * factor).to(dtype)
            assert torch.equal(grad_of(factor), want), (dtype, factor)


@cuda
@pytest.mark.cuda
@pytest.mark.one_read
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,v", [(37, 1000), (16, 32000), (9, 151936)])
def test_one_read_kernel_equals_float64(dtype, t, v, version):
    """The one-read kernel (rows staged in shared memory; a cluster of blocks for the large
    rows, on sm_90) against float64, separate gradient and in place."""
    from thdpack.torch import _loss_cuda
    logits, labels, mask = make(t, v, dtype, seed=t + v)
    if not _loss_cuda.one_read_takes(logits):
        pytest.skip("this device has no thread-block clusters for these rows")
    n = int(((labels != -100) & (mask != 0)).sum()) + 1
    lp_ref, ent_ref, grad_ref = reference(logits, labels, mask, n, 1.0)
    floor = 2 ** -24 if dtype == torch.float16 else 0.0
    for inplace in (False, True):
        x = logits.clone()
        lp, ent, _, grad, _ = _loss_cuda.per_token_cuda(
            x, labels, None if mask is None else mask, True, 1.0 / n, inplace, True,
            kernel="one_read", version=version)
        torch.testing.assert_close(lp.double(), lp_ref, rtol=TOL[dtype], atol=TOL[dtype] * 10)
        torch.testing.assert_close(ent.double(), ent_ref, rtol=TOL[dtype], atol=TOL[dtype] * 10)
        err = (grad.double() - grad_ref).abs()
        bound = GRAD_REL[dtype] * grad_ref.abs() + 1e-6 / n + floor
        assert bool((err <= bound).all()), (inplace, float((err - bound).max()))
        if inplace:
            assert grad.data_ptr() == x.data_ptr()


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hf", [False, True])
def test_token_logprobs_backward_on_the_kernel_equals_the_chunked_path(dtype, hf):
    """token_logprobs(backend="cuda"): the backward by LogprobEntropyBackward, values and
    gradients against the chunked torch path on the same logits, a temperature, both label
    formats, a strided row (a slice of wider logits)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    t, v = 301, 32003
    wide = (torch.randn(t, v + 5, device="cuda", generator=g) * 3).to(dtype)
    labels = torch.randint(0, v, (t,), device="cuda", generator=g)
    labels[::7] = -100
    if hf:
        labels[0] = -100
    mb = {"labels": labels, "label_format": "hf" if hf else "megatron"}
    g_lp = torch.randn(t, device="cuda", generator=g)
    g_en = torch.randn(t, device="cuda", generator=g)
    out = {}
    for backend in ("torch", "cuda"):
        x = wide[:, :v].detach().clone() if backend == "torch" else wide[:, :v].detach()
        x = x.requires_grad_(True)
        lp, en = tt.token_logprobs(x, mb, temperature=0.8, entropy=True, backend=backend)
        (lp * g_lp + en * g_en).sum().backward()
        out[backend] = (lp.detach(), en.detach(), x.grad.float())
    torch.testing.assert_close(out["cuda"][0], out["torch"][0], rtol=0, atol=0)
    torch.testing.assert_close(out["cuda"][1], out["torch"][1], rtol=0, atol=0)
    ref = out["torch"][2]
    err = (out["cuda"][2] - ref).abs().max().item() / ref.abs().max().item()
    assert err < {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
