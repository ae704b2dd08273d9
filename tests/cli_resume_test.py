#!/usr/bin/env python3
"""`thdpack plan` and `thdpack run` resumed, as a user runs them (ctest cli.resume).

Usage: cli_resume_test.py THDPACK WORK_DIR [MPIRUN...]

- plan and run with --start-step K print, field for field (timings aside), the steps K.. of a
  run from 0;
- run --save-state is killed with SIGKILL at random moments (mid-step included) while it runs a
  long shuffled run, and restarted from its state file, on the same topology and on others
  (another world size and scheduler, threads and MPI), over and over until the run is done; the
  steps printed after each restart are those of an uninterrupted run (same topology: the whole
  step object; another: the same samples), every step of the run is covered, and every sample of
  every epoch is trained exactly once over the steps the states committed;
- run --verify after a resume on another topology still equals one rank (the verifier checks
  every step against its own plain reading of the source, 1e-9);
- a state that does not fit (another seed, an edited file) is refused with a clear error;
- run --prefetch K (also in half of the killed attempts above) prints the steps of K = 0 on
  threads and MPI, static and dynamic, with --verify; a source that fails in step 2 fails there
  (steps 0 and 1 printed, the same error), however far ahead the data plane runs.
"""
import json
import os
import signal
import subprocess
import sys
import time

from cli_steps import fail, figures, ids, run, seeded, steps_of

THDPACK = sys.argv[1]
WORK = sys.argv[2]
MPIRUN = sys.argv[3:]
os.makedirs(WORK, exist_ok=True)

rng = seeded("cli_resume_test")

# A shuffled mock of 20,000 samples an epoch, 2,048 a step: epochs end mid-step, and a step
# takes tens of milliseconds, so a kill lands inside the run.
BATCH = 2048
COMMON = ["--data", "mock", "--shuffle", "--seed", "99", "--mock-samples", "20000",
          "--global-batch", str(BATCH), "--max-tokens-per-rank", "16384", "--json"]
TOPOLOGIES = {
    "A": ["--dp", "2", "--cp", "2"],
    "B": ["--dp", "4", "--cp", "1", "--scheduler", "sequential"],
    "C": ["--dp", "1", "--cp", "2", "--tp", "2", "--sp", "--scheduler", "dynamic"],
    "D": ["--dp", "3", "--cp", "1", "--pp", "2", "--data-on", "all"],
}
WORLD = {"A": 4, "B": 4, "C": 4, "D": 6}
STEPS = 24

# --- plan and run with --start-step: the steps K.. of a run from 0, field for field ----------
plan_all = json.loads(run([THDPACK, "plan", *COMMON, *TOPOLOGIES["A"], "--steps", "8"]).stdout)
plan_from = json.loads(run([THDPACK, "plan", *COMMON, *TOPOLOGIES["A"], "--steps", "3",
                            "--start-step", "5"]).stdout)
if plan_from["steps"] != plan_all["steps"][5:]:
    fail("plan --start-step 5 differs from steps 5.. of plan")
reference = {}
step_seconds = {}  # a step's wall time per topology: where to aim a kill
for t in TOPOLOGIES:
    t0 = time.time()
    reference[t] = steps_of(run([THDPACK, "run", *COMMON, *TOPOLOGIES[t], "--steps",
                                 str(STEPS)]).stdout)
    step_seconds[t] = (time.time() - t0) / STEPS
for t, steps in reference.items():
    if [s["step"] for s in steps] != list(range(STEPS)):
        fail(f"topology {t}: the reference run printed steps {[s['step'] for s in steps]}")
    if [ids(s) for s in steps] != [ids(s) for s in reference["A"]]:
        fail(f"topology {t}: other samples than topology A in some step (the elastic rule)")
tail = steps_of(run([THDPACK, "run", *COMMON, *TOPOLOGIES["A"], "--steps", "4",
                     "--start-step", "9"]).stdout)
if [figures(s) for s in tail] != [figures(s) for s in reference["A"][9:13]]:
    fail("run --start-step 9 differs from steps 9.. of the run from 0")
if MPIRUN:
    mpi_tail = steps_of(run([*MPIRUN, "-np", "4", THDPACK, "run", "--backend", "mpi", *COMMON,
                             *TOPOLOGIES["B"], "--steps", "3", "--start-step", "20"]).stdout)
    if [figures(s) for s in mpi_tail] != [figures(s) for s in reference["B"][20:23]]:
        fail("run --backend mpi --start-step 20 differs from steps 20.. of the run from 0")

# --- kill and resume ------------------------------------------------------------------------
state_file = os.path.join(WORK, "state.json")
if os.path.exists(state_file):
    os.remove(state_file)
printed = {}  # step -> (topology, step object), the last run that printed it wins
committed = 0  # next_step of the state file
restarts = 0
topology = "A"
while committed < STEPS:
    # Every third attempt runs a few steps under MPI to the end (an MPI job is not killed
    # here: its launcher's processes would outlive the signal); the others run on threads and
    # are killed.
    mpi = bool(MPIRUN) and restarts % 3 == 2
    steps = min(3, STEPS - committed) if mpi else STEPS - committed
    args = [THDPACK, "run", *COMMON, *TOPOLOGIES[topology], "--steps", str(steps),
            "--save-state", state_file]
    if committed > 0:
        args += ["--resume", state_file]
    if rng.random() < 0.5:
        # The data plane ahead of the loop: the state saved is still the loop's, so a kill
        # loses the prefetched steps and the restart makes them again.
        args += ["--prefetch", str(rng.choice([1, 2, 3]))]
    backend = "threads"
    if mpi:
        backend = "mpi"
        args = [*MPIRUN, "-np", str(WORLD[topology]), args[0], "run", "--backend", "mpi",
                *args[2:]]
    out_path = os.path.join(WORK, f"out{restarts}.txt")
    with open(out_path, "w") as out:
        p = subprocess.Popen(args, stdout=out, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        # Kill at a random moment: before a first step, mid-step or between steps; the last
        # attempts run to the end.
        killed = False
        if restarts < 6 and not mpi:
            # Somewhere in the first 80% of what is left (the start-up included).
            time.sleep(rng.uniform(0.0, 0.8 * step_seconds[topology] * (STEPS - committed)))
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the whole job: mpirun and its ranks
                killed = True
        _, err = p.communicate(timeout=300)
    if not killed and p.returncode != 0:
        fail(f"{' '.join(args)} exited {p.returncode}:\n{err}")
    with open(out_path) as f:
        lines = f.read().splitlines()
    # A line cut by the kill is not a step; every whole one is.
    for line in lines:
        try:
            step = json.loads(line)
        except json.JSONDecodeError:
            continue
        printed[step["step"]] = (topology, step)
    if os.path.exists(state_file):
        with open(state_file) as f:
            state = json.load(f)  # always whole: written atomically
        if state["next_step"] < committed:
            fail(f"the state went back from step {committed} to {state['next_step']}")
        committed = state["next_step"]
    print(f"cli_resume_test: attempt {restarts} on {topology} ({backend}): "
          f"{'killed' if killed else 'done'}, committed {committed}", flush=True)
    restarts += 1
    topology = rng.choice(sorted(TOPOLOGIES))

if sorted(printed) != list(range(STEPS)):
    fail(f"steps printed over the attempts: {sorted(printed)}")
trained = []
for s in range(STEPS):
    t, step = printed[s]
    if figures(step) != figures(reference[t][s]):
        diff = sorted(k for k in set(step) | set(reference[t][s])
                      if step.get(k) != reference[t][s].get(k))
        fail(f"step {s} on topology {t} after a resume differs from the uninterrupted run in "
             f"{diff}")
    trained += ids(step)
# Every sample of every epoch exactly once: ids are stream positions (the mock has no empty
# documents), so the steps hold positions 0 .. STEPS * BATCH - 1 once each.
if sorted(trained) != list(range(STEPS * BATCH)):
    fail("the samples over the steps are not the stream, each once")

# --- --verify after a resume on another topology ---------------------------------------------
# Short samples (the probe model is quadratic in the length): 64 a step, 300 an epoch.
short = os.path.join(WORK, "short.json")
with open(short, "w") as f:
    json.dump({"mode": "distribution", "type": "lognormal", "min_seq_len": 8,
               "max_seq_len": 256, "mean_seq_len": 64, "lognormal_sigma": 1.0}, f)
SMALL = ["--data", "mock:" + short, "--shuffle", "--seed", "99", "--mock-samples", "300",
         "--global-batch", "64", "--max-tokens-per-rank", "4096", "--json"]
mid = os.path.join(WORK, "mid.json")
run([THDPACK, "run", *SMALL, *TOPOLOGIES["A"], "--steps", "5", "--save-state", mid])
verified = steps_of(run([THDPACK, "run", *SMALL, *TOPOLOGIES["C"], "--steps", "3", "--resume",
                         mid, "--verify"]).stdout)
if [s["step"] for s in verified] != [5, 6, 7] or any("loss" not in s for s in verified):
    fail("run --verify after --resume did not verify steps 5 to 7")
if MPIRUN:
    run([*MPIRUN, "-np", "6", THDPACK, "run", "--backend", "mpi", *SMALL, *TOPOLOGIES["D"],
         "--steps", "2", "--resume", mid, "--verify"])

# --- states that do not fit ------------------------------------------------------------------
p = run([THDPACK, "run", *SMALL[:3], "--seed", "98", *SMALL[5:], *TOPOLOGIES["A"], "--steps",
         "1", "--resume", mid], check=False)
if p.returncode != 2 or "seed 99, this run has seed 98" not in p.stderr:
    fail(f"a state of another seed: exit {p.returncode}, {p.stderr}")
with open(mid) as f:
    text = f.read()
edited = os.path.join(WORK, "edited.json")
with open(edited, "w") as f:
    f.write(text.replace('"consumed":320', '"consumed":321'))
p = run([THDPACK, "plan", *SMALL, "--steps", "1", "--resume", edited], check=False)
if p.returncode != 2 or "checksum" not in p.stderr:
    fail(f"an edited state: exit {p.returncode}, {p.stderr}")
p = run([THDPACK, "plan", *SMALL, "--steps", "1", "--resume", mid, "--start-step", "3"],
        check=False)
if p.returncode != 2 or "--start-step" not in p.stderr:
    fail(f"--resume with --start-step: exit {p.returncode}, {p.stderr}")
# --- a blend of three kinds: plan, run --verify on several topologies, resume ---------------
lengths = os.path.join(WORK, "lengths.txt")
with open(lengths, "w") as f:
    f.write("\n".join(str(5 + (i * 37) % 200) for i in range(23)) + "\n")
jsonl = os.path.join(WORK, "code.jsonl")
with open(jsonl, "w") as f:
    for i in range(17):
        f.write(json.dumps({"input_ids": [(i * 7 + k) % 300 for k in range(3 + (i * 13) % 90)],
                            "loss_mask": [0] * 2 + [1] * (1 + (i * 13) % 90)}) + "\n")
mix = os.path.join(WORK, "mix.json")
with open(mix, "w") as f:
    json.dump({"sources": [{"data": "mock:" + short, "weight": 5},
                           {"data": "jsonl:" + jsonl, "weight": 3},
                           {"data": "lengths:" + lengths, "weight": 2, "shuffle": True}]}, f)
BLEND = ["--data", "blend:" + mix, "--global-batch", "48", "--max-tokens-per-rank", "4096",
         "--vocab", "300", "--json"]
planned = json.loads(run([THDPACK, "plan", *BLEND, *TOPOLOGIES["A"], "--steps", "4"]).stdout)
for step in planned["steps"]:
    src = step["sources"]
    if len(src) != 3 or sum(x["samples"] for x in src) != step["n_samples"] or \
            sum(x["real_tokens"] for x in src) != step["real_tokens"] or \
            sum(x["loss_tokens"] for x in src) != step["n_loss_tokens"]:
        fail(f"blend step {step['step']}: per-source figures do not add up: {src}")
for t in ("A", "C", "D"):
    steps = steps_of(run([THDPACK, "run", *BLEND, *TOPOLOGIES[t], "--steps", "4",
                          "--verify"]).stdout)
    if [ids(s) for s in steps] != [ids(s) for s in planned["steps"]] or \
            [s["sources"] for s in steps] != [s["sources"] for s in planned["steps"]]:
        fail(f"blend on topology {t}: other samples or sources than plan's")
blend_state = os.path.join(WORK, "blend_state.json")
run([THDPACK, "run", *BLEND, *TOPOLOGIES["A"], "--steps", "2", "--save-state", blend_state])
resumed = steps_of(run([THDPACK, "run", *BLEND, *TOPOLOGIES["B"], "--steps", "2", "--resume",
                        blend_state]).stdout)
if [ids(s) for s in resumed] != [ids(s) for s in planned["steps"][2:4]]:
    fail("a blend resumed on another topology: other samples")
with open(mix) as f:
    heavier = json.load(f)
heavier["sources"][1]["weight"] = 4
with open(mix, "w") as f:
    json.dump(heavier, f)
p = run([THDPACK, "run", *BLEND, *TOPOLOGIES["A"], "--steps", "1", "--resume", blend_state],
        check=False)
if p.returncode != 2 or "blend source" not in p.stderr or "weight 3" not in p.stderr:
    fail(f"a blend with another weight: exit {p.returncode}, {p.stderr}")

# --- --prefetch: the same steps, the same errors at the same step ---------------------------
for t in ("A", "C", "D"):
    for k in ("1", "3"):
        ahead = steps_of(run([THDPACK, "run", *COMMON, *TOPOLOGIES[t], "--steps", "6",
                              "--prefetch", k, "--compute-seconds", "0.002"]).stdout)
        if [figures(s) for s in ahead] != [figures(s) for s in reference[t][:6]]:
            fail(f"run --prefetch {k} on topology {t} differs from the run without it")
        if any(not isinstance(s.get("time_wait"), (int, float)) or s["time_wait"] < 0
               for s in ahead):
            fail(f"run --prefetch {k}: a step without a time_wait")
checked = steps_of(run([THDPACK, "run", *SMALL, *TOPOLOGIES["C"], "--steps", "3", "--prefetch",
                        "2", "--verify"]).stdout)
if [s["step"] for s in checked] != [0, 1, 2] or any("loss" not in s for s in checked):
    fail("run --prefetch 2 --verify did not verify steps 0 to 2")
if MPIRUN:
    for t in ("B", "C"):
        mpi_ahead = steps_of(run([*MPIRUN, "-np", str(WORLD[t]), THDPACK, "run", "--backend",
                                  "mpi", *COMMON, *TOPOLOGIES[t], "--steps", "4", "--prefetch",
                                  "2"]).stdout)
        if [figures(s) for s in mpi_ahead] != [figures(s) for s in reference[t][:4]]:
            fail(f"run --backend mpi --prefetch 2 on topology {t} differs from threads")
# A JSONL source whose 21st line is not JSON: 8 samples a step, so step 2 fails.
broken = os.path.join(WORK, "broken.jsonl")
with open(broken, "w") as f:
    for i in range(40):
        f.write("{not json\n" if i == 20 else
                json.dumps({"input_ids": [(i * 5 + k) % 300 for k in range(4 + i % 50)]}) + "\n")
BROKEN = ["--data", "jsonl:" + broken, "--global-batch", "8", "--max-tokens-per-rank", "4096",
          "--vocab", "300", "--json", "--steps", "4", *TOPOLOGIES["A"]]
plain = run([THDPACK, "run", *BROKEN], check=False)
if plain.returncode == 0 or [s["step"] for s in steps_of(plain.stdout)] != [0, 1]:
    fail(f"a source that fails in step 2: exit {plain.returncode}, {plain.stdout}{plain.stderr}")
for k in ("1", "3"):
    ahead = run([THDPACK, "run", *BROKEN, "--prefetch", k], check=False)
    if ahead.returncode != plain.returncode or \
            [figures(s) for s in steps_of(ahead.stdout)] != \
            [figures(s) for s in steps_of(plain.stdout)] or \
            ahead.stderr.strip() != plain.stderr.strip():
        fail(f"--prefetch {k} with a source that fails in step 2: exit {ahead.returncode}, "
             f"steps {[s['step'] for s in steps_of(ahead.stdout)]}, {ahead.stderr}\n"
             f"without: exit {plain.returncode}, {plain.stderr}")
p = run([THDPACK, "run", *SMALL, "--steps", "1", "--prefetch", "-1"], check=False)
if p.returncode != 2 or "--prefetch" not in p.stderr:
    fail(f"--prefetch -1: exit {p.returncode}, {p.stderr}")
print(f"cli_resume_test: passed ({restarts} attempts)")
