#!/usr/bin/env bash
# Durable-session benchmark of `bud serve` (reported, never asserted): pause, resume and a
# first cell by session size (0, 10, 100 MiB of Python data), snapshot starts, 1 000
# paused sessions on disk (resume of the first and the last against one alone), and a
# restart on that directory (start-up with the scan, resumes that check every page). The
# client is scripts/bench_durable.py (Python's stdlib, one keep-alive connection).
#
#   scripts/bench-durable.sh                 # 1000 paused sessions
#   PAUSED=200 scripts/bench-durable.sh
#
# Starts `bud serve` on 127.0.0.1:$PORT with its own state directory (emptied first) and
# stops it by pid; the restart is a second server on the same directory.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-18473}
LOG=${LOG:-target/bench-durable-server.log}
STATE=${STATE:-target/bench-durable-state}
command -v python3 >/dev/null || { echo "[bench-durable] needs python3" >&2; exit 1; }

cargo build --release --quiet
rm -rf "$STATE"
. scripts/serve-lib.sh
start_bud_serve bench-durable "$PORT" "$LOG" --state-dir "$STATE" --sessions-memory-mib 8192
python3 scripts/bench_durable.py 127.0.0.1 "$PORT" before
kill -TERM "$SERVER"; wait "$SERVER" || true
started=$(date +%s%N)
start_bud_serve bench-durable "$PORT" "$LOG.restart" --state-dir "$STATE" --sessions-memory-mib 8192
echo "restart on $(ls "$STATE/paused" | wc -l) paused files: ready after $(( ($(date +%s%N) - started) / 1000000 )) ms (polled every 0.5 s)"
python3 scripts/bench_durable.py 127.0.0.1 "$PORT" after
du -sh "$STATE" | sed 's/^/state directory: /'
