"""thdpack.schedule against a plain Python heap LPT (longest cost first onto the least loaded
replica), on the first 16,384 WLB-LLM document lengths, 64 replicas, one microbatch (the budget
holds every sample), llama2-7b cost, CP = 1.

Prints, for each, the best of several runs (time, largest replica cost) and the two ratios
measured in this run: time (Python / thdpack, goal >= 10) and largest replica cost
(thdpack / Python, goal <= 1). Plan.figures is a dictionary built when first read, so the
time of a call that also reads it is printed too. A benchmark, not a test: it never fails on a
time.

Usage: PYTHONPATH=BUILD/python /usr/bin/python3 bench/schedule_vs_python.py [DATA_DIR]
(DATA_DIR defaults to $THDPACK_DATA_DIR, else the repository's data/.)
"""
import heapq
import os
import sys
import time

import numpy as np
import thdpack

N = 16384
DP = 64
REPEATS = 15


def data_dir():
    if len(sys.argv) > 1:
        return sys.argv[1]
    here = os.path.dirname(os.path.abspath(__file__))
    return os.environ.get("THDPACK_DATA_DIR", os.path.join(here, "..", "data"))


def python_lpt(costs, dp):
    """Heap LPT: costs longest first, each onto the least loaded replica (ties: lowest index)."""
    order = sorted(range(len(costs)), key=lambda i: -costs[i])
    heap = [(0.0, r) for r in range(dp)]
    assignment = [0] * len(costs)
    for i in order:
        load, r = heapq.heappop(heap)
        assignment[i] = r
        heapq.heappush(heap, (load + costs[i], r))
    return max(load for load, _ in heap), assignment


def best_of(fn):
    best, result = float("inf"), None
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def main():
    path = os.path.join(data_dir(), "wlbllm_doc_lengths.txt")
    lengths = np.loadtxt(path, dtype=np.int64, max_rows=N)
    model = thdpack.cost_model("llama2-7b")
    costs = [model["a"] * float(x) + model["b"] * float(x) * float(x) for x in lengths]
    budget = int(lengths.sum())  # one microbatch holds every sample of a replica

    py_time, (py_max, _) = best_of(lambda: python_lpt(costs, DP))
    def schedule():
        return thdpack.schedule(lengths, dp_size=DP, max_tokens_per_rank=budget, cost="llama2-7b")

    th_time, plan = best_of(schedule)
    th_fig_time, _ = best_of(lambda: schedule().figures)
    figures = plan.figures
    assert plan.num_microbatches == 1, plan
    th_max = figures["max_replica_cost"]
    print(f"schedule {N} WLB-LLM lengths onto DP={DP}, one microbatch, llama2-7b cost "
          f"(best of {REPEATS})")
    print(f"{'what':<26} {'time ms':>10} {'max replica cost':>18} {'imbalance':>10}")
    lower_bound = figures["lower_bound"]
    print(f"{'python heapq LPT':<26} {1e3 * py_time:>10.3f} {py_max:>18.6e} "
          f"{py_max / lower_bound:>10.6f}")
    print(f"{'thdpack.schedule balanced':<26} {1e3 * th_time:>10.3f} {th_max:>18.6e} "
          f"{figures['imbalance']:>10.6f}")
    print(f"{'  ... and reading .figures':<26} {1e3 * th_fig_time:>10.3f}")
    print(f"time ratio (python / thdpack): {py_time / th_time:.1f}x   (goal >= 10); "
          f"with .figures read: {py_time / th_fig_time:.1f}x")
    print(f"max replica cost ratio (thdpack / python): {th_max / py_max:.6f}   (goal <= 1)")


if __name__ == "__main__":
    main()
