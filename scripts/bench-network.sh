#!/usr/bin/env bash
# Bytes through a sandbox's network card (docs/network.md), reported, never asserted: a
# `bud serve --network` session downloads and uploads MIB MiB (default 16) to a TCP server
# this script starts on 127.0.0.1 (named bulk.test by --egress-hosts, opened by
# --egress-allow-private), ROUNDS cells (default 2) of down, up, down, up. Prints each
# transfer's MiB/s as the guest times it, and each cell's emulated guest-kernel
# instructions (timings.kvm.emulated_instructions) and run time; beside them, the same
# transfers between two host processes over loopback.
#
# Usage: scripts/bench-network.sh [MIB] [ROUNDS]
# Starts its own servers (release build) on $PORT and $PORT+1 (default 18791), stopped by pid
# at exit. Nothing leaves the machine.
set -euo pipefail
cd "$(dirname "$0")/.."

MIB=${1:-16}
ROUNDS=${2:-2}
PORT=${PORT:-18791}
PEER_PORT=$((PORT + 1))
WORK=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT

cargo build --release --quiet
cat > "$WORK/peer.py" <<'PY'
import socket, sys, threading
n = int(sys.argv[2]) << 20
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(("127.0.0.1", int(sys.argv[1])))
l.listen(16)
def serve(c):
    if c.recv(1) == b"d":
        block = b"x" * (1 << 20)
        for _ in range(n >> 20):
            c.sendall(block)
    else:
        got = 0
        while True:
            b = c.recv(1 << 20)
            if not b:
                break
            got += len(b)
        c.sendall(str(got).encode())
    c.close()
while True:
    c, _ = l.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
PY
cat > "$WORK/transfer.py" <<'PY'
import socket, sys, time
host, port, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def down():
    s = socket.create_connection((host, port), timeout=120)
    s.sendall(b"d")
    t, n = time.perf_counter(), 0
    while True:
        b = s.recv(1 << 20)
        if not b:
            break
        n += len(b)
    return n, time.perf_counter() - t
def up():
    s = socket.create_connection((host, port), timeout=120)
    s.sendall(b"u")
    block, t = b"y" * (1 << 20), time.perf_counter()
    for _ in range(mib):
        s.sendall(block)
    s.shutdown(socket.SHUT_WR)
    n = int(s.recv(100))
    return n, time.perf_counter() - t
for f in (down, up, down, up):
    n, dt = f()
    assert n == mib << 20, (f.__name__, n)
    print(f"{f.__name__} {n / dt / 2**20:.2f}")
PY
echo "bulk.test 127.0.0.1" > "$WORK/hosts"
python3 "$WORK/peer.py" "$PEER_PORT" "$MIB" &
pids+=($!)
./target/release/bud serve --port "$PORT" --network --egress-hosts "$WORK/hosts" \
    --egress-allow-private 127.0.0.1 >"$WORK/serve.log" 2>&1 &
pids+=($!)
URL="http://127.0.0.1:$PORT"
for _ in $(seq 1 600); do
    curl -sf "$URL/v1/health" >/dev/null && break
    sleep 0.5
done
curl -sf "$URL/v1/health" >/dev/null || { echo "bud serve did not start:"; cat "$WORK/serve.log"; exit 1; }

echo "host (two processes over loopback), MiB/s:"
python3 "$WORK/transfer.py" 127.0.0.1 "$PEER_PORT" "$MIB" | sed 's/^/  /'
echo "bud (a session's cell through its card), MiB/s:"
URL="$URL" MIB="$MIB" ROUNDS="$ROUNDS" PEER_PORT="$PEER_PORT" CODE="$WORK/transfer.py" python3 - <<'PY'
import json, os, urllib.request
url = os.environ["URL"]
def call(method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    r = urllib.request.Request(url + path, data=data, method=method,
                               headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=600) as resp:
        return json.loads(resp.read() or b"null")
s = call("POST", "/v1/sessions",
         {"network": {"allow_out": ["bulk.test"], "deny_out": ["0.0.0.0/0"]}})
code = open(os.environ["CODE"]).read().replace(
    "host, port, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])",
    f"host, port, mib = 'bulk.test', {os.environ['PEER_PORT']}, {os.environ['MIB']}")
for i in range(int(os.environ["ROUNDS"])):
    r = call("POST", f"/v1/sessions/{s['id']}/exec", {"code": code, "timeout_ms": 60000})
    assert r["status"] == "ok", r
    figures = " ".join(r["stdout"].split())
    print(f"  cell {i + 1}: {figures}; emulated instructions "
          f"{r['timings']['kvm']['emulated_instructions']}, run {r['timings']['run_ms'] / 1000:.1f} s")
call("DELETE", f"/v1/sessions/{s['id']}")
PY
