#!/usr/bin/env bash
# What JavaScript costs on bud (issue 57, docs/templates.md): a fresh `bud serve --templates
# python,node` on its own port, then scripts/bench_javascript.py against it, beside the
# host's Node.js: one-shot `console.log(1+1)` jobs (JavaScript on `node`, Python on
# `python`, and a Python job handed over on `node`) against the host's `node -e`, a CPU-bound
# loop against the host's node, and the templates' sizes. Prints medians and emulated
# guest-kernel instructions; asserts no time; stops the server it started.
#
#   scripts/bench-javascript.sh
#   JOBS=500 scripts/bench-javascript.sh
#   BUD=path/to/bud scripts/bench-javascript.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${PORT:-18591}
LOG=${LOG:-target/bench-javascript-server.log}
if [ -z "${BUD:-}" ]; then
    cargo build --release --quiet
    BUD=${CARGO_TARGET_DIR:-target}/release/bud
fi
command -v node >/dev/null || { echo "[bench-javascript] needs the host's node" >&2; exit 1; }
mkdir -p "$(dirname "$LOG")"
"$BUD" serve --port "$PORT" --templates python,node --state-dir target/bench-javascript-state \
    >"$LOG" 2>&1 &
PID=$!
trap 'kill "$PID" 2>/dev/null; wait "$PID" 2>/dev/null || true' EXIT
for _ in $(seq 1 3600); do
    if curl -sf "http://127.0.0.1:$PORT/v1/templates" | python3 -c \
        'import sys, json; t = {t["name"]: t["status"] for t in json.load(sys.stdin)["templates"]}; sys.exit(t.get("node") != "ready")' \
        2>/dev/null; then
        break
    fi
    kill -0 "$PID" 2>/dev/null || { tail -20 "$LOG" >&2; exit 1; }
    sleep 0.5
done
BUD_URL="http://127.0.0.1:$PORT" python3 scripts/bench_javascript.py
