"""pack(): dtypes and the labels / loss_mask rules of docs/design.md section 5, written out by hand."""
import numpy as np
import pytest

import thdpack


def test_worked_example_lengths_7_and_3_cp2():
    a = np.array([10, 11, 12, 13, 14, 15, 16], np.int32)
    b = np.array([20, 21, 22], np.int64)
    mask_b = np.array([0, 1, 0], np.uint8)  # only token 1 of b is a target
    p = thdpack.pack([a, b], [None, mask_b], cp_size=2, pad_id=9)
    assert p["tokens"].dtype == np.int64 and p["labels"].dtype == np.int64
    assert p["position_ids"].dtype == np.int64 and p["loss_mask"].dtype == np.float32
    assert p["cu_seqlens"].dtype == np.int32 and p["cu_seqlens_padded"].dtype == np.int32
    assert p["tokens"].tolist() == [10, 11, 12, 13, 14, 15, 16, 9, 20, 21, 22, 9]
    assert p["position_ids"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert p["labels"].tolist() == [11, 12, 13, 14, 15, 16, -100, -100, 21, 22, -100, -100]
    assert p["loss_mask"].tolist() == [1, 1, 1, 1, 1, 1, 0, 0, 1, 0, 0, 0]
    assert p["cu_seqlens"].tolist() == [0, 7, 10]
    assert p["cu_seqlens_padded"].tolist() == [0, 8, 12]
    assert p["max_seqlen"] == 8 and p["n_valid"] == 7


def test_pack_shard_equals_shard_of_pack():
    rng = np.random.default_rng(5)
    samples = [rng.integers(0, 50, size=L).astype(np.int32) for L in (5, 17, 2, 9)]
    full = thdpack.pack(samples, cp_size=4, tp_size=2, sp=True)
    for r in range(4):
        s = thdpack.pack_shard(samples, cp_size=4, cp_rank=r, tp_size=2, sp=True)
        assert s["n_valid"] == full["n_valid"]
        for key in ("tokens", "labels", "position_ids", "loss_mask"):
            np.testing.assert_array_equal(
                s[key], thdpack.shard(full[key], full["cu_seqlens_padded"], 4, r), err_msg=key)


def test_pack_errors():
    with pytest.raises(ValueError, match="samples\\[1\\].*float64"):
        thdpack.pack([np.arange(3, dtype=np.int32), np.ones(3)])
    with pytest.raises(ValueError, match="samples\\[0\\]\\[1\\]"):
        thdpack.pack([np.array([1, -5], np.int64)])
    with pytest.raises(ValueError, match="target_masks"):
        thdpack.pack([np.arange(3, dtype=np.int32)], [None, None])
    with pytest.raises(ValueError):
        thdpack.pack([np.arange(3, dtype=np.int32)], [np.array([1, 2, 1], np.uint8)])
    with pytest.raises(ValueError):
        thdpack.pack([np.zeros(0, np.int32)])
