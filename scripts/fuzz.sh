#!/usr/bin/env bash
# Every cargo-fuzz target of fuzz/ for SECONDS each (default 300; CI runs 5 each), through
# tests/fuzz.rs: cargo-fuzz installed into build/tools on first use, the corpus kept in
# build/fuzz/corpus, a crash's input in build/fuzz/artifacts. Prints each target's inputs.
#
# Usage: scripts/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
BUD_FUZZ_SECONDS=${1:-300} exec cargo test --test fuzz -- --nocapture
