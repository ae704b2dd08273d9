"""The example trains over DP x CP (x PP) processes (gloo), its data path entirely thdpack's
(PackedDataIterator over torch.distributed), and its losses, statistics and parameters equal
those of a single process that trains on the same samples with plain torch."""
import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_tiny.py"


@pytest.mark.parametrize("dp,cp,pp", [(2, 2, 1), (1, 3, 1), (3, 1, 1), (2, 1, 2), (1, 2, 2)])
def test_multi_process_equals_single_process(dp, cp, pp):
    out = subprocess.run([sys.executable, str(EXAMPLE), "--dp", str(dp), "--cp", str(cp),
                          "--pp", str(pp), "--steps", "3", "--check"],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    print(out.stdout, out.stderr)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all(line.endswith("OK") for line in lines)
    assert "check: OK" in out.stdout
