"""thdpack.torch.rearrange_micro_batches: the cap is never exceeded, every sample appears once,
a sample over the cap is an error naming it; and on real lengths (data/) the split verl makes
(ceil(total / cap) microbatches balanced by the largest differencing method) goes over its cap
where thdpack's does not."""
import heapq
import pathlib

import numpy as np
import pytest
import torch

import thdpack.torch as tt

DATA = pathlib.Path(__file__).resolve().parents[2] / "data"


def check_split(lengths, cap, idx):
    seen = sorted(i for mb in idx for i in mb)
    assert seen == list(range(len(lengths)))  # every sample exactly once
    assert all(len(mb) > 0 for mb in idx)
    assert max(sum(int(lengths[i]) for i in mb) for mb in idx) <= cap


@pytest.mark.parametrize("seed", range(6))
def test_cap_holds_and_every_sample_once_on_random_batches(seed):
    rng = np.random.default_rng(seed)
    cap = int(rng.integers(64, 4096))
    n = int(rng.integers(1, 300))
    lengths = rng.integers(1, cap + 1, size=n)
    if seed % 2:
        lengths = np.minimum(lengths, int(rng.integers(1, cap + 1)))  # many short ones
    idx = tt.micro_batch_indices(lengths, cap)
    check_split(lengths, cap, idx)
    # At least the lower bound, and a requested count is honoured (rounded to the multiple).
    assert len(idx) >= -(-int(lengths.sum()) // cap)
    more = tt.micro_batch_indices(lengths, cap, num_micro_batches=min(n, len(idx) + 1))
    check_split(lengths, cap, more)
    assert len(more) >= min(n, len(idx) + 1)
    if n >= 2 * len(idx):
        even = tt.micro_batch_indices(lengths, cap, num_batches_divided_by=2)
        check_split(lengths, cap, even)
        assert len(even) % 2 == 0


def test_rearrange_splits_a_dict_batch_by_rows():
    rng = np.random.default_rng(7)
    b, s, cap = 40, 64, 200
    real = rng.integers(1, s + 1, size=b)
    mask = torch.zeros(b, s, dtype=torch.int64)
    for i, L in enumerate(real):
        mask[i, :L] = 1
    batch = {"attention_mask": mask, "input_ids": torch.arange(b * s).view(b, s),
             "uid": [f"u{i}" for i in range(b)], "temperature": 0.7}
    mbs, idx = tt.rearrange_micro_batches(batch, cap)
    check_split(real, cap, idx)
    for mb, rows in zip(mbs, idx):
        assert torch.equal(mb["input_ids"], batch["input_ids"][rows])
        assert torch.equal(mb["attention_mask"], mask[rows])
        assert mb["uid"] == [f"u{i}" for i in rows] and mb["temperature"] == 0.7
        assert int(mb["attention_mask"].sum()) <= cap
    none, idx2 = tt.rearrange_micro_batches(real, cap)
    assert none is None and idx2 == idx


def test_errors_name_the_sample():
    with pytest.raises(ValueError, match=r"seqlens\[2\] = 500 tokens is over max_token_len = 100"):
        tt.micro_batch_indices([10, 20, 500, 30], 100)
    with pytest.raises(ValueError, match=r"seqlens\[1\] = 0"):
        tt.micro_batch_indices([10, 0], 100)
    with pytest.raises(ValueError, match="more than the 2 samples"):
        tt.micro_batch_indices([10, 20], 100, num_micro_batches=3)
    with pytest.raises(ValueError, match="attention_mask"):
        tt.rearrange_micro_batches({"input_ids": torch.zeros(2, 3)}, 100)


def verl_style_partitions(lengths, k):
    """What verl's rearrange_micro_batches does: k = ceil(total / cap) partitions balanced by
    the largest differencing method (Karmarkar-Karp), written here from its description."""
    heap = []
    for order, (L, i) in enumerate(sorted((int(L), i) for i, L in enumerate(lengths))):
        sets = [(L, [i])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-L, order, sets))
    order = len(lengths)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        merged.sort(key=lambda s: -s[0])
        order += 1
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), order, merged))
    return [items for _, items in heap[0][2]]


def test_verl_split_goes_over_the_cap_on_real_lengths_and_thdpack_does_not():
    # RL-like batches: 64 documents of data/wlbllm_doc_lengths.txt each, truncated to 8192
    # tokens (a response limit), cap 16384 tokens per microbatch.
    lengths = np.minimum(np.loadtxt(DATA / "wlbllm_doc_lengths.txt", dtype=np.int64), 8192)
    cap, per_batch, n_batches = 16384, 64, 40
    over_verl, worst_verl, mbs_verl, mbs_thd = 0, 0, 0, 0
    for b in range(n_batches):
        batch = lengths[b * per_batch:(b + 1) * per_batch]
        k = -(-int(batch.sum()) // cap)
        parts = verl_style_partitions(batch, k)
        assert sorted(i for p in parts for i in p) == list(range(per_batch))
        sums = [int(batch[p].sum()) for p in parts]
        over_verl += sum(s > cap for s in sums)
        worst_verl = max(worst_verl, max(sums))
        mbs_verl += k
        idx = tt.micro_batch_indices(batch, cap)
        check_split(batch, cap, idx)
        mbs_thd += len(idx)
    print(f"\n{n_batches} batches of {per_batch} (cap {cap}): verl-style {mbs_verl} microbatches, "
          f"{over_verl} over the cap (largest {worst_verl} tokens); thdpack {mbs_thd}, none over")
    assert over_verl > 0 and worst_verl > cap
