"""thdpack.torch.adapters: a verl-style padded batch (left-padded prompts, right-padded
responses, a response mask with masked tool tokens, per-token [B, R] and per-sample [B]
tensors) to samples and back. Each sample is the row's real tokens with its fields in place;
through pack_batch at DP 2, token_logprobs and step.unpack, padded_from_unpacked gives [B, R]
equal to the log-probs computed on the padded batch itself, as verl's compute_log_prob
returns them."""
import datetime
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from worlds import spawn

V = 40


def padded_batch(seed, b=6, p=5, r=7):
    rng = np.random.default_rng(seed)
    ids = np.zeros((b, p + r), dtype=np.int64)
    mask = np.zeros((b, p + r), dtype=np.int64)
    resp = np.zeros((b, r), dtype=np.int64)
    for i in range(b):
        pl, rl = int(rng.integers(1, p + 1)), int(rng.integers(1, r + 1))
        ids[i, p - pl:p] = rng.integers(1, V, pl)
        ids[i, p:p + rl] = rng.integers(1, V, rl)
        mask[i, p - pl:p + rl] = 1
        resp[i, :rl] = rng.random(rl) < 0.8  # a masked tool output now and then
    return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask),
            "response_mask": torch.from_numpy(resp),
            "old_log_probs": torch.from_numpy(rng.standard_normal((b, r)).astype(np.float32)),
            "uid": torch.from_numpy(rng.integers(0, 3, b))}


def test_rows_become_samples_with_their_fields_in_place():
    from thdpack.torch.adapters import samples_from_padded
    batch = padded_batch(1)
    samples = samples_from_padded(batch, 7, per_token=("old_log_probs",), per_sample=("uid",))
    ids, mask = batch["input_ids"].numpy(), batch["attention_mask"].numpy().astype(bool)
    for i, x in enumerate(samples):
        real = ids[i][mask[i]]
        assert np.array_equal(x["input_ids"], real)
        pl = int(mask[i, :5].sum())
        rl = int(mask[i, 5:].sum())
        want_mask = np.concatenate([np.zeros(pl), batch["response_mask"][i, :rl].numpy()])
        assert np.array_equal(x["loss_mask"], want_mask)
        want = np.concatenate([np.zeros(pl, np.float32), batch["old_log_probs"][i, :rl].numpy()])
        assert np.array_equal(x["old_log_probs"], want) and x["old_log_probs"].dtype == np.float32
        assert x["uid"] == batch["uid"][i].item()


def test_shapes_and_masks_are_refused_by_name():
    from thdpack.torch.adapters import padded_from_unpacked, samples_from_padded
    batch = padded_batch(2)
    with pytest.raises(ValueError, match=r"response_length = 13: must be in \[1, S = 12\]"):
        samples_from_padded(batch, 13)
    bad = dict(batch, old_log_probs=torch.zeros(6, 5))
    with pytest.raises(ValueError, match=r"old_log_probs: expected \[B, R\] = \[6, 7\]"):
        samples_from_padded(bad, 7, per_token=("old_log_probs",))
    empty = dict(batch, attention_mask=batch["attention_mask"].clone())
    empty["attention_mask"][3] = 0
    with pytest.raises(ValueError, match=r"attention_mask\[3\] keeps no token"):
        samples_from_padded(empty, 7)
    with pytest.raises(ValueError, match="values: 2 samples, the batch has 6 rows"):
        padded_from_unpacked([torch.zeros(3)] * 2, batch, 7)


def test_random_masks_against_a_row_loop_both_ways():
    """Any mask (holes, rows all kept, prompts of any length), fields of several dtypes and row
    shapes: samples_from_padded equals a plain loop over each row's kept columns, and
    padded_from_unpacked gives each kept response column its token's value back, from the list
    and from the flat pair alike, the fill elsewhere."""
    from thdpack.torch.adapters import padded_from_unpacked, samples_from_padded
    rng = np.random.default_rng(3)
    for trial in range(60):
        b, p, r = int(rng.integers(1, 6)), int(rng.integers(0, 5)), int(rng.integers(1, 6))
        s = p + r
        mask = (rng.random((b, s)) < rng.choice([0.5, 0.9, 1.0])).astype(
            rng.choice([np.int64, np.int32, np.uint8, np.bool_, np.int8]))
        mask[:, -1] = 1  # every row keeps a token
        ids = rng.integers(0, 1000, (b, s))
        f32 = rng.standard_normal((b, r)).astype(np.float32)
        i64 = rng.integers(-9, 9, (b, r, 2))
        resp = rng.random((b, r)) < 0.7
        batch = {"input_ids": ids, "attention_mask": mask, "response_mask": resp,
                 "f32": f32, "i64": i64,
                 "bf": torch.from_numpy(f32).to(torch.bfloat16)}
        rows = samples_from_padded(batch, r, per_token=("f32", "i64"))
        assert len(rows) == b
        keep = mask != 0
        for i in range(b):
            x = rows[i]
            assert np.array_equal(x["input_ids"], ids[i][keep[i]])
            cols = np.flatnonzero(keep[i])
            want_mask = [int(resp[i, c - p]) if c >= p else 0 for c in cols]
            assert list(x["loss_mask"]) == want_mask, trial
            want_f = [f32[i, c - p] if c >= p else 0 for c in cols]
            assert np.array_equal(x["f32"], np.array(want_f, np.float32))
            want_i = [i64[i, c - p] if c >= p else [0, 0] for c in cols]
            assert np.array_equal(x["i64"], np.array(want_i).reshape(-1, 2))
        # Back: one value per token (its position k + 100 in the row), three dtypes.
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            per = [torch.arange(100, 100 + len(rows[i]["input_ids"])).to(dtype)
                   for i in range(b)]
            back = padded_from_unpacked(per, batch, r, fill=-1)
            flat = torch.cat(per)
            offsets = torch.tensor([0] + [len(v) for v in per]).cumsum(0)
            assert torch.equal(padded_from_unpacked((flat, offsets), batch, r, fill=-1), back)
            want = torch.full((b, r), -1).to(dtype)
            for i in range(b):
                cols = np.flatnonzero(keep[i])
                for k, c in enumerate(cols):
                    if c >= p:
                        want[i, c - p] = 100 + k
            assert back.dtype == dtype and torch.equal(back, want), (trial, dtype)


def test_sample_rows_slices_and_construction_errors():
    from thdpack.torch import SampleRows
    ids = np.array([1, 2, 3, 4, 5])
    rows = SampleRows(ids, [0, 2, 5], loss_mask=np.array([0, 1, 2, 1, 1]))
    assert len(rows) == 2 and np.array_equal(rows[1]["input_ids"], [3, 4, 5])
    assert len(rows[1:]) == 1 and np.array_equal(rows[1:][0]["input_ids"], [3, 4, 5])
    with pytest.raises(ValueError, match=r"offsets: expected \[B \+ 1\]"):
        SampleRows(ids, np.zeros((2, 2)))
    with pytest.raises(ValueError, match="given twice"):
        SampleRows(ids, [0, 5], token_fields={"a": ids}, sample_fields={"a": [1]})


def worker(rank, port, out_dir):
    from test_torch_iterator import make_groups
    from thdpack.torch import pack_batch, token_logprobs
    from thdpack.torch.adapters import fields_of, padded_from_unpacked, samples_from_padded
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    groups = make_groups(1, 1, 2, 1)
    batch = padded_batch(10 + rank)  # each DP rank its own batch, as verl dispatches them
    samples = samples_from_padded(batch, 7, per_token=("old_log_probs",), per_sample=("uid",))
    step = pack_batch(samples, groups, max_tokens_per_rank=64,
                      fields=fields_of(("old_log_probs",), ("uid",), {"uid": "int64"}))
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    values, old = [], 0.0
    for mb in step:
        values.append(token_logprobs(table[mb["tokens"].long()], mb))
        old += float((mb["old_log_probs"] * mb["loss_mask"]).sum())
    back = padded_from_unpacked(step.unpack(values), batch, 7)
    assert torch.equal(padded_from_unpacked(step.unpack(values, flat=True), batch, 7), back)
    # The same samples as dicts: the same step, every tensor of every microbatch.
    as_dicts = pack_batch(list(samples), groups, max_tokens_per_rank=64,
                          fields=fields_of(("old_log_probs",), ("uid",), {"uid": "int64"}))
    assert as_dicts.num_microbatches == step.num_microbatches
    for a, b in zip(step, as_dicts):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert torch.equal(a[k], b[k]), k
    # Bad columns: named on every rank, with the column and the row.
    bad = samples_from_padded(batch, 7, per_token=("old_log_probs",), per_sample=("uid",))
    if rank == 1:
        bad.loss_mask = bad.loss_mask.copy()
        bad.loss_mask[bad.offsets[2] + 1] = 3
    # The rank's own error a ValueError, the others' a RuntimeError naming it (pack_batch's rule).
    with pytest.raises(ValueError if rank == 1 else RuntimeError,
                       match="loader dp=1, step 0, row 2, token 1: loss_mask value 3 is not 0 "
                       "or 1"):
        pack_batch(bad, groups, max_tokens_per_rank=64,
                   fields=fields_of(("old_log_probs",), ("uid",), {"uid": "int64"}))
    with pytest.raises(ValueError, match=r"column 'uid' holds int64 rows of shape \[\], field "
                       "'uid' is declared float32"):
        pack_batch(samples, groups, max_tokens_per_rank=64,
                   fields=fields_of(("old_log_probs",), ("uid",)))
    torch.save((back, old), f"{out_dir}/a{rank}.pt")
    dist.destroy_process_group()


def test_through_a_step_and_back_as_verl_returns_log_probs(tmp_path):
    from test_torch_iterator import free_port
    spawn(worker, args=(free_port(), str(tmp_path)), nprocs=2)
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logp = torch.log_softmax(table, -1)
    total_old, want_old = 0.0, 0.0
    for rank in range(2):
        back, old = torch.load(f"{tmp_path}/a{rank}.pt")
        total_old += old
        batch = padded_batch(10 + rank)
        ids, resp = batch["input_ids"], batch["response_mask"]
        mask = batch["attention_mask"]
        want = torch.zeros(6, 7, dtype=torch.float64)
        for i in range(6):
            rl = int(mask[i, 5:].sum())
            for k in range(rl):  # response token k, predicted from the token before it
                want[i, k] = logp[ids[i, 5 + k - 1], ids[i, 5 + k]]
        assert back.shape == (6, 7)
        assert torch.allclose(back, want, atol=1e-12)
        want_old += float((batch["old_log_probs"].double() * resp).sum())
    # The per-token field arrived on its tokens: its masked sum over every microbatch.
    assert abs(total_old - want_old) < 1e-4
