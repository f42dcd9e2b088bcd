#!/usr/bin/env bash
# Times the whole test suite one binary after another (`cargo test --workspace`; the
# README's test command, `cargo xtask test`, runs them in lanes and writes each binary's time
# to target/xtask/last-run.tsv), per test binary and per test: builds first (timed on its own), then runs every
# binary with libtest's JSON events (`--report-time`; a stable toolchain allows the unstable
# harness flag through RUSTC_BOOTSTRAP=1; the guest build drops it, so the image and templates
# are the ones CI builds) and prints a Markdown
# table: each binary's time and its slowest tests. docs/testing.md keeps the latest table.
#
# Usage: scripts/test-times.sh [SLOWEST]     (tests listed per binary, default 3)
#        OUT=target/test-times.jsonl scripts/test-times.sh
set -euo pipefail
cd "$(dirname "$0")/.."
slowest=${1:-3}
out=${OUT:-target/test-times.jsonl}
mkdir -p "$(dirname "$out")"

start=$(date +%s.%N)
cargo test --workspace --no-run
built=$(date +%s.%N)
set +e
RUSTC_BOOTSTRAP=1 cargo test --workspace --no-fail-fast -- \
  -Z unstable-options --format json --report-time 2>&1 | tee "$out" |
  grep --line-buffered -E '^ +(Running|Doc-tests) |"event": "(failed|ok)", "passed|"event": "failed"'
status=${PIPESTATUS[0]}
set -e
ended=$(date +%s.%N)

python3 - "$out" "$slowest" "$start" "$built" "$ended" "$status" <<'PY'
import json, re, sys
path, slowest, start, built, ended, status = sys.argv[1:]
slowest, start, built, ended = int(slowest), float(start), float(built), float(ended)
binaries, current = [], None
for line in open(path, errors="replace"):
    m = re.match(r"\s+(?:Running (.+?) \(|Doc-tests (\S+))", line)
    if m:
        name = m.group(1) or f"doc tests of {m.group(2)}"
        current = {"name": name, "tests": [], "time": 0.0, "result": "?"}
        binaries.append(current)
        continue
    if current is None or not line.startswith("{"):
        continue
    try:
        ev = json.loads(line)
    except ValueError:
        continue
    if ev.get("type") == "test" and "exec_time" in ev:
        current["tests"].append((ev["exec_time"], ev["name"], ev["event"]))
    elif ev.get("type") == "suite" and "exec_time" in ev:
        current["time"] = ev["exec_time"]
        current["result"] = f'{ev["passed"]} passed, {ev["failed"]} failed'
total = sum(b["time"] for b in binaries)
print(f"\nbuild (cargo test --no-run): {built - start:.0f} s; tests: {ended - built:.0f} s "
      f"(sum of binaries {total:.0f} s); exit {status}\n")
print("| test binary | time | result | slowest tests |")
print("|---|---:|---|---|")
for b in sorted(binaries, key=lambda b: -b["time"]):
    if not b["tests"] and b["time"] < 0.5:
        continue
    top = sorted(b["tests"], reverse=True)[:slowest]
    tests = "; ".join(f"`{n.split('::')[-1]}` {t:.0f} s" + ("" if e == "ok" else f" ({e})")
                      for t, n, e in top)
    print(f'| {b["name"]} | {b["time"]:.0f} s | {b["result"]} | {tests} |')
PY
exit "$status"
