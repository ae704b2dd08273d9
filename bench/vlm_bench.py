"""Encoder work and payload per CP rank for images and video in packed microbatches
(docs/media.md, "Figures").

The mix (stated, seeded): each sample 50-2,000 text tokens and 0-4 images of 256-1,600 patches
(h, w even, merge 2), one sample in five with a short video (2-8 frames of 16x16 to 24x24
patches). Samples fill microbatches of CP x 8,192 tokens in order. For each microbatch and CP
size, the encoder's work per CP rank (thdpack/media.h ItemEncoderCost, the default term) under:
  thdpack      whole items spread over the CP ranks, longest first (PlaceMicrobatchMedia);
  first-token  each item encoded on the CP rank that holds its first token (a local rule);
  colocated    every CP rank encodes every item (Megatron MIMO's colocated path).
Printed: the largest rank's work over the mean (1.0 = perfect), payload rows and image-embedding
rows per rank as a share of the microbatch's (colocated: 1.0), and media_microbatch's wall time.

Then the step itself (--step): one step of --step-samples samples of the same mix through
pack_batch over a gloo world of CP ranks (DP 1, the loader holding every sample), with media and,
for comparison, the same tokens without (text only); the wall time of pack_batch on the slowest
rank, the bytes the step sent, and route_media's forward and backward of every microbatch's
encoder output ([rows, 1280] float32, a Qwen2-VL tower's width), against the step's modelled time
(llama2-7b's training FLOPs plus the default encoder term, over CP GPUs at --tflops each).

Then the replicas (--replicas): global batches of --batch samples of the same mix over DP
replicas (CP 2, 8,192 tokens a rank, llama2-7b's cost), each replica's step being its language
model's cost plus its encoder's (the default term), under:
  thdpack       the balanced scheduler with the encoder's term (encoder_work, encoder_cost);
  tokens only   the same scheduler blind to the encoder (what balancing the language model gives);
  sequential    Megatron-LM's dp_balanced order (thdpack's sequential scheduler), blind to it;
  visual tokens samples to replicas longest-first by visual-token count (NeMo Automodel's
                ordering, balancing the vision tower), each replica then packed by thdpack.
Printed: the slowest replica's step over the mean (1.0 = perfect) and its encoder work over the
mean encoder work, averaged over batches, and the encoder's share of the step's work.

Then the encoder ranks (--encoders): the items of each global microbatch (the i-th microbatch of
DP replicas of CP 2) placed over E encoder ranks of their own (encoder_ranks), against the same
items on the replicas' CP ranks.

With --step-scheduler dynamic the step runs under the dynamic scheduler (a CP group a
microbatch and sequence), and its exchange MB shows each payload row crossing it at most once.

Run: PYTHONPATH=build/python python3 bench/vlm_bench.py [--microbatches 200] [--step] [--replicas]
     [--encoders]
"""
import argparse
import datetime
import os
import socket
import statistics
import time

import numpy as np
import torch

import thdpack._thdpack as _t
from thdpack.torch import media_microbatch

IMG, VID, MERGE, D = 151655, 151656, 2, 1176  # D: 3 x 2 x 14 x 14, Qwen2-VL's patch row
MEDIA = {"image": {"token_id": IMG, "payload": "pixel_values", "grid": "image_grid_thw"},
         "video": {"token_id": VID, "payload": "pixel_values_videos", "grid": "video_grid_thw"}}


def sample(rng):
    ids, img, vid = [], [], []
    ids += [5] * int(rng.integers(50, 2001))
    for _ in range(int(rng.integers(0, 5))):
        while True:
            h, w = 2 * int(rng.integers(8, 21)), 2 * int(rng.integers(8, 21))
            if 256 <= h * w <= 1600:
                break
        img.append([1, h, w])
        ids += [IMG] * (h * w // 4) + [5] * int(rng.integers(1, 40))
    if rng.random() < 0.2:
        s = 2 * int(rng.integers(8, 13))
        vid.append([int(rng.integers(2, 9)), s, s])
        ids += [VID] * (vid[-1][0] * s * s // 4) + [5]
    rows_i = sum(t * h * w for t, h, w in img)
    rows_v = sum(t * h * w for t, h, w in vid)
    return {"input_ids": np.asarray(ids, dtype=np.int64),
            "image_grid_thw": np.asarray(img, dtype=np.int64).reshape(-1, 3),
            "video_grid_thw": np.asarray(vid, dtype=np.int64).reshape(-1, 3),
            # Zero rows that take no memory until a copy (a view of one row): the microbatches
            # above hold thousands of images.
            "pixel_values": torch.zeros(1, D, dtype=torch.bfloat16).expand(rows_i, D),
            "pixel_values_videos": torch.zeros(1, D, dtype=torch.bfloat16).expand(rows_v, D)}


def microbatches(rng, cp, count):
    budget, out, cur, used = cp * 8192, [], [], 0
    while len(out) < count:
        s = sample(rng)
        n = len(s["input_ids"])
        if n > budget:
            continue
        if used + n > budget and cur:
            out.append(cur)
            cur, used = [], 0
        cur.append(s)
        used += n
    return out


def step_worker(rank, cp, port, args, out):
    import torch.distributed as dist
    import thdpack.torch as tt
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=cp,
                            timeout=datetime.timedelta(seconds=120))
    groups = tt.Groups(cp=dist.new_group(list(range(cp))))
    rng = np.random.default_rng(args.seed)
    samples = [sample(rng) for _ in range(args.step_samples)]
    for s in samples:  # payloads as a processor gives them: contiguous (not the views above)
        for key in ("pixel_values", "pixel_values_videos"):
            s[key] = s[key].contiguous()
    text = [{"input_ids": s["input_ids"]} for s in samples]
    kw = dict(max_tokens_per_rank=8192, cost="llama2-7b", scheduler=args.step_scheduler)
    times = {"media": [], "text": [], "route": []}
    phases = []
    # A first call of each makes the step's process groups (kept for the next calls): untimed.
    tt.pack_batch(samples if rank == 0 else None, groups, media=MEDIA, spatial_merge_size=MERGE,
                  **kw)
    tt.pack_batch(text if rank == 0 else None, groups, **kw)
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        step = tt.pack_batch(samples if rank == 0 else None, groups, media=MEDIA,
                             spatial_merge_size=MERGE, mrope="qwen2-vl", **kw)
        times["media"].append(time.perf_counter() - t0)
        phases.append(dict(step.phase_seconds))
        dist.barrier()
        t0 = time.perf_counter()
        tt.pack_batch(text if rank == 0 else None, groups, **kw)
        times["text"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        for mb in step:
            for name in MEDIA:
                m = mb["media"][name]
                rows = torch.randn(m["route"]["output_rows"], 1280, requires_grad=True)
                tt.route_media(rows, mb, name).sum().backward()
        times["route"].append(time.perf_counter() - t0)
    t = torch.tensor([[statistics.median(times[k]) for k in ("media", "text", "route")]],
                     dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    names = sorted(phases[0])  # the loader's (rank 0's): the other ranks wait in theirs
    ph = torch.tensor([[statistics.median(p[k] for p in phases) for k in names]],
                      dtype=torch.float64)
    sent = torch.tensor([sum(step.bytes_sent.values()), step.bytes_sent["exchange"]],
                        dtype=torch.int64)
    dist.all_reduce(sent)
    if rank == 0:
        patches = sum(int(s["pixel_values"].shape[0] + s["pixel_values_videos"].shape[0])
                      for s in samples)
        flops = sum(_t.media_item_cost(list(map(int, g)))
                    for s in samples for key in ("image_grid_thw", "video_grid_thw")
                    for g in s[key])
        lengths = [len(s["input_ids"]) for s in samples]
        c = _t.cost_model("llama2-7b")  # cost(L) = a L + b L^2 in training FLOPs
        lm = sum(c["a"] * n + c["b"] * n * n for n in lengths)
        payload = sum(s[k].numel() * s[k].element_size() for s in samples
                      for k in ("pixel_values", "pixel_values_videos"))
        torch.save({"t": t[0].tolist(), "sent": int(sent[0]), "exchange": int(sent[1]),
                    "payload": payload, "patches": patches,
                    "tokens": sum(lengths), "mbs": step.num_microbatches,
                    "flops": flops + lm,
                    "phases": dict(zip(names, ph[0].tolist()))}, out)
    dist.destroy_process_group()


def step_figures(args):
    import torch.multiprocessing as mp
    print(f"\none step of {args.step_samples} samples through pack_batch (gloo, DP 1, the "
          f"{args.step_scheduler} scheduler), median of {args.repeats}; modelled at "
          f"{args.tflops:.0f} TFLOP/s a GPU; exchange MB: the exchange phase's bytes over every "
          f"rank, beside the payload's")
    print(f"{'CP':>3} {'mbs':>4} {'pack media ms':>14} {'pack text ms':>13} {'route ms':>9} "
          f"{'MB sent':>8} {'exchange MB':>12} {'payload MB':>11} {'modelled ms':>12} "
          f"{'(pack+route)/model':>19}")
    phases = []
    for cp in (2, 4):
        out = f"/tmp/vlm_bench_step_{os.getpid()}.pt"
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.start_processes(step_worker, args=(cp, port, args, out), nprocs=cp, join=True,
                           start_method="spawn")
        r = torch.load(out)
        os.remove(out)
        media, text, route = r["t"]
        model = r["flops"] / (cp * args.tflops * 1e12)
        print(f"{cp:>3} {r['mbs']:>4} {1e3 * media:>14.1f} {1e3 * text:>13.1f} "
              f"{1e3 * route:>9.1f} {r['sent'] / 1e6:>8.1f} {r['exchange'] / 1e6:>12.1f} "
              f"{r['payload'] / 1e6:>11.1f} {1e3 * model:>12.1f} "
              f"{(media + route) / model:>19.3f}")
        phases.append((cp, r["phases"], media))
    # Where pack_batch's time goes: the loader's phase clocks (median), and the rest of the
    # call (the conversion of the fed samples, the dicts of the microbatches) on the slowest rank.
    for cp, ph, media in phases:
        inside = sum(ph.values())
        text = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in ph.items() if v >= 5e-4)
        print(f"  CP {cp} phases ms: {text}; outside the step (conversions) "
              f"{1e3 * (media - inside):.1f}")


def replica_figures(args):
    import thdpack
    # The default term (Qwen2-VL's tower) from two items: (2 pp + 4 pf) - 2 (pp + pf) = 2 pf.
    per_frame_sq = (_t.media_item_cost([1, 1, 2]) - 2 * _t.media_item_cost([1, 1, 1])) / 2
    per_patch = _t.media_item_cost([1, 1, 1]) - per_frame_sq
    enc = (per_patch, per_frame_sq)
    kw = dict(cp_size=2, max_tokens_per_rank=8192, cost="llama2-7b")
    print(f"\n{'DP':>3} {'rule':>14} {'step max/mean':>14} {'encoder max/mean':>17}")
    for dp in (4, 8, 16):
        rng = np.random.default_rng(args.seed + dp)
        rows = {"thdpack": [], "tokens only": [], "sequential": [], "visual tokens": []}
        share = []
        for _ in range(args.batches):
            batch = [sample(rng) for _ in range(args.batch)]
            lengths = np.asarray([len(s["input_ids"]) for s in batch])
            work = np.zeros((len(batch), 2), dtype=np.int64)
            visual = np.zeros(len(batch), dtype=np.int64)
            for i, s in enumerate(batch):
                for g in (s["image_grid_thw"], s["video_grid_thw"]):
                    for t, h, w in g:
                        work[i] += (t * h * w, t * (h * w) ** 2)
                        visual[i] += t * h * w // (MERGE * MERGE)
            enc_of = work[:, 0] * enc[0] + work[:, 1] * enc[1]

            def evaluate(replica_ids, lm_costs):
                e = np.asarray([enc_of[ids].sum() / 2 for ids in replica_ids])  # over CP 2
                step = np.asarray(lm_costs) + e
                return step.max() / step.mean(), e.max() / e.mean()

            def of_plan(plan):
                ids = [np.concatenate([plan.microbatch(d, m) for m in range(plan.num_microbatches)])
                       for d in range(dp)]
                lm = [r["cost"] - r["encoder_cost"] for r in plan.figures["replicas"]]
                return ids, lm

            aware = thdpack.schedule(lengths, dp_size=dp, encoder_work=work, encoder_cost=enc, **kw)
            rows["thdpack"].append(evaluate(*of_plan(aware)))
            share.append(aware.figures["encoder_cost"] / aware.figures["total_cost"])
            rows["tokens only"].append(evaluate(*of_plan(thdpack.schedule(lengths, dp_size=dp,
                                                                          **kw))))
            rows["sequential"].append(evaluate(*of_plan(thdpack.schedule(
                lengths, dp_size=dp, scheduler="sequential", **kw))))
            # Visual tokens, longest first, each sample to the replica with the fewest so far.
            load, members = np.zeros(dp), [[] for _ in range(dp)]
            for i in sorted(range(len(batch)), key=lambda i: (-visual[i], i)):
                d = int(np.argmin(load))
                load[d] += visual[i]
                members[d].append(i)
            lm = []
            for ids in members:
                p = thdpack.schedule(lengths[ids], ids=ids, dp_size=1, **kw)
                lm.append(p.figures["replicas"][0]["cost"])
            rows["visual tokens"].append(evaluate([np.asarray(m) for m in members], lm))
        for rule, vals in rows.items():
            a = np.asarray(vals)
            print(f"{dp:>3} {rule:>14} {a[:, 0].mean():>14.3f} {a[:, 1].mean():>17.3f}")
        print(f"    the encoder's share of the step's work: {np.mean(share):.3f}")


def encoder_rank_figures(args):
    """--encoders: the encoder ranks' balance (thdpack.torch.encoders): each global microbatch -
    the i-th microbatch of every replica, DP replicas of CP 2 - has its items placed over E
    encoder ranks by place_media_items on the default term; the busiest encoder rank's work
    over the mean, against the same items placed on the replicas' CP ranks (the colocated
    path: DP x CP ranks encode), and the bound of whole items (the largest item over the mean,
    where it exceeds 1)."""
    print(f"\n{'DP':>3} {'E':>3} {'encoder ranks max/mean':>23} {'bound':>6} "
          f"{'colocated DPxCP max/mean':>25}")
    for dp in (2, 4, 8):
        rng = np.random.default_rng(args.seed + 100 + dp)
        mbs = microbatches(rng, 2, dp * min(args.microbatches, 100))
        costs = []
        for mb in mbs:
            c = []
            for s in mb:
                for g in (s["image_grid_thw"], s["video_grid_thw"]):
                    c += [_t.media_item_cost([int(v) for v in x]) for x in g]
            costs.append(np.asarray(c))
        globals_ = [costs[k:k + dp] for k in range(0, len(costs) - dp + 1, dp)]
        colocated = []
        for grp in globals_:  # each replica's items over its 2 CP ranks, as the step places
            work = np.concatenate([np.bincount(_t.place_media_items(c, 2), weights=c,
                                               minlength=2) if len(c) else np.zeros(2)
                                   for c in grp])
            colocated.append(work.max() / work.mean())
        for e in (dp, 2 * dp, 4 * dp):
            ratio, bound = [], []
            for grp in globals_:
                c = np.concatenate(grp)
                if not len(c):
                    continue
                work = np.bincount(_t.place_media_items(c, e), weights=c, minlength=e)
                ratio.append(work.max() / work.mean())
                bound.append(max(1.0, c.max() / work.mean()))
            print(f"{dp:>3} {e:>3} {np.mean(ratio):>23.3f} {np.mean(bound):>6.3f} "
                  f"{np.mean(colocated):>25.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--microbatches", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step", action="store_true", help="also one step through pack_batch")
    ap.add_argument("--step-samples", type=int, default=24)
    ap.add_argument("--step-scheduler", default="balanced", choices=("balanced", "dynamic"),
                    help="the step's scheduler (dynamic: a CP group a microbatch and sequence)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tflops", type=float, default=400.0)
    ap.add_argument("--replicas", action="store_true",
                    help="also the replicas' balance of language model plus encoder")
    ap.add_argument("--encoders", action="store_true",
                    help="also the balance over encoder ranks of their own")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--batches", type=int, default=20)
    args = ap.parse_args()
    print(f"{'CP':>3} {'rule':>12} {'work max/mean':>14} {'payload/rank':>13} "
          f"{'embeds/rank':>12} {'ms/mb':>7}")
    specs = [(n, s["token_id"], False) for n, s in MEDIA.items()]
    for cp in (2, 4, 8):
        rng = np.random.default_rng(args.seed)
        mbs = microbatches(rng, cp, args.microbatches)
        ratio = {"thdpack": [], "first-token": [], "colocated": []}
        payload, embeds, ms = [], [], []
        for mb in mbs:
            q = 2 * cp
            lens = [len(s["input_ids"]) for s in mb]
            cu = np.concatenate([[0], np.cumsum(lens)])
            cup = np.concatenate([[0], np.cumsum([(n + q - 1) // q * q for n in lens])])
            items = [_t.media_items(specs, MERGE, s["input_ids"],
                                    [s["image_grid_thw"], s["video_grid_thw"]], None, "s")
                     for s in mb]
            flat = [(i, x) for i, xs in enumerate(items) for x in xs]
            if not flat:
                continue
            cost = np.asarray([_t.media_item_cost([x[2], x[3], x[4]]) for _, x in flat])
            total = cost.sum()
            r = _t.media_route(cu, cup, cp, 0, 1, 0, 0, items, None)
            work = np.bincount(r["encoder_rank"], weights=cost, minlength=cp)
            ratio["thdpack"].append(work.max() / (total / cp))
            # first-token: the CP rank holding each item's first token.
            owner = np.empty(int(cup[-1]), dtype=np.int64)
            for c in range(cp):
                owner[np.asarray(_t.cp_partition_indices(cup.astype(np.int32), cp, c))] = c
            first = np.asarray([owner[cup[i] + x[5]] for i, x in flat])
            work_f = np.bincount(first, weights=cost, minlength=cp)
            ratio["first-token"].append(work_f.max() / (total / cp))
            ratio["colocated"].append(float(cp))  # every rank does all of it
            t0 = time.perf_counter()
            per_rank = [media_microbatch(mb, MEDIA, cu, cup, cp, c, 1, 0, MERGE)
                        for c in range(cp)]
            ms.append((time.perf_counter() - t0) * 1e3 / cp)
            rows = [sum(int(m[n]["pixel_values"].shape[0]) for n in MEDIA) for m in per_rank]
            toks = [sum(int(m[n]["token_index"].shape[0]) for n in MEDIA) for m in per_rank]
            payload.append(max(rows) / max(1, sum(rows)))
            embeds.append(max(toks) / max(1, sum(toks)))
        for rule in ratio:
            p = f"{np.mean(payload):.3f}" if rule == "thdpack" else \
                ("1.000" if rule == "colocated" else "-")
            e = f"{np.mean(embeds):.3f}" if rule == "thdpack" else \
                ("1.000" if rule == "colocated" else "-")
            t = f"{np.mean(ms):.2f}" if rule == "thdpack" else "-"
            print(f"{cp:>3} {rule:>12} {np.mean(ratio[rule]):>14.3f} {p:>13} {e:>12} {t:>7}")
    print("work max/mean: the busiest CP rank's encoder work over the mean, averaged over "
          "microbatches; payload/rank, embeds/rank: the busiest rank's share of the microbatch's "
          "payload rows and image-embedding rows (1/CP is ideal); ms/mb: media_microbatch's wall "
          "time per rank and microbatch")
    if args.step:
        step_figures(args)
    if args.replicas:
        replica_figures(args)
    if args.encoders:
        encoder_rank_figures(args)


if __name__ == "__main__":
    main()
