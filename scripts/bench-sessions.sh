#!/usr/bin/env bash
# Session benchmark of `bud serve` (reported, never asserted): create/delete, a cell round
# trip, idle session memory, and a fork of a 100 MiB session into 8 children. The client is
# scripts/bench_sessions.py (Python's stdlib, one keep-alive connection).
#
#   scripts/bench-sessions.sh              # 200 cell round trips, 3 forks
#   ROUNDS=500 FORK_ROUNDS=1 scripts/bench-sessions.sh
#
# Starts `bud serve` on 127.0.0.1:$PORT (stopped by pid on exit) with sessions allowed 2 GiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-18472}
LOG=${LOG:-target/bench-sessions-server.log}
command -v python3 >/dev/null || { echo "[bench-sessions] needs python3" >&2; exit 1; }

cargo build --release --quiet
. scripts/serve-lib.sh
start_bud_serve bench-sessions "$PORT" "$LOG"
python3 scripts/bench_sessions.py 127.0.0.1 "$PORT" "$SERVER"
