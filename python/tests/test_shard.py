"""CP sharding and the SP split against plain torch references (index_select, narrow)."""
import numpy as np
import pytest
import torch

import thdpack
import thdpack.torch as tt


def random_layout(rng, cp_size, n_max=6):
    lengths = rng.integers(1, 40, size=rng.integers(1, n_max + 1))
    samples = [rng.integers(0, 1000, size=L).astype(np.int32) for L in lengths]
    return thdpack.pack(samples, cp_size=cp_size)


def zigzag_reference(cu, cp_size, cp_rank):
    """The definition of docs/design.md section 5, written independently: each padded sequence in
    2*CP chunks, rank r keeps chunk r then chunk 2*CP-1-r. CP = 1 keeps everything (its
    sequences are not padded to a multiple of 2)."""
    if cp_size == 1:
        return np.arange(cu[-1], dtype=np.int32)
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        c = (b - a) // (2 * cp_size)
        out += list(range(a + cp_rank * c, a + (cp_rank + 1) * c))
        out += list(range(a + (2 * cp_size - 1 - cp_rank) * c, a + (2 * cp_size - cp_rank) * c))
    return np.array(out, dtype=np.int32)


def test_worked_examples():
    cu = np.array([0, 8, 16], np.int32)
    assert thdpack.cp_partition_indices(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert thdpack.cp_partition_indices(cu, 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    cu = np.array([0, 16], np.int32)
    expected = [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    for r in range(4):
        idx = thdpack.cp_partition_indices(cu, 4, r)
        assert idx.dtype == np.int32 and idx.tolist() == expected[r]


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 8])
def test_shard_matches_index_select_and_unshard_inverts(cp_size):
    rng = np.random.default_rng(cp_size)
    for _ in range(10):
        p = random_layout(rng, cp_size)
        cu = p["cu_seqlens_padded"]
        t = int(cu[-1])
        hidden = torch.randn(t, 3, 5, dtype=torch.float64)
        for name, full in [("tokens", p["tokens"]), ("loss_mask", p["loss_mask"]),
                           ("hidden", hidden.numpy())]:
            shards = []
            for r in range(cp_size):
                idx = thdpack.cp_partition_indices(cu, cp_size, r)
                assert idx.tolist() == zigzag_reference(cu.tolist(), cp_size, r).tolist()
                ref = torch.from_numpy(full).index_select(0, torch.from_numpy(idx).long())
                got = thdpack.shard(full, cu, cp_size, r)
                assert got.dtype == full.dtype and got.shape == (t // cp_size,) + full.shape[1:]
                np.testing.assert_array_equal(got, ref.numpy(), err_msg=name)
                np.testing.assert_array_equal(
                    tt.shard(torch.from_numpy(full), cu, cp_size, r).numpy(), ref.numpy())
                shards.append(got)
            np.testing.assert_array_equal(thdpack.unshard(shards, cu), full)
            np.testing.assert_array_equal(
                tt.unshard([torch.from_numpy(s) for s in shards], cu).numpy(), full)


def test_local_metadata():
    p = thdpack.pack([np.arange(1, 8, dtype=np.int32), np.arange(3, dtype=np.int32)], cp_size=2)
    cu = p["cu_seqlens_padded"]
    assert thdpack.local_cu_seqlens_padded(cu, 2).tolist() == [0, 4, 6]
    for r in range(2):
        np.testing.assert_array_equal(thdpack.local_position_ids(cu, 2, r),
                                      thdpack.shard(p["position_ids"], cu, 2, r))


def test_torch_shard_is_differentiable():
    cu = [0, 8, 16]
    x = torch.randn(16, 2, dtype=torch.float64, requires_grad=True)
    shards = [tt.shard(x, cu, 2, r) for r in range(2)]
    (tt.unshard(shards, cu) * torch.arange(16.0, dtype=torch.float64)[:, None]).sum().backward()
    np.testing.assert_array_equal(x.grad[:, 0].numpy(), np.arange(16.0))


def test_sp_split():
    local = np.arange(24, dtype=np.int64).reshape(12, 2)
    parts = [thdpack.sp_split(local, 3, t) for t in range(3)]
    for t, part in enumerate(parts):
        np.testing.assert_array_equal(part, local[4 * t:4 * t + 4])
        assert np.shares_memory(part, local)  # a view, not a copy
        np.testing.assert_array_equal(tt.sp_split(torch.from_numpy(local), 3, t).numpy(), part)
    with pytest.raises(ValueError):
        thdpack.sp_split(local, 5, 0)


def test_shard_errors():
    cu = np.array([0, 8, 16], np.int32)
    x = np.arange(16, dtype=np.int64)
    with pytest.raises(ValueError, match="cu_seqlens_padded.*float64.*integers"):
        thdpack.shard(x, cu.astype(np.float64), 2, 0)
    with pytest.raises(ValueError, match="cu_seqlens_padded\\[1\\] = 4294967304: does not fit int32"):
        thdpack.shard(x, np.array([0, 2**32 + 8, 16], np.int64), 2, 0)
    with pytest.raises(ValueError, match="array: got a object array.*holds Python objects"):
        thdpack.shard(np.array([object()] * 16), cu, 2, 0)
    with pytest.raises(ValueError, match="array: expected a NumPy array, a CPU torch tensor or a list, got int64"):
        thdpack.shard(np.int64(3), cu, 2, 0)
    with pytest.raises(ValueError, match="NumPy array, a CPU torch tensor or a list, got dict"):
        thdpack.shard({}, cu, 2, 0)
    with pytest.raises(ValueError):
        thdpack.shard(x, np.array([0, 6, 16], np.int32), 2, 0)  # 6 is not a multiple of 4
    with pytest.raises(ValueError):
        thdpack.shard(x, cu, 2, 2)  # cp_rank out of range
    with pytest.raises(ValueError, match="same dtype and shape"):
        thdpack.unshard([x[:8], x[:8].astype(np.int32)], cu)


def test_shard_accepts_what_a_user_holds():
    torch = pytest.importorskip("torch")
    cu = np.array([0, 8, 16], np.int32)
    x = np.arange(16, dtype=np.int64)
    want = [thdpack.shard(x, cu, 2, r).tolist() for r in range(2)]
    for cu_any in (cu.astype(np.int64), cu.astype(np.uint16), cu.astype("<i4"), cu.astype(">i8"),
                   cu.tolist(), torch.tensor(cu.tolist()), torch.tensor(cu)):
        for arr in (x, x.tolist(), torch.tensor(x)):
            got = [thdpack.shard(arr, cu_any, 2, r).tolist() for r in range(2)]
            assert got == want, (type(arr), getattr(cu_any, "dtype", type(cu_any)))
        assert thdpack.cp_partition_indices(cu_any, 2, 1).tolist() == \
            thdpack.cp_partition_indices(cu, 2, 1).tolist()
        assert thdpack.local_position_ids(cu_any, 2, 0).tolist() == \
            thdpack.local_position_ids(cu, 2, 0).tolist()
        assert thdpack.local_cu_seqlens_padded(cu_any, 2).tolist() == [0, 4, 8]
    shards = [thdpack.shard(x, cu, 2, r) for r in range(2)]
    assert thdpack.unshard([shards[0].astype("<i8"), shards[1]], cu.tolist()).tolist() == x.tolist()
    with pytest.raises(ValueError, match="torch tensor on device meta"):
        thdpack.shard(torch.empty(16, device="meta"), cu, 2, 0)
