#!/usr/bin/env python3
"""Stress of a process's stdin beside a running cell (the sequence of
``server/tests/beside.rs``'s native test, repeated): in a fresh session each round, a cell
runs until a file appears; beside it a process ``read x; echo "got $x"; exit 5`` is started
with a stdin pipe, fed ``beside\\n`` with close, and read to its end; then the cell is let go
and the session deleted. Every round must answer 204 to the write and end the process with
``got beside`` and exit code 5; anything else is printed with the process's record.

    scripts/stress-beside-stdin.py http://127.0.0.1:8080 200        # against a running server
    CLIENTS=2 scripts/stress-beside-stdin.py http://127.0.0.1:8080 100   # two at once

Standard library only. Exits 1 if any round went wrong. CI saw this write answered 409
`stdin_closed` once (session 24); 411 rounds here did not reproduce it
(docs/measurements.md, session 24).
"""

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request

CELL = ("import os, time\nopen('started', 'w').close()\n"
        "while not os.path.exists('go'):\n    time.sleep(0.02)\n'cell done'")


def call(base, method, path, body=None, raw=None, timeout=120):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(base + path, data=data, method=method)
    if body is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def one_round(base):
    """None if the round went as it must, else what went wrong."""
    status, body = call(base, "POST", "/v1/sessions", {})
    if status != 201:
        return f"session: {status} {body[:200]!r}"
    sid = json.loads(body)["id"]
    cell = {}
    runner = threading.Thread(target=lambda: cell.update(r=call(
        base, "POST", f"/v1/sessions/{sid}/exec", {"code": CELL, "timeout_ms": 60_000},
        timeout=120)))
    runner.start()
    try:
        deadline = time.monotonic() + 60
        while call(base, "GET", f"/v1/sessions/{sid}/files/started")[0] != 200:
            if time.monotonic() > deadline:
                return "the cell never started"
            time.sleep(0.02)
        status, body = call(base, "POST", f"/v1/sessions/{sid}/processes",
                            {"command": 'read x; echo "got $x"; exit 5', "stdin": True})
        if status != 201:
            return f"start: {status} {body[:200]!r}"
        pid = json.loads(body)["pid"]
        status, body = call(base, "POST", f"/v1/sessions/{sid}/processes/{pid}/stdin",
                            {"data": "beside\n", "close": True})
        if status != 204:
            time.sleep(2)
            record = call(base, "GET", f"/v1/sessions/{sid}/processes")[1]
            return f"stdin: {status} {body[:300]!r}; processes: {record[:600]!r}"
        _, out = call(base, "GET", f"/v1/sessions/{sid}/processes/{pid}/output")
        lines = [json.loads(line) for line in out.splitlines() if line.strip()]
        if (lines[0].get("data"), lines[-1].get("exit_code")) != ("got beside\n", 5):
            return f"output: {lines}"
        return None
    finally:
        call(base, "PUT", f"/v1/sessions/{sid}/files/go", raw=b"")
        runner.join()
        call(base, "DELETE", f"/v1/sessions/{sid}")


def main():
    base, rounds = sys.argv[1].rstrip("/"), int(sys.argv[2])
    clients = int(os.environ.get("CLIENTS", "1"))
    failures = []

    def client(n):
        for i in range(rounds):
            wrong = one_round(base)
            if wrong:
                failures.append((n, i, wrong))
                print(f"client {n} round {i}: {wrong}", flush=True)
            elif i % 10 == 0:
                print(f"client {n}: {i + 1} rounds", flush=True)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"{clients * rounds} rounds, {len(failures)} wrong")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
