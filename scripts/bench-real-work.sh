#!/usr/bin/env bash
# Real work in bud against the same code in host `python3 -c` (or `sh -c`), side by side in
# one run: fresh memory, object-heavy and data work, files, output, processes, abnormal ends.
# For each case: median wall time of bud (the job's total_ms over HTTP on a warm VM) and of
# the host process, their ratio, and the job's emulated guest-kernel instructions
# (timings.kvm.emulated_instructions: the noise-free figure on a noisy machine), with the
# case's throughput where it has one.
#
# Usage: scripts/bench-real-work.sh [REPS]          (default 3; medians over REPS)
#        CASES=memory,list scripts/bench-real-work.sh 1
# Starts its own `bud serve` (release build) on PORT (default 18479) and stops it at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${1:-3}
port=${PORT:-18479}
log=target/bench-real-work-server.log
cargo build --release -q
. scripts/serve-lib.sh
start_bud_serve real-work "$port" "$log" --max-timeout-ms 600000 --max-output-bytes 67108864
python3 - "$reps" "$port" "${CASES:-}" <<'PY'
import json, resource, statistics, subprocess, sys, time, urllib.request

reps, port, only = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
MiB = 1 << 20

# name: (language, code, (unit count, unit name) or None, expected status)
CASES = {
    "memory": ("python", "b = bytearray(50 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1",
               (50, "MiB"), "ok"),
    "shared-memory": ("python", "import mmap\nm = mmap.mmap(-1, 50 << 20)\nfor i in range(0, len(m), 4096): m[i] = 1",
                      (50, "MiB"), "ok"),
    "list": ("python", "x = list(range(10**6))\nprint(len(x))", None, "ok"),
    "json": ("python", "import json\nd = [{'id': i, 'name': 'item%d' % i, 'v': [i, i * 2.5]} for i in range(80000)]\n"
             "s = json.dumps(d)\nassert json.loads(s) == d\nprint(len(s))", None, "ok"),
    "regex": ("python", "import re\ns = ('abc123 def456 ' * 750000)[:10 << 20]\n"
              "print(len(re.findall(r'[a-z]+(\\d+)', s)))", None, "ok"),
    "csv": ("python", "import csv, io\nrows = [[i, 'name%d' % i, i * 0.5, 'x' * 20] for i in range(100000)]\n"
            "f = io.StringIO()\ncsv.writer(f).writerows(rows)\ns = f.getvalue()\n"
            "back = list(csv.reader(io.StringIO(s)))\nassert len(back) == len(rows)\nprint(len(s))", None, "ok"),
    "files": ("python", "import os\nd = '/tmp/bench'\nos.makedirs(d, exist_ok=True)\nblob = bytes(range(256)) * 400\n"
              "for i in range(100):\n    open(f'{d}/f{i}', 'wb').write(blob)\n"
              "n = sum(len(open(f'{d}/f{i}', 'rb').read()) for i in range(100))\nprint(n)",
              (100 * 100 / 1024, "MiB"), "ok"),
    "big-file": ("python", "blob = bytes(range(256)) * (40 << 10)\nwith open('/tmp/big', 'wb') as f: f.write(blob)\n"
                 "with open('/tmp/big', 'rb') as f: assert f.read() == blob\nprint(len(blob))", (10, "MiB"), "ok"),
    "output": ("python", "import os\nb = b'x' * (1 << 20)\nfor _ in range(20): os.write(1, b)",
               (20, "MiB"), "ok"),
    "subprocess": ("python", "import subprocess\nfor i in range(10): subprocess.run(['echo', str(i)], capture_output=True)",
                   (10, "process"), "ok"),
    "shell-cmd": ("shell", "for i in 1 2 3 4 5 6 7 8 9 10; do date > /dev/null; done", (10, "process"), "ok"),
    "python-c": ("python", "import subprocess\nsubprocess.run(['python3', '-c', 'pass'], check=True)", (1, "process"), "ok"),
    "exit": ("python", "import os\nos._exit(7)", None, "error"),
    "abort": ("python", "import os\nos.abort()", None, "error"),
    "memory-bomb": ("python", "chunks = []\nwhile True:\n    chunks.append(bytearray(64 << 20))", None,
                    "memory_limit"),
}

def bud(lang, code):
    body = json.dumps({"language": lang, "code": code, "timeout_ms": 600000,
                       "output_limit": 64 << 20}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/exec", data=body,
                                 headers={"content-type": "application/json"})
    a = json.load(urllib.request.urlopen(req, timeout=900))
    t = a["timings"]
    kvm = t.get("kvm") or {}
    return t["total_ms"] / 1000, kvm.get("emulated_instructions"), a["status"]

def host(lang, code, limit_memory):
    argv = ["python3", "-c", code] if lang == "python" else ["sh", "-c", code]
    # A memory bomb on the host gets an address-space limit the size of the guest's RAM
    # (256 MiB), so that it ends as the guest's does instead of eating the host.
    cap = (lambda: resource.setrlimit(resource.RLIMIT_AS, (256 << 20,) * 2)) if limit_memory else None
    t = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=cap)
    return time.perf_counter() - t

print(f"{'case':12} {'bud s':>9} {'host s':>8} {'ratio':>8} {'emulated insns':>15}  throughput (bud / host)")
for name, (lang, code, unit, want) in CASES.items():
    if only and name not in only.split(","):
        continue
    b, h, ins, statuses = [], [], [], set()
    for _ in range(reps):
        s, n, status = bud(lang, code)
        b.append(s); ins.append(n or 0); statuses.add(status)
        h.append(host(lang, code, want == "memory_limit"))
    mb, mh = statistics.median(b), statistics.median(h)
    rate = ""
    if unit:
        count, what = unit
        per = "/s" if what == "MiB" else " each"
        if what == "MiB":
            rate = f"{count / mb:.1f} / {count / mh:.1f} MiB/s"
        else:
            rate = f"{mb / count * 1000:.0f} / {mh / count * 1000:.1f} ms per {what}"
    bad = "" if statuses == {want} else f"  STATUS {sorted(statuses)} (want {want})"
    print(f"{name:12} {mb:9.3f} {mh:8.3f} {mb / mh:7.1f}x {int(statistics.median(ins)):15,d}  {rate}{bad}",
          flush=True)
PY
