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
