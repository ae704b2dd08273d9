"""thdpack.ParallelLayout: the padding rule of thdpack/parallel_layout.h against a plain Python
definition that searches for the smallest multiple, on fresh random inputs; pack() and schedule()
follow the same rule; bad arguments raise ValueError naming the argument."""
import random

import numpy as np
import pytest

import thdpack


def zigzag(cp):
    """Every padded sequence splits into 2*CP zigzag chunks (CP > 1)."""
    return 2 * cp if cp > 1 else 1


def padded_by_search(length, cp, extra):
    """The smallest P >= length that is a multiple of the zigzag multiple times extra."""
    p = length
    while p % (zigzag(cp) * extra) != 0:
        p += 1
    return p


def tokens_by_search(sum_padded, cp, tp, sp, extra, rank_multiple=1):
    """The smallest T >= sum_padded that keeps the sequence alignment, splits into equal shares
    of the ranks it is divided over (CP; CP*TP with SP over TP > 1), each share a multiple of
    the rank multiple."""
    ranks = cp * tp if sp and tp > 1 else cp
    t = sum_padded
    while t % (zigzag(cp) * extra) != 0 or t % ranks != 0 or (t // ranks) % rank_multiple != 0:
        t += 1
    return t


def quantum_by_search(cp, tp, sp, extra, rank_multiple=1):
    """The smallest q >= 1 with every multiple of q a valid T."""
    q = 1
    while tokens_by_search(q, cp, tp, sp, extra, rank_multiple) != q:
        q += 1
    return q


def random_layout(rng):
    return (int(rng.integers(1, 17)), int(rng.integers(1, 9)), bool(rng.integers(2)),
            int(rng.choice([1, 1, 2, 3, 8])), int(rng.choice([1, 1, 2, 16, 32])))


def test_default_is_unsplit():
    l = thdpack.ParallelLayout()
    assert (l.cp_size, l.tp_size, l.sp, l.extra_alignment) == (1, 1, False, 1)
    assert (l.zigzag_multiple, l.sequence_alignment, l.token_quantum) == (1, 1, 1)
    assert l.padded_length(7) == 7 and l.microbatch_tokens(7) == 7
    assert l == thdpack.ParallelLayout(cp_size=1)


def test_worked_example():
    # docs: lengths 7 and 3 at CP = 2 give P = 8 and 4, T = 12; with TP = 4 and SP, T = 16.
    cp2 = thdpack.ParallelLayout(cp_size=2)
    assert (cp2.padded_length(7), cp2.padded_length(3), cp2.microbatch_tokens(12)) == (8, 4, 12)
    sp = thdpack.ParallelLayout(cp_size=2, tp_size=4, sp=True)
    assert sp.token_quantum == 8 and sp.microbatch_tokens(12) == 16
    assert "CP=2" in repr(sp) and "TP=4" in repr(sp)


def test_rule_equals_search_on_random_inputs():
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    for trial in range(500):
        cp, tp, sp, extra, r = random_layout(rng)
        what = f"seed {seed} trial {trial}: cp {cp} tp {tp} sp {sp} extra {extra} r {r}"
        l = thdpack.ParallelLayout(cp_size=cp, tp_size=tp, sp=sp, extra_alignment=extra,
                                   rank_multiple=r)
        assert (l.cp_size, l.tp_size, l.sp, l.extra_alignment, l.rank_multiple) == \
            (cp, tp, sp, extra, r), what
        assert l.zigzag_multiple == zigzag(cp), what
        assert l.sequence_alignment == padded_by_search(1, cp, extra), what
        assert l.token_quantum == quantum_by_search(cp, tp, sp, extra, r), what
        assert l.rank_quantum == (cp * tp if sp and tp > 1 else cp) * r, what
        lengths = [int(x) for x in rng.integers(1, 3000, size=int(rng.integers(1, 6)))]
        padded = [l.padded_length(n) for n in lengths]
        assert padded == [padded_by_search(n, cp, extra) for n in lengths], what
        assert l.padded_length(0) == 0, what
        s = sum(padded)
        assert l.microbatch_tokens(s) == tokens_by_search(s, cp, tp, sp, extra, r), what
        # Any sum, not only one of padded lengths.
        s = int(rng.integers(0, 10000))
        assert l.microbatch_tokens(s) == tokens_by_search(s, cp, tp, sp, extra, r), what


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_every_cp_tp_sp_and_rank_multiple_packs_by_the_rule(cp):
    """Every (CP, TP, SP, R) on fresh random lengths: pack()'s padded lengths and T are the
    search's, every CP shard (and SP part) holds a multiple of R tokens, only the last sequence
    grows, and the shards unshard to the packed arrays."""
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    for tp in (1, 2, 3, 4, 8):
        for sp in (False, True):
            for r in (1, 3, 16, 32, 128, "fp8", "mxfp8", "blockwise"):
                rv = {"fp8": 16, "mxfp8": 32, "blockwise": 128}.get(r, r)
                what = f"seed {seed}: cp {cp} tp {tp} sp {sp} r {r}"
                lengths = [int(x) for x in rng.integers(1, 300, size=int(rng.integers(1, 6)))]
                samples = [rng.integers(0, 1000, n).astype(np.int32) for n in lengths]
                p = thdpack.pack(samples, cp_size=cp, tp_size=tp, sp=sp, rank_multiple=r)
                P = np.diff(p["cu_seqlens_padded"]).tolist()
                assert P[:-1] == [padded_by_search(n, cp, 1) for n in lengths[:-1]], what
                t = int(p["cu_seqlens_padded"][-1])
                assert t == tokens_by_search(sum(padded_by_search(n, cp, 1) for n in lengths),
                                             cp, tp, sp, 1, rv), what
                shards = []
                for rank in range(cp):
                    s = thdpack.pack_shard(samples, cp_size=cp, cp_rank=rank, tp_size=tp, sp=sp,
                                           rank_multiple=r)
                    assert len(s["tokens"]) == t // cp and (t // cp) % rv == 0, what
                    if sp and tp > 1:
                        assert (t // cp // tp) % rv == 0, what
                    shards.append(s["tokens"])
                back = thdpack.unshard(shards, p["cu_seqlens_padded"])
                assert np.array_equal(back, p["tokens"]), what


def test_pack_and_schedule_follow_the_layout():
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    for trial in range(60):
        cp, tp, sp, extra, r = random_layout(rng)
        what = f"seed {seed} trial {trial}: cp {cp} tp {tp} sp {sp} extra {extra} r {r}"
        l = thdpack.ParallelLayout(cp_size=cp, tp_size=tp, sp=sp, extra_alignment=extra,
                                   rank_multiple=r)
        lengths = [int(x) for x in rng.integers(1, 200, size=int(rng.integers(1, 6)))]
        samples = [np.arange(n, dtype=np.int32) for n in lengths]
        p = thdpack.pack(samples, cp_size=cp, tp_size=tp, sp=sp, extra_alignment=extra,
                         rank_multiple=r)
        got = np.diff(p["cu_seqlens_padded"]).tolist()
        assert got[:-1] == [l.padded_length(n) for n in lengths[:-1]], what
        assert int(p["cu_seqlens_padded"][-1]) == l.microbatch_tokens(
            sum(l.padded_length(n) for n in lengths)), what
        # One microbatch of at most this budget: the scheduler's T is the layout's.
        plan = thdpack.schedule(np.array(lengths), dp_size=1, cp_size=cp, tp_size=tp, sp=sp,
                                extra_alignment=extra, max_tokens_per_rank=1 << 20,
                                rank_multiple=r)
        fig = plan.figures["replicas"][0]["microbatches"]
        assert sum(mb["padded_tokens"] for mb in fig) == sum(
            l.microbatch_tokens(sum(l.padded_length(lengths[i]) for i in mb["samples"]))
            for mb in fig), what


@pytest.mark.parametrize("kwargs,match", [
    (dict(cp_size=0), "cp_size = 0"),
    (dict(cp_size=-3), "cp_size = -3"),
    (dict(tp_size=0), "tp_size = 0"),
    (dict(cp_size=2, extra_alignment=0), "extra_alignment = 0"),
    (dict(cp_size=4, extra_alignment=1 << 30), "extra_alignment = 1073741824.*int32"),
    (dict(cp_size=65536, tp_size=65536, sp=True), r"cp_size \* tp_size = 65536 \* 65536"),
    (dict(rank_multiple=0), "rank_multiple = 0: must be >= 1"),
    (dict(rank_multiple=-16), "rank_multiple = -16"),
    (dict(rank_multiple="fp4"), r'rank_multiple: rank multiple "fp4": expected fp8 \(16\)'),
    (dict(rank_multiple=2.5), "rank_multiple: expected an integer"),
    (dict(rank_multiple=True), "rank_multiple: expected an integer or a preset name"),
    (dict(rank_multiple=1 << 40), "rank_multiple"),
    (dict(cp_size=65536, rank_multiple=65536), "rank_multiple = 65536 times the 65536 ranks"),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        thdpack.ParallelLayout(**kwargs)
    # The bindings that take the same keyword arguments report the same error.
    with pytest.raises(ValueError, match=match):
        thdpack.pack([np.arange(5, dtype=np.int32)], **kwargs)
    with pytest.raises(ValueError, match=match):
        thdpack.schedule(np.array([5, 6]), dp_size=1, max_tokens_per_rank=100, **kwargs)


def test_rank_multiple_presets_and_worked_example():
    # docs/layout.md: lengths 7 and 3 at CP = 2 with the fp8 preset: T = 32, 16 per CP rank.
    for r, value in (("fp8", 16), ("mxfp8", 32), ("blockwise", 128), ("none", 1), (16, 16)):
        assert thdpack.ParallelLayout(rank_multiple=r).rank_multiple == value
    l = thdpack.ParallelLayout(cp_size=2, rank_multiple="fp8")
    assert (l.split_ranks, l.rank_quantum, l.token_quantum) == (2, 32, 32)
    assert l.microbatch_tokens(12) == 32 and "rank multiple 16" in repr(l)
    p = thdpack.pack([np.arange(7, dtype=np.int32), np.arange(3, dtype=np.int32)], cp_size=2,
                     rank_multiple="fp8")
    assert p["cu_seqlens_padded"].tolist() == [0, 8, 32] and p["max_seqlen"] == 24
    sp = thdpack.ParallelLayout(cp_size=2, tp_size=2, sp=True, rank_multiple=16)
    assert sp.microbatch_tokens(12) == 64
    assert thdpack.ParallelLayout(cp_size=2, rank_multiple=16) != thdpack.ParallelLayout(cp_size=2)


def test_bad_lengths_raise_value_error_naming_them():
    l = thdpack.ParallelLayout(cp_size=2)
    with pytest.raises(ValueError, match="length = -1"):
        l.padded_length(-1)
    with pytest.raises(ValueError, match="sum_padded = -4"):
        l.microbatch_tokens(-4)
    with pytest.raises(ValueError, match="length = 4611686018427387905"):
        l.padded_length((1 << 62) + 1)


def test_encode_metadata_checks_pad_multiple_against_the_layout():
    p = thdpack.pack([np.arange(7, dtype=np.int32)], cp_size=2)
    with pytest.raises(ValueError, match="pad_multiple = 6.*multiple of 4"):
        thdpack.encode_metadata([p], cp_size=2, pad_multiple=6)
    with pytest.raises(ValueError, match="cp_size = 0"):
        thdpack.encode_metadata([p], cp_size=0)
    d = thdpack.decode_metadata(thdpack.encode_metadata([p], cp_size=2))
    assert (d["cp_size"], d["tp_size"], d["sp"], d["pad_multiple"]) == (2, 1, False, 4)


def same_value(a, b):
    """Equal nested dicts, lists and arrays."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return a == b


def test_one_layout_value_through_every_binding():
    """pack, pack_shard, schedule and encode_metadata take a ParallelLayout (layout=) and give
    what its scalars give; a layout beside its scalars, or anything else as layout, is a
    TypeError naming them."""
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    for trial in range(30):
        cp, tp, sp, extra, r = random_layout(rng)
        what = f"seed {seed} trial {trial}: cp {cp} tp {tp} sp {sp} extra {extra} r {r}"
        scalars = dict(cp_size=cp, tp_size=tp, sp=sp, extra_alignment=extra, rank_multiple=r)
        l = thdpack.ParallelLayout(**scalars)
        lengths = [int(x) for x in rng.integers(1, 200, size=int(rng.integers(2, 7)))]
        samples = [rng.integers(0, 1000, n).astype(np.int32) for n in lengths]
        a, b = thdpack.pack(samples, layout=l), thdpack.pack(samples, **scalars)
        assert a.keys() == b.keys(), what
        for k in a:
            assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), (what, k)
        rank = int(rng.integers(0, cp))
        a = thdpack.pack_shard(samples, cp_rank=rank, layout=l)
        b = thdpack.pack_shard(samples, cp_rank=rank, **scalars)
        for k in a:
            assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), (what, k)
        pa = thdpack.schedule(np.array(lengths), dp_size=2, layout=l, max_tokens_per_rank=1 << 16)
        pb = thdpack.schedule(np.array(lengths), dp_size=2, max_tokens_per_rank=1 << 16,
                              **scalars)
        assert same_value(pa.figures, pb.figures), what
        assert pa.num_microbatches == pb.num_microbatches, what
        p = thdpack.pack(samples, layout=l)
        wire_a = thdpack.encode_metadata([p], layout=l)
        wire_b = thdpack.encode_metadata([p], cp_size=cp, tp_size=tp, sp=sp, rank_multiple=r,
                                         pad_multiple=l.sequence_alignment)
        assert wire_a == wire_b, what
    l = thdpack.ParallelLayout(cp_size=2)
    one = [np.arange(5, dtype=np.int32)]
    with pytest.raises(TypeError, match="pack: give layout= or its scalars, not both.*cp_size"):
        thdpack.pack(one, layout=l, cp_size=2)
    with pytest.raises(TypeError, match="schedule: .*not both.*sp, rank_multiple"):
        thdpack.schedule(np.array([5]), dp_size=1, max_tokens_per_rank=64, layout=l, sp=False,
                         rank_multiple=1)
    with pytest.raises(TypeError, match="pack_shard: layout must be a thdpack.ParallelLayout"):
        thdpack.pack_shard(one, cp_rank=0, layout={"cp_size": 2})
    with pytest.raises(TypeError, match="pack_shard: give cp_size"):
        thdpack.pack_shard(one, cp_rank=0)
    with pytest.raises(TypeError, match="layout= or pad_multiple"):
        thdpack.encode_metadata([thdpack.pack(one, layout=l)], layout=l, pad_multiple=4)
