#!/usr/bin/env bash
# The cluster benchmark of issue 23 (docs/cluster.md#the-benchmark): a 3-node cluster on this
# machine (scripts/cluster.sh: one worker per node, Redis, HAProxy in front), measured side by
# side in one run:
#   (a) latency of a trivial job (POST /v1/exec print(1)), sequential on keep-alive
#       connections, to node n1 directly and through the front, interleaved request by
#       request (the machine's noise hits both alike): p50/p99 and what the front adds;
#   (b) throughput of trivial jobs at concurrency (wrk): each node alone, all nodes directly
#       at once, and through the front (the same clients, pointed at the front);
#   (c) drain of n2 (with sessions) to n3 under a loop of session cells and one-shot jobs
#       through the front: failed requests, cells that lost their state;
#   (d) loss of n3 (SIGKILL) under a load of one-shot jobs through the front: requests not
#       answered within BOUND_S (hung), failures, the other nodes' p99 before and after, and
#       how a sandbox of the lost node answers.
# Prints a table (medians over ROUNDS rounds for (a) and (b)) and exits non-zero if the
# benchmark itself broke (not when a target is missed: it measures and reports).
#
#   scripts/bench-cluster.sh
#   ROUNDS=5 SEQ=4000 scripts/bench-cluster.sh
#   BUD=target/debug/bud BASE_PORT=18600 scripts/bench-cluster.sh
#
# Knobs: NODES (3), WORKERS (1 per node), ROUNDS (3), SEQ (2000 requests per side per round),
# CONC (4 connections per node in (b) and (d)), DURATION (5 s per (b) run), LOSS_S (8 s of
# load before and after the loss), BOUND_S (10), SESSIONS (4 on n2 for (c)), BASE_PORT
# (18550), CLUSTER_DIR (build/bench-cluster), BUD (default: cargo build --release).
# Needs wrk and python3 (wrk installed with apt-get when missing, as root).
# Stops everything it started (the cluster and its clients) on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

NODES=${NODES:-3}
ROUNDS=${ROUNDS:-3}
SEQ=${SEQ:-2000}
CONC=${CONC:-4}
DURATION=${DURATION:-5}
LOSS_S=${LOSS_S:-8}
BOUND_S=${BOUND_S:-10}
SESSIONS=${SESSIONS:-4}
export BASE_PORT=${BASE_PORT:-18550}
export CLUSTER_DIR=${CLUSTER_DIR:-$REPO/build/bench-cluster}
export WORKERS=${WORKERS:-1}
[ "$NODES" -ge 3 ] || { echo "[bench-cluster] needs NODES >= 3 (drains n2 to n3, loses n3)" >&2; exit 2; }

log() { echo "[bench-cluster] $*" >&2; }
if ! command -v wrk >/dev/null; then
    [ "$(id -u)" = 0 ] || { log "wrk is missing: apt-get install wrk"; exit 1; }
    log "installing wrk (apt-get)"
    apt-get update -qq >&2 && apt-get install -y -qq wrk >/dev/null
fi
command -v python3 >/dev/null || { log "needs python3"; exit 1; }

if [ -z "${BUD:-}" ]; then
    log "building bud (cargo build --release)"
    cargo build --release --quiet
    export BUD=$REPO/target/release/bud
fi
export BUD

mkdir -p "$CLUSTER_DIR"
WORK=$CLUSTER_DIR/bench
rm -rf "$WORK"
mkdir -p "$WORK"
CLIENTS=()
cleanup() {
    local pid
    for pid in "${CLIENTS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${CLIENTS[@]}"; do wait "$pid" 2>/dev/null || true; done
    scripts/cluster.sh down || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log "starting a $NODES-node cluster (CLUSTER_DIR=$CLUSTER_DIR, BASE_PORT=$BASE_PORT)"
FRONT=$(scripts/cluster.sh up "$NODES" | tail -1)
node_url() { echo "http://127.0.0.1:$((BASE_PORT + $1))"; }
BODY='{"language":"python","code":"print(1)"}'

# The client: python3 $WORK/client.py MODE ... (http.client, keep-alive, one connection per
# thread). Writes one JSON line of results to stdout.
cat >"$WORK/client.py" <<'EOF'
import http.client, json, statistics, sys, threading, time, urllib.parse

BODY = json.dumps({"language": "python", "code": "print(1)"})
HDRS = {"content-type": "application/json"}

def conn(url, timeout=60):
    u = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)

def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]

def call(c, method, path, body=None, timeout=None):
    """One request on keep-alive connection c (reconnects after an error): (status, body, headers)."""
    try:
        c.request(method, path, body, HDRS)
        r = c.getresponse()
        data = r.read()
        return r.status, data, r
    except Exception as e:  # the connection is dropped; the next request reconnects
        c.close()
        return None, repr(e).encode(), None

def latency(a, b, n):
    """Sequential trivial jobs, alternating a and b request by request."""
    ca, cb = conn(a), conn(b)
    for _ in range(50):  # warm-up: connections, pools
        call(ca, "POST", "/v1/exec", BODY); call(cb, "POST", "/v1/exec", BODY)
    la, lb, bad = [], [], 0
    for i in range(n):
        for c, l in ((ca, la), (cb, lb)) if i % 2 == 0 else ((cb, lb), (ca, la)):
            t = time.perf_counter()
            s, _, _ = call(c, "POST", "/v1/exec", BODY)
            l.append(time.perf_counter() - t)
            bad += s != 200
    ms = lambda x: round(x * 1e3, 3)
    print(json.dumps({"a_p50": ms(pct(la, .5)), "a_p99": ms(pct(la, .99)),
                      "b_p50": ms(pct(lb, .5)), "b_p99": ms(pct(lb, .99)), "failed": bad}))

def drain_loop(front, sessions, stop_file, oneshot_threads):
    """Session cells (n += 1, checked) and one-shot jobs through the front until stop_file."""
    import os
    lock = threading.Lock()
    res = {"requests": 0, "failed": 0, "state_lost": 0, "errors": {}}
    def note(ok, what):
        with lock:
            res["requests"] += 1
            if not ok:
                res["failed"] += 1
                res["errors"][what] = res["errors"].get(what, 0) + 1
    def cells(sid):
        c = conn(front, 120)
        expect, last = None, None
        while not os.path.exists(stop_file):
            t = time.time()
            s, d, r = call(c, "POST", f"/v1/sessions/{sid}/exec",
                           json.dumps({"code": "n = globals().get('n', 0) + 1\nprint(n)"}))
            if s != 200:
                note(False, f"cell {s} {d[:160].decode(errors='replace')}")
                continue
            got = int(json.loads(d)["stdout"].strip())
            now = (r.getheader("x-bud-node"), round(t, 3), round(time.time(), 3))
            if expect is not None and got != expect:
                with lock:
                    res["state_lost"] += 1
                    res.setdefault("state_examples", []).append(
                        f"{sid}: expected n={expect}, got {got}; previous cell (node, sent, answered) {last}, this one {now}")
            expect, last = got + 1, now
            note(True, "")
    def oneshot():
        c = conn(front, 120)
        while not os.path.exists(stop_file):
            s, d, _ = call(c, "POST", "/v1/exec", BODY)
            note(s == 200, f"exec {s} {d[:160].decode(errors='replace')}")
    ts = [threading.Thread(target=cells, args=(s,)) for s in sessions]
    ts += [threading.Thread(target=oneshot) for _ in range(oneshot_threads)]
    for t in ts: t.start()
    for t in ts: t.join()
    print(json.dumps(res))

def loss_loop(front, threads, bound, stop_file, mark_file):
    """One-shot jobs through the front until stop_file; each request is 'before' or 'after'
    by whether mark_file existed when it started. A request over bound seconds is hung."""
    import os
    lock = threading.Lock()
    rows = []  # (phase, server, seconds, status)
    def worker():
        c = conn(front, bound)
        while not os.path.exists(stop_file):
            phase = "after" if os.path.exists(mark_file) else "before"
            t = time.perf_counter()
            s, d, r = call(c, "POST", "/v1/exec", BODY)
            dt = time.perf_counter() - t
            srv = r.getheader("x-bud-node", "-") if r is not None else "-"
            code = s if s is not None else ("timeout" if "timed out" in d.decode() else d.decode()[:60])
            with lock:
                rows.append((phase, srv, dt, code))
    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts: t.start()
    for t in ts: t.join()
    out = {"requests": len(rows), "hung": sum(1 for r in rows if r[2] >= bound),
           "max_s": round(max((r[2] for r in rows), default=0), 3), "errors": {}, "p99_ms": {}}
    for ph, srv, dt, code in rows:
        if code != 200:
            k = f"{ph} {code}"
            out["errors"][k] = out["errors"].get(k, 0) + 1
    for ph in ("before", "after"):
        for srv in sorted({r[1] for r in rows}):
            xs = [r[2] for r in rows if r[0] == ph and r[1] == srv and r[3] == 200]
            if xs:
                out["p99_ms"][f"{ph} {srv}"] = [len(xs), round(pct(xs, .99) * 1e3, 2)]
    print(json.dumps(out))

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "latency":
        latency(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif mode == "drain":
        drain_loop(sys.argv[2], sys.argv[3].split(","), sys.argv[4], int(sys.argv[5]))
    elif mode == "loss":
        loss_loop(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5], sys.argv[6])
EOF
cat >"$WORK/post.lua" <<EOF
wrk.method = "POST"
wrk.body = '$BODY'
wrk.headers["Content-Type"] = "application/json"
EOF
client() { python3 "$WORK/client.py" "$@"; }
median() { python3 -c 'import statistics, sys; v = [float(x) for x in sys.argv[1:]]; print(round(statistics.median(v), 3) if v else "n/a")' "$@"; }
json_get() { python3 -c 'import json, sys; d = json.loads(sys.argv[1])
for k in sys.argv[2:]: d = d[k]
print(d)' "$@"; }

# wrk against each URL at once (one wrk, one thread, CONC connections each): sets RPS (total
# requests/s) and BAD (non-2xx answers and socket errors).
wrk_at_once() { # label urls...
    local label=$1 url i=0 pids=()
    shift
    for url in "$@"; do
        wrk -t1 -c"$CONC" -d"${DURATION}s" --timeout 30s -s "$WORK/post.lua" "$url/v1/exec" >"$WORK/wrk-$label-$i.txt" 2>&1 &
        pids+=("$!")
        CLIENTS+=("$!")
        i=$((i + 1))
    done
    for url in "${pids[@]}"; do wait "$url"; done
    read -r RPS BAD < <(python3 - "$WORK"/wrk-"$label"-*.txt <<'EOF'
import re, sys
rps = bad = 0.0
for f in sys.argv[1:]:
    t = open(f).read()
    rps += float(re.search(r"Requests/sec:\s+([\d.]+)", t).group(1))
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", t)
    bad += int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", t)
    bad += sum(int(x) for x in m.groups()) if m else 0
print(f"{rps:.1f} {int(bad)}")
EOF
)
}

# --- (a) latency ---------------------------------------------------------------------------
A_DIRECT=() A_FRONT=() A_DIRECT99=() A_FRONT99=() A_ADDED=() A_FAILED=0
for r in $(seq "$ROUNDS"); do
    log "(a) round $r/$ROUNDS: $SEQ sequential trivial jobs each to n1 and through the front, interleaved"
    out=$(client latency "$(node_url 1)" "$FRONT" "$SEQ")
    A_DIRECT+=("$(json_get "$out" a_p50)") A_DIRECT99+=("$(json_get "$out" a_p99)")
    A_FRONT+=("$(json_get "$out" b_p50)") A_FRONT99+=("$(json_get "$out" b_p99)")
    A_ADDED+=("$(python3 -c "print(round($(json_get "$out" b_p50) - $(json_get "$out" a_p50), 3))")")
    A_FAILED=$((A_FAILED + $(json_get "$out" failed)))
done

# --- (b) throughput --------------------------------------------------------------------------
B_SUM=() B_DIRECT=() B_FRONT=() B_BAD=0
for r in $(seq "$ROUNDS"); do
    sum=0
    for i in $(seq "$NODES"); do
        log "(b) round $r/$ROUNDS: n$i alone, ${DURATION}s at concurrency $CONC"
        wrk_at_once "alone$i-$r" "$(node_url "$i")"
        sum=$(python3 -c "print($sum + $RPS)")
        B_BAD=$((B_BAD + BAD))
    done
    B_SUM+=("$sum")
    urls=() fronts=()
    for i in $(seq "$NODES"); do urls+=("$(node_url "$i")"); fronts+=("$FRONT"); done
    log "(b) round $r/$ROUNDS: all nodes directly at once, then the same clients through the front"
    wrk_at_once "direct-$r" "${urls[@]}"
    B_DIRECT+=("$RPS")
    B_BAD=$((B_BAD + BAD))
    wrk_at_once "front-$r" "${fronts[@]}"
    B_FRONT+=("$RPS")
    B_BAD=$((B_BAD + BAD))
done

# --- (c) drain ---------------------------------------------------------------------------------
log "(c) $SESSIONS sessions on n2, cells and one-shot jobs through the front; drain n2 to n3"
sids=()
for _ in $(seq "$SESSIONS"); do
    sid=$(curl -sf "$(node_url 2)/v1/sessions" -H 'content-type: application/json' -d '{"idle_timeout_s": 600}' |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["id"])')
    sids+=("$sid")
done
rm -f "$WORK/stop-c"
client drain "$FRONT" "$(IFS=,; echo "${sids[*]}")" "$WORK/stop-c" 2 >"$WORK/drain.json" &
CLIENTS+=("$!")
LOOP=$!
sleep 3
t0=$(date +%s.%N)
if scripts/cluster.sh drain 2 3 >"$WORK/drain-answer.json" 2>"$WORK/drain.log"; then C_OK=yes; else C_OK=no; fi
C_SECS=$(python3 -c "print(round($(date +%s.%N) - $t0, 2))")
sleep 3
touch "$WORK/stop-c"
wait "$LOOP"
C_MOVED=$(python3 -c 'import json, sys; print(len(json.load(open(sys.argv[1])).get("moved", [])))' "$WORK/drain-answer.json" 2>/dev/null || echo "?")
[ $C_OK = yes ] || { log "the drain failed:"; cat "$WORK/drain.log" "$WORK/drain-answer.json" >&2 || true; }
curl -s -o /dev/null -X POST "$(node_url 2)/v1/admin/undrain" || true

# --- (d) node loss ---------------------------------------------------------------------------
log "(d) one-shot jobs through the front ($((CONC * NODES)) connections): ${LOSS_S}s, kill n3, ${LOSS_S}s more"
lost_sid=$(curl -sf "$(node_url 3)/v1/sessions" -H 'content-type: application/json' -d '{}' |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["id"])' || echo "")
rm -f "$WORK/stop-d" "$WORK/mark-d"
client loss "$FRONT" $((CONC * NODES)) "$BOUND_S" "$WORK/stop-d" "$WORK/mark-d" >"$WORK/loss.json" &
CLIENTS+=("$!")
LOOP=$!
sleep "$LOSS_S"
touch "$WORK/mark-d"
scripts/cluster.sh stop-node 3
sleep "$LOSS_S"
touch "$WORK/stop-d"
wait "$LOOP"
D_SANDBOX="n/a"
if [ -n "$lost_sid" ]; then
    D_SANDBOX=$(curl -s -m "$BOUND_S" -w ' %{http_code} %{time_total}s' "$FRONT/v1/sessions/$lost_sid" || echo "no answer")
fi

# --- the table -----------------------------------------------------------------------------------
echo "$D_SANDBOX" >"$WORK/lost-sandbox.txt"
A_DIRECT="${A_DIRECT[*]}" A_FRONT="${A_FRONT[*]}" A_DIRECT99="${A_DIRECT99[*]}" A_FRONT99="${A_FRONT99[*]}" \
A_ADDED="${A_ADDED[*]}" B_SUM="${B_SUM[*]}" B_DIRECT="${B_DIRECT[*]}" B_FRONT="${B_FRONT[*]}" \
A_FAILED=$A_FAILED B_BAD=$B_BAD C_SECS=$C_SECS C_MOVED=$C_MOVED C_OK=$C_OK ROUNDS=$ROUNDS SEQ=$SEQ \
CONC=$CONC NODES=$NODES BOUND_S=$BOUND_S python3 - "$WORK" <<'EOF'
import json, os, statistics, sys
e, work = os.environ, sys.argv[1]
med = lambda k: statistics.median(float(x) for x in e[k].split())
c = json.load(open(f"{work}/drain.json"))
d = json.load(open(f"{work}/loss.json"))
b_sum, b_direct, b_front = med("B_SUM"), med("B_DIRECT"), med("B_FRONT")
print(f"\nbud cluster benchmark: {e['NODES']} nodes x {e['WORKERS']} worker(s), HAProxy in front; "
      f"(a) and (b): medians of {e['ROUNDS']} rounds")
row = lambda m, v, t="": print(f"{m:62} {str(v):>20} {t:>10}")
row("measure", "value", "target")
row(f"(a) trivial job p50, n1 directly ({e['SEQ']} sequential)", f"{med('A_DIRECT'):.3f} ms")
row("(a) trivial job p50, through the front", f"{med('A_FRONT'):.3f} ms")
row("(a) p99 directly / through the front", f"{med('A_DIRECT99'):.2f} / {med('A_FRONT99'):.2f} ms")
row("(a) added by the front to p50 (median of the rounds')", f"{med('A_ADDED'):+.3f} ms", "<= 0.3 ms")
row("(a) failed requests", e["A_FAILED"], "0")
row(f"(b) jobs/s, sum of each node alone (c={e['CONC']} each)", f"{b_sum:.0f}")
row("(b) jobs/s, all nodes directly at once", f"{b_direct:.0f}")
row("(b) jobs/s, through the front (the same clients)", f"{b_front:.0f}")
row("(b) front / sum of the nodes alone", f"{b_front / b_sum:.2f}", ">= 0.90")
row("(b) front / all nodes directly at once", f"{b_front / b_direct:.2f}")
row("(b) non-2xx answers and socket errors", e["B_BAD"], "0")
row("(c) drain n2 -> n3: took, ids moved" + ("" if e["C_OK"] == "yes" else " (DRAIN FAILED)"),
    f"{e['C_SECS']} s, {e['C_MOVED']}")
row("(c) requests during the drain: total / failed", f"{c['requests']} / {c['failed']}", "0 failed")
row("(c) cells that lost their session's state", c["state_lost"], "0")
for x in c.get("state_examples", [])[:3]:
    print(f"    {x}")
for k, v in c["errors"].items():
    row(f"    {k[:58]}", v)
row(f"(d) loss of n3: requests / not answered within {e['BOUND_S']} s", f"{d['requests']} / {d['hung']}", "0 hung")
row("(d) slowest answer", f"{d['max_s']} s")
for k, v in sorted(d["errors"].items()):
    row(f"(d) failed: {k}", v)
for n in range(1, int(e["NODES"]) + 1):
    if n == 3:
        continue
    b, a = d["p99_ms"].get(f"before n{n}"), d["p99_ms"].get(f"after n{n}")
    if b and a:
        row(f"(d) n{n} p99 before / after ({b[0]} / {a[0]} requests)", f"{b[1]:.1f} / {a[1]:.1f} ms")
        row(f"(d) n{n} p99 after / before", f"{a[1] / b[1]:.2f}x", "<= 2x")
print("(d) a sandbox of n3 through the front after the loss:")
print("    " + open(f"{work}/lost-sandbox.txt").read().strip())
EOF
log "raw outputs in $WORK"
