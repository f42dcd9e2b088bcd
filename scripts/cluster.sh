#!/usr/bin/env bash
# A bud cluster on one machine, for tests, benchmarks and trying it: N `bud serve` nodes, a
# Redis (the cluster-wide sandbox list) and HAProxy in front (deploy/haproxy/gen-config.sh).
# docs/cluster.md explains the routing, drain and node loss.
#
#   scripts/cluster.sh up N          start N nodes (n1..nN), Redis and the front; wait until
#                                    every node's /v1/health is 200 and the front serves; the
#                                    LAST line of stdout is the front's URL (http://127.0.0.1:P)
#   scripts/cluster.sh stop-node I   kill node I with SIGKILL (node loss)
#   scripts/cluster.sh drain I [J]   drain node I (POST /v1/admin/drain; to node J if given),
#                                    print its answer, and send each moved id to its new node
#                                    (HAProxy's moved.map, at run time and in the file)
#   scripts/cluster.sh undrain I     node I takes new work again (POST /v1/admin/undrain)
#   scripts/cluster.sh status        nodes, pids, ports, health, HAProxy's view of them
#   scripts/cluster.sh url           the front's URL
#   scripts/cluster.sh down          stop everything `up` started (SIGTERM, then SIGKILL after
#                                    DOWN_GRACE_S); idempotent; keeps logs and state
#
# Environment:
#   CLUSTER_DIR   everything it writes: pids, logs, configs, maps, state (default
#                 <repo>/build/cluster)
#   BASE_PORT     front on BASE_PORT, node I on BASE_PORT+I, its agent on BASE_PORT+100+I,
#                 Redis on BASE_PORT+99 (default 18400)
#   BUD           the bud binary (default: `cargo build --release`, then target/release/bud)
#   WORKERS       --workers of each node (default 1)
#   BUD_ARGS      extra arguments to every node (word-split)
#   BUD_API_KEY   a key for the admin call of `drain` (when the nodes have --api-keys-file)
#   WAIT_S        how long `up` waits for the nodes (default 1800: a fresh machine builds the
#                 guest and boots the template first, minutes)
#   DOWN_GRACE_S  how long `down` waits after SIGTERM before SIGKILL (default 20)
#   DRAIN_DEADLINE_S  the drain's deadline_s (default: the node's, 300 s)
#
# Layout of CLUSTER_DIR: nodes (the node list), nI/{bud.log,pid,state/}, redis/{redis.conf,
# redis.log,pid}, haproxy/{haproxy.cfg,haproxy.log,pid,admin.sock,maps/moved.map}, front.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CLUSTER_DIR=${CLUSTER_DIR:-$REPO/build/cluster}
BASE_PORT=${BASE_PORT:-18400}
WORKERS=${WORKERS:-1}
BUD_ARGS=${BUD_ARGS:-}
WAIT_S=${WAIT_S:-1800}
DOWN_GRACE_S=${DOWN_GRACE_S:-20}
HOST=127.0.0.1

log() { echo "[cluster] $*" >&2; }
die() { echo "[cluster] error: $*" >&2; exit 1; }

if ! [[ $BASE_PORT =~ ^[0-9]+$ ]] || [ "$BASE_PORT" -lt 1024 ] || [ "$BASE_PORT" -gt 65000 ]; then
    die "BASE_PORT must be a number in 1024..65000"
fi
[[ $WORKERS =~ ^[1-9][0-9]*$ ]] || die "WORKERS must be a positive number"

front_port() { echo "$BASE_PORT"; }
node_port() { echo $((BASE_PORT + $1)); }
agent_port() { echo $((BASE_PORT + 100 + $1)); }
redis_port() { echo $((BASE_PORT + 99)); }

# The absolute CLUSTER_DIR (HAProxy names its map by the path in its configuration, and the
# runtime API calls of `drain` must use the same path).
resolve_dir() {
    mkdir -p "$CLUSTER_DIR"
    CLUSTER_DIR=$(cd "$CLUSTER_DIR" && pwd)
    HA_DIR=$CLUSTER_DIR/haproxy
    MAPS=$HA_DIR/maps
    SOCK=$HA_DIR/admin.sock
}

# --- processes, by recorded pid ----------------------------------------------------------
# A pid file holds `PID MARK`: the process is ours only while its command line still holds
# MARK (a pid reused by another process, or our own exited child, is not).
record_pid() { echo "$2 $3" >"$1"; }
pid_of() { # pidfile -> pid if that process is alive and still ours
    local pid mark
    [ -s "$1" ] || return 1
    read -r pid mark <"$1" || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [ -r "/proc/$pid/cmdline" ] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$mark" || return 1
    echo "$pid"
}
# Stop the processes of these pid files: SIGTERM all, wait up to DOWN_GRACE_S, SIGKILL the rest.
stop_pids() {
    local f pid pids=() files=() waited=0
    for f in "$@"; do
        if pid=$(pid_of "$f"); then
            pids+=("$pid") files+=("$f")
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    [ ${#pids[@]} -gt 0 ] || return 0
    while [ $waited -lt $((DOWN_GRACE_S * 10)) ]; do
        local alive=0
        for f in "${files[@]}"; do pid_of "$f" >/dev/null && alive=1; done
        [ $alive = 1 ] || break
        sleep 0.1
        waited=$((waited + 1))
    done
    for f in "${files[@]}"; do
        if pid=$(pid_of "$f"); then
            log "pid $pid ($f) still running after ${DOWN_GRACE_S}s: SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    # Reap our own children (when `up` failed and stops what it started).
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
# Starts a daemon in its own session (a terminal's hangup does not reach it), stdin from
# /dev/null, output appended to LOG; records its pid with MARK. $! is the daemon itself:
# setsid only forks when it is a process group leader, which a background job of a script
# is not; checked below all the same.
start_daemon() { # pidfile mark log cmd...
    local pidfile=$1 mark=$2 logf=$3
    shift 3
    echo "=== $(date -u +%FT%TZ) $*" >>"$logf"
    setsid "$@" </dev/null >>"$logf" 2>&1 &
    record_pid "$pidfile" "$!" "$mark"
    sleep 0.05
    if ! pid_of "$pidfile" >/dev/null; then
        sleep 0.5
        pid_of "$pidfile" >/dev/null || {
            tail -20 "$logf" >&2
            die "$(basename "$1") did not start or exited at once (log: $logf)"
        }
    fi
}

cluster_pidfiles() { # every pid file of this cluster dir, front first
    local f
    [ -f "$HA_DIR/pid" ] && echo "$HA_DIR/pid"
    for f in "$CLUSTER_DIR"/n*/pid; do [ -f "$f" ] && echo "$f"; done
    [ -f "$CLUSTER_DIR/redis/pid" ] && echo "$CLUSTER_DIR/redis/pid"
    return 0
}
running_any() {
    local f
    while read -r f; do pid_of "$f" >/dev/null && return 0; done < <(cluster_pidfiles)
    return 1
}

# --- helpers -------------------------------------------------------------------------------
need_pkg() { # command package
    command -v "$1" >/dev/null && return 0
    [ "$(id -u)" = 0 ] || die "$1 is missing: install Debian's $2 package (as root: apt-get install $2)"
    # One apt client at a time: bud's first-use steps (the kernel script, the tests' own
    # installs, other clusters starting at once) take turns under the build lock, and an
    # apt run outside bud is waited for (dpkg's lock through DPkg::Lock::Timeout; the lists
    # lock, which Debian 12's apt-get update does not wait for, by retrying).
    mkdir -p "$REPO/build"
    exec 8>>"$REPO/build/build.lock"
    if ! flock -n 8; then
        log "waiting for the build lock ($REPO/build/build.lock) to install $2"
        flock 8
    fi
    if ! command -v "$1" >/dev/null; then
        log "installing $2 (apt-get)"
        local waited=0 out
        until out=$(apt-get update -qq 2>&1); do
            if ! grep -q "Could not get lock" <<<"$out" || [ "$waited" -ge 600 ]; then
                echo "$out" >&2
                die "apt-get update failed"
            fi
            sleep 2
            waited=$((waited + 2))
        done
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 "$2" >&2 ||
            die "could not install $2 with apt-get"
        # Debian's packages enable a system-wide service; this cluster runs its own.
        command -v "$1" >/dev/null || die "$2 installed but $1 is not on PATH"
    fi
    flock -u 8
    exec 8>&-
}
port_busy() { (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; }
http_code() { curl -s -o /dev/null -m "${2:-2}" -w '%{http_code}' "$1" 2>/dev/null || true; }
agent_line() { # port -> the agent's one line
    local line=
    { exec 3<>"/dev/tcp/$HOST/$1" && IFS= read -r -t 1 line <&3; exec 3<&-; } 2>/dev/null || true
    echo "${line:-(no answer)}"
}
# The runtime API: one command, its answer on stdout.
ha_cmd() { echo "$1" | socat -t 2 - "UNIX-CONNECT:$SOCK"; }
node_count() { if [ -s "$CLUSTER_DIR/nodes" ]; then grep -c '^n' "$CLUSTER_DIR/nodes" || true; else echo 0; fi; }
check_index() { # I
    if ! [[ $1 =~ ^[1-9][0-9]*$ ]] || [ "$1" -gt "$(node_count)" ]; then
        die "no node $1 in $CLUSTER_DIR (nodes: 1..$(node_count))"
    fi
}

# --- up ----------------------------------------------------------------------------------------
bud_binary() {
    if [ -n "${BUD:-}" ]; then
        [ -x "$BUD" ] || die "BUD=$BUD is not an executable"
        BUD=$(cd "$(dirname "$BUD")" && pwd)/$(basename "$BUD")
    else
        log "building bud (cargo build --release)"
        (cd "$REPO" && cargo build --release --quiet) >&2 || die "cargo build --release failed"
        BUD=$REPO/target/release/bud
    fi
}

wait_nodes() { # indices...: until each node's /v1/health is 200
    local i start=$SECONDS last=$SECONDS pending
    while :; do
        pending=()
        for i in "$@"; do
            pid_of "$CLUSTER_DIR/n$i/pid" >/dev/null || {
                tail -20 "$CLUSTER_DIR/n$i/bud.log" >&2
                die "node n$i exited (log: $CLUSTER_DIR/n$i/bud.log)"
            }
            [ "$(http_code "http://$HOST:$(node_port "$i")/v1/health")" = 200 ] || pending+=("$i")
        done
        [ ${#pending[@]} -eq 0 ] && return 0
        if [ $((SECONDS - start)) -ge "$WAIT_S" ]; then
            die "node(s) ${pending[*]} not ready after ${WAIT_S}s (logs: $CLUSTER_DIR/n*/bud.log)"
        fi
        if [ $((SECONDS - last)) -ge 15 ]; then
            last=$SECONDS
            log "waiting for node(s) ${pending[*]} ($((SECONDS - start))s; a first start builds the guest and the template: minutes); n${pending[0]}: $(tail -1 "$CLUSTER_DIR/n${pending[0]}/bud.log" | cut -c1-160)"
        fi
        sleep 0.3
    done
}

wait_front() { # n: until the front answers /v1/health and HAProxy has every server UP
    local n=$1 start=$SECONDS up
    while :; do
        pid_of "$HA_DIR/pid" >/dev/null || { tail -20 "$HA_DIR/haproxy.log" >&2; die "haproxy exited (log: $HA_DIR/haproxy.log)"; }
        if [ "$(http_code "http://$HOST:$(front_port)/v1/health")" = 200 ]; then
            # show stat: pxname,svname,...,status(18th); every server of every backend UP.
            up=$(ha_cmd "show stat" 2>/dev/null | awk -F, '$1 != "" && $2 != "FRONTEND" && $2 != "BACKEND" && $18 == "UP" {n++} END {print n + 0}')
            [ "$up" -ge $((2 * n)) ] && return 0
        fi
        [ $((SECONDS - start)) -lt 60 ] || die "the front on port $(front_port) is not serving after 60s (log: $HA_DIR/haproxy.log)"
        sleep 0.2
    done
}

cmd_up() {
    local n=${1:-}
    if ! [[ $n =~ ^[1-9][0-9]*$ ]] || [ "$n" -gt 98 ]; then die "usage: cluster.sh up N (1..98 nodes)"; fi
    resolve_dir
    if running_any; then
        die "a cluster in $CLUSTER_DIR is already running (scripts/cluster.sh status; down first)"
    fi
    need_pkg haproxy haproxy
    need_pkg redis-server redis-server
    need_pkg socat socat
    need_pkg curl curl
    need_pkg python3 python3
    local i p
    for p in "$(front_port)" "$(redis_port)"; do port_busy "$p" && die "port $p is in use (BASE_PORT=$BASE_PORT)"; done
    for i in $(seq "$n"); do
        for p in "$(node_port "$i")" "$(agent_port "$i")"; do
            port_busy "$p" && die "port $p is in use (BASE_PORT=$BASE_PORT)"
        done
    done
    bud_binary
    "$BUD" serve --help 2>&1 | grep -q -- '--agent-port' ||
        die "$BUD has no --node-id/--agent-port/--redis (older than issue 23): rebuild it"
    # From here on, a failure stops what this run started (logs stay).
    trap 'log "up failed: stopping what it started"; cmd_down_quiet' EXIT

    mkdir -p "$CLUSTER_DIR/redis" "$MAPS"
    : >"$CLUSTER_DIR/nodes"
    rm -f "$CLUSTER_DIR/front"
    for i in $(seq "$n"); do
        echo "n$i $HOST:$(node_port "$i") $(agent_port "$i")" >>"$CLUSTER_DIR/nodes"
    done

    # Redis: loopback, its own port, no persistence, in the foreground (its pid is ours).
    local rp
    rp=$(redis_port)
    cat >"$CLUSTER_DIR/redis/redis.conf" <<EOF
# Written by scripts/cluster.sh: the cluster's sandbox registry (no persistence).
bind 127.0.0.1
port $rp
protected-mode yes
daemonize no
supervised no
save ""
appendonly no
dir $CLUSTER_DIR/redis
logfile ""
EOF
    log "starting redis-server on port $rp"
    start_daemon "$CLUSTER_DIR/redis/pid" "redis-server" "$CLUSTER_DIR/redis/redis.log" \
        redis-server "$CLUSTER_DIR/redis/redis.conf"

    # The nodes: the first alone (a fresh machine builds the guest and the template once, in
    # the shared build dir), then the others.
    # The session key the nodes share (docs/durable.md): a session paused on one node is
    # imported by another (drain, hand-over) only if both hold the key that signed it.
    local keys=$CLUSTER_DIR/session.keys
    if [ ! -s "$keys" ]; then
        (umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$keys" && echo >>"$keys")
    fi
    local extra=() args
    start_node() {
        local i=$1 dir=$CLUSTER_DIR/n$1
        mkdir -p "$dir/state"
        args=(serve --port "$(node_port "$i")" --node-id "n$i" --agent-port "$(agent_port "$i")"
            --workers "$WORKERS" --state-dir "$dir/state" --redis "redis://$HOST:$rp/0"
            --session-key-file "$keys")
        # shellcheck disable=SC2206 # BUD_ARGS is a list of options
        extra=($BUD_ARGS)
        log "starting n$i on port $(node_port "$i") (agent $(agent_port "$i"))"
        start_daemon "$dir/pid" "--port $(node_port "$i") " "$dir/bud.log" "$BUD" "${args[@]}" "${extra[@]}"
    }
    start_node 1
    wait_nodes 1
    log "n1 ready"
    for i in $(seq 2 "$n"); do start_node "$i"; done
    [ "$n" -lt 2 ] || wait_nodes $(seq 2 "$n")
    log "all $n nodes ready"

    log "starting haproxy on port $(front_port)"
    mkdir -p "$HA_DIR"
    "$REPO/deploy/haproxy/gen-config.sh" --nodes "$CLUSTER_DIR/nodes" --port "$(front_port)" \
        --socket "$SOCK" --maps "$MAPS" --out "$HA_DIR/haproxy.cfg"
    haproxy -c -q -f "$HA_DIR/haproxy.cfg" >&2 || die "haproxy rejects $HA_DIR/haproxy.cfg"
    rm -f "$SOCK"
    start_daemon "$HA_DIR/pid" "$HA_DIR/haproxy.cfg" "$HA_DIR/haproxy.log" \
        haproxy -db -f "$HA_DIR/haproxy.cfg"
    wait_front "$n"
    trap - EXIT
    echo "http://$HOST:$(front_port)" >"$CLUSTER_DIR/front"
    log "cluster up: $n nodes, redis $rp, front http://$HOST:$(front_port) (CLUSTER_DIR=$CLUSTER_DIR)"
    echo "http://$HOST:$(front_port)"
}

# --- down, stop-node ----------------------------------------------------------------------------
cmd_down_quiet() {
    local files=()
    mapfile -t files < <(cluster_pidfiles)
    [ ${#files[@]} -eq 0 ] || stop_pids "${files[@]}"
    rm -f "$CLUSTER_DIR/front"
}
cmd_down() {
    resolve_dir
    if running_any; then
        log "stopping the cluster in $CLUSTER_DIR"
        cmd_down_quiet
        log "stopped (logs kept in $CLUSTER_DIR)"
    else
        rm -f "$CLUSTER_DIR/front"
        log "nothing running in $CLUSTER_DIR"
    fi
}

cmd_stop_node() {
    resolve_dir
    local i=${1:-} pid
    [ -n "$i" ] || die "usage: cluster.sh stop-node I"
    check_index "$i"
    pid=$(pid_of "$CLUSTER_DIR/n$i/pid") || die "node n$i is not running"
    kill -KILL "$pid"
    # Gone once reaped, or once its main thread is a zombie with no other thread left: only
    # then are its sockets closed. Its command line empties earlier (the kernel drops a
    # dying process's memory before its files), and its main thread is a zombie while
    # others (a vCPU's) still exit, for tens of milliseconds; a connection the front made
    # meanwhile was accepted by the dying node's listening socket, then cut, and counted
    # as a job lost in flight (tests/cluster.rs saw it: 502 node_lost after 41 ms).
    while [ -e "/proc/$pid" ]; do
        if [ "$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1)" = Z ] &&
            [ "$(find "/proc/$pid/task" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)" -le 1 ]; then
            break
        fi
        sleep 0.02
    done
    log "node n$i (pid $pid) killed with SIGKILL"
}

# --- drain -------------------------------------------------------------------------------------
# Points ID at NODE: the running HAProxy's map (set, or add when absent) and the map file.
move_id() { # id node
    local id=$1 node=$2 map=$MAPS/moved.map out tmp
    [[ $id =~ ^[A-Za-z0-9_-]+$ && $node =~ ^[a-z0-9-]+$ ]] || { log "skipping odd id/node '$id' '$node'"; return 0; }
    if pid_of "$HA_DIR/pid" >/dev/null; then
        out=$(ha_cmd "set map $map $id $node" 2>&1 || true)
        if [ -n "${out//[[:space:]]/}" ]; then
            out=$(ha_cmd "add map $map $id $node" 2>&1 || true)
            [ -z "${out//[[:space:]]/}" ] || log "runtime API: add map $id: $out"
        fi
    else
        log "haproxy is not running: moved.map file only"
    fi
    tmp=$map.tmp
    { grep -v -- "^$id " "$map" 2>/dev/null || true; echo "$id $node"; } >"$tmp"
    mv "$tmp" "$map"
}

cmd_drain() {
    resolve_dir
    local i=${1:-} j=${2:-} body answer code moved
    [ -n "$i" ] || die "usage: cluster.sh drain I [J]"
    check_index "$i"
    [ -z "$j" ] || check_index "$j"
    [ "$i" != "$j" ] || die "cannot drain n$i to itself"
    body=$(TO=${j:+http://$HOST:$(node_port "${j:-0}")} DL=${DRAIN_DEADLINE_S:-} python3 -c '
import json, os
b = {}
if os.environ["TO"]: b["to"] = os.environ["TO"]
if os.environ["DL"]: b["deadline_s"] = int(os.environ["DL"])
print(json.dumps(b))')
    log "draining n$i${j:+ to n$j}: POST /v1/admin/drain $body"
    local auth=()
    [ -z "${BUD_API_KEY:-}" ] || auth=(-H "Authorization: Bearer $BUD_API_KEY")
    answer=$(curl -sS -m $((${DRAIN_DEADLINE_S:-300} + 120)) -w '\n%{http_code}' "${auth[@]}" \
        -H 'content-type: application/json' -d "$body" \
        "http://$HOST:$(node_port "$i")/v1/admin/drain") || die "drain request to n$i failed"
    code=${answer##*$'\n'}
    answer=${answer%$'\n'*}
    echo "$answer"
    [ "$code" = 200 ] || die "n$i answered $code to the drain"
    moved=$(python3 -c '
import json, sys
for m in json.loads(sys.argv[1]).get("moved", []):
    print(m["id"], m["node"])' "$answer") || die "cannot read the drain's answer"
    local id node count=0
    while read -r id node; do
        [ -n "$id" ] || continue
        move_id "$id" "$node"
        count=$((count + 1))
    done <<<"$moved"
    log "n$i drained; $count moved id(s) routed to their new node (moved.map)"
}

cmd_undrain() {
    resolve_dir
    local i=${1:-} auth=()
    [ -n "$i" ] || die "usage: cluster.sh undrain I"
    check_index "$i"
    [ -z "${BUD_API_KEY:-}" ] || auth=(-H "Authorization: Bearer $BUD_API_KEY")
    curl -sS -f -m 30 "${auth[@]}" -X POST "http://$HOST:$(node_port "$i")/v1/admin/undrain" ||
        die "undrain of n$i failed"
    echo
    log "n$i takes work again"
}

# --- status ------------------------------------------------------------------------------------
cmd_status() {
    resolve_dir
    local n i pid state stat
    n=$(node_count)
    if [ "$n" = 0 ]; then echo "no cluster in $CLUSTER_DIR"; return 0; fi
    stat=$( (pid_of "$HA_DIR/pid" >/dev/null && ha_cmd "show stat") 2>/dev/null || true)
    printf '%-6s %-8s %-7s %-6s %-6s %-8s %-16s %s\n' NODE PID STATE PORT AGENT HEALTH AGENT-SAYS "HAPROXY(balanced/node)"
    for i in $(seq "$n"); do
        if pid=$(pid_of "$CLUSTER_DIR/n$i/pid"); then state=running; else pid=-; state=stopped; fi
        printf '%-6s %-8s %-7s %-6s %-6s %-8s %-16s %s\n' "n$i" "$pid" "$state" "$(node_port "$i")" "$(agent_port "$i")" \
            "$(http_code "http://$HOST:$(node_port "$i")/v1/health")" \
            "$(if [ "$state" = running ]; then agent_line "$(agent_port "$i")"; else echo -; fi)" \
            "$(awk -F, -v s="n$i" '$2 == s && $1 == "balanced" {b = $18 "/w" $19} $2 == s && $1 == "node_" s {d = $18} END {print (b ? b : "-") " " (d ? d : "-")}' <<<"$stat")"
    done
    if pid=$(pid_of "$CLUSTER_DIR/redis/pid"); then
        echo "redis  pid $pid port $(redis_port): $(redis-cli -p "$(redis_port)" ping 2>/dev/null || echo 'no answer')"
    else
        echo "redis  stopped (port $(redis_port))"
    fi
    if pid=$(pid_of "$HA_DIR/pid"); then
        echo "front  pid $pid http://$HOST:$(front_port) /v1/health: $(http_code "http://$HOST:$(front_port)/v1/health"); socket $SOCK"
    else
        echo "front  stopped (port $(front_port))"
    fi
    echo "moved  $(awk 'NF {n++} END {print n + 0}' "$MAPS/moved.map" 2>/dev/null || echo 0) id(s) in $MAPS/moved.map"
}

cmd=${1:-}
[ $# -eq 0 ] || shift
case $cmd in
    up) cmd_up "$@" ;;
    down) cmd_down ;;
    stop-node) cmd_stop_node "$@" ;;
    drain) cmd_drain "$@" ;;
    undrain) cmd_undrain "$@" ;;
    status) cmd_status ;;
    url) resolve_dir; [ -s "$CLUSTER_DIR/front" ] || die "no cluster up in $CLUSTER_DIR"; cat "$CLUSTER_DIR/front" ;;
    *) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0" >&2; exit 2 ;;
esac
