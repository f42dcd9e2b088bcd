"""Client of scripts/bench-beside.sh: latency of file and process requests to a session
that runs nothing, and beside a cell that sleeps or computes (module docs there). Prints
medians and p90s; asserts nothing about time."""

import http.client
import json
import os
import statistics
import sys
import threading
import time

HOST, PORT = sys.argv[1], int(sys.argv[2])
ROUNDS = int(os.environ.get("ROUNDS", "40"))


def connect():
    return http.client.HTTPConnection(HOST, PORT, timeout=300)


def call(conn, method, path, body=None, raw=False):
    data = body if raw or body is None else json.dumps(body).encode()
    headers = {} if raw or body is None else {"content-type": "application/json"}
    started = time.perf_counter()
    conn.request(method, path, body=data, headers=headers)
    r = conn.getresponse()
    out = r.read()
    elapsed = (time.perf_counter() - started) * 1e3
    if r.status >= 300 and r.status != 204:
        sys.exit(f"{method} {path}: {r.status} {out[:300]!r}")
    return out, elapsed


def summary(name, values):
    values = sorted(values)
    p90 = values[int(len(values) * 0.9) - 1]
    print(f"{name:<52} n={len(values):<4} p50 {statistics.median(values):8.2f} ms"
          f"  p90 {p90:8.2f} ms", flush=True)
    return statistics.median(values)


def command(conn, sid):
    """`echo 1` started and read to its end; returns the milliseconds it took."""
    started = time.perf_counter()
    out, _ = call(conn, "POST", f"/v1/sessions/{sid}/processes", {"command": "echo 1"})
    pid = json.loads(out)["pid"]
    lines, _ = call(conn, "GET", f"/v1/sessions/{sid}/processes/{pid}/output")
    assert b'"end"' in lines, lines
    return (time.perf_counter() - started) * 1e3


CELLS = {
    "idle": None,
    "beside a sleeping cell": "import os, time\nwhile not os.path.exists('stop'):\n"
                              "    time.sleep(0.02)\n",
    "beside a computing cell": "import os\nn = 0\nwhile not os.path.exists('stop'):\n"
                               "    for _ in range(20000):\n        n += 1\n",
}

conn = connect()
out, _ = call(conn, "POST", "/v1/sessions", {})
sid = json.loads(out)["id"]
call(conn, "PUT", f"/v1/sessions/{sid}/files/small.txt", b"x" * 1024, raw=True)
call(conn, "PUT", f"/v1/sessions/{sid}/files/big.bin", b"y" * (1 << 20), raw=True)
medians = {}
for setting, code in CELLS.items():
    runner = None
    if code is not None:
        def run(code=code):
            c = connect()
            call(c, "POST", f"/v1/sessions/{sid}/exec", {"code": code, "timeout_ms": 60000})
        runner = threading.Thread(target=run)
        runner.start()
        while True:  # until the cell holds the session
            info, _ = call(conn, "GET", f"/v1/sessions/{sid}")
            if json.loads(info)["busy"]:
                break
            time.sleep(0.01)
        time.sleep(0.2)
    for name, path in (("read 1 KiB", "small.txt"), ("read 1 MiB", "big.bin")):
        times = [call(conn, "GET", f"/v1/sessions/{sid}/files/{path}")[1] for _ in range(ROUNDS)]
        medians[(setting, name)] = summary(f"{name}, {setting}", times)
    times = [call(conn, "GET", f"/v1/sessions/{sid}/files")[1] for _ in range(ROUNDS)]
    medians[(setting, "list")] = summary(f"list the work directory, {setting}", times)
    times = [command(conn, sid) for _ in range(max(ROUNDS // 4, 10))]
    medians[(setting, "command")] = summary(f"command `echo 1` to its end, {setting}", times)
    if runner is not None:
        call(conn, "PUT", f"/v1/sessions/{sid}/files/stop", b"", raw=True)
        runner.join()
        call(conn, "DELETE", f"/v1/sessions/{sid}/files/stop")
call(conn, "DELETE", f"/v1/sessions/{sid}")
print("ratios to idle (p50):")
for (setting, name), m in medians.items():
    if setting != "idle":
        print(f"  {name:<10} {setting:<26} {m / medians[('idle', name)]:6.2f}x")
