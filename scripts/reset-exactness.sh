#!/usr/bin/env bash
# Warm-VM reset exactness at a chosen size: JOBS jobs (default 300; CI runs 26) of every
# kind a reset must undo (tmpfs writes, heap growth, fork and exec, mmap churn, threads,
# signals, a shell pipeline with a background process, kernel state, an output flood, a
# timeout, a memory error, os._exit, a guest kernel restart), round robin on one warm VM
# with every reset verified by value against the template (tests/reset.rs). Prints the
# jobs, rounds, time and the executor's counters.
#
# Usage: scripts/reset-exactness.sh [JOBS]
set -euo pipefail
cd "$(dirname "$0")/.."
BUD_RESET_JOBS=${1:-300} exec cargo test --test reset -- --nocapture \
  every_reset_is_exact_after_jobs_of_every_kind
