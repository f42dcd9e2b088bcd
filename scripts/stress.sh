#!/usr/bin/env bash
# The guest-process stress test at a chosen size: JOBS jobs (default 1 000; CI runs 24) in
# which a parent makes system calls beside its children, half Python, half shell, on two
# workers; every job must end `ok` with its exact output. Prints the jobs, the time, the
# time per job per worker and how many went wrong (tests/stress.rs).
#
# Usage: scripts/stress.sh [JOBS]
set -euo pipefail
cd "$(dirname "$0")/.."
BUD_STRESS_JOBS=${1:-1000} exec cargo test --test stress -- --nocapture
