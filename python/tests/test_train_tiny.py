"""The example trains over DP x CP (x PP) processes (gloo), its data path entirely thdpack's
(PackedDataIterator over torch.distributed), and its losses, statistics and parameters equal
those of a single process that trains on the same samples with plain torch: with the static
scheduler, and with the dynamic one (a CP group per microbatch); and RL-style (--rollouts), its
in-memory rollouts with an advantage field packed by pack_batch and its log-probabilities
unpacked back to the loaders; and GRPO/GSPO (--gspo) on that data path, its groups kept on one
replica; and DPO (train_dpo.py), its preference pairs kept in one microbatch."""
import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
EXAMPLE = EXAMPLES / "train_tiny.py"


def checked_run(dp, cp, pp, scheduler, *more, example=EXAMPLE):
    """The example at a topology with --check over 3 steps: its step lines, each and the whole
    run required OK."""
    from test_torch_iterator import free_port  # claimed: xdist workers run examples side by side
    out = subprocess.run([sys.executable, str(example), "--port", str(free_port()),
                          "--dp", str(dp), "--cp", str(cp),
                          "--pp", str(pp), "--scheduler", scheduler, "--steps", "3", *more,
                          "--check"],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    print(out.stdout, out.stderr)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all(line.endswith("OK") for line in lines)
    assert "check: OK" in out.stdout
    return lines


# Not under the sanitizers: the example's data path is the iterator and the loss, whose C++ runs
# under ASan in test_torch_iterator.py, test_torch_iterator_dynamic.py and test_loss_torch.py;
# what is its own (the model, its pipeline stages) is torch's.
@pytest.mark.no_sanitizer
@pytest.mark.parametrize("dp,cp,pp,scheduler", [
    (2, 2, 1, "balanced"), (1, 3, 1, "balanced"), (3, 1, 1, "balanced"), (2, 1, 2, "balanced"),
    (1, 2, 2, "balanced"), (2, 2, 1, "dynamic"), (1, 4, 1, "dynamic"), (1, 2, 2, "dynamic")])
def test_multi_process_equals_single_process(dp, cp, pp, scheduler):
    lines = checked_run(dp, cp, pp, scheduler)
    if scheduler == "dynamic":  # groups of more than one rank were used
        sizes = [int(g.split(":")[0]) for line in lines
                 for g in line.split(" cp sizes ")[1].split(" |")[0].split(",")]
        assert max(sizes) > 1, lines


# RL-style: in-memory rollouts with a per-token advantage field, one pack_batch a step, the
# advantage-weighted loss, and the log-probabilities unpacked back to each loader in its order:
# equal to one process (the same loss and updates, each sample's log-probabilities).
@pytest.mark.no_sanitizer
@pytest.mark.parametrize("dp,cp,pp,scheduler", [
    (2, 2, 1, "balanced"), (1, 2, 2, "balanced"), (2, 2, 1, "dynamic")])
def test_rollouts_with_fields_equal_single_process(dp, cp, pp, scheduler):
    checked_run(dp, cp, pp, scheduler, "--rollouts")


# GRPO/GSPO: group-normalised advantages, GSPO's clipped ratio of each whole sequence (its mean
# log-ratio reduced over CP by sequence_means), seq-mean-token-mean: the loss and updates equal
# one process.
@pytest.mark.no_sanitizer
@pytest.mark.parametrize("dp,cp,pp,scheduler", [
    (2, 2, 1, "balanced"), (1, 4, 1, "balanced"), (1, 2, 2, "balanced"), (2, 2, 1, "dynamic")])
def test_gspo_equals_single_process(dp, cp, pp, scheduler):
    checked_run(dp, cp, pp, scheduler, "--gspo")

# DPO: preference pairs kept side by side in one microbatch (keep_groups="microbatch"), each
# response's log-probability summed over its whole sequence across CP (sequence_sums), the pair
# loss: the loss, accuracy, margin and updates equal one process at DP x CP x PP 1x1x1, 2x2x1,
# 1x4x1, 2x2x2 and with dynamic CP.
@pytest.mark.no_sanitizer
@pytest.mark.parametrize("dp,cp,pp,scheduler", [
    (1, 1, 1, "balanced"), (2, 2, 1, "balanced"), (1, 4, 1, "balanced"), (2, 2, 2, "balanced"),
    (2, 2, 1, "dynamic")])
def test_dpo_equals_single_process(dp, cp, pp, scheduler):
    checked_run(dp, cp, pp, scheduler, example=EXAMPLES / "train_dpo.py")
