"""encode_metadata / decode_metadata: round trip, and ValueError on every corruption."""
import numpy as np
import pytest

import thdpack


def make_meta():
    rng = np.random.default_rng(3)
    mbs = []
    for _ in range(3):
        samples = [rng.integers(0, 100, size=L).astype(np.int32)
                   for L in rng.integers(1, 60, size=4)]
        mbs.append(thdpack.pack(samples, cp_size=2))
    n = sum(m["n_valid"] for m in mbs) + 17
    return mbs, dict(step=12, epoch=1, dp_size=2, replica=1, cp_size=2, n_loss_tokens=n,
                     skipped_ids=[5, 9])


def test_round_trip():
    mbs, kw = make_meta()
    data = thdpack.encode_metadata(mbs, **kw)
    assert isinstance(data, bytes)
    d = thdpack.decode_metadata(data)
    for key, value in kw.items():
        got = d[key].tolist() if key == "skipped_ids" else d[key]
        assert got == value, key
    assert d["pad_multiple"] == 4
    for got, mb in zip(d["microbatches"], mbs):
        assert got["cu_seqlens"].tolist() == mb["cu_seqlens"].tolist()
        assert got["cu_seqlens_padded"].tolist() == mb["cu_seqlens_padded"].tolist()
        assert got["max_seqlen"] == mb["max_seqlen"] and got["n_valid"] == mb["n_valid"]
    assert d["real_tokens"] == sum(int(m["cu_seqlens"][-1]) for m in mbs)
    assert d["padded_tokens"] == sum(int(m["cu_seqlens_padded"][-1]) for m in mbs)
    sq = sum(int((np.diff(m["cu_seqlens_padded"]).astype(np.int64) ** 2).sum()) for m in mbs)
    assert d["sum_sq"] == sq


def test_decode_errors_on_corrupt_bytes():
    mbs, kw = make_meta()
    data = thdpack.encode_metadata(mbs, **kw)
    for cut in range(len(data)):  # every truncation
        with pytest.raises(ValueError):
            thdpack.decode_metadata(data[:cut])
    rng = np.random.default_rng(0)
    for _ in range(300):  # random bit flips
        b = bytearray(data)
        i = int(rng.integers(len(b)))
        b[i] ^= 1 << int(rng.integers(8))
        with pytest.raises(ValueError):
            thdpack.decode_metadata(bytes(b))
    with pytest.raises(ValueError, match="(?i)magic"):
        thdpack.decode_metadata(b"XXXX" + data[4:])
    with pytest.raises(ValueError):
        thdpack.decode_metadata(data + b"\0")


def test_encode_errors_name_the_field():
    mbs, kw = make_meta()
    kw["n_loss_tokens"] = 1  # smaller than the replica's own loss tokens
    with pytest.raises(ValueError, match="n_loss_tokens"):
        thdpack.encode_metadata(mbs, **kw)
    with pytest.raises(ValueError, match="missing key 'n_valid'"):
        thdpack.encode_metadata([{"cu_seqlens": mbs[0]["cu_seqlens"],
                                  "cu_seqlens_padded": mbs[0]["cu_seqlens_padded"]}])


def test_decode_accepts_the_bytes_a_user_holds():
    torch = pytest.importorskip("torch")
    mbs, kw = make_meta()
    data = thdpack.encode_metadata(mbs, **kw)
    want = thdpack.decode_metadata(data)
    as_numpy = np.frombuffer(data, np.uint8)
    holders = [bytearray(data), memoryview(data), as_numpy, as_numpy.astype(np.int8),
               torch.frombuffer(bytearray(data), dtype=torch.uint8),
               torch.tensor(list(data), dtype=torch.uint8)]
    for held in holders:
        got = thdpack.decode_metadata(held)
        assert got["n_loss_tokens"] == want["n_loss_tokens"], type(held)
        assert got["skipped_ids"].tolist() == want["skipped_ids"].tolist()
        for g, w in zip(got["microbatches"], want["microbatches"]):
            assert g["cu_seqlens_padded"].tolist() == w["cu_seqlens_padded"].tolist()
    # Corruption is still found through every holder.
    with pytest.raises(ValueError):
        thdpack.decode_metadata(bytearray(data[:-1]))
    with pytest.raises(ValueError, match="data: got a int32 array of shape \\([0-9]+,\\), expected bytes"):
        thdpack.decode_metadata(as_numpy.astype(np.int32))
    # A strided view of the bytes is read through its strides.
    doubled = np.repeat(as_numpy, 2)
    assert thdpack.decode_metadata(doubled[::2])["n_loss_tokens"] == want["n_loss_tokens"]
    assert thdpack.decode_metadata(memoryview(bytes(doubled))[::2])["n_loss_tokens"] == \
        want["n_loss_tokens"]
    with pytest.raises(ValueError, match="data: expected a NumPy array, a CPU torch tensor or a list, got int"):
        thdpack.decode_metadata(5)


def test_encode_accepts_cu_seqlens_of_any_integer_dtype():
    torch = pytest.importorskip("torch")
    mbs, kw = make_meta()
    want = thdpack.encode_metadata(mbs, **kw)
    for convert in (lambda a: a.astype(np.int64), lambda a: a.astype("<i4"), lambda a: a.tolist(),
                    lambda a: torch.tensor(a.tolist()), lambda a: a.astype(np.uint32)):
        other = [dict(mb, cu_seqlens=convert(mb["cu_seqlens"]),
                      cu_seqlens_padded=convert(mb["cu_seqlens_padded"])) for mb in mbs]
        assert thdpack.encode_metadata(other, **kw) == want


def test_groups_round_trip_as_version_2():
    """The dynamic scheduler's metadata: a group per microbatch (idle: (0, 0)), each padded by
    its group's layout; static metadata stays version 1 and has no groups."""
    rng = np.random.default_rng(5)
    samples = [rng.integers(0, 100, size=L).astype(np.int32) for L in (7, 1, 20)]
    group3 = thdpack.pack(samples, cp_size=3)  # padded to multiples of 2*3
    idle = {"cu_seqlens": np.array([0], np.int32), "cu_seqlens_padded": np.array([0], np.int32),
            "n_valid": 0}
    group1 = thdpack.pack([samples[0]], cp_size=1)
    groups = [(0, 3), (0, 0), (2, 1)]
    data = thdpack.encode_metadata([group3, idle, group1], dp_size=2, cp_size=2, replica=1,
                                   groups=groups, domain_rank=2)
    assert data[4] == 2
    d = thdpack.decode_metadata(data)
    assert [tuple(g) for g in d["groups"]] == groups and d["domain_rank"] == 2
    assert d["microbatches"][0]["cu_seqlens_padded"].tolist() == [0, 12, 18, 42]
    assert d["microbatches"][1]["cu_seqlens"].tolist() == [0]
    with pytest.raises(ValueError, match="domain_rank"):
        thdpack.encode_metadata([group3, idle, group1], dp_size=2, cp_size=2, replica=1,
                                groups=[(0, 3), (0, 0), (3, 1)], domain_rank=2)
    static = thdpack.decode_metadata(thdpack.encode_metadata([group1]))
    assert "groups" not in static


def test_rank_multiple_round_trips_as_version_3():
    """A rank multiple (docs/wire_format.md, version 3): the microbatches packed with it encode
    as version 3 and decode with it; without it the bytes are version 1's, as before; a layout
    whose T breaks the multiple is refused, naming the rule."""
    rng = np.random.default_rng(9)
    samples = [rng.integers(0, 100, size=L).astype(np.int32) for L in (7, 3, 30)]
    for r, value in (("fp8", 16), (32, 32), ("blockwise", 128)):
        mb = thdpack.pack(samples, cp_size=2, tp_size=2, sp=True, rank_multiple=r)
        assert int(mb["cu_seqlens_padded"][-1]) % (4 * value) == 0
        data = thdpack.encode_metadata([mb], cp_size=2, tp_size=2, sp=True, rank_multiple=r)
        assert data[4] == 3
        d = thdpack.decode_metadata(data)
        assert d["rank_multiple"] == value and d["pad_multiple"] == 4 and d["sp"]
        assert d["microbatches"][0]["cu_seqlens_padded"].tolist() == \
            mb["cu_seqlens_padded"].tolist()
    plain = thdpack.pack(samples, cp_size=2)
    data = thdpack.encode_metadata([plain], cp_size=2)
    assert data[4] == 1 and thdpack.decode_metadata(data)["rank_multiple"] == 1
    with pytest.raises(ValueError, match="total 44 is not a multiple of 32.*rank_multiple 16"):
        thdpack.encode_metadata([plain], cp_size=2, rank_multiple=16)
    with pytest.raises(ValueError, match="rank_multiple: rank multiple \"fp7\""):
        thdpack.encode_metadata([plain], cp_size=2, rank_multiple="fp7")
