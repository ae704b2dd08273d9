"""thdpack.torch.hf_attention's two ways to attend on a zigzag shard, against each other:

  * varlen_segments: each query of the shard, in its segment under the bottom-right causal rule
    of flash-attn's varlen kernels, sees exactly the keys of its own sequence at or before its
    position (a plain set comparison, on random layouts at CP 1, 2 and 4, every rank);
  * the varlen path (through varlen_reference, flash_attn_varlen_func's contract in plain torch)
    equals the sdpa mask path on random float64 queries, keys and values with GQA - outputs and
    the gradients of all three, every rank at CP 1, 2 and 4;
  * the `attention` choices and their errors (flash-attn does not import on these machines; no
    GPU has run the "flash" path).
The gather of K/V over the CP group is the same code in both paths (test_grpo_hf.py trains
through it).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
    pytest.skip("torch < 2.0 has no scaled_dot_product_attention", allow_module_level=True)

from thdpack.torch import hf_attention  # noqa: E402
from thdpack.torch.sharding import partition_indices  # noqa: E402


def random_layout(rng, cp):
    """cu_seqlens_padded of 1-6 sequences, each padded to a multiple of 2 CP (CP > 1)."""
    m = 2 * cp if cp > 1 else 1
    lengths = [int(rng.integers(1, 4)) * m * int(rng.integers(1, 5)) for _ in
               range(int(rng.integers(1, 7)))]
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_each_query_sees_its_sequence_at_or_before_it(cp):
    rng = np.random.default_rng(cp)
    for _ in range(30):
        cup = random_layout(rng, cp)
        seq_of = np.repeat(np.arange(len(cup) - 1), np.diff(cup))
        for r in range(cp):
            q_pos = partition_indices(cup, cp, r).numpy()
            cu_q, cu_k, k_index, max_q, max_k = hf_attention.varlen_segments(cup, cp, r)
            assert cu_q[-1] == len(q_pos)
            assert max_q == np.diff(cu_q).max() and max_k == np.diff(cu_k).max()
            for j in range(len(cu_q) - 1):
                n, keys = cu_q[j + 1] - cu_q[j], k_index[cu_k[j]:cu_k[j + 1]]
                for i in range(n):
                    q = q_pos[cu_q[j] + i]
                    seen = set(keys[:len(keys) - n + i + 1].tolist())  # bottom-right causal
                    want = {k for k in range(cup[-1]) if seq_of[k] == seq_of[q] and k <= q}
                    assert seen == want, (cup.tolist(), r, j, i)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_varlen_path_equals_the_sdpa_path(cp):
    rng = np.random.default_rng(10 + cp)
    gen = torch.Generator().manual_seed(cp)
    hq, hkv, d = 4, 2, 8  # GQA: each key/value head serves two query heads
    for trial in range(6):
        cup = random_layout(rng, cp)
        total = int(cup[-1])
        key = torch.randn(1, hkv, total, d, dtype=torch.float64, generator=gen)
        value = torch.randn(1, hkv, total, d, dtype=torch.float64, generator=gen)
        for r in range(cp):
            query = torch.randn(1, hq, total // cp, d, dtype=torch.float64, generator=gen)
            grad = torch.randn(1, total // cp, hq, d, dtype=torch.float64, generator=gen)
            outs = []
            for path in ("varlen", "sdpa"):
                mb = {"cu_seqlens_padded": torch.from_numpy(cup), "cp_size": cp, "cp_rank": r}
                q, k, v = (x.clone().requires_grad_() for x in (query, key, value))
                if path == "varlen":
                    out = hf_attention._attend_varlen(q, k, v, mb, 0.0, 0.3,
                                                      hf_attention.varlen_reference)
                else:
                    out = hf_attention._attend_sdpa(q, k, v, mb, 0.0, 0.3)
                (out * grad).sum().backward()
                outs.append((out.detach(), q.grad, k.grad, v.grad))
            for name, a, b in zip(("out", "dq", "dk", "dv"), *outs):
                assert torch.allclose(a, b, rtol=0, atol=1e-12), \
                    (name, trial, r, (a - b).abs().max().item())


def test_attention_choices_and_their_errors():
    cpu = torch.zeros(1, 2, 4, 8)
    assert hf_attention._kernel("sdpa", cpu) is None
    assert hf_attention._kernel("auto", cpu) is None  # a CPU query: the mask path
    assert hf_attention._kernel(hf_attention.varlen_reference, cpu) is \
        hf_attention.varlen_reference
    with pytest.raises(ValueError, match="attention='bogus': expected 'auto', 'sdpa', 'flash'"):
        hf_attention._kernel("bogus", cpu)
    try:
        import flash_attn  # noqa: F401
        with pytest.raises(ValueError, match="needs a CUDA query in float16 or bfloat16"):
            hf_attention._kernel("flash", cpu)
    except ImportError:
        with pytest.raises(ValueError, match=r"needs flash-attn \(pip install flash-attn\)"):
            hf_attention._kernel("flash", cpu)
    with pytest.raises(ValueError, match="dropout_p must be 0"):
        hf_attention.varlen_reference(cpu[0].transpose(0, 1), cpu[0].transpose(0, 1),
                                      cpu[0].transpose(0, 1), [0, 4], [0, 4], 4, 4,
                                      dropout_p=0.1)
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        with pytest.raises(ValueError, match="attention='torch' needs a CUDA query"):
            hf_attention._kernel("torch", cpu)
    except ImportError:
        with pytest.raises(ValueError, match="needs torch's varlen_attn"):
            hf_attention._kernel("torch", cpu)
    kw = hf_attention.model_kwargs({"position_ids": torch.arange(4)}, attention="sdpa")
    assert kw["thdpack_attention"] == "sdpa" and kw["position_ids"].shape == (1, 4)


def gpu_kernels():
    """The fused varlen kernels this machine can run: torch's and flash-attn's."""
    out = []
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        out.append("torch")
    except ImportError:
        pass
    try:
        import flash_attn  # noqa: F401
        out.append("flash")
    except ImportError:
        pass
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_fused_varlen_kernels_equal_the_float64_reference(cp):
    """On a GPU: each fused kernel through the varlen path, bfloat16, against the sdpa path in
    float64 on the same values - outputs and the gradients of Q, K and V (the bottom-right
    causal alignment of each kernel is what this checks)."""
    kernels = gpu_kernels()
    if not kernels:
        pytest.skip("neither torch's varlen_attn nor flash-attn here")
    rng = np.random.default_rng(20 + cp)
    gen = torch.Generator().manual_seed(cp)
    hq, hkv, d = 8, 2, 64
    for trial in range(3):
        cup = random_layout(rng, cp) * 8  # longer sequences, the same divisibility
        total = int(cup[-1])
        key = torch.randn(1, hkv, total, d, generator=gen)
        value = torch.randn(1, hkv, total, d, generator=gen)
        for r in range(cp):
            query = torch.randn(1, hq, total // cp, d, generator=gen)
            grad = torch.randn(1, total // cp, hq, d, generator=gen)
            mb = {"cu_seqlens_padded": torch.from_numpy(cup), "cp_size": cp, "cp_rank": r}
            q, k, v = (x.double().requires_grad_() for x in (query, key, value))
            ref = hf_attention._attend_sdpa(q, k, v, dict(mb), 0.0, None)
            (ref * grad.double()).sum().backward()
            want = (ref.detach(), q.grad, k.grad, v.grad)
            for name in kernels:
                q, k, v = (x.cuda().bfloat16().requires_grad_() for x in (query, key, value))
                out = hf_attention._attend_varlen(q, k, v, dict(mb), 0.0, None,
                                                  hf_attention._kernel(name, q))
                (out.float() * grad.cuda()).sum().backward()
                for what, a, b in zip(("out", "dq", "dk", "dv"),
                                      (out.detach(), q.grad, k.grad, v.grad), want):
                    err = (a.double().cpu() - b).abs().max().item()
                    assert err < 0.05 * max(1.0, b.abs().max().item()), (name, what, trial, r, err)
