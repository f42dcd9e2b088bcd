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
target/release/bud serve --port "$PORT" >"$LOG" 2>&1 &
SERVER=$!
stop_server() {
    if kill -0 "$SERVER" 2>/dev/null; then
        kill -TERM "$SERVER"
        wait "$SERVER" || true
    fi
}
trap stop_server EXIT
for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:$PORT/v1/health" >/dev/null 2>&1; then break; fi
    kill -0 "$SERVER" 2>/dev/null || { echo "[bench-sessions] server died; log: $LOG" >&2; tail -20 "$LOG" >&2; exit 1; }
    sleep 0.5
done
python3 scripts/bench_sessions.py 127.0.0.1 "$PORT" "$SERVER"
