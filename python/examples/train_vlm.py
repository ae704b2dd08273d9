#!/usr/bin/env python3
"""A tiny vision-language model trained on packed (THD) batches with images and video from
thdpack, over torch.distributed (gloo, CPU) with DP x CP processes, checked against one process.

Each loader rank (cp = 0) feeds its share of every step - samples of text with images and short
videos, each item a payload of patch rows and a grid, placed at its placeholder tokens as
Qwen2-VL's processor writes them - to thdpack.torch.PackedDataIterator with media=MEDIA and
mrope="qwen2-vl". The C++ step schedules the samples over the replicas and microbatches, moves
each image with its sample, places every item whole on one CP rank of its microbatch (balancing
the encoder's work) and gives each rank the payload rows it encodes, the local positions of the
placeholders its shard holds, and its shard of the mRoPE positions. Each rank runs the vision
tower on its items only; thdpack.torch.route_media sends each output row to the rank whose shard
holds its token (one all-to-all over CP, its backward the reverse) and the rows replace the
placeholders' embeddings. The language model: embeddings, the three mRoPE position rows as three
learned tables (temporal, height, width) added to them, one causal attention block (K/V
all-gathered over CP), an MLP and a head; the CP-local loss share from thdpack.torch.local_loss;
gradients summed over DP x CP.

The vision tower: each patch row embedded, each merged 2x2 block of patch embeddings
concatenated and projected to the language model's width, plus each item's mean patch embedding
projected (a term that mixes the whole item, as attention does).

The single process trains the same model on the same samples one by one with plain torch: each
sample's items encoded, placed by masked_scatter (Megatron's alignment rule), its mRoPE positions
(thdpack.torch.mrope_positions, equal to transformers' get_rope_index, python/tests/test_media.py),
causal attention within the sample, cross-entropy over the step's loss tokens. Losses and
parameters must agree to float64 rounding.

With --pp 2 the vision tower, the embeddings and the attention block are the first stage (the
step hands media and mRoPE positions to it alone) and the MLP and head the second; they
exchange activations and their gradients, and each stage's gradients are summed over its
DP x CP ranks.

With --encoders E the vision tower runs on E ranks of its own (world ranks DP*CP ..
DP*CP*PP+E-1, Megatron MIMO's non-colocated encoders): the language ranks' step hands each item to
one of them (thdpack.torch.EncoderIterator there), placed by the encoder's cost; their output
rows come back through route_media, their gradients return in its backward, and the tower's
gradients are summed over the encoder ranks. With --pp 2 too, the bridge group is the first
stage's ranks and the encoder ranks (encoder_group).

  /usr/bin/python3 python/examples/train_vlm.py --dp 2 --cp 2 [--pp 2] [--encoders 2] --check
(with PYTHONPATH=<build>/python). Exit status 1 when --check finds a difference.
"""
import argparse
import json
import math
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import thdpack.torch as tt  # noqa: E402
from train_tiny import (Place, free_port, join_world, new_groups,  # noqa: E402 - the tiny
                        param_sum, sgd_step)                       # example's

VOCAB, HIDDEN, VISION, PATCH, MERGE = 48, 16, 8, 6, 2
IMAGE, VIDEO = 46, 47
MEDIA = {"image": {"token_id": IMAGE, "payload": "pixel_values", "grid": "image_grid_thw"},
         "video": {"token_id": VIDEO, "payload": "pixel_values_videos", "grid": "video_grid_thw"}}
SEED, LR = 7, 0.05


def sample(i):
    """Sample i of the stream: text (ids 1..45) with 0-2 images and now and then a video, each
    between text tokens; its payloads [patches, PATCH] float64; a loss on text targets only."""
    rng = np.random.default_rng(1000 + i)
    ids = list(rng.integers(1, 46, int(rng.integers(2, 8))))
    grids = {"image": [], "video": []}
    rows = {"image": [], "video": []}
    for _ in range(int(rng.integers(0, 3))):
        kind = "video" if rng.random() < 0.25 else "image"
        t = int(rng.integers(2, 4)) if kind == "video" else 1
        h, w = MERGE * int(rng.integers(1, 3)), MERGE * int(rng.integers(1, 3))
        grids[kind].append([t, h, w])
        rows[kind].append(rng.standard_normal((t * h * w, PATCH)))
        ids += [IMAGE if kind == "image" else VIDEO] * (t * (h // MERGE) * (w // MERGE))
        ids += list(rng.integers(1, 46, int(rng.integers(1, 5))))
    ids = np.asarray(ids, dtype=np.int64)
    # Token j is a target when it is text (a placeholder is never predicted).
    mask = ((ids != IMAGE) & (ids != VIDEO)).astype(np.uint8)
    out = {"input_ids": ids, "loss_mask": mask}
    for kind, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        out[MEDIA[kind]["grid"]] = np.asarray(grids[kind], dtype=np.int64).reshape(-1, 3)
        out[key] = torch.from_numpy(np.concatenate(rows[kind]) if rows[kind]
                                    else np.zeros((0, PATCH)))
    return out


class TinyVLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(SEED)

        def w(*shape, scale):
            return torch.nn.Parameter(torch.randn(*shape, generator=g, dtype=torch.float64) * scale)

        self.patch = w(PATCH, VISION, scale=PATCH ** -0.5)
        self.merge = w(MERGE * MERGE * VISION, HIDDEN, scale=(MERGE * MERGE * VISION) ** -0.5)
        self.mix = w(VISION, HIDDEN, scale=VISION ** -0.5)
        self.emb = w(VOCAB, HIDDEN, scale=0.5)
        self.pos = torch.nn.ParameterList([w(64, HIDDEN, scale=0.1) for _ in range(3)])
        self.wq, self.wk, self.wv, self.wo = (w(HIDDEN, HIDDEN, scale=HIDDEN ** -0.5)
                                              for _ in range(4))
        self.w1 = w(HIDDEN, 2 * HIDDEN, scale=HIDDEN ** -0.5)
        self.w2 = w(2 * HIDDEN, HIDDEN, scale=(2 * HIDDEN) ** -0.5)
        self.head = w(HIDDEN, VOCAB, scale=HIDDEN ** -0.5)

    def vision(self, pixel_values, grid_thw):
        """[tokens of the items, HIDDEN]: the items of grid_thw, in order."""
        out, at = [], 0
        for t, h, w in grid_thw.tolist():
            e = torch.tanh(pixel_values[at:at + t * h * w] @ self.patch)
            at += t * h * w
            blocks = e.reshape(-1, MERGE * MERGE * VISION)
            out.append(blocks @ self.merge + e.mean(0) @ self.mix)
        return torch.cat(out) if out else torch.zeros((0, HIDDEN), dtype=self.merge.dtype)

    def embed(self, tokens, mrope):
        x = self.emb[tokens]
        for r in range(3):
            x = x + self.pos[r][mrope[r]]
        return x

    def attend_block(self, x, attend):
        return x + attend(x @ self.wq, x @ self.wk, x @ self.wv) @ self.wo

    def mlp_head(self, x):
        return (x + torch.tanh(x @ self.w1) @ self.w2) @ self.head

    def rest(self, x, attend):
        return self.mlp_head(self.attend_block(x, attend))


def causal_attention(q, k, v, q_pos, k_pos, q_seq, k_seq):
    scores = (q @ k.T) / math.sqrt(q.shape[-1])
    visible = (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


# The two stages of --pp 2: the vision tower, the embeddings and the attention block first; the
# MLP and the head last.
STAGE_PARAMS = (("patch", "merge", "mix", "emb", "pos", "wq", "wk", "wv", "wo"),
                ("w1", "w2", "head"))


def stage_params(model, place):
    """The parameters this rank's stage holds (every one without PP)."""
    names = STAGE_PARAMS[0] + STAGE_PARAMS[1] if place.pp == 1 else STAGE_PARAMS[place.stage]
    out = []
    for name in names:
        p = getattr(model, name)
        out += list(p) if isinstance(p, torch.nn.ParameterList) else [p]
    return out


VISION_PARAMS = ("patch", "merge", "mix")


def join_with_encoders(rank, dp, cp, pp, encoders, port):
    """--encoders E: a gloo world of DP x CP x PP language ranks (0 .. DP*CP*PP-1, their own
    world for the step) and E encoder ranks after them. Every rank makes every group, in one
    order. Returns the Place (None on an encoder rank), the Groups (None there), the group over
    which this rank's gradients are summed (its stage's DP x CP ranks, or the encoder ranks),
    the language ranks' world, the encoder ranks and the bridge group (None without PP: the
    default group; with PP the first stage's ranks and the encoder ranks)."""
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    n = dp * cp * pp
    dist.init_process_group("gloo", rank=rank, world_size=n + encoders)
    enc = list(range(n, n + encoders))
    lm_world = dist.new_group(list(range(n)))
    enc_group = dist.new_group(enc)
    at = Place(0, dp, cp, pp).at
    cp_group = new_groups([[at(c, d, s) for c in range(cp)] for s in range(pp) for d in range(dp)])
    dp_group = new_groups([[at(c, d, s) for d in range(dp)] for s in range(pp) for c in range(cp)])
    pp_group = new_groups([[at(c, d, s) for s in range(pp)] for d in range(dp) for c in range(cp)])
    dpcp_group = new_groups([[at(c, d, s) for d in range(dp) for c in range(cp)]
                             for s in range(pp)])
    bridge = None
    if pp > 1:
        bridge = dist.new_group([at(c, d, 0) for d in range(dp) for c in range(cp)] + enc)
    if rank in enc:
        return None, None, enc_group, lm_world, enc, bridge
    groups = tt.Groups(cp=cp_group, dp=dp_group, pp=pp_group, world=lm_world)
    return Place(rank, dp, cp, pp), groups, dpcp_group, lm_world, enc, bridge


def encoder_worker(rank, model, sum_group, enc, bridge):
    """An encoder rank: the vision tower on the items the bridge places here, each output row
    sent to the language ranks (route_media), the gradients that come back summed over the
    encoder ranks."""
    params = [getattr(model, n) for n in VISION_PARAMS]
    for step in tt.EncoderIterator(enc, MEDIA, group=bridge):
        for mb in step:
            rows = [tt.route_media(model.vision(m["pixel_values"], m["grid_thw"]), mb, name)
                    for name, m in mb["media"].items()]
            sum(r.sum() for r in rows).backward()
        for p in params:  # an encoder rank without items this step
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        sgd_step(params, sum_group, LR)
        for p in params:
            p.grad = None
    vision = torch.zeros(1, dtype=torch.float64)
    if rank == enc[0]:
        vision[0] = float(sum(p.detach().sum() for p in params))
    dist.all_reduce(vision)
    lm = torch.zeros(1, dtype=torch.float64)
    dist.all_reduce(lm)
    dist.destroy_process_group()


def worker(rank, dp, cp, pp, steps, global_batch, port, out_path, encoders=0):
    if encoders:
        place, groups, dpcp_group, lm_world, enc, bridge = join_with_encoders(
            rank, dp, cp, pp, encoders, port)
        if place is None:
            return encoder_worker(rank, TinyVLM(), dpcp_group, enc, bridge)
    else:
        place, groups, dpcp_group = join_world(rank, dp, cp, pp, port)
        enc = lm_world = bridge = None
    model = TinyVLM()
    params = stage_params(model, place)
    if enc:  # the vision tower lives on the encoder ranks
        params = [p for p in params
                  if not any(p is getattr(model, n) for n in VISION_PARAMS)]
    loader = place.first and place.cp_rank == 0
    # Loader d's share: stream positions d, d + DP, ... (a DistributedSampler's order).
    share = (sample(i) for i in range(place.dp_rank, steps * global_batch, dp)) if loader \
        else None
    it = tt.PackedDataIterator(share, groups, global_batch=global_batch, steps=steps,
                               max_tokens_per_rank=48, media=MEDIA, spatial_merge_size=MERGE,
                               mrope="qwen2-vl", prefetch=1, encoder_ranks=enc,
                               encoder_group=bridge)
    losses = []
    for step in it:
        n = step.n_loss_tokens
        total = torch.zeros(1, dtype=torch.float64)
        for mb in step:
            cup = mb["cu_seqlens_padded"].numpy()
            c_size, c_rank, group = mb["cp_size"], mb["cp_rank"], mb["cp_group"]
            local = int(cup[-1]) // c_size
            to = (place.cp_rank, place.dp_rank)
            if place.first:  # media and mRoPE reach the first stage only
                x = model.emb[mb["tokens"].long()]
                for name in MEDIA:  # every rank, every modality, in order
                    m = mb["media"][name]
                    # (with --encoders no items here: [0, HIDDEN] in, the rows back)
                    rows = tt.route_media(model.vision(m["pixel_values"], m["grid_thw"]), mb,
                                          name)
                    x = x.index_put((m["token_index"],), rows)
                mrope = mb["mrope_position_ids"]
                for r in range(3):
                    x = x + model.pos[r][mrope[r]]
                seq = torch.from_numpy(np.repeat(np.arange(len(cup) - 1), np.diff(cup)))
                q_pos = tt.partition_indices(cup, c_size, c_rank)
                k_pos = torch.arange(int(cup[-1]))

                def attend(q, k, v):
                    if c_size > 1:
                        k = tt.unshard(list(tt.gather_cp(k, group, c_size, c_rank)), cup)
                        v = tt.unshard(list(tt.gather_cp(v, group, c_size, c_rank)), cup)
                    return causal_attention(q, k, v, q_pos, k_pos, seq[q_pos], seq)

                x = model.attend_block(x, attend)
                if pp > 1:  # hand the activations on, take their gradient back
                    dist.send(x.detach(), dst=place.at(*to, place.stage + 1))
                    grad = torch.empty(local, HIDDEN, dtype=torch.float64)
                    dist.recv(grad, src=place.at(*to, place.stage + 1))
                    x.backward(grad)
                    continue
            else:  # the last stage starts from the first stage's activations
                x = torch.empty(local, HIDDEN, dtype=torch.float64)
                dist.recv(x, src=place.at(*to, place.stage - 1))
                x.requires_grad_(True)
            share_ = tt.local_loss(model.mlp_head(x), mb["labels"], mb["loss_mask"], n)
            share_.backward()
            if pp > 1:
                dist.send(x.grad, dst=place.at(*to, place.stage - 1))
            total += share_.detach()
        dist.all_reduce(total, group=lm_world)  # the last stage's shares, over DP x CP
        sgd_step(params, dpcp_group, LR)  # the shares are designed for a sum over DP x CP
        for p in params:
            p.grad = None
        losses.append(float(total))
    if enc:  # the vision tower's sum from the encoder ranks, each stage's from one rank
        vision = torch.zeros(1, dtype=torch.float64)
        dist.all_reduce(vision)
        lm = torch.zeros(1, dtype=torch.float64)
        if place.cp_rank == 0 and place.dp_rank == 0:
            lm[0] = float(sum(p.detach().sum() for p in params))
        dist.all_reduce(lm)
        total_params = float(vision[0] + lm[0])
    else:
        total_params = param_sum(params, place)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "param_sum": total_params}, f)
    dist.destroy_process_group()


def single_process(steps, global_batch):
    """The same model on the same samples, one sample at a time, as a plain torch program."""
    model = TinyVLM()
    params = list(model.parameters())
    losses = []
    for s in range(steps):
        batch = [sample(i) for i in range(s * global_batch, (s + 1) * global_batch)]
        n = sum(int(x["loss_mask"][1:].sum()) for x in batch)
        total = 0
        for x in batch:
            ids = torch.from_numpy(x["input_ids"])
            emb = model.emb[ids]
            for name, spec in MEDIA.items():
                rows = model.vision(x[spec["payload"]], torch.from_numpy(x[spec["grid"]]))
                emb = emb.masked_scatter((ids == spec["token_id"])[:, None].expand_as(emb), rows)
            mrope = tt.mrope_positions(x["input_ids"], x, MEDIA, MERGE, "qwen2-vl")
            for r in range(3):
                emb = emb + model.pos[r][mrope[r]]
            pos = torch.arange(len(ids))
            seq = torch.zeros(len(ids), dtype=torch.long)
            logits = model.rest(emb, lambda q, k, v: causal_attention(q, k, v, pos, pos, seq, seq))
            target = torch.from_numpy(x["loss_mask"][1:].astype(bool))
            ce = torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="none")
            total = total + (ce * target).sum() / n
        total.backward()
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
                p.grad = None
        losses.append(float(total.detach()))
    return {"losses": losses, "param_sum": float(sum(p.detach().sum() for p in params))}



def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1, choices=(1, 2),
                    help="pipeline stages: 2 splits the model after the attention block")
    ap.add_argument("--encoders", type=int, default=0,
                    help="encoder ranks of their own (non-colocated; 0: each item is encoded "
                         "on a CP rank of its replica)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--check", action="store_true",
                    help="also train in one process and compare (relative tolerance --rtol)")
    ap.add_argument("--rtol", type=float, default=1e-9)
    ap.add_argument("--port", type=int, default=0,
                    help="the gloo rendezvous port (default: one the OS finds free)")
    args = ap.parse_args()
    import multiprocessing
    multiprocessing.set_forkserver_preload(["numpy", "torch", "torch.distributed", "thdpack",
                                            "thdpack.torch"])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.start_processes(worker, args=(args.dp, args.cp, args.pp, args.steps,
                                         args.global_batch, args.port or free_port(), out,
                                         args.encoders),
                           nprocs=args.dp * args.cp * args.pp + args.encoders, join=True,
                           start_method="forkserver")
        with open(out) as f:
            multi = json.load(f)
    enc = f" + {args.encoders} encoder ranks" if args.encoders else ""
    print(f"DP {args.dp} x CP {args.cp} x PP {args.pp}{enc}: losses "
          + ", ".join(f"{v:.6f}" for v in multi["losses"]))
    if not args.check:
        return 0
    one = single_process(args.steps, args.global_batch)
    bad = []
    for k, (a, b) in enumerate(zip(multi["losses"], one["losses"])):
        if abs(a - b) > args.rtol * max(1.0, abs(b)):
            bad.append(f"step {k}: loss {a!r} vs one process {b!r}")
    a, b = multi["param_sum"], one["param_sum"]
    if abs(a - b) > args.rtol * max(1.0, abs(b)):
        bad.append(f"parameters: sum {a!r} vs one process {b!r}")
    print("check: " + ("equal to one process" if not bad else "; ".join(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
