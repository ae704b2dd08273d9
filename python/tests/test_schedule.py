"""schedule(): the invariants of thdpack/schedule.h checked from Python on random inputs."""
import numpy as np
import pytest

import thdpack


def padded_tokens(lengths, cp_size, tp_size=1, sp=False):
    """The padding rule of docs/design.md section 5, written independently."""
    m = 2 * cp_size if cp_size > 1 else 1
    total = sum(-(-int(L) // m) * m for L in lengths)
    if sp and tp_size > 1:
        q = np.lcm(m, cp_size * tp_size)
        total = -(-total // q) * q
    return total


@pytest.mark.parametrize("scheduler", ["balanced", "sequential"])
@pytest.mark.parametrize("dp,cp,tp,sp,k", [(1, 1, 1, False, 1), (2, 2, 1, False, 1),
                                          (4, 1, 1, False, 2), (3, 4, 2, True, 1)])
def test_invariants(scheduler, dp, cp, tp, sp, k):
    rng = np.random.default_rng(dp * 100 + cp * 10 + k)
    for trial in range(5):
        n = int(rng.integers(dp * k * 2, 200))
        lengths = rng.integers(1, 300, size=n)
        budget_per_rank = 512
        plan = thdpack.schedule(lengths, dp_size=dp, cp_size=cp, tp_size=tp, sp=sp,
                                max_tokens_per_rank=budget_per_rank, scheduler=scheduler,
                                microbatch_multiple=k)
        m = plan.num_microbatches
        assert m >= 1 and m % k == 0 and plan.dp_size == dp
        seen = []
        for d in range(dp):
            for mb in range(m):
                ids = plan.microbatch(d, mb)
                assert ids.dtype == np.int64 and len(ids) > 0
                assert padded_tokens(lengths[ids], cp, tp, sp) <= cp * budget_per_rank
                fig = plan.figures["replicas"][d]["microbatches"][mb]
                assert fig["samples"].tolist() == ids.tolist()
                assert fig["real_tokens"] == int(lengths[ids].sum())
                assert fig["padded_tokens"] == padded_tokens(lengths[ids], cp, tp, sp)
                seen += ids.tolist()
        assert sorted(seen) == list(range(n))  # every sample exactly once
        f = plan.figures
        assert f["num_microbatches"] == m and f["n_samples"] == n and f["n_skipped"] == 0
        assert f["real_tokens"] == int(lengths.sum())
        assert f["n_loss_tokens"] == int((lengths - 1).sum())
        assert f["imbalance"] >= 1.0 - 1e-12
        again = thdpack.schedule(lengths, dp_size=dp, cp_size=cp, tp_size=tp, sp=sp,
                                 max_tokens_per_rank=budget_per_rank, scheduler=scheduler,
                                 microbatch_multiple=k)
        assert again.sample_ids.tolist() == plan.sample_ids.tolist()  # deterministic
        assert again.offsets.tolist() == plan.offsets.tolist()


def test_n_targets_ids_skip_and_flops():
    lengths = np.array([10, 2000, 30, 40, 50], np.int32)
    plan = thdpack.schedule(lengths, n_targets=np.array([3, 0, 5, 7, 9]),
                            ids=np.array([100, 101, 102, 103, 104]), dp_size=2,
                            max_tokens_per_rank=100, oversize="skip", cost="llama2-7b")
    assert plan.skipped.tolist() == [101]
    assert sorted(plan.sample_ids.tolist()) == [100, 102, 103, 104]
    f = plan.figures
    assert f["n_loss_tokens"] == 3 + 5 + 7 + 9
    a, b = thdpack.flops_coefficients("llama2-7b")
    assert f["flops"] == pytest.approx(a * f["padded_tokens"] + b * f["sum_sq"], rel=1e-12)
    assert thdpack.flops("llama2-7b", padded_tokens=f["padded_tokens"], sum_sq=f["sum_sq"]) == \
        pytest.approx(f["flops"], rel=1e-12)


def test_schedule_errors():
    with pytest.raises(ValueError, match="2000"):
        thdpack.schedule(np.array([10, 2000]), dp_size=1, max_tokens_per_rank=100)
    with pytest.raises(ValueError, match="lengths.*float64"):
        thdpack.schedule(np.array([1.0, 2.0]), dp_size=1, max_tokens_per_rank=100)
    with pytest.raises(ValueError, match="too few"):
        thdpack.schedule(np.array([5]), dp_size=2, max_tokens_per_rank=100)
    with pytest.raises(ValueError, match="scheduler"):
        thdpack.schedule(np.array([5, 6]), dp_size=1, max_tokens_per_rank=100, scheduler="x")
    with pytest.raises(TypeError):
        thdpack.schedule(np.array([5, 6]))  # dp_size is required
    # max_tokens_per_rank defaults to the job's (JobOptions: 16384), said once there.
    job = thdpack.resolve_job()
    long = thdpack.schedule(np.array([5, 16384]), dp_size=1, cost="tokens")
    assert long.figures["padded_tokens"] == 16384 + 5
    with pytest.raises(ValueError, match="16384"):
        thdpack.schedule(np.array([5, 16385]), dp_size=1, cost="tokens")
    assert job["cost"] == "llama2-7b"


def group_padded(length, c):
    """P of a sequence on a group of c ranks (no extra alignment): a multiple of 2c for c > 1."""
    m = 2 * c if c > 1 else 1
    return -(-int(length) // m) * m


@pytest.mark.parametrize("dp,cp,k,cp_sizes", [(1, 1, 1, "any"), (3, 1, 1, "any"),
                                              (2, 3, 2, "any"), (4, 2, 1, "pow2")])
def test_dynamic_groups(dp, cp, k, cp_sizes):
    """scheduler="dynamic" returns groups: every id once, contiguous disjoint ranks of the
    domain, each group within c * max_tokens_per_rank, M a multiple of k."""
    rng = np.random.default_rng(dp * 10 + cp)
    domain = dp * cp
    budget = 256
    for trial in range(4):
        n = int(rng.integers(1, 80))
        lengths = rng.integers(1, budget * domain, size=n)
        plan = thdpack.schedule(lengths, dp_size=dp, cp_size=cp, max_tokens_per_rank=budget,
                                scheduler="dynamic", cost="llama3-8b", hw="h100-ib",
                                cp_sizes=cp_sizes, microbatch_multiple=k)
        assert plan.domain_size == domain
        assert plan.num_microbatches % k == 0
        assert plan.sim_step_time > 0
        seen = []
        for groups in plan.groups:
            used = set()
            for g in groups:
                ranks = [int(r) for r in g["ranks"]]
                c = len(ranks)
                assert ranks == list(range(ranks[0], ranks[0] + c))
                assert 0 <= ranks[0] and ranks[-1] < domain
                assert not used & set(ranks)
                used |= set(ranks)
                if cp_sizes == "pow2":
                    assert c & (c - 1) == 0
                ids = [int(i) for i in g["samples"]]
                assert ids == sorted(ids)
                assert sum(group_padded(lengths[i], c) for i in ids) <= c * budget
                seen += ids
        assert sorted(seen) == list(range(n))


def test_dynamic_needs_a_model_and_static_plans_report_time():
    lengths = np.array([100, 200, 300])
    with pytest.raises(ValueError, match="model dimensions"):
        thdpack.schedule(lengths, dp_size=2, max_tokens_per_rank=512, scheduler="dynamic",
                         cost="tokens")
    plan = thdpack.schedule(lengths, dp_size=1, max_tokens_per_rank=1024, cost="llama2-7b")
    # One replica of one rank: the sum of F(P) / R over the three sequences, R = 400e12.
    a, b = 39642464256, 786432
    expected = sum(a * p + b * p * p for p in (100, 200, 300)) / 400e12
    assert plan.sim_step_time == pytest.approx(expected, rel=1e-12)
    assert thdpack.schedule(lengths, dp_size=1, max_tokens_per_rank=1024,
                            cost="tokens").sim_step_time is None


def test_default_cost_is_the_command_lines_and_lengths_come_in_any_form():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    lengths = rng.integers(1, 3000, size=64)
    want = thdpack.schedule(lengths, dp_size=4, max_tokens_per_rank=4096, cost="llama2-7b")
    tokens = thdpack.schedule(lengths, dp_size=4, max_tokens_per_rank=4096, cost="tokens")
    assert tokens.figures["flops"] is None
    for held in (lengths, lengths.astype(np.uint16), lengths.astype("<i4"), lengths.tolist(),
                 torch.tensor(lengths)):
        got = thdpack.schedule(held, dp_size=4, max_tokens_per_rank=4096)  # no cost given
        for key in ("flops", "padded_tokens", "sum_sq", "max_replica_cost", "num_microbatches"):
            assert got.figures[key] == want.figures[key], key
        assert got.figures["flops"] is not None
        assert got.sample_ids.tolist() == want.sample_ids.tolist()
        assert got.offsets.tolist() == want.offsets.tolist()


# Static shapes from Python: at most max_seqs sequences a microbatch and, with
# pad_to_max_tokens, every microbatch's padded tokens CP * max_tokens_per_rank in the figures;
# the dynamic scheduler refuses them by name.
def test_static_shapes():
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 200, size=40)
    for max_seqs in (1, 3, 7):
        plan = thdpack.schedule(lengths, dp_size=2, cp_size=2, max_tokens_per_rank=256,
                                max_seqs=max_seqs, pad_to_max_tokens=True)
        sizes = [len(plan.microbatch(d, m)) for d in range(2)
                 for m in range(plan.num_microbatches)]
        assert max(sizes) <= max_seqs and sum(sizes) == 40
        assert plan.figures["padded_tokens"] == 2 * plan.num_microbatches * 512
    with pytest.raises(ValueError, match="with the dynamic scheduler"):
        thdpack.schedule(lengths, dp_size=2, cp_size=2, max_tokens_per_rank=256, max_seqs=3,
                         scheduler="dynamic", cost="llama2-7b")


def test_schedule_encoder_work_is_checked_and_charged():
    """thdpack.schedule's encoder_work: [n, 2] integers with encoder_cost, charged in every
    figure; anything else a ValueError naming the argument and the rule."""
    lengths = [100, 200, 300, 400]
    work = np.array([[0, 0], [64, 64 * 64], [0, 0], [16, 256]])
    plan = thdpack.schedule(lengths, dp_size=2, max_tokens_per_rank=1024, cost="tokens",
                            encoder_work=work, encoder_cost=(2.0, 0.5))
    f = plan.figures
    assert f["encoder_cost"] == 2.0 * 80 + 0.5 * (64 * 64 + 256)
    assert sum(r["encoder_cost"] for r in f["replicas"]) == f["encoder_cost"]
    plain = thdpack.schedule(lengths, dp_size=2, max_tokens_per_rank=1024, cost="tokens")
    assert plain.figures["encoder_cost"] == 0
    assert f["total_cost"] == plain.figures["total_cost"] + f["encoder_cost"]
    for bad, says in ((work.astype(np.float64), "an integer array \\[n, 2\\]"),
                      (work[:3], "with n = 4"), (work[:, :1], "an integer array \\[n, 2\\]"),
                      (-work, "must be >= 0")):
        with pytest.raises(ValueError, match=says):
            thdpack.schedule(lengths, dp_size=2, max_tokens_per_rank=1024, cost="tokens",
                             encoder_work=bad, encoder_cost=(2.0, 0.5))
    with pytest.raises(ValueError, match="encoder_work without encoder_cost"):
        thdpack.schedule(lengths, dp_size=2, max_tokens_per_rank=1024, encoder_work=work)


def test_dynamic_schedule_charges_the_encoder_in_seconds():
    """Under the dynamic scheduler (and in a static plan's sim_step_time) encoder_work goes into
    the step-time model: encoder_cost in
    FLOPs becomes seconds at the hardware's R (h100-ib: 400 TFLOP/s), each sequence costing its
    group's ranks its encoder seconds over c; the plan's modelled time holds it, never above
    the time of the plan made blind to it; a cost without seconds is named."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(200, 4000, 64)
    work = np.zeros((64, 2), dtype=np.int64)
    for i in range(0, 64, 3):  # an image of 32 x 32 ... 64 x 64 patches on every third sample
        hw = int(rng.integers(32, 65)) ** 2
        work[i] = (hw, hw * hw)
    term = (3.77e9, 4.9e5)  # Qwen2-VL's tower, training FLOPs
    kw = dict(dp_size=2, cp_size=2, max_tokens_per_rank=8192, scheduler="dynamic",
              cost="llama2-7b")
    blind = thdpack.schedule(lengths, **kw)
    aware = thdpack.schedule(lengths, encoder_work=work, encoder_cost=term, **kw)
    # The encoder's seconds over the domain's 4 ranks, at best spread evenly: a lower bound on
    # what the plan adds.
    encoder = float((work[:, 0] * term[0] + work[:, 1] * term[1]).sum()) / 400e12
    assert aware.sim_step_time >= blind.sim_step_time + encoder / 4 * (1 - 1e-9)
    assert aware.sim_step_time <= blind.sim_step_time + encoder  # never all on one rank's path
    zero = thdpack.schedule(lengths, encoder_work=np.zeros_like(work), encoder_cost=term, **kw)
    assert zero.sim_step_time == blind.sim_step_time
    # A static plan's modelled time charges it too, each replica's share over its CP ranks:
    # on one replica (its step the sum of its microbatches, the language model's the same
    # however they are packed, without SP or a per-microbatch constant) exactly E / CP more.
    static = dict(kw, scheduler="balanced", dp_size=1)
    text = thdpack.schedule(lengths, **static).sim_step_time
    both = thdpack.schedule(lengths, encoder_work=work, encoder_cost=term, **static)
    assert both.sim_step_time == pytest.approx(text + encoder / 2, rel=1e-9)
    with pytest.raises(ValueError, match="has no known seconds"):
        thdpack.schedule(lengths, dp_size=2, cp_size=2, max_tokens_per_rank=8192,
                         scheduler="dynamic", cost="1,0.001", encoder_work=work,
                         encoder_cost=term)
