"""A transformers Qwen2 at DP x CP (python/examples/grpo_hf.py): thdpack's attention function
registered through transformers' attention interface runs the model's own layers on zigzag CP
shards (K/V all-gathered over the microbatch's CP group, varlen causal by the step's metadata),
and GRPO training equals one process running the model with sdpa on each rollout alone - every
parameter to float64 rounding - at DP 1 x CP 2, DP 2 x CP 2 and DP 1 x CP 4."""
import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "grpo_hf.py"


def _transformers5():
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the attention interface used is transformers 5.x's")


@pytest.mark.no_sanitizer
@pytest.mark.parametrize("dp,cp", [(1, 2), (2, 2), (1, 4)])
def test_qwen2_at_dp_x_cp_equals_one_process(dp, cp):
    _transformers5()
    from test_torch_iterator import free_port
    out = subprocess.run([sys.executable, str(EXAMPLE), "--port", str(free_port()), "--dp",
                          str(dp), "--cp", str(cp), "--steps", "2", "--check"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "check: equal to one process" in out.stdout, out.stdout
