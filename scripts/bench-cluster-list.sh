#!/usr/bin/env bash
# The cluster-wide sandbox list (docs/cluster.md#the-cluster-wide-list), measured: E2B's
# `GET /v2/sandboxes` through the front, with the same number of sandboxes (TOTAL, default
# 60: a node holds 64 sessions by default) on one node and spread over three (each node
# publishes its rows to Redis; a list reads the other nodes' rows from it). Also how soon a sandbox made on one node shows in a
# list answered by another. Prints medians of REPS lists (default 50).
#
#   scripts/bench-cluster-list.sh
#   TOTAL=300 REPS=100 BUD=target/debug/bud scripts/bench-cluster-list.sh
#
# Starts its clusters with scripts/cluster.sh (CLUSTER_DIR build/bench-cluster-list, ports
# from BASE_PORT, 18750) and stops them on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
TOTAL=${TOTAL:-60}
REPS=${REPS:-50}
export BASE_PORT=${BASE_PORT:-18750}
export CLUSTER_DIR=${CLUSTER_DIR:-$PWD/build/bench-cluster-list}
if [ -z "${BUD:-}" ]; then
    cargo build --release >&2
    export BUD=$PWD/target/release/bud
fi
trap 'scripts/cluster.sh down >/dev/null 2>&1 || true' EXIT

measure() { # NODES -> one result line
    local nodes=$1 front
    front=$(scripts/cluster.sh up "$nodes" | tail -n 1)
    python3 - "$front" "$nodes" "$TOTAL" "$REPS" <<'PY'
import http.client, json, statistics, sys, time, urllib.parse
front, nodes, total, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
u = urllib.parse.urlparse(front)
conn = http.client.HTTPConnection(u.hostname, u.port)
def call(method, path, body=None):
    conn.request(method, path, body=json.dumps(body) if body is not None else None,
                 headers={"content-type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    return r.status, r.getheader("x-bud-node"), data
ids = []
for i in range(total):
    s, _, d = call("POST", "/v2/sandboxes", {"templateID": "python", "timeout": 600,
                                              "metadata": {"bench": "list"}})
    assert s == 201, (s, d)
    ids.append(json.loads(d)["sandboxID"])
spread = sorted({i.split("_")[1] for i in ids})
time.sleep(1.5)  # every node has published
times, seen = [], 0
for _ in range(reps):
    t = time.perf_counter()
    s, _, d = call("GET", "/v2/sandboxes?limit=100")
    times.append((time.perf_counter() - t) * 1e3)
    assert s == 200, (s, d)
    seen = len(json.loads(d))
# How soon a new sandbox made on some node shows in a list answered by another.
lags = []
for _ in range(10 if nodes > 1 else 0):
    s, made_on, d = call("POST", "/v2/sandboxes", {"templateID": "python", "timeout": 600})
    new = json.loads(d)["sandboxID"]
    t = time.perf_counter()
    while True:
        s, by, d = call("GET", "/v2/sandboxes?limit=100&order=desc")
        if by != made_on and any(x["sandboxID"] == new for x in json.loads(d)):
            break
        if time.perf_counter() - t > 5:
            raise SystemExit("a new sandbox did not show in 5 s")
    lags.append((time.perf_counter() - t) * 1e3)
    call("DELETE", f"/sandboxes/{new}")
for i in ids:
    call("DELETE", f"/sandboxes/{i}")
lag = f"{statistics.median(lags):.0f} ms" if lags else "-"
print(f"{nodes} node(s), {total} sandboxes on {','.join(spread)}: list of {seen} "
      f"p50 {statistics.median(times):.2f} ms, p90 {sorted(times)[int(reps*0.9)-1]:.2f} ms; "
      f"a new sandbox in another node's list after (p50 of 10) {lag}")
PY
    scripts/cluster.sh down >/dev/null 2>&1
}

measure 1
measure 3
