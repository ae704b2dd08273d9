"""thdpack.schedule against a plain Python heap LPT (longest cost first onto the least loaded
replica), on the first 16,384 WLB-LLM document lengths, 64 replicas, one microbatch (the budget
holds every sample), llama2-7b cost, CP = 1.

Prints, for each, the best of several runs taken in turns (wall and CPU time of the calling
thread, largest replica cost) and the two ratios measured in this run: time (Python /
thdpack, goal >= 10) and largest replica cost (thdpack / Python, goal <= 1). Plan.figures is a dictionary built when first read, so the
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
REPEATS = 31


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


def best_of_interleaved(fns):
    """Each fn REPEATS times, the fns taking turns (so a noisy spell of a shared machine hits
    all of them alike); per fn the least wall time and the least CPU time of this thread (the
    scheduler runs on the calling thread), and its last result."""
    wall = [float("inf")] * len(fns)
    cpu = [float("inf")] * len(fns)
    results = [None] * len(fns)
    for _ in range(REPEATS):
        for k, fn in enumerate(fns):
            w0, c0 = time.perf_counter(), time.thread_time()
            results[k] = fn()
            c1, w1 = time.thread_time(), time.perf_counter()
            wall[k] = min(wall[k], w1 - w0)
            cpu[k] = min(cpu[k], c1 - c0)
    return wall, cpu, results


def main():
    path = os.path.join(data_dir(), "wlbllm_doc_lengths.txt")
    lengths = np.loadtxt(path, dtype=np.int64, max_rows=N)
    model = thdpack.cost_model("llama2-7b")
    costs = [model["a"] * float(x) + model["b"] * float(x) * float(x) for x in lengths]
    budget = int(lengths.sum())  # one microbatch holds every sample of a replica

    def schedule():
        return thdpack.schedule(lengths, dp_size=DP, max_tokens_per_rank=budget, cost="llama2-7b")

    wall, cpu, results = best_of_interleaved(
        [lambda: python_lpt(costs, DP), schedule, lambda: (schedule().figures, None)[1]])
    py_max = results[0][0]
    plan = results[1]
    figures = plan.figures
    assert plan.num_microbatches == 1, plan
    th_max = figures["max_replica_cost"]
    print(f"schedule {N} WLB-LLM lengths onto DP={DP}, one microbatch, llama2-7b cost "
          f"(best of {REPEATS}, the three taking turns)")
    print(f"{'what':<28} {'wall ms':>9} {'CPU ms':>9} {'max replica cost':>18} {'imbalance':>10}")
    lower_bound = figures["lower_bound"]
    print(f"{'python heapq LPT':<28} {1e3 * wall[0]:>9.3f} {1e3 * cpu[0]:>9.3f} {py_max:>18.6e} "
          f"{py_max / lower_bound:>10.6f}")
    print(f"{'thdpack.schedule balanced':<28} {1e3 * wall[1]:>9.3f} {1e3 * cpu[1]:>9.3f} "
          f"{th_max:>18.6e} {figures['imbalance']:>10.6f}")
    print(f"{'  ... and reading .figures':<28} {1e3 * wall[2]:>9.3f} {1e3 * cpu[2]:>9.3f}")
    print(f"time ratio (python / thdpack): wall {wall[0] / wall[1]:.1f}x, CPU "
          f"{cpu[0] / cpu[1]:.1f}x   (goal >= 10); with .figures read: wall "
          f"{wall[0] / wall[2]:.1f}x, CPU {cpu[0] / cpu[2]:.1f}x")
    print(f"max replica cost ratio (thdpack / python): {th_max / py_max:.6f}   (goal <= 1)")


if __name__ == "__main__":
    main()
