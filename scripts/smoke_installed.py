"""A smoke test of an installed thdpack (scripts/test_current_stack.sh runs it in fresh virtual
environments made from the wheel): the package comes from site-packages, not from a source or
build tree; its version is the wheel's and CMake's; the public API works; thdpack.torch works
where torch is installed and says what is missing where it is not.

Usage: python smoke_installed.py EXPECTED_VERSION
"""
import importlib.metadata
import os
import sys
import sysconfig

import numpy as np

import thdpack

want = sys.argv[1]
site = os.path.realpath(sysconfig.get_paths()["purelib"])
where = os.path.realpath(thdpack.__file__)
assert where.startswith(site + os.sep), f"thdpack imported from {where}, not from {site}"
assert thdpack.__version__ == want, (thdpack.__version__, want)
assert importlib.metadata.version("thdpack") == want, importlib.metadata.version("thdpack")

plan = thdpack.schedule([7, 3, 12, 5], dp_size=2, cp_size=2, max_tokens_per_rank=16)
samples = [thdpack.mock_tokens(1234, i, L, 100) for i, L in enumerate([7, 3, 12, 5])]
mb = thdpack.pack([samples[i] for i in plan.microbatch(0, 0)], cp_size=2)
labels = thdpack.shard(mb["labels"], mb["cu_seqlens_padded"], 2, 1)
logits = np.random.default_rng(0).standard_normal((len(labels), 100)).astype(np.float32)
out = thdpack.cross_entropy(logits.T.copy().T, labels, None, 100, with_grad=True)
assert out["grad"].shape == logits.shape
meta = thdpack.decode_metadata(thdpack.encode_metadata([mb], cp_size=2))
assert meta["microbatches"][0]["cu_seqlens_padded"].tolist() == mb["cu_seqlens_padded"].tolist()
assert thdpack.plan_job(steps=1, global_batch=16)["summary"]["n_samples"] == 16

try:
    import torch
except ImportError:
    torch = None
if torch is None:
    try:
        import thdpack.torch  # noqa: F401
    except ImportError as e:
        assert "torch" in str(e), e
    else:
        raise AssertionError("thdpack.torch imported without torch")
    print(f"smoke: thdpack {thdpack.__version__} from {where}, NumPy {np.__version__}, no torch")
else:
    import thdpack.torch as tt
    z = torch.from_numpy(logits).requires_grad_(True)
    share = tt.local_loss(z, torch.from_numpy(labels), None, 100)
    share.backward()
    assert torch.allclose(z.grad, torch.from_numpy(out["grad"]))
    print(f"smoke: thdpack {thdpack.__version__} from {where}, NumPy {np.__version__}, "
          f"torch {torch.__version__}")
