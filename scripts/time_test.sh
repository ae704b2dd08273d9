#!/usr/bin/env bash
# Measures make test as docs/testing.md reports it, and writes the table there (between the
# markers "timing table begin" and "timing table end"), with the date, commit and machine:
#   1. cold     a clean clone of HEAD, nothing cached (an empty ccache, an empty pip cache: the
#               current stack's download included), `make test`;
#   2. one file the same clone after a one-line change to one library source
#               (src/pack/pack.cc), `make test` again;
#   3. CI       another clean clone, `CI=true bash .ci/run`, with the caches that runs 1 and 2
#               left (what CI finds after a session that ran make test).
# Each run's parts come from make test's own clock (scripts/timed.sh, build-timings.txt).
# The Debian packages must be installed already (scripts/install_deps.sh); their download is
# not part of any figure. Takes about 40 minutes on 2 cores; nothing else should run meanwhile.
# Usage: scripts/time_test.sh [--no-write] [WORK_DIR]   (WORK_DIR default: a new temporary one)
set -euo pipefail
write=1
if [ "${1:-}" = "--no-write" ]; then
  write=0
  shift
fi
here=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d /tmp/thdpack-time-XXXXXX)}
mkdir -p "$work"
commit=$(git -C "$here" rev-parse --short HEAD)
if [ -n "$(git -C "$here" status --porcelain --untracked-files=no)" ]; then
  echo "time_test: the checkout has uncommitted changes; HEAD ($commit) is what gets measured" >&2
fi
export CCACHE_DIR=$work/ccache PIP_CACHE_DIR=$work/pip-cache
rm -rf "$CCACHE_DIR" "$PIP_CACHE_DIR"
bash "$here/scripts/install_deps.sh"

run() {  # NAME CLONE COMMAND...: runs the command in the clone, keeps its log and timings
  local name=$1 clone=$2
  shift 2
  echo "time_test: $name: $* in $clone" >&2
  local start status
  start=$(date +%s.%N)
  if (cd "$clone" && "$@") > "$work/$name.log" 2>&1; then status=0; else status=$?; fi
  awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.0f\n", b - a }' > "$work/$name.wall"
  cp "$clone/build-timings.txt" "$work/$name.timings" 2>/dev/null || true
  ccache --show-stats > "$work/$name.ccache" 2>&1 || true
  if [ $status -ne 0 ]; then
    echo "time_test: $name failed (status $status); the log: $work/$name.log" >&2
    tail -40 "$work/$name.log" >&2
    exit 1
  fi
  ccache --zero-stats > /dev/null 2>&1 || true
}

git clone -q "$here" "$work/clone-a"
git -C "$work/clone-a" checkout -q "$commit"
ccache --zero-stats > /dev/null 2>&1 || true
run cold "$work/clone-a" env CI=true make test
echo "// a one-line change, to time make test after it" >> "$work/clone-a/src/pack/pack.cc"
run one-file "$work/clone-a" env CI=true make test
git clone -q "$here" "$work/clone-b"
git -C "$work/clone-b" checkout -q "$commit"
run ci "$work/clone-b" env CI=true bash .ci/run

python3 - "$work" "$commit" "$here/docs/testing.md" "$write" <<'PY'
import datetime, os, platform, re, subprocess, sys
work, commit, doc, write = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
runs = [("cold", "clean clone, nothing cached (`make test`)"),
        ("one-file", "the same clone after a one-line change to `src/pack/pack.cc` (`make test`)"),
        ("ci", "another clean clone with the caches runs 1-2 left (`CI=true bash .ci/run`)")]
parts = ["deps", "venv", "test-unit", "test-current", "test-asan", "test-fuzz"]

def timings(name):
    rows = {}
    for line in open(os.path.join(work, f"{name}.timings")):
        part, start, end, status = line.split()
        rows[part] = (float(start), float(end))
    return rows

def hits(name):
    text = open(os.path.join(work, f"{name}.ccache")).read()
    m = re.search(r"Hits:\s+(\d+)\s*/\s*(\d+)", text)
    return f"{m.group(1)}/{m.group(2)}" if m else "-"

cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
           platform.processor())
lines = [f"Measured by `scripts/time_test.sh` on {datetime.date.today().isoformat()} at {commit}, "
         f"{os.cpu_count()} cores ({cpu}), Debian's packages installed beforehand. Each cell is "
         f"a part's wall time from make test's own clock (`build-timings.txt`); `venv` runs "
         f"beside `test-unit` (it starts with it), so the total is less than the sum.", "",
         "| run | " + " | ".join(f"`{p}`" for p in parts) + " | total | ccache hits |",
         "|---|" + "---|" * (len(parts) + 2)]
for name, what in runs:
    t = timings(name)
    first = min(s for s, _ in t.values())
    last = max(e for _, e in t.values())
    cells = [f"{t[p][1] - t[p][0]:.0f} s" if p in t else "-" for p in parts]
    total = last - first
    lines.append(f"| {what} | " + " | ".join(cells) +
                 f" | **{total:.0f} s ({total / 60:.1f} min)** | {hits(name)} |")
table = "\n".join(lines)
print(table)
if write:
    text = open(doc).read()
    begin, end = "<!-- timing table begin -->", "<!-- timing table end -->"
    if begin not in text or end not in text:
        sys.exit(f"time_test: {doc} has no '{begin}' ... '{end}' markers")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    open(doc, "w").write(head + begin + "\n" + table + "\n" + end + tail)
    print(f"time_test: the table is written into {doc}", file=sys.stderr)
PY
