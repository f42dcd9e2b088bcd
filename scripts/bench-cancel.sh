#!/usr/bin/env bash
# How fast a job is cancelled when its client goes away (reported, never asserted): for
# ROUNDS rounds, a streaming job that prints a line and then sleeps for its whole timeout
# (30 s) is started on a server with one job thread; the client reads the first line and
# closes its connection; the time from the close until the job is counted `cancelled` in
# /metrics, and until its job thread is free again (health: nothing running or queued; the
# cancelled VM is discarded first), is measured. Then the same for a session's streamed
# cell, which is interrupted rather than stopped: the session must answer its next cell.
# Medians.
#
# Usage: scripts/bench-cancel.sh [ROUNDS]   (default 10)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-10}
port=${PORT:-18475}
log=target/bench-cancel-server.log
cargo build --release -q
. scripts/serve-lib.sh
start_bud_serve bench-cancel "$port" "$log" --workers 1 --queue 1 --max-batch-jobs 1 \
    --max-timeout-ms 30000
python3 - "$rounds" "$port" <<'PY'
import json, socket, statistics, sys, time, urllib.request

rounds, port = int(sys.argv[1]), int(sys.argv[2])
base = f"http://127.0.0.1:{port}"
job = json.dumps({"code": "import time\nprint('started', flush=True)\nwhile True:\n    time.sleep(1)",
                  "timeout_ms": 30000}).encode()

def idle():
    h = json.load(urllib.request.urlopen(base + "/v1/health"))
    return h["jobs_running"] == 0 and h["jobs_queued"] == 0

def cancelled():
    m = urllib.request.urlopen(base + "/metrics").read().decode()
    return int(next(l.split()[-1] for l in m.splitlines()
                    if l.startswith('bud_jobs_total{status="cancelled"}')))

def post(path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req))

def measure(stream_path, next_path):
    to_cancel, to_next = [], []
    for _ in range(rounds):
        before = cancelled()
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST " + stream_path.encode() + b" HTTP/1.1\r\nhost: x\r\n"
                  b"content-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n" % len(job) + job)
        seen = b""
        while b"started" not in seen:
            seen += s.recv(4096)
        t = time.perf_counter()
        s.close()
        while cancelled() == before:
            time.sleep(0.001)
        to_cancel.append(time.perf_counter() - t)
        while not idle():
            time.sleep(0.001)
        to_next.append(time.perf_counter() - t)
        r = post(next_path, {"code": "print(1)"})
        assert r["stdout"] == "1\n", r
    return to_cancel, to_next

ms = lambda v: f"{statistics.median(v) * 1e3:.1f} ms (max {max(v) * 1e3:.1f})"
to_cancel, to_next = measure("/v1/exec/stream", "/v1/exec")
print(f"{rounds} jobs: client gone -> job cancelled {ms(to_cancel)}; "
      f"-> its job thread free again {ms(to_next)}")
sid = post("/v1/sessions", {})["id"]
to_cancel, to_next = measure(f"/v1/sessions/{sid}/exec/stream", f"/v1/sessions/{sid}/exec")
print(f"{rounds} session cells: client gone -> cell cancelled {ms(to_cancel)}; "
      f"-> its job thread free again {ms(to_next)} (the session answered every next cell)")
PY
