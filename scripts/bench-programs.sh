#!/usr/bin/env bash
# What a program runtime costs (docs/templates.md, "Runtimes of your own"; issue 57): a fresh
# `bud serve` (jailed, as by default) on its own port and state directory, then
# scripts/bench_programs.py against it: a user template with Debian's Lua and busybox's awk
# as runtimes of its own, their one-shot jobs beside shell and Python jobs on it, and the
# same programs started on the host. Prints medians; asserts no time; stops the server.
#
#   scripts/bench-programs.sh
#   JOBS=300 scripts/bench-programs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/serve-lib.sh

PORT=${PORT:-18582}
DIR=target/bench-programs
cargo build --release --quiet
rm -rf "$DIR"
mkdir -p "$DIR"
start_bud_serve bench-programs "$PORT" "$DIR/serve.log" --state-dir "$DIR/state"
BUD_URL="http://127.0.0.1:$PORT" python3 scripts/bench_programs.py
