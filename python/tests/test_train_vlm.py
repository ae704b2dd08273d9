"""The VLM example (python/examples/train_vlm.py) trains a tiny vision-language model on packed
batches with images and video over DP x CP (x PP) gloo processes - media moved and placed by the step,
encoder rows routed by route_media, mRoPE positions from the step; the vision tower on the CP
ranks or on encoder ranks of its own - and its losses and parameters equal one process's at
every topology."""
import inspect
import os
import pathlib
import subprocess
import sys

import pytest
import torch.distributed as dist

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_vlm.py"


# Not under the sanitizers: the media path's C++ runs under ASan in test_media_step.py.
@pytest.mark.no_sanitizer
@pytest.mark.parametrize("dp,cp,pp", [(2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 4, 1), (1, 2, 2),
                                      (2, 1, 2)])
def test_vlm_equals_one_process(dp, cp, pp):
    from test_torch_iterator import free_port
    out = subprocess.run([sys.executable, str(EXAMPLE), "--port", str(free_port()),
                          "--dp", str(dp), "--cp", str(cp), "--pp", str(pp), "--steps", "3",
                          "--check"],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "check: equal to one process" in out.stdout, out.stdout


# Encoders on ranks of their own (--encoders E): where torch makes a group of some ranks alone.
@pytest.mark.no_sanitizer
@pytest.mark.skipif("use_local_synchronization" not in
                    inspect.signature(dist.new_group).parameters,
                    reason="torch without new_group(use_local_synchronization=True)")
@pytest.mark.parametrize("dp,cp,pp,encoders", [(2, 2, 1, 2), (1, 4, 1, 1), (1, 2, 2, 1)])
def test_vlm_with_encoder_ranks_equals_one_process(dp, cp, pp, encoders):
    from test_torch_iterator import free_port
    out = subprocess.run([sys.executable, str(EXAMPLE), "--port", str(free_port()),
                          "--dp", str(dp), "--cp", str(cp), "--pp", str(pp),
                          "--encoders", str(encoders),
                          "--steps", "3", "--check"],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "check: equal to one process" in out.stdout, out.stdout
