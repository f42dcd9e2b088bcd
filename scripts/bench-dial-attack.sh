#!/usr/bin/env bash
# The stalled-dial attack of issue 58, measured (reported, never asserted): a victim sandbox
# resolves an allowed name and connects to a loopback echo server ROUNDS times (default 7)
# without the attack, then as many times while 3 attacker sandboxes each keep 40
# non-blocking connections dialing a loopback port whose accept queue is full (every SYN
# dropped: the dials hang until their 10 s timeout, and the attackers dial again for each
# that fails). Prints the medians of the victim's lookup and connect as its guest times
# them (time.monotonic around getaddrinfo and create_connection), every round's sum, and
# what each attacker dialed and had refused past its cap of dials in flight.
#
# Usage: scripts/bench-dial-attack.sh [ROUNDS]
# Runs tests/network_attack.rs's ignored measurement (the test profile, real guests on
# /dev/kvm). Traffic goes only to the test's own listeners on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."

BUD_ATTACK_ROUNDS=${1:-7} cargo test -q --test network_attack \
    victim_lookup_and_connect_with_and_without_the_attack -- --ignored --nocapture 2>&1 \
    | grep -E '^(without|during|attacker|  |attack under way)'
