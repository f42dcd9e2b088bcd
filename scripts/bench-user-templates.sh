#!/usr/bin/env bash
# What user templates cost (docs/templates.md, issue 56): a fresh `bud serve` (jailed, as by
# default) on its own port and state directory, then scripts/bench_user_templates.py
# against it: a cold build (its wheel and .deb caches emptied), a warm one, one more package
# on top, the host's pip beside, and jobs, cells and a first session on the user template
# against `python`. Prints medians; asserts no time; stops the server it started.
#
#   scripts/bench-user-templates.sh
#   JOBS=500 WHEEL=rich==13.7.1 APT=sqlite3 scripts/bench-user-templates.sh
#   BUD=path/to/bud scripts/bench-user-templates.sh
#   RUN=5647 ONLY_JOBS=1 scripts/bench-user-templates.sh  # jobs and cells only, on run 5647's template
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${PORT:-18581}
DIR=${DIR:-target/bench-user-templates}
if [ -z "${BUD:-}" ]; then
    cargo build --release --quiet
    BUD=${CARGO_TARGET_DIR:-target}/release/bud
fi
rm -rf "$DIR"
mkdir -p "$DIR"
"$BUD" serve --port "$PORT" --state-dir "$DIR/state" >"$DIR/serve.log" 2>&1 &
PID=$!
trap 'kill "$PID" 2>/dev/null; wait "$PID" 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
    if curl -sf "http://127.0.0.1:$PORT/v1/health" | grep -q '"template_ready":true'; then
        break
    fi
    kill -0 "$PID" 2>/dev/null || { cat "$DIR/serve.log" >&2; exit 1; }
    sleep 0.5
done
BUD_URL="http://127.0.0.1:$PORT" python3 scripts/bench_user_templates.py
