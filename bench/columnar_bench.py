#!/usr/bin/env python3
"""Columnar sources (thdpack/arrow.h): read + pack throughput against Hugging Face's own path and
thdpack's JSONL and Megatron sources on the same tokens, the first step far into a large
dataset (O(1) seek), and the memory a run over a large Arrow file holds.

1. Throughput. --rows samples (default 100,000), their lengths the first ones of
   data/wikipedia_doc_lengths.txt capped at --max-len (default 1,024), random token ids with a
   loss mask, written once to --dir (default /tmp/thdpack-columnar-bench) as Parquet (row groups
   of 10,000), an Arrow IPC file, a saved Hugging Face dataset (datasets.save_to_disk), JSONL and
   a Megatron indexed dataset (no mask). Each is read and packed for --steps steps of
   --global-batch samples (default 256) on one rank (`_run_steps_on_threads`: open, read,
   schedule, pack, the step's arrays handed to Python), tokens/s over the whole run (median of
   3 runs), the files in the page cache and already opened. Hugging Face's path on the same rows: `load_from_disk`,
   then per step `ds[i:i + G]` and `DataCollatorWithFlattening` (packed input_ids, labels and
   position_ids, the padding-free batch TRL trains on).
2. Seek. An Arrow IPC file and a Parquet file of --seek-rows short samples (default 10,100,000,
   4-24 tokens): the wall time of the first step at sample 0 and at sample 10,000,000
   (`run_state_at`), the source already open in the process; of the first open (Parquet: its
   decode into the cache, emptied first, then the cached file mapped); and of an open in a
   fresh process once the cache holds it (what every other rank, job and resume pays).
3. Memory. After 200 steps over each large file: the process's anonymous resident memory
   (RssAnon) and its file-backed resident pages (RssFile), against the file's size; the cache
   (--dir/cache, THDPACK_CACHE) on disk. With --cli (a command line built with Arrow C++:
   build-arrow/thdpack) and --limit-mib N (default 256): `thdpack run` over every row of the
   large Parquet file in order, and 3 shuffled steps, inside a memory cgroup of N MiB (v1 or v2;
   skipped, saying why, where none can be made), with a cache of its own (it decodes the file first, so that the
   cache file's pages are its cgroup's): its exit code, its largest RssAnon (sampled every
   10 ms) and the cgroup's largest usage, page cache included.

A benchmark, not a test: it prints figures and never fails on a time.

Usage: PYTHONPATH=build-wheel/python .venv/bin/python bench/columnar_bench.py [--rows N] ...
"""
import argparse
import json
import os
import struct
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lengths_of(n, cap):
    path = os.path.join(os.environ.get("THDPACK_DATA_DIR", os.path.join(ROOT, "data")),
                        "wikipedia_doc_lengths.txt")
    with open(path) as f:
        out = [min(int(line), cap) for _, line in zip(range(n), f)]
    while len(out) < n:
        out += out[:n - len(out)]
    return np.array(out, np.int64)


def rss():
    """(RssAnon, RssFile) of this process in MiB."""
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon", "RssFile")):
                k, v = line.split(":")
                got[k] = int(v.split()[0]) / 1024
    return got.get("RssAnon", 0.0), got.get("RssFile", 0.0)


def columns(lengths, seed):
    rng = np.random.default_rng(seed)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = rng.integers(0, 32000, int(offsets[-1]), dtype=np.int32)
    mask = (rng.random(int(offsets[-1])) < 0.8).astype(np.uint8)
    return offsets, tokens, mask


def write_files(d, lengths):
    import pyarrow as pa
    import pyarrow.parquet as pq
    os.makedirs(d, exist_ok=True)
    offsets, tokens, mask = columns(lengths, 1)
    o32 = pa.array(offsets.astype(np.int32))
    table = pa.table({"input_ids": pa.ListArray.from_arrays(o32, pa.array(tokens)),
                      "loss_mask": pa.ListArray.from_arrays(o32, pa.array(mask))})
    specs = {}
    if not os.path.exists(f"{d}/data.parquet"):
        pq.write_table(table, f"{d}/data.parquet", row_group_size=10_000)
    specs["parquet"] = f"parquet:{d}/data.parquet"
    if not os.path.exists(f"{d}/data.arrow"):
        with pa.ipc.new_file(f"{d}/data.arrow", table.schema) as w:
            for b in table.to_batches(max_chunksize=10_000):
                w.write_batch(b)
    specs["arrow"] = f"arrow:{d}/data.arrow"
    if not os.path.exists(f"{d}/hf"):
        import datasets
        datasets.Dataset(table).save_to_disk(f"{d}/hf")
    specs["hf-saved (arrow:)"] = f"arrow:{d}/hf"
    if not os.path.exists(f"{d}/data.jsonl"):
        with open(f"{d}/data.jsonl", "w") as f:
            for i in range(len(lengths)):
                a, b = offsets[i], offsets[i + 1]
                f.write(json.dumps({"input_ids": tokens[a:b].tolist(),
                                    "loss_mask": mask[a:b].tolist()}) + "\n")
    specs["jsonl"] = f"jsonl:{d}/data.jsonl"
    if not os.path.exists(f"{d}/meg.idx"):
        with open(f"{d}/meg.bin", "wb") as f:
            f.write(tokens.tobytes())
        n = len(lengths)
        with open(f"{d}/meg.idx", "wb") as f:
            f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4))
            f.write(struct.pack("<Q", n) + struct.pack("<Q", n + 1))
            f.write(lengths.astype(np.int32).tobytes() + (offsets[:-1] * 4).tobytes())
            f.write(np.arange(n + 1, dtype=np.int64).tobytes())
    specs["megatron (no mask)"] = f"megatron:{d}/meg"
    return specs, int(offsets[-1])


def thdpack_run(spec, steps, args, state=None):
    from thdpack import _thdpack
    opts = dict(dp=1, global_batch=args.global_batch, max_tokens_per_rank=args.max_tokens,
                cost="llama2-7b")
    return _thdpack._run_steps_on_threads(opts, steps, spec, None, state)


def hf_run(d, steps, g):
    import datasets
    from transformers import DataCollatorWithFlattening
    collate = DataCollatorWithFlattening(return_tensors="pt")
    ds = datasets.load_from_disk(f"{d}/hf")
    tokens = 0
    for s in range(steps):
        rows = ds[s * g:(s + 1) * g]
        feats = [{"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, mask)]}
                 for ids, mask in zip(rows["input_ids"], rows["loss_mask"])]
        out = collate(feats)
        tokens += int(out["input_ids"].numel())
    return tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seek-rows", type=int, default=10_100_000)
    ap.add_argument("--dir", default="/tmp/thdpack-columnar-bench")
    ap.add_argument("--cli", default=None, help="a command line built with Arrow C++")
    ap.add_argument("--limit-mib", type=int, default=256)
    args = ap.parse_args()
    os.environ["THDPACK_CACHE"] = f"{args.dir}/cache"
    import thdpack  # noqa: F401 - sets the readers of parquet: and arrow:
    import pyarrow as pa
    import pyarrow.parquet as pq

    lengths = lengths_of(args.rows, args.max_len)
    specs, total = write_files(args.dir, lengths)
    steps = min(args.steps, args.rows // args.global_batch)
    step_tokens = int(lengths[:steps * args.global_batch].sum())
    print(f"{args.rows:,} rows, {total:,} tokens (mean {total / args.rows:.0f}); {steps} steps "
          f"of {args.global_batch} samples ({step_tokens:,} tokens), one rank, files cached\n")
    print("| path | tokens/s (M) | run (s) |\n|---|---|---|")
    rates = {}
    for name, spec in specs.items():
        thdpack_run(spec, 1, args)  # opened once (pyarrow reads the files), cached
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            thdpack_run(spec, steps, args)
            runs.append(time.perf_counter() - t0)
        dt = float(np.median(runs))
        rates[name] = step_tokens / dt
        print(f"| thdpack {name} | {rates[name] / 1e6:.1f} | {dt:.2f} |")
    hf_run(args.dir, 1, args.global_batch)
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        got = hf_run(args.dir, steps, args.global_batch)
        runs.append(time.perf_counter() - t0)
    dt = float(np.median(runs))
    assert got == step_tokens, (got, step_tokens)
    rates["hf"] = step_tokens / dt
    print(f"| Hugging Face: load_from_disk + ds[i:i+G] + DataCollatorWithFlattening | "
          f"{rates['hf'] / 1e6:.2f} | {dt:.2f} |")
    print(f"\nratio thdpack parquet / Hugging Face: {rates['parquet'] / rates['hf']:.1f}x; "
          f"arrow / Hugging Face: {rates['arrow'] / rates['hf']:.1f}x")

    # Seek: the first step at sample 0 and at 10,000,000 of a large file.
    rng = np.random.default_rng(2)
    big = rng.integers(4, 25, args.seek_rows)
    big_arrow, big_pq = f"{args.dir}/big.arrow", f"{args.dir}/big.parquet"
    if not os.path.exists(big_arrow) or not os.path.exists(big_pq):
        offsets, tokens, mask = columns(big, 3)
        o64 = pa.array(offsets)
        table = pa.table({"input_ids": pa.LargeListArray.from_arrays(o64, pa.array(tokens)),
                          "loss_mask": pa.LargeListArray.from_arrays(o64, pa.array(mask))})
        with pa.ipc.new_file(big_arrow, table.schema) as w:
            for b in table.to_batches(max_chunksize=100_000):
                w.write_batch(b)
        pq.write_table(table, big_pq, row_group_size=100_000)
        del table, offsets, tokens, mask
    size = os.path.getsize(big_arrow) / 2**20
    print(f"\nseek: {args.seek_rows:,} rows of 4-24 tokens; Arrow file {size:.0f} MiB, Parquet "
          f"{os.path.getsize(big_pq) / 2**20:.0f} MiB")
    print("| source | first open (s) | open, another process (s) | first step at 0 (ms) | "
          "first step at 10,000,000 (ms) |")
    print("|---|---|---|---|---|")
    import shutil
    import subprocess
    import sys
    import thdpack as tp
    target = 10_000_000
    shutil.rmtree(f"{args.dir}/cache/parquet", ignore_errors=True)
    memory = []
    for name, spec in (("arrow", f"arrow:{big_arrow}"), ("parquet", f"parquet:{big_pq}")):
        before, _ = rss()
        t0 = time.perf_counter()
        first = thdpack_run(spec, 1, args)
        opened = time.perf_counter() - t0
        code = ("import sys, time, thdpack; t0 = time.perf_counter(); "
                f"thdpack.read_lengths({spec!r}); print(time.perf_counter() - t0)")
        again = float(subprocess.run([sys.executable, "-c", code], check=True, text=True,
                                     capture_output=True).stdout)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            thdpack_run(spec, 1, args)
            t1 = time.perf_counter()
            far = tp.run_state_at(json.loads(first[0][0]["state"]), target // args.global_batch,
                                  target)
            t2 = time.perf_counter()
            thdpack_run(spec, 1, args, far)
            t3 = time.perf_counter()
            times.append((t1 - t0, t3 - t1))
        at0, atfar = np.median(np.array(times), 0) * 1e3
        print(f"| {name} | {opened:.2f} | {again:.2f} | {at0:.1f} | {atfar:.1f} |")
        # Memory: steps over the big file, on the rows already open.
        anon0, _ = rss()
        n = min(200, args.seek_rows // args.global_batch)
        thdpack_run(spec, n, args)
        anon, filed = rss()
        memory.append(f"{name}: RssAnon +{anon - before:.0f} MiB from before its open to after "
                      f"{n} steps (+{anon - anon0:.0f} over the steps); RssFile {filed:.0f} MiB")
    cached = sum(os.path.getsize(os.path.join(f"{args.dir}/cache/parquet", f))
                 for f in os.listdir(f"{args.dir}/cache/parquet"))
    print(f"\nmemory (one process, both large files open; Arrow file {size:.0f} MiB, Parquet "
          f"{os.path.getsize(big_pq) / 2**20:.0f} MiB decoded to {cached / 2**20:.0f} MiB in the "
          f"cache):")
    for line in memory:
        print(f"  {line}")
    if args.cli:
        batch = 65536
        whole = -(-args.seek_rows // batch)
        for shuffle, steps in ((False, whole), (True, 3)):
            got = limited_run(args.cli, f"parquet:{big_pq}", args.limit_mib, steps, batch,
                              f"{args.dir}/cache-limited", shuffle)
            what = (f"{'3 shuffled steps' if shuffle else f'all {args.seek_rows:,} rows in order'} "
                    f"({steps} steps of {batch:,})")
            if isinstance(got, str):
                print(f"\nlimited memory: skipped: {got}")
                break
            rc, anon, usage, seconds, err = got
            print(f"\nlimited memory: `thdpack run` over the Parquet file, {what}, decoding it "
                  f"into a cache of its own first, in a memory cgroup of {args.limit_mib} MiB "
                  f"(the decoded file {cached / 2**20:.0f} MiB): exit {rc}, RssAnon at most "
                  f"{anon} MiB, the cgroup's usage (page cache included) at most {usage} MiB, "
                  f"{seconds:.1f} s{(': ' + err.strip()[-300:]) if rc else ''}")


def limited_run(cli, spec, limit_mib, steps, batch, cache, shuffle):
    """`cli run` over `spec` in a memory cgroup of limit_mib, with a cache folder of its own
    (emptied first: it decodes the Parquet file itself, so that every page of the cache file is
    its cgroup's, not this process's): (rc, peak RssAnon MiB, peak cgroup usage MiB, seconds,
    stderr), or a string saying why it could not run."""
    import shutil
    import subprocess
    shutil.rmtree(cache, ignore_errors=True)
    name = f"thdpack-bench-{os.getpid()}"
    v1 = "/sys/fs/cgroup/memory"
    if os.path.isdir(v1):
        group, limit_file, procs = f"{v1}/{name}", "memory.limit_in_bytes", "cgroup.procs"
        peak_file = "memory.max_usage_in_bytes"
    elif os.path.exists("/sys/fs/cgroup/cgroup.subtree_control"):
        group, limit_file, procs, peak_file = f"/sys/fs/cgroup/{name}", "memory.max", \
            "cgroup.procs", "memory.peak"
    else:
        return "no memory cgroup on this machine"
    try:
        os.mkdir(group)
        with open(f"{group}/{limit_file}", "w") as f:
            f.write(str(limit_mib << 20))
    except OSError as e:
        return f"cannot make a memory cgroup ({e})"
    try:
        args = [cli, "run", "--data", spec, "--dp", "2", "--cp", "1", "--global-batch",
                str(batch), "--max-tokens-per-rank", "65536", "--steps", str(steps)]
        if shuffle:
            args.append("--shuffle")
        t0 = time.perf_counter()
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env=dict(os.environ, THDPACK_CACHE=cache),
                             preexec_fn=lambda: open(f"{group}/{procs}", "w").write(
                                 str(os.getpid())))
        peak = 0
        while p.poll() is None:
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    for line in f:
                        if line.startswith("RssAnon:"):
                            peak = max(peak, int(line.split()[1]) // 1024)
            except OSError:
                pass
            time.sleep(0.01)
        seconds = time.perf_counter() - t0
        err = p.stderr.read().decode()
        with open(f"{group}/{peak_file}") as f:
            usage = int(f.read()) >> 20
        return p.returncode, peak, usage, seconds, err
    finally:
        os.rmdir(group)
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
