"""Drives a `bud serve --verify-resets` for scripts/hwvirt/stage2.sh and checks every answer.

Usage: python3 drive.py URL JOBS [--server-pid PID]
       python3 drive.py URL --latency N [--server-pid PID]
         (only N trivial jobs in a row: the warm-job figure)
With --server-pid, waiting for the template stops as soon as that process has exited.

Waits for the server's template, then sends JOBS one-shot jobs in a fixed round robin of
kinds (Python and shell output, exit codes, stdin/args/env, an exception, a fork, files in
and out, a large output, a batch; every 10th job a timeout, a memory bomb or an output
flood), runs session scenarios (state across cells, a shell cell, files, a fork of two whose
children keep their own state, deletion; three rounds from 100 JOBS on, else one), then
min(50, JOBS) trivial jobs one after another for the warm-job latency. Every answer is
checked against its exact expected status and output. At the end the server's metrics must show resets and no reset that failed its verification.
Prints "hwvirt-stage2: PASS|FAIL|FIGURE|NOTE ..." lines; exits 1 if any check failed.
Standard library only (it runs with the host's python3, inside the test VM).
"""

import base64
import os
import http.client
import json
import re
import statistics
import sys
import time
import urllib.parse

PREFIX = "hwvirt-stage2:"
SHOWN_FAILURES = 20


class Driver:
    def __init__(self, url):
        u = urllib.parse.urlsplit(url)
        self.host, self.port = u.hostname, u.port
        self.conn = None
        self.failures = 0
        self.checks = 0

    def request(self, method, path, body=None, raw=False, timeout=120):
        """One request on a kept-alive connection (reopened once if the server closed it)."""
        headers = {}
        data = None
        if body is not None:
            if isinstance(body, bytes):
                data = body
                headers["content-type"] = "application/octet-stream"
            else:
                data = json.dumps(body).encode()
                headers["content-type"] = "application/json"
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
            try:
                self.conn.timeout = timeout
                self.conn.request(method, path, body=data, headers=headers)
                resp = self.conn.getresponse()
                payload = resp.read()
                break
            except (ConnectionError, http.client.HTTPException, OSError):
                self.conn.close()
                self.conn = None
                if attempt == 1:
                    raise
        if raw:
            return resp.status, payload
        try:
            return resp.status, json.loads(payload) if payload else None
        except ValueError:
            return resp.status, payload.decode(errors="replace")

    def check(self, what, ok, detail=""):
        self.checks += 1
        if ok:
            return True
        self.failures += 1
        if self.failures <= SHOWN_FAILURES:
            print(f"{PREFIX} FAIL {what}: {detail}"[:2000], flush=True)
        return False

    def wait_ready(self, server_pid=None, limit_s=600):
        deadline = time.monotonic() + limit_s
        last = None
        while time.monotonic() < deadline:
            if server_pid is not None and not os.path.exists(f"/proc/{server_pid}"):
                self.check("the server's template became ready", False,
                           f"the server (pid {server_pid}) exited; last answer: {last}")
                return False
            try:
                status, h = self.request("GET", "/v1/health", timeout=10)
                last = (status, h)
                if status == 200 and isinstance(h, dict) and h.get("template_ready"):
                    return True
            except OSError as e:
                last = e
                self.conn = None
            time.sleep(0.5)
        self.check("the server's template became ready", False, f"after {limit_s} s: {last}")
        return False


def b64(s):
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def job_for(i):
    """The i-th one-shot job: (kind, request, check(result) -> problem or None)."""
    rare = i % 10 == 9
    if rare:
        kind = ["timeout", "memory_limit", "output_limit"][(i // 10) % 3]
        if kind == "timeout":
            return kind, {"code": "while True:\n    pass", "timeout_ms": 500}, \
                lambda r: expect(r, "timeout")
        if kind == "memory_limit":
            return kind, {"code": "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 30))",
                          "timeout_ms": 30000}, lambda r: expect(r, "memory_limit")
        return kind, {"code": "while True:\n    print('x' * 1000)", "output_limit": 10000,
                      "timeout_ms": 30000}, \
            lambda r: expect(r, "output_limit") or (
                None if len(r.get("stdout", "")) <= 10000 else f"stdout {len(r['stdout'])} bytes")
    k = i % 9
    if k == 0:
        return "python", {"code": f"print({i} * 7)"}, lambda r: expect(r, "ok", 0, f"{i * 7}\n")
    if k == 1:
        return "shell", {"language": "shell", "code": f"echo job{i}; exit {i % 5 + 1}"}, \
            lambda r: expect(r, "error", i % 5 + 1, f"job{i}\n")
    if k == 2:
        code = "import os, sys\nprint(sys.argv[1], sys.stdin.read(), os.environ['G'])"
        return "stdin-args-env", {"code": code, "args": [f"a{i}"], "stdin": f"in{i}",
                                  "env": {"G": f"g{i}"}}, \
            lambda r: expect(r, "ok", 0, f"a{i} in{i} g{i}\n")
    if k == 3:
        return "exception", {"code": "1 / 0"}, \
            lambda r: expect(r, "error", 1, "") or (
                None if "ZeroDivisionError" in r.get("stderr", "") else f"stderr {r.get('stderr')!r}")
    if k == 4:
        code = ("import os\npid = os.fork()\nif pid == 0:\n    os._exit(7)\n"
                "_, st = os.waitpid(pid, 0)\nprint(os.waitstatus_to_exitcode(st))")
        return "fork", {"code": code}, lambda r: expect(r, "ok", 0, "7\n")
    if k == 5:
        return "shell-pipe", {"language": "shell", "code": f"echo {i} | sed 's/^/n=/'; ls / | grep -c ."}, \
            lambda r: expect(r, "ok", 0) or (
                None if re.fullmatch(rf"n={i}\n[1-9][0-9]*\n", r.get("stdout", "")) else f"stdout {r.get('stdout')!r}")
    if k == 6:
        code = "open('out.txt', 'w').write(open('in.txt').read().upper())"
        want = {"in.txt": b64(f"hello{i}"), "out.txt": b64(f"HELLO{i}")}
        return "files", {"code": code, "files": {"in.txt": b64(f"hello{i}")}, "return_files": ["*.txt"]}, \
            lambda r: expect(r, "ok", 0, "") or (None if r.get("files") == want else f"files {r.get('files')}")
    if k == 7:
        return "large-output", {"code": "print('y' * 200000)"}, lambda r: expect(r, "ok", 0, "y" * 200000 + "\n")
    return "urandom", {"code": "import os\nprint(len(os.urandom(16).hex()))"}, lambda r: expect(r, "ok", 0, "32\n")


def expect(r, status, exit_code=None, stdout=None):
    """None if result r has this status (and exit code, and stdout); else what differs."""
    if not isinstance(r, dict):
        return f"not a result: {r!r}"
    got = (r.get("status"), r.get("exit_code"), r.get("stdout"))
    want = (status,
            exit_code if exit_code is not None else got[1],
            stdout if stdout is not None else got[2])
    if got == want:
        return None
    shown = {k: r.get(k) for k in ("status", "exit_code", "signal", "crash")}
    shown["stdout"] = (r.get("stdout") or "")[:200]
    shown["stderr"] = (r.get("stderr") or "")[-400:]
    shown["console_tail"] = r.get("console_tail")
    return f"want status {status} exit {exit_code} stdout {(stdout or '')[:60]!r}; got {shown}"


def one_shot_jobs(d, n):
    kinds = {}
    for i in range(n):
        kind, body, check = job_for(i)
        status, r = d.request("POST", "/v1/exec", body, timeout=120)
        problem = f"HTTP {status}: {r}" if status != 200 else check(r)
        ok = d.check(f"job {i} ({kind})", problem is None, problem)
        done, good = kinds.get(kind, (0, 0))
        kinds[kind] = (done + 1, good + int(ok))
    batch = [{"code": "print('b0')"}, {"language": "shell", "code": "echo b1; exit 2"},
             {"code": "import sys; sys.exit(5)"}]
    status, r = d.request("POST", "/v1/exec/batch", {"jobs": batch})
    results = r.get("results") if isinstance(r, dict) else None
    ok = status == 200 and isinstance(results, list) and len(results) == 3 and \
        [expect(results[0], "ok", 0, "b0\n"), expect(results[1], "error", 2, "b1\n"),
         expect(results[2], "error", 5, "")] == [None, None, None]
    d.check("a batch of 3 in order", ok, f"HTTP {status}: {r}")
    kinds["batch"] = (1, int(ok))
    return kinds


def sessions(d, rounds):
    """Session scenarios; returns how many passed."""
    good = 0
    for n in range(rounds):
        before = d.failures
        status, s = d.request("POST", "/v1/sessions", {})
        if not d.check(f"session {n}: create", status == 201 and "id" in (s or {}), f"HTTP {status}: {s}"):
            continue
        sid = s["id"]

        def cell(code, sid=sid, **extra):
            st, r = d.request("POST", f"/v1/sessions/{sid}/exec", {"code": code, **extra})
            return r if st == 200 else {"http": st, "body": r}

        cell("import math\nx = 41")
        r = cell("x + 1")
        d.check(f"session {n}: state across cells", (r.get("result") or {}).get("text/plain") == "42"
                and r.get("execution_count") == 2, r)
        r = cell("echo $((6 * 7)) > six.txt; cat six.txt", language="shell")
        d.check(f"session {n}: a shell cell in the same VM", expect(r, "ok", 0, "42\n") is None, r)
        payload = bytes(range(256)) * 64
        st, _ = d.request("PUT", f"/v1/sessions/{sid}/files/in/data.bin", payload)
        st2, back = d.request("GET", f"/v1/sessions/{sid}/files/in/data.bin", raw=True)
        d.check(f"session {n}: a file in and back", (st, st2, back) == (204, 200, payload),
                f"PUT {st}, GET {st2}, {len(back or b'')} bytes")
        r = cell("len(open('in/data.bin', 'rb').read())")
        d.check(f"session {n}: the cell sees the file", (r.get("result") or {}).get("text/plain") == "16384", r)
        st, f = d.request("POST", f"/v1/sessions/{sid}/fork", {"count": 2})
        kids = (f or {}).get("ids") if isinstance(f, dict) else None
        if d.check(f"session {n}: fork of 2", st == 201 and isinstance(kids, list) and len(kids) == 2,
                   f"HTTP {st}: {f}"):
            for j, k in enumerate(kids):
                cell(f"x = {100 + j}", sid=k)
            cell("x = 0")
            views = [(cell("(x, open('six.txt').read())", sid=k).get("result") or {}).get("text/plain")
                     for k in kids]
            mine = (cell("x").get("result") or {}).get("text/plain")
            d.check(f"session {n}: forks keep their own state",
                    views == ["(100, '42\\n')", "(101, '42\\n')"] and mine == "0", f"{views}, {mine}")
            for k in kids:
                st, _ = d.request("DELETE", f"/v1/sessions/{k}")
                d.check(f"session {n}: delete a fork", st == 204, f"HTTP {st}")
        st, _ = d.request("DELETE", f"/v1/sessions/{sid}")
        st2, _ = d.request("GET", f"/v1/sessions/{sid}")
        d.check(f"session {n}: delete, then 404", (st, st2) == (204, 404), f"{st}, {st2}")
        good += int(d.failures == before)
    return good


def warm_latency(d, n=50):
    wall, total, run = [], [], []
    for i in range(n):
        t = time.perf_counter()
        status, r = d.request("POST", "/v1/exec", {"code": "print(1)"})
        wall.append((time.perf_counter() - t) * 1000)
        if d.check(f"trivial job {i}", status == 200 and expect(r, "ok", 0, "1\n") is None, r):
            total.append(r["timings"]["total_ms"])
            run.append(r["timings"]["run_ms"])
    return wall, total, run


def metrics(d):
    status, text = d.request("GET", "/metrics", raw=True)
    text = text.decode(errors="replace") if status == 200 else ""
    values = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
        if m:
            values[m.group(1)] = float(m.group(2))
    return status, values


def latency_only(d, n):
    wall, total, run = warm_latency(d, n)
    if total:
        print(f"{PREFIX} FIGURE warm job print(1) without --verify-resets, {len(wall)} in a row: "
              f"round trip p50 {statistics.median(wall):.1f} ms (p90 {quantile(wall, 0.9):.1f}); "
              f"server total_ms p50 {statistics.median(total):.2f}, run_ms p50 "
              f"{statistics.median(run):.2f}", flush=True)
    return 1 if d.failures else 0


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    args = sys.argv[1:]
    server_pid = None
    if len(args) >= 2 and args[-2] == "--server-pid":
        server_pid = int(args[-1])
        args = args[:-2]
    url = args[0]
    d = Driver(url)
    t0 = time.monotonic()
    if not d.wait_ready(server_pid):
        return 1
    if args[1] == "--latency":
        return latency_only(d, int(args[2]))
    n = int(args[1])
    print(f"{PREFIX} NOTE the server's template was ready {time.monotonic() - t0:.1f} s after its start",
          flush=True)
    t = time.monotonic()
    kinds = one_shot_jobs(d, n)
    took = time.monotonic() - t
    print(f"{PREFIX} NOTE one-shot jobs by kind (passed/run): "
          + ", ".join(f"{k} {g}/{c}" for k, (c, g) in sorted(kinds.items())), flush=True)
    print(f"{PREFIX} FIGURE {n} one-shot jobs + a batch with --verify-resets: {took:.1f} s "
          f"({took / (n + 1) * 1000:.0f} ms per request)", flush=True)
    t = time.monotonic()
    # A short run (CI's 30 jobs) runs each session scenario and the warm-job series once
    # over; the figures come from longer runs (scripts/test-hwvirt.sh alone runs 200 jobs).
    rounds = 3 if n >= 100 else 1
    good = sessions(d, rounds)
    print(f"{PREFIX} NOTE session scenarios passed: {good}/{rounds} ({time.monotonic() - t:.1f} s)", flush=True)
    wall, total, run = warm_latency(d, min(50, n))
    if total:
        print(f"{PREFIX} FIGURE warm job print(1) with --verify-resets, {len(wall)} in a row: round trip p50 "
              f"{statistics.median(wall):.1f} ms (max {max(wall):.1f}); server total_ms p50 "
              f"{statistics.median(total):.2f}, run_ms p50 {statistics.median(run):.2f} "
              f"(each reset verified by value)", flush=True)
    status, m = metrics(d)
    resets = m.get("bud_resets_total", 0)
    failed = m.get('bud_vms_replaced_total{reason="reset_failed"}')
    d.check("the metrics show resets and none failed its verification",
            status == 200 and resets > 0 and failed == 0,
            f"HTTP {status}, bud_resets_total {resets}, reset_failed {failed}")
    replaced = {r: m.get('bud_vms_replaced_total{reason="%s"}' % r, 0)
                for r in ("abnormal", "too_dirty", "reset_failed")}
    print(f"{PREFIX} NOTE metrics: bud_resets_total {resets:.0f}, VMs replaced: "
          + ", ".join(f"{r} {v:.0f}" for r, v in replaced.items()), flush=True)
    print(f"{PREFIX} NOTE driver: {d.checks} checks, {d.failures} failed", flush=True)
    return 1 if d.failures else 0


if __name__ == "__main__":
    sys.exit(main())
