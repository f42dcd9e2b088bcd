#!/usr/bin/env bash
# How fast a job is cancelled when its client goes away (reported, never asserted): for
# ROUNDS rounds, a streaming job that prints a line and then sleeps for its whole timeout
# (30 s) is started on a server with one job thread; the client reads the first line and
# closes its connection; the time from the close until the job is counted `cancelled` in
# /metrics, and until its job thread is free again (health: nothing running or queued; the
# cancelled VM is discarded first), is measured. Medians.
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

to_cancel, to_next = [], []
for _ in range(rounds):
    before = cancelled()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/exec/stream HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
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
    req = urllib.request.Request(base + "/v1/exec", json.dumps({"code": "print(1)"}).encode(),
                                 {"content-type": "application/json"})
    r = json.load(urllib.request.urlopen(req))
    assert r["stdout"] == "1\n", r
ms = lambda v: f"{statistics.median(v) * 1e3:.1f} ms (max {max(v) * 1e3:.1f})"
print(f"{rounds} rounds: client gone -> job cancelled {ms(to_cancel)}; "
      f"-> its job thread free again {ms(to_next)}")
PY
