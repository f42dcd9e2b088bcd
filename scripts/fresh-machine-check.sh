#!/usr/bin/env bash
# Reproduces a new user's first steps on a fresh machine of this kind, as far as this one
# allows, and times them: the README's two commands, from a fresh clone, in both orders.
#
# For each order it removes the host packages that bud installs itself and that a fresh
# machine of this kind lacks (the kernel build's and the image builder's own lists, less
# what such a machine already has: the Rust toolchain's gcc, make, libc6-dev, and the base
# system's tools), clones this repository's HEAD into an empty folder (so build/ and target/
# are empty: kernel, image, templates, venvs and tools are built again), and runs:
#   tests-first:  the test command (`cargo xtask test`, what .ci/run runs), then the
#                 serve command (`cargo run --release -- serve`) until /v1/health is 200 and
#                 one job answers, then stops it by pid;
#   serve-first:  the same two the other way round.
# It prints each step's time and exit status, and a summary; it exits 1 if any step failed.
#
# Usage: scripts/fresh-machine-check.sh [tests-first|serve-first|both]   (default both)
#        WORK=/path/for/clones PORT=8080 scripts/fresh-machine-check.sh
# Needs root (apt-get). Takes the machine for a long while (two clean test runs for both).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
orders=${1:-both}
[[ $orders == both ]] && orders="tests-first serve-first"
work=${WORK:-/tmp/bud-fresh}
port=${PORT:-8080}
[[ $EUID -eq 0 ]] || { echo "fresh-machine-check: needs root (it removes packages)" >&2; exit 2; }

# What bud installs itself: the kernel script's DEPS and the image builder's REQUIRED_TOOLS.
mapfile -t ours < <(
  sed -n '/^readonly DEPS=(/,/)/p' "$repo/scripts/build-kernel.sh" |
    sed 's/^readonly DEPS=//' | tr -d '()"' | tr ' ' '\n' | grep -v '^$' |
    sed "s/^\\\$SRC_PKG\$/$(sed -n 's/^readonly SRC_PKG=//p' "$repo/scripts/build-kernel.sh")/"
  sed -n '/REQUIRED_TOOLS: &\[/,/\];/p' "$repo/guest/src/host.rs" |
    grep -o '("[^"]*", "[^"]*")' | sed 's/.*, "\(.*\)")/\1/'
)
# And what scripts/cluster.sh and tests/deploy.rs install (the cluster tests' front, its
# registry, the runtime API's client). Not systemd: a machine of this kind has it.
ours+=(haproxy redis-server socat)
# What a fresh machine of this kind already has (its Rust toolchain needs a C compiler).
fresh_has=" gcc make libc6-dev xz-utils patch dpkg binutils bc libssl-dev "

log() { printf '[fresh %s] %s\n' "$(date +%T)" "$*"; }

remove_ours() {
  local p installed=()
  for p in "${ours[@]}"; do
    [[ $fresh_has == *" $p "* ]] && continue
    dpkg -s "$p" >/dev/null 2>&1 && installed+=("$p")
  done
  if ((${#installed[@]})); then
    log "removing ${installed[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get purge -y -q -o DPkg::Lock::Timeout=600 \
      "${installed[@]}" >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get autoremove --purge -y -q \
      -o DPkg::Lock::Timeout=600 >/dev/null
  else
    log "none of bud's own packages is installed"
  fi
}

declare -A took status
step() { # NAME COMMAND...
  local name=$1 t0 rc=0
  shift
  log "$name: $*"
  t0=$(date +%s)
  "$@" || rc=$?
  took[$name]=$(($(date +%s) - t0))
  status[$name]=$rc
  log "$name: exit $rc after ${took[$name]} s"
}

run_tests() { # DIR
  (cd "$1" && cargo xtask test) >"$1.tests.log" 2>&1
}

run_serve() { # DIR
  local dir=$1 pid rc=1 i
  (cd "$dir" && exec cargo run --release -- serve --port "$port") >"$dir.serve.log" 2>&1 &
  pid=$!
  for i in $(seq 3600); do
    if python3 - "$port" <<'PY' 2>/dev/null; then
import json, sys, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
urllib.request.urlopen(base + "/v1/health", timeout=5).read()
req = urllib.request.Request(base + "/v1/exec", data=json.dumps({"code": "print(6 * 7)"}).encode(),
                             headers={"content-type": "application/json"})
answer = json.load(urllib.request.urlopen(req, timeout=60))
assert answer["status"] == "ok" and answer["stdout"] == "42\n", answer
PY
      rc=0
      break
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  kill -TERM "$pid" 2>/dev/null && wait "$pid" || true
  ((rc == 0)) || tail -n 30 "$dir.serve.log" >&2
  return $rc
}

mkdir -p "$work"
for order in $orders; do
  dir=$work/$order
  rm -rf "$dir" "$dir".*.log
  remove_ours
  git clone -q --no-local "$repo" "$dir"
  log "$order: fresh clone of $(git -C "$dir" rev-parse --short HEAD) in $dir"
  case $order in
    tests-first) step "$order: test command" run_tests "$dir"
                 step "$order: serve command" run_serve "$dir" ;;
    serve-first) step "$order: serve command" run_serve "$dir"
                 step "$order: test command" run_tests "$dir" ;;
    *) echo "unknown order $order" >&2; exit 2 ;;
  esac
done

failed=0
echo
echo "| step | time | exit |"
echo "|---|---:|---:|"
for name in "${!took[@]}"; do
  printf '| %s | %d min %02d s | %d |\n' "$name" $((took[$name] / 60)) $((took[$name] % 60)) "${status[$name]}"
  ((status[$name] == 0)) || failed=1
done | sort
exit $failed
