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
    with pytest.raises(ValueError, match="samples\\[0\\] \\(id 0\\): tokens\\[1\\] = -5"):
        thdpack.pack([np.array([1, -5], np.int64)])
    with pytest.raises(ValueError, match="target_masks"):
        thdpack.pack([np.arange(3, dtype=np.int32)], [None, None])
    with pytest.raises(ValueError):
        thdpack.pack([np.arange(3, dtype=np.int32)], [np.array([1, 2, 1], np.uint8)])
    with pytest.raises(ValueError):
        thdpack.pack([np.zeros(0, np.int32)])


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int16, np.int8])
def test_every_token_dtype_gets_the_same_checks(dtype):
    # -100 is the ignore index: taken as a token it became a label the loss then skipped, so
    # n_valid disagreed with what cross_entropy counts. Rejected whatever the dtype.
    bad = np.array([7, -100, 9], dtype)
    msg = "samples\\[1\\] \\(id 1\\): tokens\\[1\\] = -100: token ids must lie in \\[0, 2\\^31\\)"
    with pytest.raises(ValueError, match=msg):
        thdpack.pack([np.array([1, 2], np.int32), bad])
    with pytest.raises(ValueError, match=msg):
        thdpack.pack_shard([np.array([1, 2], np.int32), bad], cp_size=1, cp_rank=0)
    with pytest.raises(ValueError, match=msg):
        thdpack.pack([[1, 2], bad.tolist()])


def test_tokens_that_do_not_fit_int32_name_their_position():
    with pytest.raises(ValueError, match="samples\\[0\\]\\[2\\] = 2147483648: does not fit int32"):
        thdpack.pack([np.array([1, 2, 2**31], np.int64)])
    with pytest.raises(ValueError, match="samples\\[0\\]\\[0\\] = 18446744073709551615"):
        thdpack.pack([np.array([2**64 - 1], np.uint64)])
    with pytest.raises(ValueError, match="samples\\[0\\]: got a bool array"):
        thdpack.pack([np.array([True, False])])


def test_explicit_byte_order_dtypes_are_accepted():
    # Every unpickled array (e.g. after all_gather_object) spells its dtype '<i4'.
    import pickle
    native = [np.arange(1, 8, dtype=np.int32), np.arange(3, 6, dtype=np.int32)]
    masks = [np.array([0, 0, 1, 1, 1, 1, 1], np.uint8), None]
    spelled = [np.asarray(a, dtype="<i4") for a in native]
    unpickled = pickle.loads(pickle.dumps(native))
    big_endian = [a.astype(">i4") for a in native]  # not native: converted, same values
    want_full = thdpack.pack(native, masks, cp_size=2)
    for samples in (spelled, unpickled, big_endian):
        for r in range(2):
            got = thdpack.pack_shard(samples, pickle.loads(pickle.dumps(masks)), cp_size=2,
                                     cp_rank=r)
            want = thdpack.pack_shard(native, masks, cp_size=2, cp_rank=r)
            for key in ("tokens", "labels", "position_ids", "loss_mask", "cu_seqlens"):
                assert got[key].tolist() == want[key].tolist(), key
        got_full = thdpack.pack(samples, masks, cp_size=2)
        assert got_full["tokens"].tolist() == want_full["tokens"].tolist()


def test_pack_accepts_what_a_user_holds():
    torch = pytest.importorskip("torch")
    a = [5, 6, 7, 8]
    b = [9, 10, 11]
    mask_a = [0, 1, 1, 1]
    want = thdpack.pack([np.array(a, np.int32), np.array(b, np.int32)],
                        [np.array(mask_a, np.uint8), None], cp_size=2)
    holders = [
        ([a, b], [mask_a, None]),  # lists
        ((tuple(a), tuple(b)), (tuple(mask_a), None)),  # tuples
        ([torch.tensor(a), torch.tensor(b, dtype=torch.int32)],
         [torch.tensor(mask_a, dtype=torch.bool), None]),  # CPU tensors
        ([np.array(a, np.uint16), np.array(b, np.int8)],
         [np.array(mask_a, np.float32), None]),  # any integer dtype, a float 0/1 mask
        ([np.array(a, np.uint64), np.array(b, np.int64)],
         [np.array(mask_a, np.int64), None]),
        ([torch.tensor(a, requires_grad=False), torch.tensor(b)],
         [torch.tensor(mask_a, dtype=torch.float32), torch.ones(3)]),  # an explicit all-ones
    ]
    for samples, masks in holders:
        got = thdpack.pack(samples, masks, cp_size=2)
        for key in ("tokens", "labels", "position_ids", "loss_mask", "cu_seqlens_padded"):
            assert got[key].tolist() == want[key].tolist(), (key, type(samples[0]))
        assert got["n_valid"] == want["n_valid"] == 3 + 2
    # A mask value other than 0 or 1 is named, whatever the dtype.
    with pytest.raises(ValueError, match="target_masks\\[0\\]\\[1\\] = 0.5: a target mask holds 0 or 1"):
        thdpack.pack([a], [np.array([0, 0.5, 1, 1], np.float32)])
    with pytest.raises(ValueError, match="target_masks\\[0\\]\\[3\\] = 2"):
        thdpack.pack([a], [[0, 1, 1, 2]])
    with pytest.raises(ValueError, match="target_masks\\[0\\]\\[2\\] = nan"):
        thdpack.pack([a], [np.array([0, 1, np.nan, 1])])
    # A tensor is viewed, not copied: what pack reads is the tensor's memory.
    t = torch.tensor(a, dtype=torch.int32)
    t[0] = 42
    assert thdpack.pack([t])["tokens"][0] == 42
    with pytest.raises(ValueError, match="samples\\[0\\]: expected a NumPy array, a CPU torch tensor or a list, got str"):
        thdpack.pack(["abc"])
    with pytest.raises(ValueError, match="samples\\[0\\]: got a list that"):
        thdpack.pack([[1, [2, 3]]])


def test_hf_label_format_written_out_by_hand():
    """label_format="hf": Hugging Face's convention (the model shifts the labels): token j where
    its own target mask is 1, -100 at each sequence's first token, where the mask is 0 and at
    padding; the keyword names of transformers' DataCollatorWithFlattening beside thdpack's."""
    a = np.array([10, 11, 12, 13, 14, 15, 16], np.int32)
    b = np.array([20, 21, 22], np.int64)
    mask_a = np.array([0, 0, 1, 1, 1, 1, 1], np.uint8)  # a prompt of two tokens
    p = thdpack.pack([a, b], [mask_a, None], label_format="hf")
    X = -100
    assert p["labels"].tolist() == [X, X, 12, 13, 14, 15, 16, X, 21, 22]
    assert p["loss_mask"].tolist() == [0, 0, 1, 1, 1, 1, 1, 0, 1, 1]
    assert p["n_valid"] == 7 and p["loss_mask"].sum() == 7
    assert p["input_ids"].tolist() == p["tokens"].tolist()
    assert p["cu_seq_lens_q"].dtype == np.int32
    assert p["cu_seq_lens_q"].tolist() == p["cu_seq_lens_k"].tolist() == [0, 7, 10]
    assert p["max_length_q"] == p["max_length_k"] == 7
    # The Megatron convention of the same samples shifted by one is the same set of targets.
    m = thdpack.pack([a, b], [mask_a, None])
    assert "input_ids" not in m and "cu_seq_lens_q" not in m
    assert m["labels"][m["loss_mask"] > 0].tolist() == p["labels"][p["loss_mask"] > 0].tolist()
    # A rank multiple pads the last sequence; its tail is -100 and the keyword offsets cover it.
    r = thdpack.pack([a, b], [mask_a, None], label_format="hf", rank_multiple=16, pad_id=5)
    assert r["cu_seq_lens_q"].tolist() == [0, 7, 16] and r["max_length_q"] == 9
    assert r["labels"].tolist() == [X, X, 12, 13, 14, 15, 16, X, 21, 22] + [X] * 6
    h, hm = thdpack.hf_labels(m["labels"], m["loss_mask"], m["cu_seqlens_padded"])
    assert h.dtype == np.int64 and hm.dtype == np.float32
    assert h.tolist() == p["labels"].tolist() and hm.tolist() == p["loss_mask"].tolist()


def test_hf_label_format_errors_say_why():
    a = [np.arange(1, 9, dtype=np.int32)]
    with pytest.raises(ValueError, match="label_format = 'hf' needs cp_size = 1, got 2: a "
                                         "Hugging Face model shifts its labels"):
        thdpack.pack(a, cp_size=2, label_format="hf")
    with pytest.raises(ValueError, match="label_format = 'HF': expected 'megatron'"):
        thdpack.pack(a, label_format="HF")
    with pytest.raises(ValueError, match="labels has 8 elements.*T = cu_seqlens_padded\\[n\\] = 9"):
        thdpack.hf_labels(np.zeros(8, np.int64), np.zeros(8, np.float32), [0, 9])
    with pytest.raises(ValueError, match="loss_mask\\[2\\] = 0.5"):
        thdpack.hf_labels(np.zeros(4, np.int64), [0, 0, 0.5, 0], [0, 4])
    with pytest.raises(ValueError, match="cu_seqlens_padded"):
        thdpack.hf_labels(np.zeros(4, np.int64), np.zeros(4), [0, 3, 2, 4])
