"""thdpack.torch.calibrate and measured cost profiles from Python: the fit recovers the
coefficients of a step whose time is a known function of the microbatch (a fake clock, not
sleeps), refuses too few or degenerate microbatches, and a profile written and read back plans
exactly as before; bad profile files are ValueErrors naming the file and the field."""
import json

import numpy as np
import pytest
import torch

import thdpack
import thdpack.torch as tt

A, B, C, M = 2e-6, 4e-11, 3e-5, 4e-3


class FakeClock:
    """A clock that step_fn advances by a known function of its microbatch's padded lengths."""

    def __init__(self, per_microbatch=0.0):
        self.now = 0.0
        self.calls = 0
        self.per_microbatch = per_microbatch

    def __call__(self):
        return self.now

    def step(self, mb):
        cup = mb["cu_seqlens_padded"].numpy().astype(np.int64)
        p = np.diff(cup)
        assert mb["tokens"].dtype == torch.int64 and mb["tokens"].shape == (int(cup[-1]),)
        self.now += A * p.sum() + B * (p * p).sum() + C * len(p) + self.per_microbatch
        self.calls += 1


def test_calibrate_recovers_known_coefficients(tmp_path):
    clock = FakeClock()
    profile = tt.calibrate(clock.step, 8192, clock=clock, out=tmp_path / "p.json",
                           timings_out=tmp_path / "t.csv", model="llama2-7b", dtype="fp32",
                           attention="test", warmup=1, repeats=2)
    for got, want in ((profile["a"], A), (profile["b"], B), (profile["c"], C)):
        assert got == pytest.approx(want, rel=0.02)
    assert profile["use"] == "abc" and profile["refined"] is None  # nothing to refine
    fit = profile["fit"]["abc"]
    assert fit["held_out"]["n"] >= 7 and fit["held_out"]["max_rel_error"] < 1e-6
    held = [r["lengths"] for r in profile["fit"]["held_out"]]
    assert "4096" in held and "256x16" in held  # 1 x T against T/256 x 256, T the middle total
    assert profile["measured_on"]["model"] == "llama2-7b"
    assert profile["measured_on"]["thdpack_version"] == thdpack.__version__
    # warm-up and repetitions: 3 calls a microbatch
    assert clock.calls == 3 * sum(1 for _ in open(tmp_path / "t.csv")) - 3
    assert thdpack.read_cost_profile(str(tmp_path / "p.json")) == profile
    # The CSV it wrote fits to the same profile (thdpack calibrate --timings reads it).
    rows = thdpack.read_timings_csv(str(tmp_path / "t.csv"), 0)
    again = thdpack.fit_cost_profile([(s, l) for s, l, _ in rows])
    assert again["a"] == pytest.approx(A, rel=1e-6)


def test_calibrate_keeps_a_constant_per_microbatch():
    clock = FakeClock(per_microbatch=M)
    profile = tt.calibrate(clock.step, 8192, clock=clock, repeats=1, warmup=0)
    assert profile["use"] == "refined"
    r = profile["refined"]
    for got, want in ((r["a"], A), (r["b"], B), (r["c"], C), (r["m"], M)):
        assert got == pytest.approx(want, rel=0.02)
    assert profile["fit"]["refined"]["held_out"]["max_rel_error"] < \
        profile["fit"]["abc"]["held_out"]["max_rel_error"]


def test_calibrate_refuses_what_it_cannot_fit():
    clock = FakeClock()
    with pytest.raises(ValueError, match="max_tokens = 1000"):
        tt.calibrate(clock.step, 1000, clock=clock)
    with pytest.raises(ValueError, match="at least two different totals"):
        tt.calibrate(clock.step, 8192, totals=[4096], clock=clock)
    with pytest.raises(ValueError, match="step_fn"):
        tt.calibrate(None, 8192)
    with pytest.raises(ValueError, match="a timer that does not advance"):
        tt.calibrate(lambda mb: None, 8192, clock=lambda: 0.0)
    # Too few, or microbatches that do not vary.
    with pytest.raises(ValueError, match="at least 4"):
        thdpack.fit_cost_profile([(0.1, [256]), (0.2, [512]), (0.3, [1024])])
    with pytest.raises(ValueError, match="do not vary enough"):
        thdpack.fit_cost_profile([(0.5, [4096])] * 8)
    with pytest.raises(ValueError, match=r"timings\[1\]\[1\]"):
        thdpack.fit_cost_profile([(0.1, [256]), (0.2, "x")])


def same(x, y):
    """Equal, arrays compared by value, nested in dicts and lists."""
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(same(a, b) for a, b in zip(x, y))
    if isinstance(x, np.ndarray):
        return np.array_equal(x, y)
    return x == y


def test_profile_written_and_read_back_plans_identically(tmp_path):
    clock = FakeClock(per_microbatch=M)
    profile = tt.calibrate(clock.step, 8192, clock=clock, out=tmp_path / "p.json",
                           model="llama2-7b", repeats=1, warmup=0)
    # Through Python's json and back: the same numbers, so the same plans.
    (tmp_path / "q.json").write_text(json.dumps(profile, indent=1))
    lengths = thdpack.mock_lengths(300, max_seq_len=6000, seed=5)
    for scheduler in ("balanced", "sequential", "dynamic"):
        plans = [thdpack.schedule(lengths, dp_size=4, cp_size=2, max_tokens_per_rank=8192,
                                  scheduler=scheduler, cost=f"profile:{tmp_path / f}")
                 for f in ("p.json", "q.json")]
        assert same(plans[0].figures, plans[1].figures), scheduler
        assert plans[0].sim_step_time == plans[1].sim_step_time > 0
    plan = thdpack.schedule(lengths, dp_size=4, max_tokens_per_rank=8192,
                            cost=f"profile:{tmp_path / 'p.json'}")
    for d in range(4):
        for m in range(plan.num_microbatches):
            other = thdpack.schedule(lengths, dp_size=4, max_tokens_per_rank=8192,
                                    cost=f"profile:{tmp_path / 'q.json'}").microbatch(d, m)
            assert plan.microbatch(d, m).tolist() == other.tolist()
    # The iterator's job options take it too (threads run the same step).
    steps = thdpack._thdpack._run_steps_on_threads(
        dict(dp=2, global_batch=8, max_tokens_per_rank=8192, cost=f"profile:{tmp_path / 'p.json'}"),
        1, "mock", None)
    assert steps[0][0]["figures"]["sim_step_time"] > 0


def test_bad_profile_files_name_the_file_and_field(tmp_path):
    good = {"format": "thdpack-cost-profile", "version": 1, "a": 1e-6, "b": 1e-11, "c": 1e-5,
            "refined": None, "use": "abc", "measured_on": {"model": "x"}}

    def plan(profile):
        path = tmp_path / "bad.json"
        path.write_text(profile if isinstance(profile, str) else json.dumps(profile))
        return thdpack.schedule([100, 200, 300], dp_size=1, max_tokens_per_rank=1024,
                                cost=f"profile:{path}")

    assert plan(good).num_microbatches >= 1
    for change, says in ((dict(a=-1), 'field "a" = -1'), (dict(b="1"), 'field "b" is string'),
                         (dict(format="x"), "not a thdpack cost profile"),
                         (dict(use="refined"), '"refined" is null'),
                         (dict(measured_on=None), '"measured_on"')):
        with pytest.raises(ValueError, match=f"cost: cost profile .*bad.json: .*{says}"):
            plan({**good, **change})
    with pytest.raises(ValueError, match='missing field "c"'):
        plan({k: v for k, v in good.items() if k != "c"})
    with pytest.raises(ValueError, match="not a JSON object"):
        plan("not json")
    with pytest.raises(OSError, match="cannot open"):
        thdpack.read_cost_profile(str(tmp_path / "none.json"))


PER_PATCH, PER_FRAME_SQ = 3e-8, 5e-13


def test_calibrate_encoder_recovers_a_known_term(tmp_path):
    """An encoder whose time is a known function of its item's grid: the fitted term equals it,
    joins the language model's profile (written in place) and reads back; without two frame
    sizes, or with a timer that does not advance, the error says why."""
    clock = FakeClock()
    tt.calibrate(clock.step, 8192, clock=clock, out=tmp_path / "p.json", warmup=0, repeats=1)
    seen = []

    def encoder(pixels, grid):
        t, h, w = (int(v) for v in grid[0])
        assert pixels.shape == (t * h * w, 16) and pixels.dtype == torch.float32
        seen.append((t, h, w))
        clock.now += PER_PATCH * t * h * w + PER_FRAME_SQ * t * (h * w) ** 2

    profile = tt.calibrate_encoder(encoder, tmp_path / "p.json", width=16, dtype=torch.float32,
                                   clock=clock, model="tiny tower", warmup=1, repeats=2)
    enc = profile["encoder"]
    assert enc["per_patch"] == pytest.approx(PER_PATCH, rel=1e-9)
    assert enc["per_frame_sq"] == pytest.approx(PER_FRAME_SQ, rel=1e-9)
    assert enc["model"] == "tiny tower"
    assert enc["fit"]["held_out"]["n"] == 3 and enc["fit"]["held_out"]["max_rel_error"] < 1e-9
    assert len(seen) == 12 * 3  # 6 sides x 2 frame counts, a warm-up and two timed calls each
    assert thdpack.read_cost_profile(str(tmp_path / "p.json")) == profile
    assert profile["a"] == pytest.approx(A, rel=0.02)  # the language model's term is kept
    with pytest.raises(ValueError, match="one size"):
        thdpack._thdpack.fit_encoder_profile([1.0, 2.0, 3.0, 4.0], [4, 8, 12, 16],
                                             [16, 32, 48, 64], profile=str(tmp_path / "p.json"))
    with pytest.raises(ValueError, match="does not advance"):
        tt.calibrate_encoder(lambda p, g: None, tmp_path / "p.json", clock=lambda: 0.0,
                             width=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="two different even sides"):
        tt.calibrate_encoder(encoder, tmp_path / "p.json", sides=(16, 16), clock=clock)
    with pytest.raises(ValueError, match="patches must be >= 1"):
        thdpack._thdpack.fit_encoder_profile([1.0] * 4, [4, 0, 4, 4], [16, 16, 64, 64],
                                             profile=str(tmp_path / "p.json"))
