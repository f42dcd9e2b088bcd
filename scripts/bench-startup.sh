#!/usr/bin/env bash
# Side by side in one run, bud against plain processes on the host:
#  1. one tiny program, process start to exit:
#       bud run -c 'print(1)'             (sent to the bud serve this script starts: a warm VM)
#       bud run --local -c 'print(1)'     (no server: template load + fresh clone in-process)
#       python3 -c 'print(1)'             (the host's interpreter, no isolation)
#       bwrap ... python3 -c 'print(1)'   (bubblewrap namespaces around the host's interpreter)
#     interleaved, one of each per round, so machine noise hits all alike;
#  2. N small programs (a few lines of real work and an assert each), all of them, at the same
#     parallelism (one per core): through bud's batch API, as host python3 processes, as
#     bwrap python3 processes. Wall time for all N, median of ROUNDS.
# Prints markdown tables of medians and ratios to host python3. Measures; asserts no time.
#
# Usage: scripts/bench-startup.sh [ROUNDS] [N]   (default 20 rounds, N = 64 programs).
# Builds bud (release), the guest and the template on first use; installs bubblewrap from
# Debian if missing; starts `bud serve` on a free port and stops it (by pid) at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-20}
programs=${2:-64}
port=${PORT:-18472}

if ! command -v bwrap >/dev/null; then
    echo "[bench] installing bubblewrap" >&2
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap >&2
fi
cargo build --release -q
bud=target/release/bud
# First use builds the guest and the template (minutes); not part of the measurement.
"$bud" run --local -c 'print(1)' >/dev/null

. scripts/serve-lib.sh
start_bud_serve bench-startup "$port" target/bench-startup-server.log

BUD_URL="http://127.0.0.1:$port" python3 - "$rounds" "$bud" "$programs" <<'PY'
import concurrent.futures, json, os, statistics, subprocess, sys, time, urllib.request

rounds, bud, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
url = os.environ["BUD_URL"]
py = "/usr/bin/python3"
cores = os.cpu_count() or 2
bwrap = ["bwrap", "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib",
         "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/bin", "/bin",
         "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--unshare-all",
         "--die-with-parent", py]

def table(title, rows, base_name, unit_note):
    base = statistics.median(rows[base_name])
    print(f"\n{title}\n")
    print(f"| {unit_note} | median | p90 | vs host python3 |")
    print("|---|---:|---:|---:|")
    for name, v in rows.items():
        v = sorted(v)
        med = statistics.median(v)
        p90 = v[min(len(v) - 1, int(len(v) * 0.9))]
        print(f"| `{name}` | {med*1e3:.1f} ms | {p90*1e3:.1f} ms | {med/base:.2f}x |")

# 1. One tiny program.
cases = [
    ("bud run -c 'print(1)' (bud serve up)", [bud, "run", "-c", "print(1)"]),
    ("bud run --local -c 'print(1)'", [bud, "run", "--local", "-c", "print(1)"]),
    ("python3 -c 'print(1)' (host)", [py, "-c", "print(1)"]),
    ("bwrap python3 -c 'print(1)'", bwrap + ["-c", "print(1)"]),
]
times = {name: [] for name, _ in cases}
for _ in range(rounds):
    for name, cmd in cases:
        t = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True)
        dt = time.perf_counter() - t
        if out.returncode != 0 or out.stdout != b"1\n":
            sys.exit(f"{name} failed: rc={out.returncode} out={out.stdout!r} err={out.stderr[-500:]!r}")
        times[name].append(dt)
table(f"{rounds} rounds, one program, wall time per run (process start to exit):", times,
      cases[2][0], "command")

# 2. N small programs, each a little real work and an assert.
def program(i):
    return (f"import json, re, math, collections\n"
            f"words = re.findall(r'[a-z]+', 'the quick brown fox jumps over the lazy dog ' * {i % 7 + 1})\n"
            f"c = collections.Counter(words)\n"
            f"s = sum(math.isqrt(k * k + {i}) for k in range(2000))\n"
            f"assert c['the'] == {2 * (i % 7 + 1)}, c\n"
            f"print(json.dumps({{'i': {i}, 'top': c.most_common(1)[0][0], 's': s}}))\n")
progs = [program(i) for i in range(n)]

def check(i, out):
    got = json.loads(out)
    assert got["i"] == i and got["top"] == "the", got

def run_bud():
    batch = 16  # bud serve's default --max-batch-jobs
    chunks = [list(range(k, min(n, k + batch))) for k in range(0, n, batch)]
    def send(idx):
        body = json.dumps({"jobs": [{"code": progs[i]} for i in idx]}).encode()
        req = urllib.request.Request(f"{url}/v1/exec/batch", body,
                                     {"content-type": "application/json"})
        res = json.load(urllib.request.urlopen(req, timeout=120))["results"]
        for i, r in zip(idx, res):
            assert r["status"] == "ok", r
            check(i, r["stdout"])
    # The server runs one job per core; keep its queue fed with two batches in flight.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(send, chunks))

def run_procs(prefix):
    def one(i):
        out = subprocess.run(prefix + ["-c", progs[i]], capture_output=True, check=True)
        check(i, out.stdout)
    with concurrent.futures.ThreadPoolExecutor(cores) as pool:
        list(pool.map(one, range(n)))

runs = [
    (f"bud: POST /v1/exec/batch ({cores} workers)", run_bud),
    (f"host python3, {cores} at a time", lambda: run_procs([py])),
    (f"bwrap python3, {cores} at a time", lambda: run_procs(bwrap)),
]
times = {name: [] for name, _ in runs}
for _ in range(max(3, rounds // 4)):
    for name, fn in runs:
        t = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - t)
table(f"{n} small programs (regex, Counter, math, json, an assert), wall time for all of them:",
      times, runs[1][0], "how")
PY
