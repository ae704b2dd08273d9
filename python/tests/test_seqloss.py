"""Post-training losses on CP shards (thdpack.torch.seqloss) equal one process.

Rollouts carry per-token "new" and "old" log-probabilities as target fields; pack_batch packs and
shards them at DP x CP x PP topologies (static and dynamic CP) over gloo. On the last stage each
rank takes its shard of the new log-probabilities as the leaf of the graph, computes a loss with
every aggregation mode of ``aggregate_loss`` (and a GSPO-like per-token term built on
``sequence_means``, and a per-sequence term on ``sequence_sums``), backpropagates, and sends the
gradients back to the loaders with ``step.unpack``. The sum of the shares over the world and
each sample's gradient must equal, to float64 rounding, one process computing the same loss with
plain torch on the unpacked samples; so must the RL statistics (RLStatistics: mean ratio, clip
fraction, KL estimate, by token and by sequence).
"""
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from worlds import spawn

N = 24
FIELDS = {"new": {"kind": "target", "dtype": "float64"},
          "old": {"kind": "target", "dtype": "float64"}}
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
         "gspo", "per-sequence")
SCALE = 37.0


def samples(seed=5):
    rng = np.random.default_rng(seed)
    out = []
    for k in range(N):
        L = int(rng.integers(1, 40))
        prompt = int(rng.integers(0, L + 1)) if k % 5 else L  # every fifth: no loss token
        out.append({"input_ids": rng.integers(0, 100, L),
                    "loss_mask": (np.arange(L) >= prompt).astype(np.uint8),
                    "new": rng.normal(size=L) * 0.3 - 1.0,
                    "old": rng.normal(size=L) * 0.3 - 1.0})
    return out


def per_token(new, old):
    """A PPO-like clipped surrogate with the old values as advantages: nonlinear in new."""
    ratio = torch.exp(new - old)
    return -torch.minimum(ratio * old, ratio.clamp(0.8, 1.2) * old)


def reference(items, mode):
    """(loss, [per-sample gradient of `new`]) in one process, plain torch, whole sequences."""
    news = [torch.tensor(x["new"], requires_grad=True) for x in items]
    terms, seq_terms = [], []
    n_tokens = sum(int(x["loss_mask"][1:].sum()) for x in items)
    n_seqs = sum(int(x["loss_mask"][1:].sum() > 0) for x in items)
    for x, new in zip(items, news):
        m = torch.tensor(x["loss_mask"][1:], dtype=torch.float64)  # value j >= 1 is predicted
        nw, od = new[1:], torch.tensor(x["old"][1:])
        if mode == "gspo":
            n = m.sum()
            s = ((nw - od) * m).sum() / n if n > 0 else torch.zeros((), dtype=torch.float64)
            terms.append((-torch.exp(s) * od * m).sum())
        elif mode == "per-sequence":
            if m.sum() > 0:
                seq_terms.append(-F.logsigmoid((nw * m).sum()))
        else:
            lt = per_token(nw, od) * m
            if mode == "seq-mean-token-mean":
                terms.append(lt.sum() / m.sum() if m.sum() > 0 else lt.sum() * 0)
            else:
                terms.append(lt.sum())
    if mode in ("token-mean", "gspo"):
        loss = sum(terms) / n_tokens
    elif mode == "seq-mean-token-sum-norm":
        loss = sum(terms) / SCALE
    elif mode == "per-sequence":
        loss = sum(seq_terms) / n_seqs
    else:
        loss = sum(terms) / n_seqs
    loss.backward()
    return float(loss), [torch.zeros_like(new) if new.grad is None else new.grad for new in news]


def reference_statistics(items):
    """The token and sequence means of the RL figures in one process."""
    sums, seq_sums, tokens, seqs = {}, {}, 0, 0
    for x in items:
        m = x["loss_mask"][1:] != 0
        new, old = x["new"][1:][m], x["old"][1:][m]
        ratio = np.exp(new - old)
        vals = {"ratio": ratio, "clipped": ((ratio < 0.8) | (ratio > 1.2)).astype(float),
                "kl": np.exp(old - new) - (old - new) - 1}
        tokens += int(m.sum())
        seqs += int(m.sum() > 0)
        for k, v in vals.items():
            sums[k] = sums.get(k, 0.0) + float(v.sum())
            seq_sums[k] = seq_sums.get(k, 0.0) + (float(v.mean()) if m.sum() else 0.0)
    out = {"n_loss_tokens": tokens, "n_loss_sequences": seqs}
    for k in sums:
        out[k] = sums[k] / tokens
        out[k + "_seq_mean"] = seq_sums[k] / seqs
    return out


def share_of(step, mode):
    """This rank's share and the leaf tensors (one per microbatch) its gradients land on."""
    import thdpack.torch as tt
    total = torch.zeros((), dtype=torch.float64)
    leaves = []
    for mb in step:
        if not step.last_stage or mb["idle"]:
            leaves.append(None)
            continue
        new = mb["new"].clone().requires_grad_(True)
        old = mb["old"]
        leaves.append(new)
        if mode == "gspo":
            s = tt.sequence_means(new - old, mb)
            seq = mb["seq_index"].long().clamp(min=0)
            lt = -torch.exp(s[seq]) * old
            total = total + tt.aggregate_loss(lt, mb, step, "token-mean")
        elif mode == "per-sequence":
            sums = tt.sequence_sums(new, mb)
            has = mb["seq_n_targets"] > 0
            # The same on every CP rank of the microbatch: each adds 1/cp_size of it.
            term = -F.logsigmoid(sums[has]).sum() / step.n_loss_sequences
            total = total + term / mb["cp_size"]
        else:
            total = total + tt.aggregate_loss(per_token(new, old), mb, step, mode,
                                              loss_scale_factor=SCALE)
    return total, leaves


TOPOLOGIES = [((2, 2, 1), "balanced"), ((1, 4, 1), "balanced"), ((2, 1, 2), "balanced"),
              ((2, 2, 1), "dynamic")]


def worker(rank, world, port, out, topologies):
    from test_torch_iterator import join_gloo, make_groups, coords
    import thdpack.torch as tt
    join_gloo(rank, world, port)
    items = samples()
    for (dp, cp, pp), scheduler in topologies:
        groups = make_groups(1, cp, dp, pp)
        c = coords(rank, 1, cp, dp, pp)
        loader = c["cp"] == 0 and c["pp"] == 0
        mine = items[c["dp"]::dp] if loader else None
        step = tt.pack_batch(mine, groups, fields=FIELDS, max_tokens_per_rank=40,
                             scheduler=scheduler, cost="llama2-7b")
        for mode in MODES:
            where = f"DPxCPxPP {dp}x{cp}x{pp} {scheduler} {mode} rank {rank}"
            share, leaves = share_of(step, mode)
            if share.requires_grad:
                share.backward()
            loss = share.detach().clone()
            dist.all_reduce(loss)
            grads = [None if leaf is None else leaf.grad for leaf in leaves]
            got = step.unpack(grads)
            want_loss, want_grads = reference(items, mode)
            assert abs(float(loss) - want_loss) <= 1e-9 * abs(want_loss), \
                f"{where}: loss {float(loss)!r} != {want_loss!r}"
            if loader:
                for k, g in enumerate(got):
                    want = want_grads[c["dp"] + k * dp]
                    assert torch.allclose(g[1:], want[1:], rtol=1e-9, atol=1e-15), \
                        f"{where}: gradient of sample {c['dp'] + k * dp}"
        # RL figures, over the DP x CP ranks of the last stage: equal to one process's.
        stage_groups = [dist.new_group([r for r in range(world)
                                        if coords(r, 1, cp, dp, pp)["pp"] == s])
                        for s in range(pp)]
        if step.last_stage:
            stats = tt.RLStatistics()
            for mb in step:
                if mb["idle"]:
                    continue
                ratio = torch.exp(mb["new"] - mb["old"])
                stats.add_microbatch(mb, ratio=ratio,
                                     clipped=((ratio < 0.8) | (ratio > 1.2)).double(),
                                     kl=torch.exp(mb["old"] - mb["new"]) -
                                     (mb["old"] - mb["new"]) - 1)
            got = stats.summary(stage_groups[pp - 1])
            want = reference_statistics(items)
            for key, value in want.items():
                assert got[key] == value if isinstance(value, int) else \
                    abs(got[key] - value) <= 1e-9 * abs(value), f"{key}: {got[key]} != {value}"
    torch.save(True, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_every_mode_equals_one_process(tmp_path):
    from test_torch_iterator import free_port
    spawn(worker, args=(4, free_port(), str(tmp_path), TOPOLOGIES), nprocs=4)
    for r in range(4):
        assert torch.load(tmp_path / f"rank{r}.pt")


# DP x CP x PP 2x2x2 (8 ranks; the 4-rank paths above run under the sanitizers).
@pytest.mark.no_sanitizer
def test_every_mode_equals_one_process_at_2x2x2(tmp_path):
    from test_torch_iterator import free_port
    spawn(worker, args=(8, free_port(), str(tmp_path), [((2, 2, 2), "balanced")]), nprocs=8)
    for r in range(8):
        assert torch.load(tmp_path / f"rank{r}.pt")


def test_modes_and_arguments_are_checked():
    import thdpack.torch as tt
    mb = {"idle": False, "sample_ids": torch.tensor([0]), "seq_index": torch.tensor([0, 0]),
          "loss_mask": torch.tensor([1.0, 0.0]), "seq_n_targets": torch.tensor([1]),
          "cp_size": 1, "cp_group": None}

    class Step:
        n_loss_tokens, n_loss_sequences = 1, 1

    with pytest.raises(ValueError, match="mode: 'mean' is not one of token-mean"):
        tt.aggregate_loss(torch.zeros(2), mb, Step(), "mean")
    with pytest.raises(ValueError, match="needs loss_scale_factor: verl's default is the padded"):
        tt.aggregate_loss(torch.zeros(2), mb, Step(), "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="3 local tokens, the microbatch's shard holds 2"):
        tt.aggregate_loss(torch.zeros(3), mb, Step())
    with pytest.raises(ValueError, match="over: 'tokens' is not 'loss' or 'all'"):
        tt.sequence_sums(torch.zeros(2), mb, over="tokens")
    x = torch.tensor([2.0, 5.0], requires_grad=True)
    s = tt.sequence_sums(x, mb, over="all")
    assert s.tolist() == [7.0]
    s.sum().backward()
    assert x.grad.tolist() == [1.0, 1.0]
    assert tt.sequence_means(torch.tensor([2.0, 5.0]), mb).tolist() == [2.0]


def test_grad_factor_scales_what_local_loss_scales_and_factors_are_checked():
    """aggregate_loss's grad_factor multiplies its share and the share's gradient (as
    local_loss's); sequence_sums' multiplies only the gradient that flows back through the sums;
    a factor or loss_scale_factor that is 0, negative, NaN or infinite is refused by name."""
    import types
    from thdpack.torch import aggregate_loss, sequence_sums
    mb = {"sample_ids": torch.tensor([3, 4]), "idle": False, "cp_size": 1, "cp_group": None,
          "seq_index": torch.tensor([0, 0, 0, 1, 1, -1], dtype=torch.int32),
          "loss_mask": torch.tensor([1, 1, 0, 1, 1, 0]),
          "seq_n_targets": torch.tensor([2, 2])}
    step = types.SimpleNamespace(n_loss_tokens=4, n_loss_sequences=2)
    base = torch.tensor([0.5, 1.0, 7.0, 2.0, -1.0, 9.0], dtype=torch.float64)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        x1, x4 = base.clone().requires_grad_(), base.clone().requires_grad_()
        a1 = aggregate_loss(x1, mb, step, mode)
        a4 = aggregate_loss(x4, mb, step, mode, grad_factor=4)
        a1.backward()
        a4.backward()
        assert torch.allclose(a4, 4 * a1) and torch.allclose(x4.grad, 4 * x1.grad), mode
    x1, x3 = base.clone().requires_grad_(), base.clone().requires_grad_()
    s1, s3 = sequence_sums(x1, mb), sequence_sums(x3, mb, grad_factor=3)
    assert torch.equal(s1, s3) and s1.tolist() == [1.5, 1.0]
    (s1 ** 2).sum().backward()
    (s3 ** 2).sum().backward()
    assert torch.allclose(x3.grad, 3 * x1.grad)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="grad_factor = .*: must be a finite number > 0"):
            aggregate_loss(base, mb, step, grad_factor=bad)
        with pytest.raises(ValueError, match="grad_factor = .*: must be a finite number > 0"):
            sequence_sums(base, mb, grad_factor=bad)
        with pytest.raises(ValueError, match="loss_scale_factor = .*: must be a finite number"):
            aggregate_loss(base, mb, step, "seq-mean-token-sum-norm", loss_scale_factor=bad)
