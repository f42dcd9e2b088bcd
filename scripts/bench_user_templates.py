#!/usr/bin/env python3
"""What a user template costs (docs/templates.md, issue 56), against a running `bud serve`
(scripts/bench-user-templates.sh starts one), beside the host in one run:

1. cold: a template of `python` + a wheel + a Debian package, its wheel and `.deb` caches
   emptied first: POST to ready (the build's last NDJSON line), and the build's own steps;
2. warm: the same packages under another name (the wheel cached; the image is new, and the
   template is made from python's snapshot: docs/templates.md, "Made from its parent's
   snapshot");
3. one more package: a user template on the warm one with one more wheel (made from the
   warm one's snapshot);
4. the host's `pip install --target` of the same wheels, from the same index (beside);
5. a trivial one-shot job and a session cell on the user template against `python`,
   alternating (p50, p90), and a new session's create + first cell on each.

It measures and prints; it asserts no time. It exits non-zero if a build or request failed.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

BASE = os.environ.get("BUD_URL", "http://127.0.0.1:18581")
BUILD_DIR = os.environ.get("BUILD_DIR", "build")
JOBS = int(os.environ.get("JOBS", "200"))
APT = os.environ.get("APT", "jq")
WHEEL = os.environ.get("WHEEL", "tabulate==0.9.0")
MORE = os.environ.get("MORE", "six==1.16.0")
RUN = os.environ.get("RUN", str(os.getpid()))
# Only the jobs and cells, on the warm template of an earlier run with the same RUN.
ONLY_JOBS = os.environ.get("ONLY_JOBS") == "1"


def call(method, path, body=None, timeout=1800):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(BASE + path, data=data, method=method)
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def build(definition):
    """POSTs `definition` and follows its log: (seconds to the last line, last line, log)."""
    started = time.monotonic()
    status, body = call("POST", "/v1/templates", definition)
    if status != 201:
        sys.exit(f"POST /v1/templates {definition['name']}: {status} {body[:300]!r}")
    status, log = call("GET", f"/v1/templates/{definition['name']}/build")
    seconds = time.monotonic() - started
    lines = [json.loads(l) for l in log.decode().splitlines()]
    last = lines[-1]
    if last.get("status") != "ready":
        sys.exit(f"build {definition['name']} failed: {last}")
    return seconds, lines


def steps(lines):
    """When the build reached its main steps, from its log's own clock."""
    marks = {}
    for l in lines:
        text = l.get("line", "")
        for key, needle in (("apt", "apt-get download"), ("pip", "pip download"),
                            ("image", "writing the archive"), ("boot", "guest:"),
                            ("ready", "ready: the template is served")):
            if needle in text and key not in marks:
                marks[key] = l["t_s"]
    return marks


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(p / 100 * len(values)))]


def timed_jobs(templates, code):
    """JOBS one-shot jobs on each of `templates`, alternating (A, B, A, B: the machine's
    noise hits both alike): {template: ([ms], [emulated guest-kernel instructions])}."""
    out = {t: ([], []) for t in templates}
    for _ in range(JOBS):
        for t in templates:
            started = time.monotonic()
            status, body = call("POST", "/v1/exec", {"template": t, "code": code})
            ms = (time.monotonic() - started) * 1e3
            r = json.loads(body) if status == 200 else {}
            if r.get("status") != "ok":
                sys.exit(f"job on {t}: {status} {body[:300]!r}")
            out[t][0].append(ms)
            out[t][1].append(r["timings"]["kvm"]["emulated_instructions"])
    return out


def session_cells(template):
    t = time.monotonic()
    status, body = call("POST", "/v1/sessions", {"template": template})
    if status != 201:
        sys.exit(f"session on {template}: {status} {body[:300]!r}")
    sid = json.loads(body)["id"]
    cells = []
    first = None
    for i in range(JOBS // 2):
        c = time.monotonic()
        status, body = call("POST", f"/v1/sessions/{sid}/exec", {"code": "x = 1 + 1"})
        cells.append((time.monotonic() - c) * 1e3)
        if status != 200:
            sys.exit(f"cell on {template}: {status} {body[:300]!r}")
        if i == 0:
            first = (time.monotonic() - t) * 1e3
    call("DELETE", f"/v1/sessions/{sid}")
    return first, cells


def host_pip(requirements):
    """The host's own `pip install --target` of the same wheels (binary only), seconds."""
    target = tempfile.mkdtemp(prefix="bud-bench-pip-")
    try:
        t = time.monotonic()
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-cache-dir",
                        "--only-binary=:all:", "--target", target, *requirements],
                       check=True)
        return time.monotonic() - t
    finally:
        shutil.rmtree(target, ignore_errors=True)


def forget(name):
    """Empties the caches a cold build of `name` would fill (the whole `.deb` pool too: every
    template's directory keeps its own links, the pool is only where a build looks first)."""
    for path in (f"{BUILD_DIR}/debs-{name}", f"{BUILD_DIR}/debs-pool", f"{BUILD_DIR}/image-{name}"):
        shutil.rmtree(path, ignore_errors=True)
    wheel = WHEEL.split("==")[0]
    for f in os.listdir(f"{BUILD_DIR}/wheels") if os.path.isdir(f"{BUILD_DIR}/wheels") else ():
        if f.lower().startswith(wheel.lower()):
            os.remove(f"{BUILD_DIR}/wheels/{f}")


def main():
    cold, warm, more = f"bench-cold-{RUN}", f"bench-warm-{RUN}", f"bench-more-{RUN}"
    packages = {"apt": [APT], "pip": [WHEEL], "warm": f"import {WHEEL.split('==')[0]}"}
    print(f"[bench-user-templates] {BASE}: python + {WHEEL} + apt {APT}")
    if ONLY_JOBS:
        # The jobs alone, on a template an earlier run with this RUN built (cached).
        s_warm, _ = build({"name": warm, **packages})
        print(f"build of a template built before (RUN={RUN}): {s_warm:.1f} s to ready")
    else:
        forget(cold)
        s_cold, l_cold = build({"name": cold, **packages})
        print(f"cold build (no cached wheel or .deb): {s_cold:.1f} s to ready; steps at {steps(l_cold)}")
        s_warm, l_warm = build({"name": warm, **packages})
        print(f"warm build (wheel and .debs cached):  {s_warm:.1f} s to ready; steps at {steps(l_warm)}")
        s_more, l_more = build({"name": more, "from": warm, "pip": [MORE]})
        print(f"one more package ({MORE}):          {s_more:.1f} s to ready; steps at {steps(l_more)}")
        print(f"host pip install --target {WHEEL} {MORE}: {host_pip([WHEEL, MORE]):.1f} s")

    code = "print(1 + 1)"
    timed_jobs(("python", warm), code)  # warm-up: every VM of both pools used once
    rows = timed_jobs(("python", warm), code)
    for t, (ms, insns) in rows.items():
        print(f"one-shot job on {t:>24}: p50 {statistics.median(ms):.2f} ms, "
              f"p90 {pct(ms, 90):.2f} ms, emulated instructions p50 "
              f"{statistics.median(insns):.0f} ({len(ms)} jobs, alternating)")
    ratio = statistics.median(rows[warm][0]) / statistics.median(rows["python"][0])
    print(f"  user template / python: {ratio:.2f}x")
    cells = {}
    for t in ("python", warm):
        cells[t] = session_cells(t)
    for t, (first, v) in cells.items():
        print(f"session on {t:>24}: create + first cell {first:.1f} ms; cell p50 {statistics.median(v):.2f} ms, p90 {pct(v, 90):.2f} ms")
    ratio = statistics.median(cells[warm][1]) / statistics.median(cells["python"][1])
    print(f"  user template / python (cells): {ratio:.2f}x")
    for t in (cold, warm, more):
        call("DELETE", f"/v1/templates/{t}")  # 404 for those this run did not build


if __name__ == "__main__":
    main()
