"""JavaScript on bud beside the host's Node.js (driven by scripts/bench-javascript.sh).

Prints, for each kind of job, the median and p90 of the wall time over HTTP (one request at
a time), bud's own run time and the emulated guest-kernel instructions KVM counted
(`timings.kvm.emulated_instructions`: noise-free on a busy machine) and the VM's page faults
(`timings.kvm.page_faults`), and the host's
`node -e` / `python3 -c` beside; then a CPU-bound loop against the host's node, and the
templates' image and memory-file sizes. Measures and reports only.
"""

import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

URL = os.environ["BUD_URL"]
JOBS = int(os.environ.get("JOBS", "200"))
HOST_RUNS = int(os.environ.get("HOST_RUNS", "20"))
LOOP = "function f(n) { let s = 0; for (let i = 0; i < n; i++) s += i; return s; }\n" \
       "const t = process.hrtime.bigint(); f(1e8); " \
       "console.log(Number(process.hrtime.bigint() - t) / 1e6)"


def post(path, body):
    req = urllib.request.Request(URL + path, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def get(path):
    with urllib.request.urlopen(URL + path, timeout=30) as r:
        return json.load(r)


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))]


def jobs(label, body, n=JOBS):
    for _ in range(10):  # every pooled VM has run once
        post("/v1/exec", body)
    walls, runs, insns, faults = [], [], [], []
    for _ in range(n):
        t = time.perf_counter()
        r = post("/v1/exec", body)
        walls.append((time.perf_counter() - t) * 1000)
        if r["status"] != "ok":
            sys.exit(f"{label}: {r}")
        runs.append(r["timings"]["run_ms"])
        insns.append(r["timings"]["kvm"]["emulated_instructions"])
        faults.append(r["timings"]["kvm"]["page_faults"])
    print(f"{label:44s} wall p50 {statistics.median(walls):7.2f} ms  p90 {pct(walls, 0.9):7.2f} ms"
          f"  run p50 {statistics.median(runs):6.2f} ms  emulated p50 {statistics.median(insns):8.0f}"
          f"  page faults p50 {statistics.median(faults):6.0f}")
    return statistics.median(walls)


def host(label, argv, n=HOST_RUNS):
    walls = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        walls.append((time.perf_counter() - t) * 1000)
    print(f"{label:44s} wall p50 {statistics.median(walls):7.2f} ms  p90 {pct(walls, 0.9):7.2f} ms")
    return statistics.median(walls)


def delete(path):
    req = urllib.request.Request(URL + path, method="DELETE")
    with urllib.request.urlopen(req, timeout=30):
        pass


def cells(n=JOBS):
    """Session cells on `node` (`1 + 1`, one at a time) and the first cell of new JavaScript
    contexts, beside a Python session's cells on `python`."""
    for template, code in (("node", "1 + 1"), ("python", "1 + 1")):
        sid = post("/v1/sessions", {"template": template})["id"]
        for _ in range(5):
            post(f"/v1/sessions/{sid}/exec", {"code": code})
        walls, insns = [], []
        for _ in range(n):
            t = time.perf_counter()
            r = post(f"/v1/sessions/{sid}/exec", {"code": code})
            walls.append((time.perf_counter() - t) * 1000)
            insns.append(r["timings"]["kvm"]["emulated_instructions"])
        label = f"session cell 1 + 1 [{template}]"
        if template == "node":
            ts_walls = []
            for _ in range(n):
                t = time.perf_counter()
                r = post(f"/v1/sessions/{sid}/exec", {"code": "const t: number = 2; t", "language": "ts"})
                ts_walls.append((time.perf_counter() - t) * 1000)
                if r["status"] != "ok":
                    sys.exit(f"typescript cell: {r}")
            print(f"{'session cell const t: number [node, ts]':44s} wall p50 {statistics.median(ts_walls):7.2f} ms"
                  f"  p90 {pct(ts_walls, 0.9):7.2f} ms")
        print(f"{label:44s} wall p50 {statistics.median(walls):7.2f} ms  p90 {pct(walls, 0.9):7.2f} ms"
              f"  emulated p50 {statistics.median(insns):8.0f}")
        if template == "node":
            firsts = []
            for _ in range(5):
                ctx = post(f"/v1/sessions/{sid}/contexts", {"language": "javascript"})["id"]
                t = time.perf_counter()
                post(f"/v1/sessions/{sid}/contexts/{ctx}/exec", {"code": "typeof require"})
                firsts.append((time.perf_counter() - t) * 1000)
            print(f"{'first cell of a new JS context':44s} wall p50 {statistics.median(firsts):7.2f} ms"
                  f"  max {max(firsts):7.2f} ms")
        delete(f"/v1/sessions/{sid}")


def main():
    node_version = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    print(f"{JOBS} jobs each, one at a time, over HTTP; host node {node_version}")
    js = jobs("bud javascript console.log(1+1) [node]",
              {"template": "node", "language": "javascript", "code": "console.log(1+1)"})
    jobs("bud typescript const x: number [node]",
         {"template": "node", "language": "typescript",
          "code": "const x: number = 1 + 1; console.log(x)"})
    jobs("bud python print(1+1) [python]",
         {"template": "python", "language": "python", "code": "print(1+1)"})
    jobs("bud python print(1+1) [node, handed over]",
         {"template": "node", "language": "python", "code": "print(1+1)"})
    host_node = host("host node -e 'console.log(1+1)'", ["node", "-e", "console.log(1+1)"])
    host("host python3 -c 'print(1+1)'", ["python3", "-c", "print(1+1)"])
    print(f"ratio bud javascript / host node -e: {js / host_node:.3f}")

    cells()

    loops = []
    for _ in range(5):
        r = post("/v1/exec", {"template": "node", "language": "javascript", "code": LOOP,
                              "timeout_ms": 60000})
        loops.append(float(r["stdout"]))
    host_loops = [float(subprocess.run(["node", "-e", LOOP], capture_output=True, text=True,
                                       check=True).stdout) for _ in range(5)]
    g, h = statistics.median(loops), statistics.median(host_loops)
    print(f"loop f(1e8) in a function: bud {g:.1f} ms, host node {h:.1f} ms, ratio {g / h:.2f}")

    templates = {t["name"]: t for t in get("/v1/templates")["templates"]}
    for name in ("python", "node"):
        t = templates[name]
        print(f"template {name}: image {t.get('image_bytes', 0) / 2**20:.1f} MiB, memory file "
              f"{t.get('memory_file_bytes', 0) / 2**20:.1f} MiB, RAM {t.get('ram_bytes', 0) >> 20} MiB")
    py, nd = templates["python"].get("memory_file_bytes", 0), templates["node"].get("memory_file_bytes", 0)
    if py:
        print(f"memory file node / python: {nd / py:.2f}")


if __name__ == "__main__":
    main()
