"""Durable-session benchmark client (run by scripts/bench-durable.sh against `bud serve`).

`before`: by session size (0, 10, 100 MiB of Python data: one random MiB repeated), the
pause's wall time and its own pause_ms, the file's bytes, an explicit resume's wall time
and the first cell after it (what it touches comes back through page faults); a snapshot
of the 100 MiB session and 8 sessions started from it; then PAUSED small paused sessions
on disk and the resume of the first and the last made (against a resume with one paused).
`after` (a server started again on the directory): resumes of paused sessions, which now
check every page of their file. Prints medians; asserts nothing about time.
"""

import json
import os
import statistics
import sys
import time

from bench_http import Api

HOST, PORT, PHASE = sys.argv[1], int(sys.argv[2]), sys.argv[3]
PAUSED = int(os.environ.get("PAUSED", "1000"))
ROUNDS = int(os.environ.get("ROUNDS", "5"))
IDS = "target/bench-durable-ids.json"
api = Api(HOST, PORT, timeout=600)
call = api.call




def line(name, values, unit="ms"):
    values = sorted(values)
    print(f"{name:<52} n={len(values):<4} p50 {statistics.median(values):9.2f} {unit}"
          f"  min {values[0]:9.2f}  max {values[-1]:9.2f}")


def session(mib):
    s, _ = call("POST", "/v1/sessions", {"idle_timeout_s": 3600})
    code = f"import random\ndata = random.randbytes(1 << 20) * {mib}\nx = 0"
    call("POST", f"/v1/sessions/{s['id']}/exec", {"code": code})
    return s["id"]


def cycle(sid):
    """Pause, resume, first cell: wall times, the server's pause_ms and the file's bytes."""
    p, pause = call("POST", f"/v1/sessions/{sid}/pause")
    _, resume = call("POST", f"/v1/sessions/{sid}/resume")
    _, cell = call("POST", f"/v1/sessions/{sid}/exec", {"code": "x += 1"})
    return pause, p["pause_ms"], p["bytes"], resume, cell


if PHASE == "before":
    for mib in (0, 10, 100):
        sid = session(mib)
        runs = [cycle(sid) for _ in range(ROUNDS)]
        line(f"{mib:>3} MiB: pause (wall)", [r[0] for r in runs])
        line(f"{mib:>3} MiB: pause (server's pause_ms)", [r[1] for r in runs])
        line(f"{mib:>3} MiB: file", [r[2] / 2**20 for r in runs], "MiB")
        line(f"{mib:>3} MiB: resume (wall)", [r[3] for r in runs])
        line(f"{mib:>3} MiB: first cell after the resume", [r[4] for r in runs])
        if mib == 100:
            snap, took = call("POST", f"/v1/sessions/{sid}/snapshots")
            line("100 MiB: snapshot (wall)", [took])
            starts, cells = [], []
            for _ in range(8):
                s, t = call("POST", "/v1/sessions", {"snapshot": snap["id"]})
                _, c = call("POST", f"/v1/sessions/{s['id']}/exec", {"code": "x += 1"})
                starts.append(t)
                cells.append(c)
                call("DELETE", f"/v1/sessions/{s['id']}")
            line("100 MiB: session from the snapshot (wall)", starts)
            line("100 MiB: its first cell", cells)
        call("DELETE", f"/v1/sessions/{sid}")
    alone = session(0)
    call("POST", f"/v1/sessions/{alone}/pause")
    _, one = call("POST", f"/v1/sessions/{alone}/resume")
    call("DELETE", f"/v1/sessions/{alone}")
    ids, t0 = [], time.perf_counter()
    for i in range(PAUSED):
        s, _ = call("POST", "/v1/sessions", {"idle_timeout_s": 3600})
        call("POST", f"/v1/sessions/{s['id']}/exec", {"code": f"n = {i}"})
        call("POST", f"/v1/sessions/{s['id']}/pause")
        ids.append(s["id"])
    print(f"{PAUSED} sessions made and paused in {time.perf_counter() - t0:.1f} s")
    line("resume with 1 paused session on disk", [one])
    first, last = [], []
    for sid, out in ((ids[0], first), (ids[-1], last)):
        _, t = call("POST", f"/v1/sessions/{sid}/resume")
        out.append(t)
        call("POST", f"/v1/sessions/{sid}/pause")
    line(f"resume of the first of {PAUSED} paused", first)
    line(f"resume of the last of {PAUSED} paused", last)
    with open(IDS, "w") as f:
        json.dump(ids, f)
else:
    ids = json.load(open(IDS))
    listed, t = call("GET", "/v1/sessions")
    paused = sum(1 for s in listed["sessions"] if s["state"] == "paused")
    line(f"GET /v1/sessions ({paused} paused)", [t])
    picks = [ids[0], ids[len(ids) // 2], ids[-1]]
    times, cells = [], []
    for sid in picks:
        _, rt = call("POST", f"/v1/sessions/{sid}/resume")
        out, ct = call("POST", f"/v1/sessions/{sid}/exec", {"code": "print(n)"})
        times.append(rt)
        cells.append(ct)
    line("resume after the restart (every page checked)", times)
    line("its first cell", cells)
    for sid in ids:
        call("DELETE", f"/v1/sessions/{sid}")
