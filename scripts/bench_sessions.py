"""Session benchmark client (run by scripts/bench-sessions.sh against a running `bud serve`).

Measures over HTTP on loopback, with one keep-alive connection (Python's stdlib only):
create (POST /v1/sessions) and delete; a cell round trip (`x += 1`); the host memory an
idle session holds (the API's memory_bytes and the server's RSS growth); and a fork of a
session holding 100 MiB of Python data into 8 children (the source's pause and the
per-child creation time the server reports, the request's wall time, and each child's
first cell). Prints medians and p90s; asserts nothing about time.
"""

import os
import statistics
import sys
import time

from bench_http import Api

HOST, PORT, SERVER_PID = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ROUNDS = int(os.environ.get("ROUNDS", "200"))
api = Api(HOST, PORT, timeout=300)
call = api.call




def summary(name, values, unit="ms"):
    values = sorted(values)
    p90 = values[int(len(values) * 0.9) - 1] if len(values) >= 10 else values[-1]
    print(f"{name:<44} n={len(values):<4} p50 {statistics.median(values):8.2f} {unit}"
          f"  p90 {p90:8.2f} {unit}  min {values[0]:8.2f} {unit}")


def rss_kib(field="RssAnon:"):
    """The server's anonymous resident memory (its own heap and every VM's private pages;
    VmRSS would count each VM's mapping of the shared template file again)."""
    with open(f"/proc/{SERVER_PID}/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def cell(sid, code, timeout_ms=None):
    body = {"code": code}
    if timeout_ms:
        body["timeout_ms"] = timeout_ms
    r, ms = call("POST", f"/v1/sessions/{sid}/exec", body)
    if r["status"] != "ok":
        sys.exit(f"cell {code[:40]!r} ended {r['status']}: {r['stderr'][-500:]}")
    return r, ms


# warm-up
for _ in range(5):
    s, _ = call("POST", "/v1/sessions", {})
    cell(s["id"], "1")
    call("DELETE", f"/v1/sessions/{s['id']}")

creates, deletes = [], []
for _ in range(min(ROUNDS, 100)):
    s, ms = call("POST", "/v1/sessions", {})
    creates.append(ms)
    _, ms = call("DELETE", f"/v1/sessions/{s['id']}")
    deletes.append(ms)
summary("create session (POST /v1/sessions)", creates)
summary("delete session (never used)", deletes)

s, _ = call("POST", "/v1/sessions", {})
sid = s["id"]
cell(sid, "x = 0")
trips, guest = [], []
for _ in range(ROUNDS):
    r, ms = cell(sid, "x += 1")
    trips.append(ms)
    guest.append(r["timings"]["run_ms"])
r, _ = cell(sid, "x")
assert r["result"]["text/plain"] == str(ROUNDS), r
summary("cell round trip `x += 1` (HTTP)", trips)
summary("  of which the VM ran (run_ms)", guest)
call("DELETE", f"/v1/sessions/{sid}")

# Idle memory: sessions that ran one small cell each, then sit idle.
IDLE = 20
before = rss_kib()
ids = []
for _ in range(IDLE):
    s, _ = call("POST", "/v1/sessions", {})
    cell(s["id"], "import json\ny = json.dumps({'a': list(range(100))})")
    ids.append(s["id"])
time.sleep(0.5)
after = rss_kib()
own = [call("GET", f"/v1/sessions/{i}")[0]["memory_bytes"] / 1024 for i in ids]
summary("idle session memory_bytes (API)", own, "KiB")
print(f"{'server RssAnon growth per idle session':<44} {(after - before) / IDLE:8.0f} KiB"
      f"  ({IDLE} sessions: {before} -> {after} KiB)")
for i in ids:
    call("DELETE", f"/v1/sessions/{i}")

# Fork of a session holding 100 MiB of Python data (bytes objects, filled: every page real).
s, _ = call("POST", "/v1/sessions", {})
sid = s["id"]
started = time.perf_counter()
# random.randbytes runs in guest user mode (native speed); os.urandom would run the guest
# kernel's ChaCha20, which kvm_pvm emulates instruction by instruction.
cell(sid, "import random\nchunks = []")
for _ in range(4):
    cell(sid, "chunks.append(random.randbytes(25 << 20))", timeout_ms=60000)
fill_s = time.perf_counter() - started
info, _ = call("GET", f"/v1/sessions/{sid}")
print(f"{'filling 100 MiB in the guest':<44} {fill_s:8.1f} s (fresh guest pages; "
      f"session memory_bytes {info['memory_bytes'] >> 20} MiB)")
time.sleep(2)  # let the reaper finish closing the VMs of the sessions deleted above
rows, firsts = [], []
for _ in range(int(os.environ.get("FORK_ROUNDS", "4"))):
    f, wall = call("POST", f"/v1/sessions/{sid}/fork", {"count": 8})
    rows.append((f["source_pause_ms"], f["per_child_ms"], wall, f["layer_bytes"]))
    for k in f["ids"]:
        r, ms = cell(k, "sum(len(c) for c in chunks)")
        assert r["result"]["text/plain"] == str(100 << 20), r
        firsts.append(ms)
    for k in f["ids"]:
        call("DELETE", f"/v1/sessions/{k}")
    time.sleep(1)
pause, child, wall, layer = rows[0]
print(f"{'first fork x8 (freezes the session)':<44} pause {pause:6.1f} ms, per child {child:5.2f} ms,"
      f" request {wall:6.1f} ms, layer {layer >> 20} MiB")
later = rows[1:]
if later:
    summary("later forks x8 (nothing new): source pause", [r[0] for r in later])
    summary("later forks x8: per child", [r[1] for r in later])
    summary("later forks x8: request wall time", [r[2] for r in later])
summary("fork child's first cell (reads all 100 MiB)", firsts)
call("DELETE", f"/v1/sessions/{sid}")
