#!/usr/bin/env python3
"""A transformers Qwen2, built from a config (no download), trained GRPO-style on thdpack's
packed batches at DP x CP over gloo, checked against one process that runs the same model on
each rollout alone.

Rollouts in groups of 4 (a prompt, a response, a reward from the tokens) carry their GRPO
advantage as a sample field; each loader (cp = 0) hands its rollouts to thdpack.torch.pack_batch
once a step. The model runs on each rank's zigzag shard with thdpack.torch.hf_attention's
attention function (K/V all-gathered over the microbatch's CP group, varlen causal by the
step's cu_seqlens_padded) registered through transformers' attention interface - the model's own
code otherwise, RoPE at each token's position in its sequence. Per token: token_logprobs; per
rollout: per_token spreads its advantage; the loss is GRPO's on-policy surrogate
-exp(logp - logp.detach()) * A aggregated seq-mean-token-mean over the step (aggregate_loss), its
shares summed over DP x CP with the gradients.

The single process computes the same loss with the model's sdpa attention on every rollout
alone (unpacked, positions from 0), the mean over rollouts of each one's token mean. Losses and
parameters must agree to float64 rounding.

  python python/examples/grpo_hf.py --dp 2 --cp 2 --steps 2 --check
(with PYTHONPATH=<build>/python and transformers >= 5 installed). Exit status 1 when --check
finds a difference.
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import thdpack.torch as tt  # noqa: E402
from thdpack.torch import hf_attention  # noqa: E402
from train_tiny import free_port, sgd_step  # noqa: E402 - the tiny example's, shared

VOCAB, GROUP, LR = 64, 4, 0.1


def model_of(attn):
    from transformers import AutoModelForCausalLM, Qwen2Config
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.double()


def rollout(i):
    """Rollout i: a prompt (shared by its group of 4) and a response; the reward counts the
    response's even tokens."""
    g = np.random.default_rng(100 + i // GROUP)
    prompt = g.integers(1, VOCAB, int(g.integers(3, 9)))
    r = np.random.default_rng(10_000 + i)
    response = r.integers(1, VOCAB, int(r.integers(2, 14)))
    ids = np.concatenate([prompt, response]).astype(np.int64)
    mask = np.concatenate([np.zeros(len(prompt)), np.ones(len(response))]).astype(np.uint8)
    return {"input_ids": ids, "loss_mask": mask, "reward": float((response % 2 == 0).mean())}


def advantages(first, n):
    """GRPO's group-normalised advantage of rollouts first .. first + n - 1 (whole groups)."""
    rewards = np.array([rollout(i)["reward"] for i in range(first, first + n)])
    out = np.zeros(n)
    for g in range(0, n, GROUP):
        r = rewards[g:g + GROUP]
        out[g:g + GROUP] = (r - r.mean()) / (r.std() + 1e-6)
    return out


def worker(rank, dp, cp, steps, batch, port, out_path):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=dp * cp)
    cp_rank, dp_rank = rank % cp, rank // cp

    def groups_of(lists):
        mine = None
        for ranks in lists:
            g = dist.new_group(ranks)
            if rank in ranks:
                mine = g
        return mine
    groups = tt.Groups(cp=groups_of([[d * cp + c for c in range(cp)] for d in range(dp)]),
                       dp=groups_of([[d * cp + c for d in range(dp)] for c in range(cp)]))
    model = model_of(hf_attention.register())
    params = [p for p in model.parameters()]
    losses = []
    for s in range(steps):
        first = s * batch
        adv = advantages(first, batch)
        mine = None
        if cp_rank == 0:  # loader d: rollouts d, d + DP, ... of the step
            mine = [dict(rollout(i), advantage=adv[i - first])
                    for i in range(first + dp_rank, first + batch, dp)]
            for x in mine:
                del x["reward"]
        step = tt.pack_batch(mine, groups, max_tokens_per_rank=64,
                             fields={"advantage": {"kind": "sample", "dtype": "float64"}})
        total = torch.zeros(1, dtype=torch.float64)
        for mb in step:
            logits = model(input_ids=mb["tokens"][None].long(),
                           **hf_attention.model_kwargs(mb)).logits[0]
            logp = tt.token_logprobs(logits, mb)
            a = tt.per_token(mb["advantage"], mb)
            share = tt.aggregate_loss(-torch.exp(logp - logp.detach()) * a, mb, step,
                                      "seq-mean-token-mean")
            share.backward()
            # The policy's mean NLL over the step's response tokens, logged and compared.
            total += tt.aggregate_loss(-logp.detach(), mb, step, "token-mean")
        dist.all_reduce(total)
        sgd_step(params, None, LR)  # the shares are designed for a sum over DP x CP
        for p in params:
            p.grad = None
        losses.append(float(total))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"nll": losses,
                       "params": torch.cat([p.detach().reshape(-1) for p in params]).tolist()},
                      f)
    dist.destroy_process_group()


def single_process(steps, batch):
    model = model_of("sdpa")
    params = list(model.parameters())
    losses = []
    for s in range(steps):
        first = s * batch
        adv = advantages(first, batch)
        terms, nll, n = [], 0.0, 0
        for i in range(first, first + batch):
            x = rollout(i)
            ids = torch.from_numpy(x["input_ids"])
            logits = model(input_ids=ids[None]).logits[0].double()
            logp = torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None])[:, 0]
            target = torch.from_numpy(x["loss_mask"][1:].astype(bool))
            nll += float(-logp.detach()[target].sum())
            n += int(target.sum())
            if target.any():
                per = -torch.exp(logp - logp.detach()) * float(adv[i - first])
                terms.append(per[target].mean())
        loss = torch.stack(terms).mean()
        loss.backward()
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
                p.grad = None
        losses.append(nll / n)
    return {"nll": losses, "params": torch.cat([p.detach().reshape(-1) for p in params]).tolist()}



def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="rollouts a step (groups of 4)")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--rtol", type=float, default=1e-9)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    import multiprocessing
    multiprocessing.set_forkserver_preload(["numpy", "torch", "torch.distributed", "thdpack",
                                            "thdpack.torch", "transformers"])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.start_processes(worker, args=(args.dp, args.cp, args.steps, args.batch,
                                         args.port or free_port(), out),
                           nprocs=args.dp * args.cp, join=True, start_method="forkserver")
        with open(out) as f:
            multi = json.load(f)
    print(f"DP {args.dp} x CP {args.cp}: mean NLL of the responses a step "
          + ", ".join(f"{v:.9f}" for v in multi["nll"]))
    if not args.check:
        return 0
    one = single_process(args.steps, args.batch)
    bad = [f"step {k}: NLL {a!r} vs one process {b!r}"
           for k, (a, b) in enumerate(zip(multi["nll"], one["nll"]))
           if abs(a - b) > args.rtol * max(1.0, abs(b))]
    a, b = np.array(multi["params"]), np.array(one["params"])
    moved = np.abs(b - np.array(one_start())).max()
    diff = np.abs(a - b).max()
    if diff > args.rtol * max(1.0, np.abs(b).max()):
        bad.append(f"parameters: max difference {diff!r}")
    print(f"parameters: max difference {diff:.3g} after training moved them by up to {moved:.3g}")
    print("check: " + ("equal to one process" if not bad else "; ".join(bad)))
    return 1 if bad else 0


def one_start():
    return torch.cat([p.detach().reshape(-1) for p in model_of("sdpa").parameters()]).tolist()


if __name__ == "__main__":
    sys.exit(main())
