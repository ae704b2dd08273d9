"""Fields of fed samples (thdpack/fields.h) through the C++ step, from Python.

Rollouts carry per-token fields (input and target, every dtype, [L] and [L, k]) and per-sample
ones; at topologies with TP, SP, CP, DP, PP, static and dynamic, the fields each rank's
microbatch holds equal a plain NumPy/torch reference built from the samples it names
(``sample_ids``): the zigzag shard of the packed field, shifted like the labels for a target
field (and unshifted in Hugging Face's convention), the fill on padding. The same through
``PackedDataIterator`` over gloo, tensors of the declared dtype and shape. Fields that do not
fit are errors naming the sample and the field.
"""
import numpy as np
import pytest
import torch
import torch.distributed as dist

from thdpack import _thdpack
from thdpack.torch.iterator import _to_sample, field_specs
from worlds import spawn

GLOBAL_BATCH = 12
STEPS = 2
MAX_TOKENS = 64
FIELDS = {
    "old_logp": "target",
    "adv": {"kind": "target", "dtype": torch.bfloat16, "fill": -1},
    "topk": {"kind": "target", "dtype": "float64", "shape": (2,), "fill": 0.5},
    "mrope": {"kind": "input", "dtype": np.int32, "shape": (3,), "fill": -7},
    "token_type": {"kind": "input", "dtype": "uint8", "fill": 9},
    "uid": {"kind": "sample", "dtype": "int64"},
    "reward": "sample",
    "pair": {"kind": "sample", "dtype": "bool", "shape": (2,)},
    "half": {"kind": "target", "dtype": torch.float16, "shape": (2,), "fill": 0.25},
}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8, "bool": torch.bool,
          "float16": torch.float16}


def rollouts(n, seed=3):
    """n fed samples, their fields given in turn as tensors, arrays, lists, Python numbers and
    NumPy scalars (shape [], as a Python number)."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        L = int(rng.integers(1, 60))
        prompt = int(rng.integers(0, L + 1))
        item = {"input_ids": rng.integers(0, 1000, L),
                "loss_mask": (np.arange(L) >= prompt).astype(np.uint8),
                "old_logp": torch.from_numpy(rng.normal(size=L).astype(np.float32)),
                "adv": torch.randn(L, generator=torch.Generator().manual_seed(k)).bfloat16(),
                "topk": rng.normal(size=(L, 2)),
                "mrope": rng.integers(-5, 500, (L, 3)).astype(np.int32),
                "token_type": rng.integers(0, 3, L).astype(np.uint8).tolist(),
                "uid": np.int64(k // 2) if k % 3 == 0 else k // 2,
                "reward": np.float32(rng.normal()) if k % 3 == 1 else float(rng.normal()),
                "pair": [bool(k % 2), True],
                "half": rng.normal(size=(L, 2)).astype(np.float16)}
        out.append(item)
    return out


def options(tp, cp, dp, pp, sp, data_on, scheduler, **more):
    return dict(tp=tp, cp=cp, dp=dp, pp=pp, sp=sp, data_on=data_on, global_batch=GLOBAL_BATCH,
                max_tokens_per_rank=MAX_TOKENS, cost="llama2-7b", scheduler=scheduler, **more)


def as_tensor(value, dtype, shape):
    if isinstance(value, torch.Tensor):
        return value.to(dtype).reshape(-1, *shape)
    return torch.as_tensor(np.asarray(value)).to(dtype).reshape(-1, *shape)


def zigzag(full, cup, cp, r):
    """CP rank r's rows of a packed [T, ...] tensor: chunks r and 2CP-1-r of every sequence."""
    if cp == 1:
        return full
    parts = []
    for i in range(len(cup) - 1):
        a, b = int(cup[i]), int(cup[i + 1])
        c = (b - a) // (2 * cp)
        parts += [full[a + r * c:a + (r + 1) * c],
                  full[a + (2 * cp - 1 - r) * c:a + (2 * cp - r) * c]]
    return torch.cat(parts)


def reference(items, m, spec, hf):
    """The field of microbatch m (a raw dict) as the plain rule builds it from its samples."""
    name, kind, dtype, shape, fill = spec
    dt = DTYPES[dtype]
    values = [as_tensor(items[int(i)][name], dt, shape) for i in m["sample_ids"]]
    if kind == "sample":
        return torch.cat(values) if values else torch.zeros((0, *shape), dtype=dt)
    cu, cup = m["cu_seqlens"], m["cu_seqlens_padded"]
    full = torch.full((int(cup[-1]), *shape), fill, dtype=dt)
    for i, v in enumerate(values):
        a, L = int(cup[i]), int(cu[i + 1] - cu[i])
        assert len(v) == L
        if kind == "input":
            full[a:a + L] = v
        elif hf:  # unshifted: position o holds value o, the first position the fill
            full[a + 1:a + L] = v[1:]
        else:  # position o holds value o + 1
            full[a:a + L - 1] = v[1:]
    return zigzag(full, cup, int(m["cp_size"]), int(m["cp_rank"]))


def check_microbatch(items, m, fields, first, last, hf, where, typed=False):
    """m: a raw microbatch (uint8 field bytes) or, typed, a microbatch dict of tensors."""
    n = len(m["cu_seqlens"]) - 1 if not m["idle"] else 0
    ids = np.asarray(m["sample_ids"])
    assert len(ids) == n, where
    for i, sid in enumerate(ids):
        x = items[int(sid)]
        assert len(x["input_ids"]) == m["cu_seqlens"][i + 1] - m["cu_seqlens"][i], where
        want = int(np.asarray(x["loss_mask"])[1:].sum())
        assert int(m["seq_n_targets"][i]) == want, where
    for spec in fields:
        name, kind, dtype, shape, _ = spec
        got = m[name] if typed else m["fields"][name]
        holds = kind == "sample" or (first if kind == "input" else last)
        if m["idle"] or not holds:
            assert got is None or len(got) == 0, f"{where}: {name} on a stage without it"
            continue
        if typed:
            assert got.dtype == DTYPES[dtype] and tuple(got.shape[1:]) == shape, \
                f"{where}: {name} {got.dtype} {tuple(got.shape)}"
        else:
            got = torch.from_numpy(got).view(DTYPES[dtype]).reshape(-1, *shape)
        want = reference(items, m, spec, hf and kind == "target")
        assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), \
            f"{where}: field {name}"


def shares(items, dp, specs):
    """Loader d's samples of every step, converted as the iterator converts them."""
    out = []
    for d in range(dp):
        mine = []
        for s in range(STEPS):
            for i in range(d, GLOBAL_BATCH, dp):
                mine.append(_to_sample(items[s * GLOBAL_BATCH + i], f"sample {i}", specs))
        out.append(mine)
    return out


TOPOLOGIES = [
    (1, 1, 2, 1, False, "tp0", "balanced"), (1, 2, 2, 1, False, "tp0", "balanced"),
    (2, 2, 1, 2, True, "tp0", "sequential"), (1, 2, 1, 2, False, "all", "balanced"),
    (1, 2, 2, 1, False, "tp0", "dynamic"), (2, 2, 1, 1, False, "all", "dynamic"),
]


def test_the_dtype_table_is_the_cpp_one():
    """One list of element types (thdpack/fields.h): thdpack.torch's torch and NumPy dtypes are
    derived from it, each of the C++'s width."""
    from thdpack.torch import _dtypes
    table = _thdpack.field_dtypes()
    assert [name for name, _ in table] == list(DTYPES)  # the test's own list, in enum order
    for name, width in table:
        assert _dtypes.TORCH[name] == DTYPES[name]
        assert torch.empty(0, dtype=DTYPES[name]).element_size() == width, name
        if name != "bfloat16":  # NumPy has no bfloat16: its tensors cross as their bits
            assert np.dtype(name).itemsize == width and _dtypes.NUMPY_NAMES[np.dtype(name)] == name


@pytest.mark.parametrize("topo", TOPOLOGIES, ids=lambda t: "-".join(map(str, t)))
def test_fields_on_threads_equal_the_reference(topo):
    tp, cp, dp, pp = topo[:4]
    items = rollouts(GLOBAL_BATCH * STEPS)
    specs = field_specs(FIELDS)
    steps = _thdpack._run_steps_on_threads(options(*topo), STEPS, None, shares(items, dp, specs),
                                           None, specs)
    for r, per in enumerate(steps):
        for s, step in enumerate(per):
            want = sum(int(np.asarray(x["loss_mask"])[1:].sum() > 0)
                       for x in items[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH])
            assert step["n_loss_sequences"] == want
            for k, m in enumerate(step["microbatches"]):
                check_microbatch(items, m, specs, step["first_stage"], step["last_stage"], False,
                                 f"{topo} rank {r} step {s} microbatch {k}")


def test_fields_that_do_not_fit_are_errors_naming_the_sample_and_field():
    specs = field_specs(FIELDS)
    opts = options(1, 1, 2, 1, False, "tp0", "balanced")

    def error_of(edit):
        items = rollouts(GLOBAL_BATCH * STEPS)
        edit(items[5])
        with pytest.raises(ValueError) as e:
            _thdpack._run_steps_on_threads(opts, 1, None, shares(items, 2, specs), None, specs)
        return str(e.value)

    msg = error_of(lambda x: x.update(old_logp=x["old_logp"][:-1]))
    assert "old_logp (target float32 [L])" in msg and "expected [" in msg, msg
    msg = error_of(lambda x: x.update(topk=x["topk"].astype(np.float32)))
    assert "holds float32 values, declared float64 (values are never cast)" in msg, msg
    msg = error_of(lambda x: x.pop("uid"))
    assert "declared field uid (sample int64) is missing" in msg, msg
    msg = error_of(lambda x: x.update(values=[1.0]))
    assert "'values' is not a declared field" in msg, msg
    msg = error_of(lambda x: x.update(uid=2.5))
    assert "holds float64 values, declared int64" in msg, msg
    with pytest.raises(ValueError, match="oversize 'split' with a caller-fed source"):
        _thdpack._run_steps_on_threads(dict(opts, oversize="split"), 1, None,
                                       shares(rollouts(GLOBAL_BATCH * STEPS), 2, specs), None,
                                       specs)
    with pytest.raises(ValueError, match="global_batch_tokens = 100 with a caller-fed source"):
        _thdpack._run_steps_on_threads(dict(opts, global_batch_tokens=100), 1, None,
                                       shares(rollouts(GLOBAL_BATCH * STEPS), 2, specs), None,
                                       specs)
    with pytest.raises(ValueError, match="fields\\[1\\] 'x': declared twice|fill"):
        _thdpack._run_steps_on_threads(opts, 1, None, None, None,
                                       [("x", "target", "bool", (), 2.0)])
    with pytest.raises(ValueError, match="field kind 'token'"):
        field = [("x", "token", "float32", (), 0.0)]
        _thdpack._run_steps_on_threads(opts, 1, None, None, None, field)


# --oversize truncate from Python: samples over the budget (CP 2 x 16 = 32 tokens) keep their
# first 32 tokens; every rank's step figures report the samples, tokens and targets cut, equal to
# the plain count over the step's samples.
def test_truncate_reports_what_it_cut():
    specs = field_specs(FIELDS)
    opts = dict(options(1, 2, 2, 1, False, "tp0", "balanced", oversize="truncate"),
                max_tokens_per_rank=16)
    items = rollouts(GLOBAL_BATCH * STEPS)
    steps = _thdpack._run_steps_on_threads(opts, STEPS, None, shares(items, 2, specs), None,
                                           specs)
    for s in range(STEPS):
        mine = items[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]
        long = [x for x in mine if len(x["input_ids"]) > 32]
        masks = [np.asarray(x["loss_mask"]) for x in long]
        want = (len(long), sum(len(x["input_ids"]) - 32 for x in long),
                sum(int(m[32:].sum()) for m in masks))
        assert want[0] > 0
        for r, per in enumerate(steps):
            f = per[s]["figures"]
            got = (f["n_truncated"], f["truncated_tokens"], f["truncated_targets"])
            assert got == want, (s, r, got, want)
            assert f["n_samples"] == GLOBAL_BATCH and f["n_skipped"] == 0


# Static shapes from Python (pad_to_max_tokens, max_seqs): every microbatch of every rank holds
# CP * MAX_TOKENS tokens, T/CP on each rank, over every step; the offsets attention reads
# (cu_seqlens, cu_seqlens_padded, packed_seq_params) are max_seqs + 1 long, the real ones
# followed by the last repeated; max_seqlen is T; the host offsets stay the real [n+1] ones;
# every field still equals the reference, the fixed tail holding the fill.
@pytest.mark.parametrize("topo", [(1, 1, 2, 1, False, "tp0", "balanced"),
                                  (2, 2, 1, 2, True, "tp0", "sequential"),
                                  (1, 2, 2, 1, False, "all", "balanced")],
                         ids=lambda t: "-".join(map(str, t)))
def test_static_shapes_on_threads(topo):
    from thdpack.torch.iterator import _microbatch
    tp, cp, dp, pp = topo[:4]
    max_seqs = 3
    items = rollouts(GLOBAL_BATCH * STEPS)
    specs = field_specs(FIELDS)
    opts = options(*topo, pad_to_max_tokens=True, max_seqs=max_seqs)
    steps = _thdpack._run_steps_on_threads(opts, STEPS, None, shares(items, dp, specs), None,
                                           specs)
    T = cp * MAX_TOKENS
    for r, per in enumerate(steps):
        shapes = set()
        for s, step in enumerate(per):
            for k, m in enumerate(step["microbatches"]):
                where = f"{topo} rank {r} step {s} microbatch {k}"
                check_microbatch(items, m, specs, step["first_stage"], step["last_stage"], False,
                                 where)
                out = _microbatch(m, "cpu", None, fields=specs)
                n = out["num_seqs"]
                assert 1 <= n <= max_seqs and int(m["cu_seqlens_padded"][-1]) == T, where
                for key, real in (("cu_seqlens", "cu_seqlens_cpu"),
                                  ("cu_seqlens_padded", "cu_seqlens_padded_cpu")):
                    fixed = out[key].tolist()
                    assert len(fixed) == max_seqs + 1, where
                    assert fixed == out[real].tolist() + [fixed[n]] * (max_seqs - n), where
                    assert out["packed_seq_params"][key.replace("seqlens", "seqlens_q")] \
                        is out[key]
                assert out["packed_seq_params"]["max_seqlen_q"] == T, where
                local = [tuple(out[x].shape) for x in ("tokens", "labels") if out[x] is not None]
                shapes.add((tuple(out["cu_seqlens"].shape), T // cp, tuple(local)))
                assert all(shape == (T // cp,) for shape in local), where
            assert step["figures"]["padded_tokens"] == \
                T * dp * step["figures"]["num_microbatches"]
        assert len(shapes) == 1, (topo, r, shapes)  # one shape per rank over the steps


# Groups kept together through the C++ step (keep_groups, group_field): the pairs of "uid"
# (samples 2j, 2j + 1) side by side in one microbatch, or on one replica; every field still
# equal to the reference.
@pytest.mark.parametrize("topo,keep", [
    ((1, 2, 2, 1, False, "tp0", "balanced"), "microbatch"),
    ((1, 1, 3, 1, False, "tp0", "balanced"), "replica"),
    ((1, 2, 2, 1, False, "tp0", "dynamic"), "microbatch")], ids=str)
def test_groups_kept_together_on_threads(topo, keep):
    tp, cp, dp, pp = topo[:4]
    items = rollouts(GLOBAL_BATCH * STEPS)
    specs = field_specs(FIELDS)
    opts = options(*topo, keep_groups=keep, group_field="uid")
    steps = _thdpack._run_steps_on_threads(opts, STEPS, None, shares(items, dp, specs), None,
                                           specs)
    for r, per in enumerate(steps):
        for s, step in enumerate(per):
            for k, m in enumerate(step["microbatches"]):
                check_microbatch(items, m, specs, step["first_stage"], step["last_stage"], False,
                                 f"{topo} rank {r} step {s} microbatch {k}")
            if keep == "microbatch" or topo[-1] == "dynamic":
                for m in step["microbatches"]:
                    ids = [int(i) for i in m["sample_ids"]]
                    for a, i in enumerate(ids):  # each pair's other half right beside it
                        assert (i ^ 1) in ids[max(a - 1, 0):a + 2], (topo, r, s, ids)
    # Replica mode: each pair on one replica (the dp of the ranks holding its microbatches).
    if keep == "replica":
        replica_of = {}
        for r, per in enumerate(steps):
            for m in per[0]["microbatches"]:
                for i in m["sample_ids"]:
                    replica_of.setdefault(int(i), set()).add(r)
        assert all(replica_of[i] == replica_of[i ^ 1] for i in replica_of), replica_of
    with pytest.raises(ValueError, match="group_field 'reward' is reward"):
        bad = options(*topo, keep_groups=keep, group_field="reward")
        _thdpack._run_steps_on_threads(bad, 1, None, shares(items, dp, specs), None, specs)


# Over gloo, through PackedDataIterator: 4 ranks, static with CP and DP, Hugging Face's labels
# with SP, dynamic CP, at prefetch depths 0 and 1.
GLOO_RUNS = [((1, 2, 2, 1, False, "tp0", "balanced"), {}, 1),
             ((2, 1, 2, 1, True, "tp0", "balanced"), {"label_format": "hf"}, 0),
             ((1, 2, 2, 1, False, "tp0", "dynamic"), {}, 1)]


def as_rows(items):
    """The same samples as one SampleRows: each per-token field's rows concatenated in its
    declared dtype, each sample field stacked."""
    from thdpack.torch import SampleRows
    specs = {name: (kind, dtype) for name, kind, dtype, _, _ in field_specs(FIELDS)}
    lengths = [len(x["input_ids"]) for x in items]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    token, sample = {}, {}
    for name, (kind, dtype) in specs.items():
        if dtype == "bfloat16":
            token[name] = torch.cat([x[name] for x in items])
        elif kind == "sample":
            sample[name] = np.stack([np.asarray(x[name], dtype=dtype) for x in items])
        else:
            token[name] = np.concatenate([np.asarray(x[name], dtype=dtype) for x in items])
    return SampleRows(np.concatenate([x["input_ids"] for x in items]), offsets,
                      np.concatenate([x["loss_mask"] for x in items]), token, sample)


def gloo_worker(rank, world, port, out):
    from test_torch_iterator import join_gloo, make_groups, coords
    from thdpack.torch import PackedDataIterator
    join_gloo(rank, world, port)
    items = rollouts(GLOBAL_BATCH * STEPS)
    results = []
    for run, (topo, more, prefetch) in enumerate(GLOO_RUNS):
        tp, cp, dp, pp = topo[:4]
        groups = make_groups(tp, cp, dp, pp)
        c = coords(rank, tp, cp, dp, pp)
        loader = c["tp"] == 0 and c["cp"] == 0 and c["pp"] == 0
        mine = [items[s * GLOBAL_BATCH + i] for s in range(STEPS)
                for i in range(c["dp"], GLOBAL_BATCH, dp)] if loader else None
        opts = {k: v for k, v in options(*topo).items() if k not in ("tp", "cp", "dp", "pp")}
        # The later runs feed the same samples as columns (SampleRows), read a share a step.
        fed = as_rows(mine) if run > 0 and mine is not None else mine
        it = PackedDataIterator(fed, groups, fields=FIELDS, prefetch=prefetch, **opts, **more)
        specs = it.fields
        for s, step in enumerate(it):
            for k, mb in enumerate(step):
                check_microbatch(items, mb, specs, step.first_stage, step.last_stage,
                                 more.get("label_format") == "hf",
                                 f"{topo} {more} rank {rank} step {s} microbatch {k}", typed=True)
            results.append(step.n_loss_sequences)
            # Under hf the target fields are unshifted, as the labels: unpack takes them so.
            check_unpack(step, items, mine, s, c, dp, f"{topo} {more} rank {rank} step {s}")
        it.close()
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def check_unpack(step, items, mine, s, c, dp, where):
    """step.unpack of target fields' packed values gives each loader its samples' fields back in
    its order (entry 0 the fill); the values come from the last stage's tp 0 only."""
    for name, fill in (("old_logp", 0.0), ("topk", -3.0), ("adv", 2.0), ("half", -1.5)):
        values = [mb[name] if step.last_stage else None for mb in step]
        got = step.unpack(values, fill=fill)
        if mine is None:
            assert got == [], where
            continue
        share = mine[len(mine) // STEPS * s:len(mine) // STEPS * (s + 1)] if s is not None else mine
        assert len(got) == len(share), where
        for k, (g, x) in enumerate(zip(got, share)):
            spec = dict((f[0], f) for f in field_specs(FIELDS))[name]
            want = as_tensor(x[name], DTYPES[spec[2]], spec[3]).clone()
            want[0] = fill
            assert g.dtype == want.dtype and torch.equal(g, want), f"{where}: unpack {name} {k}"


# pack_batch: the loaders' lists, one step; at static CP x DP, PP, dynamic CP.
BATCH_RUNS = [(1, 2, 2, 1, False, "tp0", "balanced"), (1, 1, 2, 2, False, "tp0", "balanced"),
              (1, 2, 2, 1, False, "tp0", "dynamic")]


def batch_worker(rank, world, port, out):
    from test_torch_iterator import join_gloo, make_groups, coords
    from thdpack.torch import pack_batch
    join_gloo(rank, world, port)
    items = rollouts(30, seed=11)
    done = 0
    messages = []
    for topo in BATCH_RUNS:
        tp, cp, dp, pp = topo[:4]
        groups = make_groups(tp, cp, dp, pp)
        c = coords(rank, tp, cp, dp, pp)
        loader = c["tp"] == 0 and c["cp"] == 0 and c["pp"] == 0
        mine = items[c["dp"]::dp] if loader else None
        opts = {k: v for k, v in options(*topo).items()
                if k not in ("tp", "cp", "dp", "pp", "global_batch")}
        step = pack_batch(mine, groups, fields=FIELDS, **opts)
        assert step.num_microbatches >= 1
        for k, mb in enumerate(step):
            check_microbatch(items, mb, field_specs(FIELDS), step.first_stage, step.last_stage,
                             False, f"{topo} rank {rank} microbatch {k}", typed=True)
        check_unpack(step, items, mine, None, c, dp, f"pack_batch {topo} rank {rank}")
        messages.append(unpack_errors(step, rank, world))
        # A second batch in the same world makes no process group: the first call's are kept.
        made = []
        new_group = dist.new_group
        dist.new_group = lambda *a, **k: made.append(1) or new_group(*a, **k)
        try:
            again = pack_batch(mine, groups, fields=FIELDS, **opts)
        finally:
            dist.new_group = new_group
        assert made == [] and again.num_microbatches == step.num_microbatches, made
        done += 1
        # The last loader holding one sample too many: the batch of 31 gives loader 0 16
        # samples and loader 1 15, neither what it holds: an error on every rank (the loaders'
        # name the counts, the others' the loader that failed).
        bad = (mine + mine[:1]) if (loader and c["dp"] == dp - 1) else mine
        try:
            pack_batch(bad, groups, fields=FIELDS, **opts)
        except (ValueError, RuntimeError) as e:
            assert "its share of the batch of 31" in str(e), e
        else:
            raise AssertionError("a loader with a sample too many was not refused")
    torch.save((done, messages), f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


UNPACK_ERRORS = ("dtype", "shape", "within", "fill", "no tensor")


def unpack_errors(step, rank, world):
    """step.unpack where the last rank (of the last stage, beside others) passes values of
    another dtype, of another row shape, of two dtypes in its own microbatches, or no tensor;
    and where every rank's fill does not fit the dtype. Each must raise on every rank (never a
    hang: the world goes on to the next batch), a ValueError where every rank finds it, naming
    the rank that failed where one rank did. {case: this rank's exception}."""
    out = {}
    odd = rank == world - 1
    for how in UNPACK_ERRORS:
        values = [mb["topk"] if step.last_stage else None for mb in step]
        fill = 0.0
        if odd and how == "dtype":
            values = [None if v is None else v.to(torch.float32) for v in values]
        elif odd and how == "shape":
            values = [None if v is None else v.reshape(-1) for v in values]
        elif how == "within" and step.num_microbatches == 1:  # M: the same on every rank
            out[how] = "skipped"
            continue
        elif odd and how == "within":  # its last values int64, the others float64
            last = max((k for k, v in enumerate(values) if v is not None), default=-1)
            values = [v.to(torch.int64) if k == last else v for k, v in enumerate(values)]
        elif odd and how == "no tensor":
            values = [[1.0] for _ in values]
        elif how == "fill":
            values = [None if v is None else v.to(torch.int64) for v in values]
            fill = 0.5
        try:
            step.unpack(values, fill=fill)
        except (ValueError, RuntimeError) as e:  # a peer's own error: RuntimeError (Aborted)
            out[how] = f"{type(e).__name__}: {e}"
        else:
            out[how] = None
    return out


def test_pack_batch_and_unpack_over_gloo(tmp_path):
    from test_torch_iterator import free_port
    spawn(batch_worker, args=(4, free_port(), str(tmp_path)), nprocs=4)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    for r in range(4):
        assert got[r][0] == len(BATCH_RUNS)
    # The unpack errors of each batch: a ValueError on every rank; where ranks disagree on the
    # dtype or row shape, the same message on every rank naming both.
    for b, topo in enumerate(BATCH_RUNS):
        said = [got[r][1][b] for r in range(4)]
        for how in UNPACK_ERRORS:
            msgs = [m[how] for m in said]
            assert all(m is not None for m in msgs), (topo, how, msgs)
            if how in ("dtype", "shape"):
                assert len(set(msgs)) == 1 and msgs[0].startswith("ValueError"), (topo, msgs)
                want = "float32 [T/CP, 2]" if how == "dtype" else "float64 [T/CP]"
                assert f"rank 3 passed values of {want}" in msgs[0], msgs[0]
                assert "of float64 [T/CP, 2] (every rank's values are of one dtype" in msgs[0]
            elif how == "fill":
                assert all(m.startswith("ValueError") and "fill: the value 0.5 is not exactly "
                           "representable as int64" in m for m in msgs), msgs
            elif how == "within":  # named by microbatch, or by rank where its others were idle
                assert msgs == ["skipped"] * 4 or all("int64 [T/CP, 2]" in m for m in msgs), msgs
                assert msgs == ["skipped"] * 4 or msgs[3].startswith("ValueError"), msgs
            else:  # rank 3's own error, named on every rank
                assert all("values of microbatch 0: expected a tensor, got list" in m
                           for m in msgs), msgs
                assert msgs[3].startswith("ValueError") and all(
                    "rank 3 (unpack) failed" in m for m in msgs[:3]), msgs


def test_fields_through_the_iterator_over_gloo(tmp_path):
    from test_torch_iterator import free_port
    spawn(gloo_worker, args=(4, free_port(), str(tmp_path)), nprocs=4)
    for r in range(4):
        assert len(torch.load(tmp_path / f"rank{r}.pt")) == len(GLOO_RUNS) * STEPS


ALIKE_FIELDS = {"old_logp": "target", "mrope": {"kind": "input", "dtype": "int32", "shape": (3,)},
                "reward": {"kind": "sample", "dtype": "float64"}}


def alike(n, seed=5):
    """Sample dicts a trainer holds: every value an array (or CPU tensor) of one dtype a key."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        L = int(rng.integers(1, 60))
        out.append({"input_ids": rng.integers(0, 1000, L),
                    "loss_mask": torch.from_numpy((np.arange(L) >= L // 3).astype(np.uint8)),
                    "old_logp": rng.normal(size=L).astype(np.float32),
                    "mrope": rng.integers(-5, 500, (L, 3)).astype(np.int32),
                    "reward": np.float64(rng.normal())})
    return out


def test_alike_dicts_become_columns_and_unalike_ones_do_not():
    from thdpack.torch.rows import rows_of_dicts
    items = alike(9)
    rows = rows_of_dicts(items, ALIKE_FIELDS)
    assert rows is not None and len(rows) == len(items)
    for x, y in zip(items, rows):  # the same samples, value for value
        assert set(x) == set(y)
        for k in x:
            a, b = np.asarray(x[k]), np.asarray(y[k])
            assert a.dtype == b.dtype and np.array_equal(a, b), k

    def variant(k, **change):
        out = [dict(x) for x in items]
        out[k].update(change)
        return out
    unalike = {
        "a list": variant(3, old_logp=list(items[3]["old_logp"])),
        "another dtype": variant(4, old_logp=items[4]["old_logp"].astype(np.float64)),
        "big-endian": variant(2, mrope=items[2]["mrope"].astype(">i4")),
        "bfloat16": variant(1, old_logp=torch.from_numpy(items[1]["old_logp"]).bfloat16()),
        "a position": [dict(x, position=i) for i, x in enumerate(items)],
        "a float mask": [dict(x, loss_mask=x["loss_mask"].float()) for x in items],
        "2-D input_ids": variant(0, input_ids=items[0]["input_ids"][None]),
        "an undeclared key": [dict(x, extra=np.zeros(1)) for x in items],
        "a key missing": [x if i else {k: v for k, v in x.items() if k != "reward"}
                          for i, x in enumerate(items)],
        "a short field": variant(5, old_logp=items[5]["old_logp"][:-1]),
        "empty input_ids": variant(6, input_ids=items[6]["input_ids"][:0]),
    }
    for what, case in unalike.items():
        assert rows_of_dicts(case, ALIKE_FIELDS) is None, what


def alike_worker(rank, world, port, out):
    from test_torch_iterator import join_gloo, make_groups
    from thdpack.torch import pack_batch
    join_gloo(rank, world, port)
    items = alike(40)
    mine = items[rank::world]
    # The same samples with one value a list: the dicts then go one by one.
    one_by_one = [dict(x) for x in mine]
    one_by_one[0]["old_logp"] = one_by_one[0]["old_logp"].tolist()
    from thdpack.torch.rows import rows_of_dicts
    assert rows_of_dicts(mine, ALIKE_FIELDS) is not None
    assert rows_of_dicts(one_by_one, ALIKE_FIELDS) is None
    got = []
    for share in (mine, one_by_one):
        step = pack_batch(share, make_groups(1, 1, world, 1), fields=ALIKE_FIELDS,
                          max_tokens_per_rank=MAX_TOKENS)
        got.append([{k: v.clone() for k, v in mb.items() if isinstance(v, torch.Tensor)}
                    for mb in step] + [step.unpack([mb["labels"].double() for mb in step])])
    torch.save(got, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_pack_batch_of_alike_dicts_equals_the_dicts_one_by_one(tmp_path):
    from test_torch_iterator import free_port
    spawn(alike_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    for r in range(2):
        columns, dicts = torch.load(f"{tmp_path}/rank{r}.pt")
        assert len(columns) == len(dicts) and len(columns) > 2
        for a, b in zip(columns[:-1], dicts[:-1]):
            assert a.keys() == b.keys()
            for k in a:
                assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        for a, b in zip(columns[-1], dicts[-1]):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
