"""Data sources and FLOPs from Python, checked against values worked out independently."""
import json

import numpy as np
import pytest

import thdpack


def test_read_jsonl(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}) + "\n"
                    + json.dumps({"input_ids": [9]}) + "\n")
    samples = thdpack.read_jsonl(str(path))
    assert [s["id"] for s in samples] == [0, 1]
    assert samples[0]["tokens"].dtype == np.int32 and samples[0]["tokens"].tolist() == [5, 6, 7]
    assert samples[0]["target_mask"].tolist() == [0, 1, 1]
    assert samples[1]["target_mask"] is None
    assert len(thdpack.read_jsonl(str(path), limit=1)) == 1
    lengths = thdpack.read_lengths("jsonl:" + str(path))
    assert lengths["lengths"].tolist() == [3, 1] and lengths["n_targets"].tolist() == [2, 0]
    # The samples go straight into pack.
    p = thdpack.pack([s["tokens"] for s in samples], [s["target_mask"] for s in samples])
    assert p["n_valid"] == 2


def test_read_errors_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_ids": [1, 2]}\n{"input_ids": [1, -3]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        thdpack.read_jsonl(str(path))
    with pytest.raises((OSError, ValueError), match="missing"):
        thdpack.read_jsonl(str(tmp_path / "missing.jsonl"))


def test_deep_nesting_nul_and_bom_in_jsonl(tmp_path):
    # A value nested 100,000 deep crashed the interpreter (stack overflow while formatting the
    # error); a NUL byte silently cut the line; a BOM belongs to no line.
    d = 100000
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"input_ids":[1]}\n{"input_ids":' + "[" * d + "]" * d + "}\n")
    with pytest.raises(ValueError, match="deep.jsonl:2: JSON nested deeper than 64 levels"):
        thdpack.read_jsonl(str(deep))
    nul = tmp_path / "nul.jsonl"
    nul.write_bytes(b'{"input_ids":[1]}\0{"input_ids":[2,3,4,5,6]} x\n')
    with pytest.raises(ValueError, match="nul.jsonl:1: NUL byte at byte 17 of the line"):
        thdpack.read_jsonl(str(nul))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"input_ids":[3,4]}\n{"input_ids":[5]}\n')
    assert [s["tokens"].tolist() for s in thdpack.read_jsonl(str(bom))] == [[3, 4], [5]]
    lengths = tmp_path / "lengths.txt"
    lengths.write_bytes(b"\xef\xbb\xbf12\n7\n")
    assert thdpack.read_lengths("lengths:" + str(lengths))["lengths"].tolist() == [12, 7]


def test_mock_lengths_equal_the_mock_source():
    a = thdpack.mock_lengths(200, seed=7)
    b = thdpack.read_lengths("mock", seed=7, mock_num_samples=200)
    assert a.dtype == np.int64 and a.tolist() == b["lengths"].tolist()
    assert a.min() >= 16 and a.max() <= 16384
    small = thdpack.mock_lengths(1000, min_seq_len=2, max_seq_len=40, mean_seq_len=14, sigma=0.7)
    assert small.min() >= 2 and small.max() <= 40 and 8 < small.mean() < 20
    t = thdpack.mock_tokens(1234, 5, 50, 100)
    assert t.dtype == np.int32 and len(t) == 50 and t.min() >= 0 and t.max() < 100
    assert t.tolist() == thdpack.mock_tokens(1234, 5, 50, 100).tolist()


def test_flops_by_hand():
    l, h, nh, nkv, f, v = 32, 4096, 32, 32, 11008, 32000  # Llama-2 7B
    per_token = 3 * (2 * l * (h * h + 2 * h * h * nkv // nh + h * h + 3 * h * f) + 2 * h * v)
    per_token_sq = 3 * 2 * l * h
    assert thdpack.flops_coefficients("llama2-7b") == (per_token, per_token_sq)
    cu = np.array([0, 100, 300], np.int32)
    expected = per_token * 300 + per_token_sq * (100 ** 2 + 200 ** 2)
    assert thdpack.flops("llama2-7b", cu) == pytest.approx(expected, rel=1e-15)
    assert thdpack.cost_model("2,0.5")["a"] == 2.0
    with pytest.raises(ValueError):
        thdpack.flops("tokens", cu)  # no model dimensions behind "tokens"


def test_steps_beyond_the_memory_limit_are_memory_errors(tmp_path):
    # --global-batch 4000000000 aborted the process with std::bad_alloc; now a named error.
    with pytest.raises(MemoryError, match="ResourceExhausted: --global-batch 4000000000: a step"):
        thdpack.plan_job(global_batch=4000000000)
    with pytest.raises(MemoryError, match="\\(--memory-limit\\)"):
        thdpack.plan_job(global_batch=1000, memory_limit=1000, cost="tokens")
    assert len(thdpack.plan_job(global_batch=16, steps=1, memory_limit="1G",
                                cost="tokens")["steps"]) == 1
    with pytest.raises(ValueError, match="--memory-limit"):
        thdpack.plan_job(memory_limit="lots")
    # Sample by sample, 3 billion sequences are a MemoryError; where the histogram bulk plan
    # applies (it holds no sample), 2 billion still plan in one step.
    h = tmp_path / "h.csv"
    h.write_text("length,count\n5,3000000000\n")
    with pytest.raises(MemoryError, match="a step of 3000000000 samples"):
        thdpack.plan_job(data="histogram:" + str(h), global_batch="all", cost="tokens")
    h.write_text("length,count\n3000,1000000000\n9000,1000000000\n")
    plan = thdpack.plan_job(data="histogram:" + str(h), global_batch="all", cost="tokens",
                            summary_only=True)
    assert plan["summary"]["n_samples"] == 2000000000
