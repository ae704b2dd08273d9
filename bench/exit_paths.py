#!/usr/bin/env python3
"""How often each way of leaving a prefetching PackedDataIterator ends a rank with a status
other than 0 (python/tests/test_exit_paths.py's paths, each rank an interpreter of its own).

  PYTHONPATH=build/python /usr/bin/python3 bench/exit_paths.py --runs 200 --world 4 \
      [--paths break_destroy,break_return] [--load 2]
  (pack_batch once, then the end: --paths batch_return,batch_destroy)

--load N keeps N busy-looping processes beside the worlds (the CPU loaded, as a CI machine is).
Prints, per path, the runs, the failed runs and the statuses seen.
"""
import argparse
import collections
import multiprocessing
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python",
                                "tests"))
import test_exit_paths as paths  # noqa: E402


def spin():
    while True:
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--world", type=int, default=4, choices=(2, 4, 6, 8))
    ap.add_argument("--paths", default=",".join(paths.PATHS))
    ap.add_argument("--load", type=int, default=0)
    args = ap.parse_args()
    load = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.load)]
    for p in load:
        p.start()
    with tempfile.TemporaryDirectory() as d:
        data = os.path.join(d, "samples.jsonl")
        paths.write_samples(data)
        print(f"| path | world | runs | failed runs | statuses | seconds a run |")
        print(f"|---|---|---|---|---|---|")
        for path in args.paths.split(","):
            failed, statuses = 0, collections.Counter()
            t0 = time.perf_counter()
            for _ in range(args.runs):
                codes = [code for code, _ in paths.run_world(path, args.world, data)]
                statuses.update(codes)
                failed += any(c != 0 for c in codes)
            seconds = (time.perf_counter() - t0) / args.runs
            print(f"| {path} | {args.world} | {args.runs} | {failed} | "
                  f"{dict(sorted(statuses.items()))} | {seconds:.1f} |", flush=True)
    for p in load:
        p.terminate()


if __name__ == "__main__":
    main()
