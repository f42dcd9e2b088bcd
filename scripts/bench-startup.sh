#!/usr/bin/env bash
# Times, side by side in one run, how long it takes to run `print(1)`:
#   - bud run -c 'print(1)'          (a fresh copy-on-write clone of the warm guest, per run)
#   - python3 -c 'print(1)'          (the host's interpreter, no isolation)
#   - bwrap ... python3 -c 'print(1)' (bubblewrap namespaces around the host's interpreter)
# and prints a markdown table of medians and ratios. Runs interleaved (one of each per round)
# so that machine noise hits all three alike.
#
# Usage: scripts/bench-startup.sh [ROUNDS]   (default 30). Builds bud (release) and the guest
# template on first use; installs bubblewrap from Debian if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-30}

if ! command -v bwrap >/dev/null; then
    echo "[bench] installing bubblewrap" >&2
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap >&2
fi
cargo build --release -q
bud=target/release/bud
# First use builds the guest and the template (minutes); not part of the measurement.
"$bud" run -c 'print(1)' >/dev/null

python3 - "$rounds" "$bud" <<'PY'
import statistics, subprocess, sys, time

rounds, bud = int(sys.argv[1]), sys.argv[2]
py = "/usr/bin/python3"
cases = [
    ("bud run -c 'print(1)'", [bud, "run", "-c", "print(1)"]),
    ("python3 -c 'print(1)' (host)", [py, "-c", "print(1)"]),
    ("bwrap python3 -c 'print(1)'", [
        "bwrap", "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/bin", "/bin",
        "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--unshare-all",
        "--die-with-parent", py, "-c", "print(1)"]),
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
base = statistics.median(times[cases[1][0]])
print(f"\n{rounds} rounds, wall time per run (process start to exit):\n")
print("| command | median | p90 | vs host python3 |")
print("|---|---:|---:|---:|")
for name, _ in cases:
    v = sorted(times[name])
    med = statistics.median(v)
    p90 = v[min(len(v) - 1, int(len(v) * 0.9))]
    print(f"| `{name}` | {med*1e3:.1f} ms | {p90*1e3:.1f} ms | {med/base:.2f}x |")
PY
