#!/usr/bin/env bash
# Every libFuzzer target of fuzz/ for SECONDS each (default 300; CI runs 5 each), through
# tests/fuzz.rs: the targets built optimized with the coverage instrumentation (no
# cargo-fuzz needed), the corpus kept in build/fuzz/corpus, a crash's input in
# build/fuzz/artifacts. Prints each target's inputs.
#
# Usage: scripts/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
BUD_FUZZ_SECONDS=${1:-300} exec cargo test --test fuzz -- --nocapture
