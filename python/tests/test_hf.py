"""Hugging Face's label convention (pack(label_format="hf"), docs/python.md "With a Hugging Face
model") against Hugging Face's own code, on fresh random samples with completion-only masks:

  * transformers' DataCollatorWithFlattening and TRL's padding-free
    DataCollatorForLanguageModeling give the same input_ids, labels, position_ids,
    cu_seq_lens_q/k and max_length_q/k, byte for byte;
  * transformers' ForCausalLMLoss on those labels (it shifts them itself) is the loss of
    thdpack's own (Megatron) labels, and a tiny transformers model trained on the packed batch
    gets the loss of its samples one by one, with and without a rank multiple's padding.

Skipped where transformers does not import (Debian's stack); the current stack has it
(python/requirements-current.txt). The TRL comparison is skipped where TRL does not import.
"""
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers import DataCollatorWithFlattening  # noqa: E402
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

import thdpack  # noqa: E402

VOCAB = 97
X = -100


def random_samples(rng, n=None):
    """Samples as an SFT loader holds them: token arrays, and per sample a target mask - None
    (pretraining), a completion-only mask (a prompt of zeros, then ones) or several turns."""
    samples, masks = [], []
    for i in range(int(rng.integers(1, 9)) if n is None else n):
        length = int(rng.integers(1, 60))
        samples.append(rng.integers(0, VOCAB, length).astype(np.int32))
        kind = i % 3
        if kind == 0:
            masks.append(None)
        elif kind == 1:
            prompt = int(rng.integers(0, length + 1))
            masks.append((np.arange(length) >= prompt).astype(np.uint8))
        else:
            masks.append(rng.integers(0, 2, length).astype(np.uint8))
    return samples, masks


def hf_features(samples, masks):
    """What TRL's completion-only preparation hands a collator: labels = input_ids, -100 where
    the completion mask is 0 (the collators then set -100 at every sequence's first token)."""
    out = []
    for tokens, mask in zip(samples, masks):
        labels = [int(t) if mask is None or mask[j] else X for j, t in enumerate(tokens)]
        out.append({"input_ids": tokens.tolist(), "labels": labels})
    return out


def check_same(ours, theirs, what):
    for key in ("input_ids", "labels", "position_ids"):
        got = np.asarray(theirs[key])
        assert got.shape == (1, len(ours[key])), f"{what}: {key} {got.shape}"
        np.testing.assert_array_equal(got[0], ours[key], err_msg=f"{what}: {key}")
        assert got.dtype == ours[key].dtype == np.int64, f"{what}: {key}"
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        got = np.asarray(theirs[key])
        np.testing.assert_array_equal(got, ours[key], err_msg=f"{what}: {key}")
        assert got.dtype == ours[key].dtype == np.int32, f"{what}: {key}"
    for key in ("max_length_q", "max_length_k"):
        assert int(theirs[key]) == ours[key], f"{what}: {key}"


def test_pack_equals_transformers_data_collator_with_flattening():
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="np")
    for trial in range(200):
        samples, masks = random_samples(rng)
        what = f"seed {seed} trial {trial}"
        ours = thdpack.pack(samples, masks, label_format="hf")
        check_same(ours, collator(hf_features(samples, masks)), what)
        # The loss targets are the set thdpack's own labels name, one position earlier.
        meg = thdpack.pack(samples, masks)
        hf_targets = np.flatnonzero(ours["labels"] != X)
        np.testing.assert_array_equal(hf_targets, np.flatnonzero(ours["loss_mask"]), what)
        np.testing.assert_array_equal(np.flatnonzero(meg["loss_mask"]) + 1, hf_targets, what)
        np.testing.assert_array_equal(meg["labels"][meg["loss_mask"] > 0],
                                      ours["labels"][hf_targets], what)
        assert ours["n_valid"] == meg["n_valid"] == len(hf_targets), what


def test_pack_equals_trls_padding_free_collator():
    pytest.importorskip("trl")
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    for trial in range(100):
        samples, masks = random_samples(rng)
        out = collator(hf_features(samples, masks))
        theirs = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
        check_same(thdpack.pack(samples, masks, label_format="hf"), theirs,
                   f"seed {seed} trial {trial}")


def test_for_causal_lm_loss_on_hf_labels_is_the_loss_of_thdpacks_labels():
    """transformers' loss shifts the labels itself; on thdpack's HF labels it scores exactly the
    targets thdpack's own (already shifted) labels name, with any padding of a rank multiple."""
    seed = random.randrange(2**32)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(50):
        samples, masks = random_samples(rng, n=int(rng.integers(2, 7)))
        rank_multiple = (1, 16, 32)[trial % 3]
        what = f"seed {seed} trial {trial} rank_multiple {rank_multiple}"
        hf = thdpack.pack(samples, masks, label_format="hf", rank_multiple=rank_multiple)
        meg = thdpack.pack(samples, masks, rank_multiple=rank_multiple)
        t = len(hf["labels"])
        logits = torch.randn(1, t, VOCAB, generator=gen)
        n = hf["n_valid"]
        if n == 0:
            continue
        theirs = ForCausalLMLoss(logits, torch.from_numpy(hf["labels"])[None], VOCAB,
                                 num_items_in_batch=n)
        targets = torch.from_numpy(np.where(meg["loss_mask"] > 0, meg["labels"], X))
        ours = torch.nn.functional.cross_entropy(logits[0], targets, ignore_index=X,
                                                 reduction="sum") / n
        torch.testing.assert_close(theirs, ours, rtol=1e-6, atol=0, msg=what)
        mean = ForCausalLMLoss(logits, torch.from_numpy(hf["labels"])[None], VOCAB)
        torch.testing.assert_close(mean, ours, rtol=1e-6, atol=0, msg=what)


@pytest.mark.parametrize("rank_multiple", [1, "fp8"])
def test_a_transformers_model_on_the_packed_batch_gets_each_samples_loss(rank_multiple):
    """A tiny Llama trained as Hugging Face trains padding-free (input_ids, position_ids and
    labels, no attention mask, no cache): its loss on thdpack's packed batch is the token-weighted
    loss of its samples one by one - no sequence attends across a boundary or is scored on
    another's tokens, and the padding of a rank multiple changes nothing."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).double().eval()
    rng = np.random.default_rng(11)
    samples, masks = random_samples(rng, n=6)
    mb = thdpack.pack(samples, masks, label_format="hf", rank_multiple=rank_multiple)
    with torch.no_grad():
        packed = model(input_ids=torch.from_numpy(mb["input_ids"])[None],
                       position_ids=torch.from_numpy(mb["position_ids"])[None],
                       labels=torch.from_numpy(mb["labels"])[None], use_cache=False).loss
        total, count = 0.0, 0
        for feature in hf_features(samples, masks):
            labels = torch.tensor([feature["labels"]])
            labels[0, 0] = X
            k = int((labels[0, 1:] != X).sum())
            if k == 0:
                continue
            one = model(input_ids=torch.tensor([feature["input_ids"]]), labels=labels,
                        use_cache=False).loss
            total += float(one) * k
            count += k
    assert count == mb["n_valid"]
    assert abs(float(packed) - total / count) <= 1e-6 * abs(total / count)
