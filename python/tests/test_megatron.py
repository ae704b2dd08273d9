"""thdpack against the real megatron-core (the current stack; skipped where megatron.core does
not import, as on Debian's torch 1.13, which it does not support).

megatron-core on PyPI (0.16) has PackedSeqParams and the CP helpers of megatron.core.utils, not
Megatron-LM's data_schedule entry points (wrap_data_iterator,
get_batch_on_this_rank_for_sequence_packing live in the training repository), so what can be
compared is compared, field by field:
  * PackedSeqParams: thdpack.torch.megatron builds the real class, and its fields equal those of
    megatron.core.utils.get_thd_batch_on_this_cp_rank for the same packed microbatch;
  * the zigzag: megatron.core.utils.get_batch_on_this_cp_rank (over a real gloo CP group) and
    thdpack's CP shard give every CP rank the same tokens, labels, loss mask and positions for a
    microbatch of one sequence. On several sequences they differ by design: Megatron's helper
    cuts the whole packed row into 2*CP chunks as if it were one sequence (its SBHD path), where
    thdpack (like TransformerEngine's thd_get_partitioned_indices, which Megatron's THD path
    needs) cuts each sequence; the test shows that difference too.
"""
import os
import pickle

import numpy as np
import pytest
import torch
import torch.distributed as dist

mcore = pytest.importorskip("megatron.core")
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core import utils as mutils  # noqa: E402

import thdpack  # noqa: E402
import thdpack.torch as tt  # noqa: E402
from thdpack.torch import megatron  # noqa: E402
from test_torch_iterator import free_port  # noqa: E402
from worlds import spawn

KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def packed(lengths, cp, seed=0):
    rng = np.random.default_rng(seed)
    samples = [rng.integers(0, 1000, n).astype(np.int32) for n in lengths]
    mb = thdpack.pack(samples, cp_size=cp)
    return {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in mb.items()}


def test_packed_seq_params_are_megatrons():
    mb = packed([7, 3, 12], cp=2)
    ours = megatron.packed_seq_params(mb)
    assert type(ours) is PackedSeqParams
    batch = {k: mb[k].view(1, -1).clone() for k in KEYS}
    theirs_batch, theirs = mutils.get_thd_batch_on_this_cp_rank(
        batch, mb["cu_seqlens"], mb["cu_seqlens_padded"],
        torch.tensor([mb["max_seqlen"]], dtype=torch.int32), cp_size=1, cp_rank=0)
    for field in PackedSeqParams.__dataclass_fields__:
        a, b = getattr(ours, field), getattr(theirs, field)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), field
        else:
            assert a == b, (field, a, b)
    # At CP = 1 Megatron's THD helper leaves the batch whole; so does thdpack's shard.
    for k in KEYS:
        assert torch.equal(theirs_batch[k][0], tt.shard(mb[k], mb["cu_seqlens_padded"], 1, 0))


def cp_worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cp_group = dist.new_group(list(range(world)), backend="gloo")
    out = {}
    for name, lengths in (("one", [29]), ("several", [7, 3, 12])):
        mb = packed(lengths, cp=world, seed=len(lengths))
        theirs = mutils.get_batch_on_this_cp_rank({k: mb[k].view(1, -1).clone() for k in KEYS},
                                                  cp_group=cp_group)
        ours = {k: tt.shard(mb[k], mb["cu_seqlens_padded"], world, rank) for k in KEYS}
        out[name] = {k: (theirs[k][0].numpy(), ours[k].numpy()) for k in KEYS}
    with open(os.path.join(out_dir, f"cp{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.no_sanitizer)])
def test_cp_shard_equals_megatrons_on_one_sequence(cp, tmp_path):
    spawn(cp_worker, args=(cp, free_port(), str(tmp_path)), nprocs=cp)
    for r in range(cp):
        got = pickle.load(open(tmp_path / f"cp{r}.pkl", "rb"))
        for k in KEYS:
            theirs, ours = got["one"][k]
            assert theirs.dtype == ours.dtype and np.array_equal(theirs, ours), (r, k)
        # Several sequences: the same tokens in all, cut differently (by design, see above).
        theirs, ours = got["several"]["tokens"]
        assert theirs.shape == ours.shape
        if r == 0:
            assert not np.array_equal(theirs, ours)


@pytest.mark.parametrize("recipe, preset, value", [
    ("delayed", "fp8", 16), ("tensorwise", "fp8", 16), ("mxfp8", "mxfp8", 32),
    ("blockwise", "blockwise", 128), ("custom", None, None)])
def test_fp8_recipe_sets_the_rank_multiple(recipe, preset, value):
    """Megatron's fp8_recipe (its own enum) becomes the rank multiple its GEMMs need
    (docs/layout.md section 7); no FP8, or a custom recipe, sets none."""
    import types
    from megatron.core.enums import Fp8Recipe
    config = types.SimpleNamespace(fp8="hybrid", fp8_recipe=Fp8Recipe(recipe))
    opts = megatron.iterator_options(config, None, 1)
    assert opts.get("rank_multiple") == preset
    if value is not None:
        assert thdpack.ParallelLayout(rank_multiple=opts["rank_multiple"]).rank_multiple == value
    config.fp8 = None
    assert "rank_multiple" not in megatron.iterator_options(config, None, 1)
