#!/usr/bin/env bash
# Many live sessions on one server (issue 60; reported, never asserted): per STEP sessions,
# create and first-cell p50/p99, the cell's emulated guest-kernel instructions, host memory per
# idle session, the server's threads and its CPU while they idle; then the teardown of all of
# them (DELETE answered, threads and memory back); then PARKED sessions parked to disk
# (--park-idle-s) and a cell in each, resuming it; and, in a last round with the sessions
# kept, the shutdown's time. The client is scripts/bench_density.py (Python's stdlib).
#
#   scripts/bench-density.sh                 # 1000 sessions in steps of 100
#   SESSIONS=300 STEP=50 scripts/bench-density.sh
#   SHUTDOWN=0 scripts/bench-density.sh      # skip the shutdown round
#   PARKED=0 scripts/bench-density.sh        # skip the parking round (default 200 sessions)
#   SERVE_ARGS=--no-trace scripts/bench-density.sh   # more flags for bud serve (deletes
#                                            # without the trace's end checkpoint)
#
# Starts `bud serve --templates python` on 127.0.0.1:$PORT (stopped by pid on exit) with room
# for SESSIONS sessions.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-18476}
SESSIONS=${SESSIONS:-1000}
SHUTDOWN=${SHUTDOWN:-1}
LOG=${LOG:-target/bench-density-server.log}
command -v python3 >/dev/null || { echo "[bench-density] needs python3" >&2; exit 1; }
export SESSIONS

cargo build --release --quiet
. scripts/serve-lib.sh
# shellcheck disable=SC2206  # SERVE_ARGS is split into flags on purpose
serve_args=(--templates python --max-sessions $((SESSIONS + 10))
    --sessions-memory-mib $((SESSIONS * 16 + 1024)) ${SERVE_ARGS:-})
start_bud_serve bench-density "$PORT" "$LOG" "${serve_args[@]}"
python3 scripts/bench_density.py 127.0.0.1 "$PORT" "$SERVER"
kill -TERM "$SERVER"; wait "$SERVER" || true

if [ "${PARKED:-200}" -gt 0 ]; then
    echo "[bench-density] parking: ${PARKED:-200} sessions parked after 3 s idle, then resumed"
    rm -rf target/bench-density-state
    start_bud_serve bench-density "$PORT" "$LOG" "${serve_args[@]}" --park-idle-s 3 \
        --state-dir target/bench-density-state
    SESSIONS=${PARKED:-200} PARKED=1 python3 scripts/bench_density.py 127.0.0.1 "$PORT" "$SERVER"
    kill -TERM "$SERVER"; wait "$SERVER" || true
    rm -rf target/bench-density-state
fi

[ "$SHUTDOWN" = 1 ] || exit 0
echo "[bench-density] shutdown with $SESSIONS live sessions"
start_bud_serve bench-density "$PORT" "$LOG" "${serve_args[@]}"
KEEP=1 STEP=$SESSIONS IDLE_S=0.1 python3 scripts/bench_density.py 127.0.0.1 "$PORT" "$SERVER"
started=$EPOCHREALTIME
kill -TERM "$SERVER"
wait "$SERVER" || true
echo "shutdown (SIGTERM to exit) with $SESSIONS live sessions: $(python3 -c \
    "print(f'{$EPOCHREALTIME - $started:.2f}')") s"
