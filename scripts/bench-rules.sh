#!/usr/bin/env bash
# What a network rule costs a request (issue 59: at most 2 ms more at p50), measured and
# printed, never asserted: a session allowed two names pinned to the same local upstreams,
# one with a rule setting headers (one from a secret); the guest times the median of N
# requests (default 30) each way over HTTP kept-alive, HTTPS kept-alive, and HTTPS with a
# new connection each (with a rule, bud terminates the guest's TLS and opens its own).
#
# Usage: scripts/bench-rules.sh [N]
# Runs server/tests/network.rs's ignored measurement (the test profile, a real guest on
# /dev/kvm). Traffic goes only to the test's own servers on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."

BUD_RULES_REQUESTS=${1:-30} cargo test -q -p bud-server --test network \
    what_a_rule_costs_a_request -- --ignored --nocapture 2>&1 \
    | grep -E '^(http|https|[0-9]+ requests|Traceback|  |[A-Za-z]+Error)'
