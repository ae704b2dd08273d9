"""What the command line's Python tests share (cli_resume_test.py, cli_columnar_test.py): a
seeded run, a failure that names the seed, a step object's figures and sample ids, running the
command line and reading the steps it prints (--json: one JSON object a line)."""
import json
import random
import subprocess
import sys

# What legitimately differs between two runs of the same steps: timings, and the dynamic
# scheduler's count of CP groups the process made or reused (a restarted process makes its
# groups anew).
TIMING = ("bytes_sent", "time_", "groups_made", "groups_reused", "groups_evicted",
          "groups_cached")

SEED = None


def seeded(name):
    """A random.Random of a fresh seed, printed under `name` and named by every fail()."""
    global SEED
    SEED = random.randrange(1 << 30)
    print(f"{name}: seed {SEED}", flush=True)
    return random.Random(SEED)


def fail(message):
    print(f"FAIL (seed {SEED}): {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def figures(step):
    """A step object without what legitimately differs between runs: timings and bytes."""
    return {k: v for k, v in step.items() if not k.startswith(TIMING)}


def ids(step):
    """The sample ids of a step object, sorted (a dynamic step's from its groups)."""
    if "groups" in step:
        return sorted(i for mb in step["groups"] for g in mb for i in g["samples"])
    return sorted(i for r in step["replicas"] for mb in r["microbatches"] for i in mb["samples"])


def run(args, check=True, env=None):
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    if check and p.returncode != 0:
        fail(f"{' '.join(args)} exited {p.returncode}:\n{p.stderr}")
    return p


def steps_of(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]
