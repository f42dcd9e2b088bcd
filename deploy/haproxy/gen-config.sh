#!/usr/bin/env bash
# Writes the HAProxy (2.6) configuration of a bud cluster's front: one front port over a fixed
# list of bud nodes. See docs/cluster.md for what it does and why.
#
#   deploy/haproxy/gen-config.sh --nodes FILE --port PORT --socket PATH --maps DIR \
#       [--listen ADDR] [--log TARGET] [--threads N] [--stats-port PORT] [--out FILE]
#
#   --nodes FILE     the nodes, one a line: `ID HOST:PORT AGENT_PORT` (`#` comments and blank
#                    lines are skipped); ID is the node id of `bud serve --node-id`
#   --port PORT      the front's port (on --listen, default 127.0.0.1; 0.0.0.0 for all)
#   --socket PATH    the runtime API (stats) socket, `level admin`
#   --maps DIR       where moved.map lives (made empty if missing, kept if present) and the
#                    nodes' error pages (node-ID.503.http, ...) are written
#   --log TARGET     HAProxy's `log` target: `stderr` (default), a syslog address
#                    (`127.0.0.1:514`) or `none`; only errors are logged (dontlog-normal)
#   --threads N      nbthread (default 1: the front shares its machine with the nodes)
#   --stats-port P   also serve HAProxy's stats page on 127.0.0.1:P/stats
#   --out FILE       write the configuration there (default: stdout)
#
# Routing: a request that names a sandbox (session or snapshot id, in its path, its
# E2b-Sandbox-Id header, its Host `<port>-<id>.<domain>` or the JSON body of a create from a
# snapshot) goes to backend node_<node>, where <node> is the id's 2nd `_` field, or the node
# moved.map gives for the id (`<id> <node>` lines; change it at run time with `add map` /
# `set map` on the socket). Everything else goes to backend `balanced`: weighted by
# each node's agent (`ready up NN%`, `drain`, `down`), round robin. Check with `haproxy -c -f FILE`.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0" >&2; exit 2; }

nodes_file='' port='' socket='' maps='' listen=127.0.0.1 log=stderr threads=1 stats_port='' out=''
while [ $# -gt 0 ]; do
    case $1 in
        --nodes) nodes_file=$2; shift 2 ;;
        --port) port=$2; shift 2 ;;
        --socket) socket=$2; shift 2 ;;
        --maps) maps=$2; shift 2 ;;
        --listen) listen=$2; shift 2 ;;
        --log) log=$2; shift 2 ;;
        --threads) threads=$2; shift 2 ;;
        --stats-port) stats_port=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        -h|--help) usage ;;
        *) echo "gen-config.sh: unknown argument $1" >&2; usage ;;
    esac
done
if [ -z "$nodes_file" ] || [ -z "$port" ] || [ -z "$socket" ] || [ -z "$maps" ]; then usage; fi
[ -r "$nodes_file" ] || { echo "gen-config.sh: cannot read $nodes_file" >&2; exit 1; }
is_port() { [[ $1 =~ ^[0-9]+$ ]] && [ "$1" -ge 1 ] && [ "$1" -le 65535 ]; }
is_port "$port" || { echo "gen-config.sh: bad --port $port" >&2; exit 1; }
[ -z "$stats_port" ] || is_port "$stats_port" || { echo "gen-config.sh: bad --stats-port" >&2; exit 1; }
[[ $threads =~ ^[1-9][0-9]*$ ]] || { echo "gen-config.sh: bad --threads $threads" >&2; exit 1; }

# HAProxy reads map and error files by the path the configuration gives, and the runtime API
# names a map by that same path: make it absolute.
mkdir -p "$maps"
maps=$(cd "$maps" && pwd)
case $socket in /*) ;; *) socket=$PWD/$socket ;; esac
moved=$maps/moved.map
[ -e "$moved" ] || : >"$moved"

ids=() addrs=() agents=()
while read -r id addr agent rest; do
    case $id in ''|'#'*) continue ;; esac
    if ! [[ $id =~ ^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$ ]]; then
        echo "gen-config.sh: bad node id '$id' (1-63 of [a-z0-9-], no '-' at either end)" >&2; exit 1
    fi
    if ! [[ $addr =~ ^[^[:space:]]+:[0-9]+$ ]] || ! is_port "$agent" || [ -n "$rest" ]; then
        echo "gen-config.sh: bad node line '$id $addr $agent $rest' (want: ID HOST:PORT AGENT_PORT)" >&2; exit 1
    fi
    for seen in "${ids[@]}"; do
        [ "$seen" != "$id" ] || { echo "gen-config.sh: node $id listed twice" >&2; exit 1; }
    done
    ids+=("$id") addrs+=("$addr") agents+=("$agent")
done <"$nodes_file"
[ ${#ids[@]} -gt 0 ] || { echo "gen-config.sh: no nodes in $nodes_file" >&2; exit 1; }

# HAProxy's own answers for a node's backend, as full HTTP responses (errorfile): 503 when it
# could not connect (after its retry), 502 when the node closed the connection without an
# answer (killed mid-request). Both say which node, with status 502.
error_page() { # file status reason code message node
    local body
    body=$(printf '{"error":{"code":"%s","message":"%s","node":"%s"}}' "$4" "$5" "$6")
    printf 'HTTP/1.1 %s %s\r\ncontent-type: application/json\r\ncache-control: no-cache\r\nconnection: close\r\ncontent-length: %s\r\n\r\n%s' \
        "$2" "$3" "${#body}" "$body" >"$1"
}
for id in "${ids[@]}"; do
    error_page "$maps/node-$id.503.http" 502 "Bad Gateway" node_down \
        "node $id, which holds this sandbox, is down: the front cannot connect to it" "$id"
    error_page "$maps/node-$id.502.http" 502 "Bad Gateway" node_down \
        "node $id, which holds this sandbox, closed the connection without an answer: it is down or was lost mid-request" "$id"
done
body='{"error":{"code":"no_node","message":"no bud node is up and taking work (all down or draining)"}}'
printf 'HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncache-control: no-cache\r\nconnection: close\r\nretry-after: 1\r\ncontent-length: %s\r\n\r\n%s' \
    "${#body}" "$body" >"$maps/balanced.503.http"
body='{"error":{"code":"node_lost","message":"the node running this request closed the connection without an answer (it was lost mid-request); the job may have run"}}'
printf 'HTTP/1.1 502 Bad Gateway\r\ncontent-type: application/json\r\ncache-control: no-cache\r\nconnection: close\r\ncontent-length: %s\r\n\r\n%s' \
    "${#body}" "$body" >"$maps/balanced.502.http"

case $log in
    none) log_line="    # no logging (--log none)" ;;
    stderr) log_line="    log stderr format raw local0 info" ;;
    *) log_line="    log $log local0 info" ;;
esac

# Health: /v1/health is 200 once the node's template is ready (and while it drains: it still
# serves its sandboxes). Down after 3 failed checks (1 s apart, 0.5 s once failing) or at once
# on a failed connection from real traffic (observe layer4); up after 2 good ones.
# Not "on-marked-down shutdown-sessions": it also cuts the request whose failed connection
# marked the server down, while it is being redispatched (seen: client got no answer, D---).
check="check inter 1s fastinter 500ms downinter 1s fall 3 rise 2 observe layer4 error-limit 1 on-error mark-down"

# The front's rules for finding the sandbox a request names (txn.sid), written from
# sandbox-places beside this script: the places bud's own routing reads, in its order (a
# test in server/ keeps that file equal to the server's code). The first place found wins.
places=$(dirname "$0")/sandbox-places
[ -r "$places" ] || { echo "gen-config.sh: cannot read $places" >&2; exit 1; }
sandbox_rules() {
    local kind a b creates=()
    echo "    # Which sandbox the request names (txn.sid), if any: the places of sandbox-places,"
    echo "    # in bud's own order; the first form found wins."
    while read -r kind a b; do
        case $kind in
            ''|'#'*) continue ;;
            header)
                echo "    http-request set-var(txn.sid) req.hdr($a) if !{ var(txn.sid) -m found } { req.hdr($a) -m found }" ;;
            prefix)
                # The id is the path field after the prefix: /v1/sessions/ID is field 4 of '/'.
                local slashes=${a//[^\/]/}
                echo "    http-request set-var(txn.sid) path,field($(( ${#slashes} + 1 )),/) if !{ var(txn.sid) -m found } { path_reg ^$a[^/]+ }" ;;
            host)
                # Host <port>-<id>.<domain>: bud reads the id from the header $a, which the
                # front adds when it is missing.
                echo "    acl host_form req.hdr(host),field(1,:),field(1,.) -m reg ^[0-9]+-(ses|snap)_"
                echo "    http-request set-var(txn.hsid) req.hdr(host),field(1,:),field(1,.),regsub(^[0-9]+-,) if host_form !{ req.hdr($a) -m found }"
                echo "    http-request set-header $a %[var(txn.hsid)] if { var(txn.hsid) -m found }"
                echo "    http-request set-var(txn.sid) var(txn.hsid) if !{ var(txn.sid) -m found } { var(txn.hsid) -m found }" ;;
            create) creates+=("$a $b") ;;
            *) echo "gen-config.sh: unknown place '$kind' in $places" >&2; exit 1 ;;
        esac
    done <"$places"
    [ ${#creates[@]} -gt 0 ] || return 0
    echo "    # Creates from a snapshot name it in their JSON body: wait for the body (up to 2 s or a"
    echo "    # full buffer) of these requests only, and read it."
    echo "    acl has_sid var(txn.sid) -m found"
    local c path field i=0 waits=()
    for c in "${creates[@]}"; do
        read -r path field <<<"$c"
        echo "    acl create_$i path $path"
        waits+=("METH_POST !has_sid create_$i")
        i=$(( i + 1 ))
    done
    local joined=${waits[0]}
    for (( i = 1; i < ${#waits[@]}; i++ )); do joined+=" or ${waits[i]}"; done
    echo "    http-request wait-for-body time 2s if $joined"
    i=0
    for c in "${creates[@]}"; do
        read -r path field <<<"$c"
        echo "    http-request set-var(txn.sid) req.body,json_query('\$.$field') if METH_POST !has_sid create_$i"
        i=$(( i + 1 ))
    done
}

emit() {
    cat <<EOF
# Generated by deploy/haproxy/gen-config.sh from $nodes_file: do not edit, regenerate.
# Front of a bud cluster (docs/cluster.md). Nodes: ${ids[*]}.

global
$log_line
    stats socket $socket mode 600 level admin
    stats timeout 1m
    nbthread $threads
    # No chroot and no user switch: the cluster script runs this as whoever runs it.

defaults
    mode http
    log global
    option httplog
    # Log only errors and abnormal ends (a log line per request costs latency).
    option dontlog-normal
    # Keep-alive to the clients and to the nodes (HAProxy's default, said out loud): idle
    # server connections are reused by later requests ("safe": never a session's first).
    option http-keep-alive
    http-reuse safe
    timeout connect 2s
    # A job runs up to 60 s, a drain waits up to its deadline (300 s by default), streams and
    # long polls are quiet between events and keepalives: 10 min of silence ends a request.
    timeout client 10m
    timeout server 10m
    timeout tunnel 1h
    timeout client-fin 10s
    timeout server-fin 10s
    timeout http-request 15s
    timeout http-keep-alive 60s
    timeout queue 30s
    timeout check 3s
    # Retries: only where the request provably never started (see each backend).
    retries 1
    retry-on conn-failure
    option httpchk GET /v1/health
    http-check expect status 200
    default-server $check

frontend bud
    bind $listen:$port
EOF
    sandbox_rules
    cat <<EOF
    # Only an id of bud's form (ses_<node>_..., snap_<node>_...) names a node.
    http-request unset-var(txn.sid) if { var(txn.sid) -m found } !{ var(txn.sid) -m reg ^(ses|snap)_[a-z0-9-]+_ }
    # Its node: moved.map's (ids a drain moved), else the id's 2nd '_' field.
    http-request set-var(txn.node) var(txn.sid),map($moved) if { var(txn.sid) -m found }
    http-request set-var(txn.node) var(txn.sid),field(2,_) if { var(txn.sid) -m found } !{ var(txn.node) -m found }
    # A node the front does not know has no backend node_<id>: HAProxy 2.6 then applies
    # default_backend (configuration.txt, use_backend), and the node that gets it answers
    # 421 wrong_node naming the node.
    use_backend node_%[var(txn.node)] if { var(txn.node) -m found }
    default_backend balanced

# Everything that names no sandbox: the least-loaded node. Each node's agent sets its weight
# (ready up NN%: NN of 100, the node's idle share, smoothed over about a second), drains it
# (drain) or takes it out (down, until its template is ready). Round robin over those
# weights, not leastconn: this backend sees only the requests it balances, not a node's
# session cells (backend node_<id>) or processes, which the agent's weight does; and
# leastconn ranks every server with none of its own requests in flight equal whatever its
# weight (HAProxy's lb_fwlc keys an idle server 0), so a node busy with session cells got
# its full share of one-shot jobs. Retried, on another node, only when it never started: the connection failed, or
# bud answered 503 (not ready, draining, memory budget: answered before any job starts).
backend balanced
    balance roundrobin
    retry-on conn-failure 503
    # Have the whole request before sending it: HAProxy 2.6 keeps a request for a 503 retry
    # only if it was complete when first sent, and on a reused (keep-alive) server connection
    # it can be sent before that (seen: 13 of 60 503s passed to a keep-alive client unretried
    # without this, 0 of 200 with it).
    option http-buffer-request
    retries 3
    option redispatch 1
    errorfile 503 $maps/balanced.503.http
    errorfile 502 $maps/balanced.502.http
EOF
    local i
    for i in "${!ids[@]}"; do
        echo "    server ${ids[i]} ${addrs[i]} weight 100 agent-check agent-port ${agents[i]} agent-inter 1s"
    done
    for i in "${!ids[@]}"; do
        cat <<EOF

# Sandboxes of node ${ids[i]}: its one server, no agent (a draining node still serves its
# sandboxes). Retried once on a failed connection, never on anything else.
backend node_${ids[i]}
    http-request return status 502 content-type application/json string '{"error":{"code":"node_down","message":"node ${ids[i]}, which holds this sandbox, is down","node":"${ids[i]}"}}' if { nbsrv lt 1 }
    errorfile 503 $maps/node-${ids[i]}.503.http
    errorfile 502 $maps/node-${ids[i]}.502.http
    server ${ids[i]} ${addrs[i]}
EOF
    done
    if [ -n "$stats_port" ]; then
        cat <<EOF

listen stats
    bind 127.0.0.1:$stats_port
    stats enable
    stats uri /stats
    stats refresh 5s
EOF
    fi
}

if [ -n "$out" ]; then
    emit >"$out.tmp"
    mv "$out.tmp" "$out"
else
    emit
fi
