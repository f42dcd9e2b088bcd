"""Density benchmark client (run by scripts/bench-density.sh against a running `bud serve`).

Creates sessions one after another on one keep-alive connection, each running one small cell
(`x = list(range(1000))`), and keeps them all alive. After every STEP sessions it prints, for
that step: create (POST /v1/sessions) and first-cell p50/p99, the cell's emulated guest-kernel
instructions p50 (`timings.kvm`), the host memory per live session (MemTotal - MemAvailable
grown since the start, divided by the live count), the server's threads, and its CPU while
every session idles (IDLE_S seconds of /proc/PID/stat). Then it deletes every session, and
reports how long the DELETEs took and how long until the server's threads and the host's
memory came back (the teardown). The shutdown is timed by the shell script.

Prints; asserts nothing about time. Python's stdlib only.
"""

import os
import random
import statistics
import sys
import time

from bench_http import Api

HOST, PORT, SERVER_PID = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
SESSIONS = int(os.environ.get("SESSIONS", "1000"))
STEP = int(os.environ.get("STEP", "100"))
IDLE_S = float(os.environ.get("IDLE_S", "3"))
AGAIN = int(os.environ.get("AGAIN", "20"))  # later cells per step, in random older sessions
KEEP = os.environ.get("KEEP", "") == "1"  # leave the sessions for the shutdown's timing
CELL = "x = list(range(1000))"
api = Api(HOST, PORT, timeout=600)
call = api.call
CLK = os.sysconf("SC_CLK_TCK")




def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))]


def host_used_kib():
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0])
    return info["MemTotal"] - info["MemAvailable"]


def server_threads():
    with open(f"/proc/{SERVER_PID}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


def rss_anon_mib():
    """The server's anonymous resident memory: its heap and every VM's private pages."""
    with open(f"/proc/{SERVER_PID}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0


def server_cpu_s():
    with open(f"/proc/{SERVER_PID}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # utime, stime are fields 14 and 15 (1-based) of the whole line: 12 and 13 after ")".
    return (int(fields[11]) + int(fields[12])) / CLK


def idle_cpu_percent():
    a, t = server_cpu_s(), time.perf_counter()
    time.sleep(IDLE_S)
    return 100 * (server_cpu_s() - a) / (time.perf_counter() - t)


if os.environ.get("PARKED", "") == "1":
    # Parking round (the server parks sessions idle for a few seconds): SESSIONS sessions
    # each run one cell, all are parked, then each answers one more cell (resumed first).
    ids = []
    for _ in range(SESSIONS):
        s, _ = call("POST", "/v1/sessions", {})
        ids.append(s["id"])
        call("POST", f"/v1/sessions/{s['id']}/exec", {"code": CELL})
    started = time.perf_counter()
    while api.metric("bud_sessions_parked") < SESSIONS:
        if time.perf_counter() - started > 1800:
            sys.exit(f"only {api.metric('bud_sessions_parked'):.0f} of {SESSIONS} parked after 1800 s")
        time.sleep(0.5)
    parked_s = time.perf_counter() - started
    on_disk = api.metric("bud_state_bytes") / SESSIONS / (1 << 20)
    random.shuffle(ids)
    resumed = []
    for sid in ids:
        r, ms = call("POST", f"/v1/sessions/{sid}/exec", {"code": "x.append(1); len(x)"})
        if r["status"] != "ok":
            sys.exit(f"a resumed cell ended {r['status']}")
        resumed.append(ms)
    print(f"{SESSIONS} sessions parked {parked_s:.1f} s after the last one's cell"
          f" ({on_disk:.2f} MiB on disk each); a cell in each, resuming it:"
          f" p50 {statistics.median(resumed):.2f} ms p99 {pct(resumed, .99):.1f} ms"
          f" max {max(resumed):.1f} ms")
    sys.exit(0)

base_used = host_used_kib()
base_threads = server_threads()
print(f"server pid {SERVER_PID}: {base_threads} threads, host memory used {base_used / 1024:.0f} MiB"
      f" before any session; {SESSIONS} sessions in steps of {STEP}, cell {CELL!r}")
print(f"{'live':>6} {'create p50':>10} {'p99':>8} {'cell p50':>9} {'p99':>8} {'max':>8}"
      f" {'emul p50':>9} {'again p50':>9} {'p99':>8} {'MiB/sess':>9} {'RssAnon':>8}"
      f" {'threads':>8} {'idle CPU':>9}")
ids = []
all_creates, all_cells = [], []
while len(ids) < SESSIONS:
    creates, cells, insns = [], [], []
    for _ in range(min(STEP, SESSIONS - len(ids))):
        s, ms = call("POST", "/v1/sessions", {})
        creates.append(ms)
        ids.append(s["id"])
        r, ms = call("POST", f"/v1/sessions/{s['id']}/exec", {"code": CELL})
        if r["status"] != "ok":
            sys.exit(f"cell ended {r['status']}: {r.get('stderr', '')[-300:]}")
        cells.append(ms)
        insns.append(r["timings"]["kvm"]["emulated_instructions"])
    all_creates += creates
    all_cells += cells
    # A later cell in sessions made before (any of them must answer).
    again = []
    for sid in random.sample(ids, min(AGAIN, len(ids))):
        r, ms = call("POST", f"/v1/sessions/{sid}/exec", {"code": "x.append(1); len(x)"})
        again.append(ms)
    per = (host_used_kib() - base_used) / 1024 / len(ids)
    print(f"{len(ids):>6} {statistics.median(creates):>8.2f}ms {pct(creates, .99):>6.1f}ms"
          f" {statistics.median(cells):>7.2f}ms {pct(cells, .99):>6.1f}ms {max(cells):>6.0f}ms"
          f" {statistics.median(insns):>9.0f} {statistics.median(again):>7.2f}ms"
          f" {pct(again, .99):>6.1f}ms {per:>9.2f} {rss_anon_mib() / len(ids):>7.2f}M"
          f" {server_threads():>8} {idle_cpu_percent():>8.1f}%", flush=True)

print(f"all {len(ids)}: create p50 {statistics.median(all_creates):.2f} ms p99 {pct(all_creates, .99):.1f} ms;"
      f" first cell p50 {statistics.median(all_cells):.2f} ms p99 {pct(all_cells, .99):.1f} ms")
if KEEP:
    sys.exit(0)

held = host_used_kib() - base_used
closed0, close_s0 = api.metric("bud_vms_closed_total"), api.metric("bud_vm_close_seconds_total")
started = time.perf_counter()
for sid in ids:
    call("DELETE", f"/v1/sessions/{sid}")
deleted = time.perf_counter() - started
print(f"DELETE of {len(ids)} sessions answered in {deleted:.2f} s "
      f"({len(ids) / deleted:.0f}/s); host memory held by them {held / 1024:.0f} MiB")
# The teardown is over when the server holds no more VMs than idle ones for its job threads
# and its pool (`bud_live_clones`) and the host's memory is back to within 10 % of what the
# sessions held (the host's page cache moves a little).
kept = api.metric("bud_workers") + api.metric("bud_pool_size")
while True:
    now = time.perf_counter() - started
    left = host_used_kib() - base_used
    threads = server_threads()
    if api.metric("bud_live_clones") <= kept and left <= held * 0.1:
        break
    if now > 600:
        print(f"teardown not over after 600 s: {threads} threads, {left / 1024:.0f} MiB held")
        sys.exit(1)
    time.sleep(0.1)
print(f"teardown over {now:.2f} s after the first DELETE ({len(ids) / now:.0f} sessions/s):"
      f" {threads} threads, {left / 1024:.0f} MiB still held")
closed = api.metric("bud_vms_closed_total") - closed0
close_s = api.metric("bud_vm_close_seconds_total") - close_s0
if closed:
    print(f"VMs closed meanwhile: {closed:.0f}, {close_s / closed * 1e3:.1f} ms each on average")
