"""Blended data from Python: the source of every sample of a blend is Megatron-LM's choice (its
own compiled build_blending_indices where megatron-core is installed, and a plain transcription
of its loop everywhere), the weights are Megatron's normalize to the bit, and over a spawned gloo
world the iterator's microbatches carry each sequence's source, LossStatistics reports loss,
perplexity and entropy per source equal to one rank's (1e-9) at several (DP, CP) layouts, and a
blend's state resumes exactly and refuses another weight.
"""
import json
import os
import pickle
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

import thdpack

from test_torch_iterator import free_port, join_gloo, make_groups
from worlds import spawn


def megatron_rule(weights, size):
    """Megatron's loop, transcribed: (dataset_index, dataset_sample_index)."""
    w = np.array(weights, dtype=np.float64)
    w = (w / np.sum(w)).tolist()
    counts = [0] * len(w)
    index, sample_index = [], []
    for i in range(size):
        x = max(float(i), 1.0)
        best, best_error = 0, w[0] * x - counts[0]
        for d in range(1, len(w)):
            error = w[d] * x - counts[d]
            if error > best_error:
                best, best_error = d, error
        index.append(best)
        sample_index.append(counts[best])
        counts[best] += 1
    return index, sample_index


def write_blend(tmp_path, weights, weight_by="samples"):
    """A blend of len(weights) mock sources of different shapes."""
    sources = []
    for d, w in enumerate(weights):
        config = tmp_path / f"m{d}.json"
        config.write_text(json.dumps({"mode": "distribution", "type": "lognormal",
                                      "min_seq_len": 2, "max_seq_len": 20 + 30 * (d % 4),
                                      "mean_seq_len": 8 + d % 5, "lognormal_sigma": 0.6}))
        sources.append({"data": f"mock:{config}", "weight": w, "seed": 100 + d})
    path = tmp_path / f"blend_{weight_by}_{len(weights)}.json"
    path.write_text(json.dumps({"sources": sources, "weight_by": weight_by}))
    return str(path)


def random_weights(rng, d, kind):
    if kind == "tied":
        return [1.0] * d
    if kind == "ratios":
        return [float(rng.randint(1, 4)) for _ in range(d)]
    if kind == "wide":
        return [10 ** rng.uniform(-9, 0) for _ in range(d)]
    return [rng.uniform(0.001, 1) for _ in range(d)]


@pytest.mark.parametrize("kind", ["spread", "tied", "ratios", "wide"])
def test_sources_are_megatrons_choice(tmp_path, kind):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for d in (1, 3, 7, 20):
        weights = random_weights(rng, d, kind)
        path = write_blend(tmp_path, weights)
        n = 3000
        got = thdpack.read_lengths("blend:" + path, limit=n)
        assert list(got["ids"]) == list(range(n))
        index, sample_index = megatron_rule(weights, n)
        assert list(got["source"]) == index, f"seed {seed} D {d}"
        assert list(got["source_index"]) == sample_index, f"seed {seed} D {d}"
        # Megatron's own compiled helper, where megatron-core is installed.
        try:
            from megatron.core.datasets import helpers_cpp
            from megatron.core.datasets.utils import normalize
        except ImportError:
            continue
        dataset_index = np.zeros(n, dtype=np.int16)
        dataset_sample_index = np.zeros(n, dtype=np.int64)
        helpers_cpp.build_blending_indices(dataset_index, dataset_sample_index,
                                           np.array(normalize(weights), dtype=np.float64), d, n,
                                           False)
        assert got["source"].tolist() == dataset_index.tolist(), f"seed {seed} D {d}"
        assert got["source_index"].tolist() == dataset_sample_index.tolist()
    with pytest.raises(ValueError, match="never ends"):
        thdpack.read_lengths("blend:" + path)


def test_weights_are_megatrons_normalize():
    rng = np.random.default_rng()
    for n in (1, 2, 7, 8, 9, 100, 129, 1000, 3001):
        w = rng.uniform(1e-6, 10, n) * 10.0 ** rng.integers(-5, 5, n)
        want = (w / np.sum(w)).tolist()
        assert thdpack.blend_weights(w.tolist()) == want, n


def test_tokens_weighting_follows_the_token_counts(tmp_path):
    weights = [0.5, 0.3, 0.2]
    path = write_blend(tmp_path, weights, "tokens")
    got = thdpack.read_lengths("blend:" + path, limit=20000)
    # The rule on token counts, replayed from the lengths read.
    w = thdpack.blend_weights(weights)
    counts = [0, 0, 0]
    n = 0
    for d, length in zip(got["source"], got["lengths"]):
        x = max(float(n), 1.0)
        errors = [w[k] * x - counts[k] for k in range(3)]
        assert d == int(np.argmax(errors))  # argmax takes the first maximum: ties to the lower
        counts[d] += int(length)
        n += int(length)
    shares = np.array(counts) / n
    assert np.allclose(shares, weights, atol=0.002), shares


# --- the iterator and the statistics by source over gloo --------------------------------------

VOCAB = 64


def fake_logits(tokens, positions):
    """[T, V] float64 logits, a function of each token and its position only."""
    t = tokens.to(torch.float64)[:, None]
    p = positions.to(torch.float64)[:, None]
    v = torch.arange(VOCAB, dtype=torch.float64)[None, :]
    return torch.sin(0.37 * t * (v + 1) + 0.11 * p) * 3


def blend_worker(rank, world, port, path, layouts, out_dir):
    join_gloo(rank, world, port)
    from thdpack.torch import LossStatistics, PackedDataIterator
    out = {}
    opts = dict(global_batch=24, max_tokens_per_rank=512, cost="tokens", vocab=VOCAB)
    for tp, cp, dp, pp in layouts:
        if tp * cp * dp * pp != world:
            continue
        groups = make_groups(tp, cp, dp, pp)
        it = PackedDataIterator("blend:" + path, groups, **opts)
        stats = LossStatistics()
        states = []
        sources_seen = []
        for _ in range(3):
            step = next(it)
            for mb in step:
                sources_seen.append(mb["sources"].tolist())
                assert len(mb["sources"]) == len(mb["cu_seqlens"]) - 1
                if groups.coord["tp"] != 0:  # TP ranks hold the same tensors: one counts
                    continue
                logits = fake_logits(mb["tokens"], mb["position_ids"])
                stats.add_microbatch(logits, mb)
            states.append(step.state_dict())
        out[(tp, cp, dp, pp)] = {"summary": stats.summary(groups.world if world > 1 else None),
                                 "states": states}
        it.close()
    # A resume from the state after step 1, at the last layout: step 2's samples again.
    tp, cp, dp, pp = [x for x in layouts if x[0] * x[1] * x[2] * x[3] == world][-1]
    groups = make_groups(tp, cp, dp, pp)
    it = PackedDataIterator("blend:" + path, groups, **opts)
    it.load_state_dict(out[(tp, cp, dp, pp)]["states"][1])
    out["resumed_state"] = next(it).state_dict()
    it.close()
    # Another weight: refused by name on every rank.
    with open(path) as f:
        blend = json.load(f)
    blend["sources"][1]["weight"] *= 2
    other = os.path.join(out_dir, f"other{rank}.json")
    with open(other, "w") as f:
        json.dump(blend, f)
    it = PackedDataIterator("blend:" + other, groups, **opts)
    try:
        it.load_state_dict(out[(tp, cp, dp, pp)]["states"][1])
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    it.close()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def test_iterator_and_statistics_by_source(tmp_path):
    path = write_blend(tmp_path, [0.5, 0.25, 0.15, 0.1])
    layouts = [(1, 1, 1, 1), (1, 2, 2, 1), (1, 4, 1, 1), (1, 1, 4, 1), (2, 2, 1, 1)]
    results = {}
    for world in (1, 4):
        out = tmp_path / f"out{world}"
        out.mkdir()
        spawn(blend_worker, args=(world, free_port(), path, layouts, str(out)), nprocs=world)
        for r in range(world):
            with open(out / f"rank{r}.pkl", "rb") as f:
                results[(world, r)] = pickle.load(f)
    one = results[(1, 0)][(1, 1, 1, 1)]["summary"]
    assert len(one["sources"]) == 4
    # The sources' figures add up to the totals.
    assert sum(s["n_tokens"] for s in one["sources"]) == one["n_tokens"]
    assert sum(s["n_loss_tokens"] for s in one["sources"]) == one["n_loss_tokens"]
    for layout in layouts[1:]:
        for r in range(4):
            got = results[(4, r)][layout]["summary"]
            assert got["n_tokens"] == one["n_tokens"], (layout, got, one)
            for key in ("loss", "entropy", "ppl"):
                assert got[key] == pytest.approx(one[key], rel=1e-9), (layout, key)
            for d in range(4):
                a, b = got["sources"][d], one["sources"][d]
                assert a["n_tokens"] == b["n_tokens"] and a["n_loss_tokens"] == b["n_loss_tokens"]
                for key in ("loss", "entropy", "ppl"):
                    assert a[key] == pytest.approx(b[key], rel=1e-9), (layout, d, key)
            # The state is the same at every layout (the elastic rule).
            assert results[(4, r)][layout]["states"] == results[(1, 0)][(1, 1, 1, 1)]["states"]
    for r in range(4):
        assert results[(4, r)]["resumed_state"] == results[(1, 0)][(1, 1, 1, 1)]["states"][2]
        refused = results[(4, r)]["refused"]
        assert refused is not None and "blend source" in refused and "weight" in refused, refused
