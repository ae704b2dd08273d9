"""token_logprobs against verl's own functions, run from verl's wheel (verl_code.py): at TP 1
its logprobs_from_logits and entropy_from_logits, at TP 2 over gloo its vocab_parallel_entropy
and vocab_parallel_log_probs_from_logits (Megatron-core's vocab-parallel cross-entropy, with
Megatron's TP group set to the test's), on float64 logits with a temperature: values and the
gradients of both outputs equal to 1e-12 on every target - except where Megatron's
cross-entropy computes in float32 whatever the logits' dtype (its first line casts them): the
TP 2 log-probs and their gradient agree to float32 rounding (1e-5)."""
import datetime
import importlib.util
import os

import pytest
import torch
import torch.distributed as dist

import verl_code
from worlds import spawn

IGNORE = -100
# On the current stack (transformers and megatron-core are there): the subject is the numerics
# against verl's, not the C++ under the sanitizers.
def _missing():
    if verl_code.wheel_path() is None:
        return "verl's wheel is not in the environment's wheels (scripts/make_venv.sh keeps it)"
    for name in ("transformers", "megatron.core"):  # verl's modules import them
        if importlib.util.find_spec(name.split(".")[0]) is None:
            return f"{name} is not installed (the current stack has it)"
    return None


pytestmark = [pytest.mark.no_sanitizer,
              pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]


def case(seed, t=29, v=24):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(t, v, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (t,), generator=g)
    labels[torch.rand(t, generator=g) < 0.3] = IGNORE
    return logits, labels, {"labels": labels, "label_format": "megatron"}


def no_compile():
    """verl's vocab_parallel_entropy compiles a two-line helper with torch.compile; the same
    arithmetic runs eagerly here (no C++ toolchain for inductor in the test)."""
    return torch.compile.__wrapped__ if hasattr(torch.compile, "__wrapped__") else \
        (lambda fn=None, **kw: fn if fn is not None else (lambda f: f))


def test_equal_to_verls_logprobs_from_logits_and_entropy_from_logits():
    from thdpack.torch import token_logprobs
    (tf,) = verl_code.load("torch_functional")
    for seed in range(6):
        logits, labels, mb = case(seed)
        temp = [1.0, 0.6, 1.4][seed % 3]
        counted = labels != IGNORE
        w1, w2 = torch.randn(len(labels), dtype=torch.float64), torch.randn(len(labels),
                                                                            dtype=torch.float64)
        x = logits.clone().requires_grad_()
        lp, en = token_logprobs(x, mb, temp, entropy=True)
        ((lp * w1 + en * w2)[counted]).sum().backward()
        y = logits.clone().requires_grad_()
        z = y / temp  # verl's actor divides the logits by the temperature before these calls
        vlp = tf.logprobs_from_logits(z[counted], labels[counted])
        ven = tf.entropy_from_logits(z[counted])
        (vlp * w1[counted] + ven * w2[counted]).sum().backward()
        assert torch.allclose(lp[counted], vlp, rtol=0, atol=1e-12)
        assert torch.allclose(en[counted], ven, rtol=0, atol=1e-12)
        assert torch.equal(lp[~counted], torch.zeros_like(lp[~counted]))
        assert torch.allclose(x.grad, y.grad, rtol=0, atol=1e-12)


def tp_worker(rank, port, out_dir):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import cross_entropy as mce
    from thdpack.torch import token_logprobs
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    group = dist.group.WORLD
    # Megatron's TP group is the test's world: its cross-entropy and verl's entropy ask for it.
    for m in (parallel_state, mce):
        m.get_tensor_model_parallel_group = lambda *a, **k: group
        m.get_tensor_model_parallel_rank = lambda *a, **k: rank
        m.get_tensor_model_parallel_world_size = lambda *a, **k: 2
    compile_ = torch.compile
    torch.compile = no_compile()
    try:
        (tp,) = verl_code.load("megatron.tensor_parallel")
        logits, labels, mb = case(9, t=21, v=16)
        counted = labels != IGNORE
        cols = slice(rank * 8, rank * 8 + 8)
        w1 = torch.randn(21, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        # Each output's gradient on its own: the entropy's is verl's float64 code, the
        # log-probs' Megatron's float32.
        grads = []
        for part in (0, 1):
            x = logits[:, cols].clone().requires_grad_()
            lp, en = token_logprobs(x, mb, 0.8, entropy=True, tp_group=group)
            ((lp * w1 if part == 0 else en)[counted]).sum().backward()
            y = logits[:, cols].clone().requires_grad_()
            z = y / 0.8
            if part == 0:
                vlp = tp.vocab_parallel_log_probs_from_logits(z[counted], labels[counted])
                (vlp * w1[counted]).sum().backward()
            else:
                ven = tp.vocab_parallel_entropy(z[counted])
                ven.sum().backward()
            grads.append((x.grad, y.grad))
    finally:
        torch.compile = compile_
    torch.save((lp[counted].detach(), en[counted].detach(), vlp.detach(), ven.detach(), grads),
               f"{out_dir}/verl{rank}.pt")
    dist.destroy_process_group()


def test_equal_to_verls_vocab_parallel_functions_at_tp2(tmp_path):
    from test_torch_iterator import free_port
    spawn(tp_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    for r in range(2):
        lp, en, vlp, ven, ((gx_lp, gy_lp), (gx_en, gy_en)) = torch.load(f"{tmp_path}/verl{r}.pt")
        assert vlp.dtype == torch.float32  # Megatron's cross-entropy: float32 arithmetic
        assert torch.allclose(lp, vlp.double(), rtol=0, atol=1e-5), (lp - vlp).abs().max()
        assert torch.allclose(gx_lp, gy_lp.double(), rtol=0, atol=1e-5)
        assert torch.allclose(en, ven, rtol=0, atol=1e-12), (en - ven).abs().max()
        assert torch.allclose(gx_en, gy_en, rtol=0, atol=1e-12), (gx_en - gy_en).abs().max()
