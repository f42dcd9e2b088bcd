#!/usr/bin/env bash
# Requests beside a running cell (vmm::beside), reported, never asserted: a 1 KiB file read,
# a 1 MiB file read, a directory listing and a command run to its end (`echo 1`, started and
# its output stream read to the end), each on an idle session, beside a cell that sleeps
# (a `time.sleep(0.02)` loop) and beside a cell that computes (a pure-Python loop that holds
# the GIL). The client is scripts/bench_beside.py (Python's stdlib).
#
#   scripts/bench-beside.sh              # 40 rounds of each
#   ROUNDS=100 scripts/bench-beside.sh
#
# Starts `bud serve` on 127.0.0.1:$PORT (stopped by pid on exit).
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-18473}
LOG=${LOG:-target/bench-beside-server.log}
command -v python3 >/dev/null || { echo "[bench-beside] needs python3" >&2; exit 1; }

cargo build --release --quiet
. scripts/serve-lib.sh
start_bud_serve bench-beside "$PORT" "$LOG"
python3 scripts/bench_beside.py 127.0.0.1 "$PORT"
