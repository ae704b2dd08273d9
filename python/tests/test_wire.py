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
