#!/usr/bin/env python3
"""The command line on columnar files (thdpack/arrow.h), as a user runs it: built with pyarrow's
Arrow C++ (cmake/arrow_cli.cmake), and without (the plain build's refusal). Run by make test's
current-stack part (scripts/test_current_stack.sh), whose interpreter has pyarrow.

Usage: cli_columnar_test.py THDPACK_ARROW THDPACK_PLAIN WORK_DIR [MPIRUN...]

- plan --json over Parquet (two files, row groups of 37), an Arrow IPC file, a folder of Arrow
  IPC streams (a saved dataset's layout) and Parquet with Hugging Face labels prints the steps
  of JSONL of the same tokens, field for field, at DP 2 x CP 2 and TP 2 x PP 2; shuffled (which
  JSONL cannot), the same steps from each;
- run --verify on Parquet checks every microbatch against one rank reading the samples alone;
- under MPI (4 ranks decoding the same Parquet at once): the steps of the thread run, one
  file decoded into the cache;
- run --save-state over Parquet, killed with SIGKILL at random moments and restarted with
  --resume on another topology until done: the steps of an uninterrupted run, every sample of
  every epoch once;
- errors: a file without input_ids named (exit 2); the plain build refuses the spec by name.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import cli_steps
from cli_steps import fail, figures, ids, run, seeded, steps_of

THDPACK, PLAIN, WORK = sys.argv[1:4]
MPIRUN = sys.argv[4:]
shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)
rng = seeded("cli_columnar_test")


# 3,000 samples of 1-600 tokens with a loss mask, in every format.
N = 3000
g = np.random.default_rng(cli_steps.SEED)
rows = []
for _ in range(N):
    n = int(g.integers(1, 600))
    rows.append((g.integers(0, 32000, n).tolist(), g.integers(0, 2, n).tolist()))
with open(f"{WORK}/d.jsonl", "w") as f:
    for t, m in rows:
        f.write(json.dumps({"input_ids": t, "loss_mask": m}) + "\n")
table = pa.table({"input_ids": pa.array([t for t, _ in rows], pa.list_(pa.int32())),
                  "loss_mask": pa.array([[bool(v) for v in m] for _, m in rows],
                                        pa.list_(pa.bool_())),
                  "text": pa.array([str(k) for k in range(N)])})
os.makedirs(f"{WORK}/pq", exist_ok=True)
pq.write_table(table.slice(0, 1200), f"{WORK}/pq/a.parquet", row_group_size=37)
pq.write_table(table.slice(1200), f"{WORK}/pq/b.parquet", row_group_size=37)
with pa.ipc.new_file(f"{WORK}/d.arrow", table.schema) as w:
    for b in table.to_batches(max_chunksize=500):
        w.write_batch(b)
os.makedirs(f"{WORK}/saved", exist_ok=True)
for k, (lo, hi) in enumerate([(0, 1000), (1000, 3000)]):
    with pa.ipc.new_stream(f"{WORK}/saved/data-{k:05d}-of-00002.arrow", table.schema) as w:
        for b in table.slice(lo, hi - lo).to_batches(max_chunksize=300):
            w.write_batch(b)
labels = pa.array([[t if v else -100 for t, v in zip(ts, m)] for ts, m in rows],
                  pa.list_(pa.int64()))
pq.write_table(pa.table({"input_ids": table["input_ids"], "labels": labels}),
               f"{WORK}/labels.parquet", row_group_size=500)
SPECS = {"parquet": f"parquet:{WORK}/pq", "arrow": f"arrow:{WORK}/d.arrow",
         "saved": f"arrow:{WORK}/saved", "labels": f"parquet:{WORK}/labels.parquet"}
os.environ["THDPACK_CACHE"] = f"{WORK}/cache"

COMMON = ["--shuffle", "--seed", "7", "--global-batch", "128", "--max-tokens-per-rank", "8192",
          "--vocab", "32000", "--json"]
TOPOLOGIES = {"A": ["--dp", "2", "--cp", "2"],
              "B": ["--dp", "1", "--tp", "2", "--sp", "--pp", "2"],
              "C": ["--dp", "4", "--cp", "1", "--scheduler", "sequential"]}

# --- plan: the steps of JSONL (in order; JSONL streams), and shuffled alike -----------------
ORDERED = [a for a in COMMON if a not in ("--shuffle",)]
for t in ("A", "B"):
    want = json.loads(run([THDPACK, "plan", "--data", f"jsonl:{WORK}/d.jsonl", *ORDERED,
                           *TOPOLOGIES[t], "--steps", "30"]).stdout)["steps"]
    if len(want) != 30 or not want[0]["replicas"]:
        fail(f"plan of JSONL on {t}: {len(want)} steps")
    shuffled = None
    for name, spec in SPECS.items():
        got = json.loads(run([THDPACK, "plan", "--data", spec, *ORDERED, *TOPOLOGIES[t],
                              "--steps", "30"]).stdout)["steps"]
        if got != want:
            fail(f"plan of {name} ({spec}) on {t} differs from JSONL's")
        got = json.loads(run([THDPACK, "plan", "--data", spec, *COMMON, *TOPOLOGIES[t],
                              "--steps", "30"]).stdout)["steps"]
        shuffled = shuffled or got
        # Ids are stream positions: a shuffle shows in what the steps hold (their tokens).
        if got != shuffled or [s["real_tokens"] for s in got] == [s["real_tokens"]
                                                                   for s in want]:
            fail(f"shuffled plan of {name} ({spec}) on {t}: not that of the other formats")
print("cli_columnar_test: plan of Parquet, Arrow, a saved folder and labels = JSONL", flush=True)

# --- run --verify ----------------------------------------------------------------------------
run([THDPACK, "run", "--data", SPECS["parquet"], "--shuffle", "--seed", "7", "--global-batch",
     "16", "--max-tokens-per-rank", "4096", "--dp", "2", "--cp", "2", "--steps", "3",
     "--verify"])

# --- MPI: four ranks decode the same file at once ------------------------------------------
reference = steps_of(run([THDPACK, "run", "--data", SPECS["parquet"], *COMMON,
                          *TOPOLOGIES["C"], "--steps", "60"]).stdout)
if MPIRUN:
    env = dict(os.environ, THDPACK_CACHE=f"{WORK}/cache-mpi")
    got = steps_of(run([*MPIRUN, "-np", "4", THDPACK, "run", "--backend", "mpi", "--data",
                        SPECS["parquet"], *COMMON, *TOPOLOGIES["C"], "--steps", "4"],
                       env=env).stdout)
    if [figures(s) for s in got] != [figures(s) for s in reference[:4]]:
        fail("run --backend mpi on Parquet differs from the thread run")
    cached = sorted(os.listdir(f"{WORK}/cache-mpi/parquet"))
    if [c for c in cached if c.endswith(".arrow")] != sorted(
            c for c in cached if c.endswith(".arrow") and c.startswith(("a-", "b-"))) or \
            len([c for c in cached if c.endswith(".arrow")]) != 2 or \
            any(c.endswith(".tmp") for c in cached):
        fail(f"the MPI run's cache: {cached} (expected one decoded file per Parquet file)")
    print("cli_columnar_test: MPI on Parquet = threads; one decode per file", flush=True)

# --- kill and resume -------------------------------------------------------------------------
STEPS = 60  # 7,680 samples: 2.6 epochs of 3,000
state = f"{WORK}/state.json"
printed, committed, attempt, topology, kills = {}, 0, 0, "C", 0
while committed < STEPS:
    args = [THDPACK, "run", "--data", SPECS["parquet"], *COMMON, *TOPOLOGIES[topology],
            "--steps", str(STEPS - committed), "--save-state", state]
    if committed:
        args += ["--resume", state]
    out_path = f"{WORK}/out{attempt}.txt"
    with open(out_path, "w") as out:
        p = subprocess.Popen(args, stdout=out, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        killed = False
        if attempt < 3 and STEPS - committed > 1:
            # Killed once it has printed a random number of steps (fewer than it runs), then
            # a random moment later: between steps or inside one, never after its end.
            target = rng.randrange(STEPS - committed - 1)
            while p.poll() is None:
                with open(out_path) as f:
                    if sum(1 for line in f if line.startswith("{")) >= target:
                        break
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, 0.002))
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                killed = True
                kills += 1
        _, err = p.communicate(timeout=300)
    if not killed and p.returncode != 0:
        fail(f"{' '.join(args)} exited {p.returncode}:\n{err}")
    for line in open(f"{WORK}/out{attempt}.txt").read().splitlines():
        try:
            step = json.loads(line)
        except json.JSONDecodeError:
            continue
        printed[step["step"]] = (topology, step)
    if os.path.exists(state):
        committed = json.load(open(state))["next_step"]
    print(f"cli_columnar_test: attempt {attempt} on {topology}: "
          f"{'killed' if killed else 'done'}, committed {committed}", flush=True)
    attempt += 1
    topology = rng.choice(["A", "C"])
if kills == 0:
    fail("no run was killed: every attempt ended before its kill")
if sorted(printed) != list(range(STEPS)):
    fail(f"steps printed over the attempts: {sorted(printed)}")
full = {"C": reference, "A": steps_of(run([THDPACK, "run", "--data", SPECS["parquet"], *COMMON,
                                          *TOPOLOGIES["A"], "--steps", str(STEPS)]).stdout)}
trained = []
for s in range(STEPS):
    t, step = printed[s]
    if figures(step) != figures(full[t][s]):
        fail(f"step {s} on {t} after a resume differs from the uninterrupted run")
    if [x["real_tokens"] for x in (step, full["A"][s], full["C"][s])].count(
            step["real_tokens"]) != 3:
        fail(f"step {s}: the topologies' uninterrupted runs hold other tokens")
    trained += ids(step)
# Samples are stream positions: every epoch's each once, in the steps the states committed.
if sorted(trained) != list(range(STEPS * 128)):
    fail("the samples over the steps are not the stream, each once")

# --- errors ----------------------------------------------------------------------------------
pq.write_table(pa.table({"tokens": pa.array([[1, 2]])}), f"{WORK}/no_ids.parquet")
p = run([THDPACK, "plan", "--data", f"parquet:{WORK}/no_ids.parquet"], check=False)
if p.returncode != 2 or "no_ids.parquet: no column 'input_ids' (the columns: 'tokens')" \
        not in p.stderr:
    fail(f"a file without input_ids: exit {p.returncode}, {p.stderr}")
p = run([PLAIN, "plan", "--data", SPECS["parquet"]], check=False)
if p.returncode != 2 or "which this program was built without" not in p.stderr:
    fail(f"the plain build on Parquet: exit {p.returncode}, {p.stderr}")
print(f"cli_columnar_test: passed ({attempt} attempts, {kills} killed)", flush=True)
