"""thdpack.resolve_job, plan_job and run_job (thdpack/job.h): the same job configuration and
cores as the command line, so their results must equal `thdpack plan --json` and `thdpack run
--json` for the same options (run: apart from the time_* fields)."""
import json
import os
import pathlib
import subprocess

import pytest

import thdpack

# The command line built beside the module (<build>/python/thdpack -> <build>/thdpack).
CLI = pathlib.Path(os.environ.get("THDPACK_CLI",
                                  pathlib.Path(thdpack.__file__).resolve().parents[2] / "thdpack"))
needs_cli = pytest.mark.skipif(not CLI.is_file(), reason=f"no thdpack command line at {CLI}")


def cli_json(verb, **options):
    args = [str(CLI), verb, "--json"]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not False:
            args += [flag, str(value)]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    if verb == "plan":
        return json.loads(out)
    return [json.loads(line) for line in out.splitlines()]


def without_times(step):
    return {k: v for k, v in step.items() if not k.startswith("time_")}


@pytest.fixture
def lengths_file(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("".join(f"{(i * 7919) % 3000 + 1}\n" for i in range(1, 101)))
    return f"lengths:{path}"


def test_resolve_job_defaults_and_cost():
    job = thdpack.resolve_job()
    assert (job["tp"], job["cp"], job["dp"], job["pp"]) == (1, 1, 1, 1)
    assert job["steps"] == 3 and job["global_batch"] == 256
    # llama2-7b: 39642464256 FLOPs per padded token, 786432 per squared one, V = 32000.
    assert job["flops_per_token"] == 39642464256
    assert job["flops_per_token_sq"] == 786432
    assert job["vocab_size"] == 32000
    tokens = thdpack.resolve_job(cost="tokens")
    assert tokens["flops_per_token"] is None and tokens["vocab_size"] == 0


def test_global_batch_all_is_one_step_unless_steps_given():
    assert thdpack.resolve_job(global_batch="all")["steps"] == 1
    assert thdpack.resolve_job(global_batch="all", steps=4)["steps"] == 4
    assert thdpack.resolve_job(global_batch=7)["steps"] == 3


@pytest.mark.parametrize("options, option", [
    (dict(dp=0), "--dp"),
    (dict(global_batch="ten"), "--global-batch"),
    (dict(global_batch=0), "--global-batch"),
    (dict(steps=0), "--steps"),
    (dict(cost="bogus"), "--cost"),
    (dict(scheduler="fastest"), "--scheduler"),
    (dict(logits_dtype="fp16"), "--logits-dtype"),
    (dict(microbatch_multiple=2, num_microbatches=3), "--num-microbatches"),
    (dict(rank_multiple=0), "--rank-multiple: must be >= 1, got 0"),
    (dict(rank_multiple="fp4"), 'rank_multiple: rank multiple "fp4": expected fp8'),
    (dict(cp=2, max_tokens_per_rank=16, rank_multiple=32),
     "--max-tokens-per-rank: CP \\* max tokens per rank = 32 is below the token quantum 64"),
])
def test_errors_name_the_option(options, option):
    with pytest.raises(ValueError, match=option):
        thdpack.resolve_job(**options)


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="bogus"):
        thdpack.plan_job(bogus=1)


@needs_cli
@pytest.mark.parametrize("extra", [dict(), dict(sp=True), dict(scheduler="sequential"),
                                   dict(summary_only=True), dict(rank_multiple="mxfp8"),
                                   dict(sp=True, rank_multiple=16)])
def test_plan_job_equals_the_command_line(lengths_file, extra):
    options = dict(data=lengths_file, tp=2, cp=2, dp=2, global_batch=25, steps=5,
                   max_tokens_per_rank=4096, **extra)
    report = thdpack.plan_job(**options)
    # The state after the planned steps (`plan --save-state` writes it) beside plan's JSON.
    state = report.pop("state")
    assert state["next_step"] == 5 and state["consumed"] == 125
    assert report == cli_json("plan", **options)


@needs_cli
def test_plan_job_global_batch_all(lengths_file):
    options = dict(data=lengths_file, dp=2, cp=2, max_tokens_per_rank=4096, global_batch="all")
    report = thdpack.plan_job(**options)
    assert report["summary"]["n_steps"] == 1
    assert report["summary"]["n_samples"] == 100
    state = report.pop("state")
    assert state["next_step"] == 1 and state["cursor"]["epoch"] == 1  # one epoch a step
    assert report == cli_json("plan", **options)


@needs_cli
@pytest.mark.parametrize("data_on", ["tp0", "all"])
def test_run_job_equals_the_command_line_and_plan(lengths_file, data_on):
    options = dict(data=lengths_file, tp=2, cp=2, dp=2, global_batch=25, steps=3,
                   max_tokens_per_rank=4096, data_on=data_on)
    steps = thdpack.run_job(**options)
    assert [without_times(s) for s in steps] == \
        [without_times(s) for s in cli_json("run", **options)]
    # Each step is plan's object plus what run adds.
    del options["data_on"]
    planned = thdpack.plan_job(**options)["steps"]
    for got, want in zip(steps, planned):
        assert {k: got[k] for k in want} == want
        assert set(got["bytes_sent"]) == {"read", "lengths", "plan", "exchange", "pack",
                                          "deliver", "agree", "total"}


@needs_cli
def test_run_job_verify_matches_the_command_line(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text("".join(f"{(i * 37) % 150 + 2}\n" for i in range(40)))
    options = dict(data=f"lengths:{path}", tp=2, cp=2, dp=2, pp=2, global_batch=16, steps=2,
                   max_tokens_per_rank=1024, cost="tokens", verify=True, probe_layers=2)
    steps = thdpack.run_job(**options)
    cli = cli_json("run", **options)
    for got, want in zip(steps, cli):
        assert got["loss"] > 0
        assert got["n_tokens"] == want["n_tokens"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-12)
        assert got["entropy"] == pytest.approx(want["entropy"], rel=1e-12)


def test_run_job_errors_name_the_option():
    with pytest.raises(ValueError, match="--timeout: must be > 0"):
        thdpack.run_job(timeout=0)
    with pytest.raises(ValueError, match="--memory-profile-steps"):
        thdpack.run_job(steps=2, memory_profile_steps=[2])
    with pytest.raises(ValueError, match="--verify-tolerance"):
        thdpack.run_job(verify=True, verify_tolerance=-1.0)
