#!/usr/bin/env bash
# Soak test of `bud serve`: JOBS mixed jobs (default 10 000), ordinary and hostile, from
# CONCURRENCY client threads; every 1 000 jobs it prints the server's RSS, threads and open
# fds (from /proc/PID; RSS is the server's own, outside the guest-RAM mappings), and the
# jobs by status. It fails (exit 1) if a job's answer is not the one its kind must give, or
# if RSS, threads or fds grew between the first checkpoint (the warm state) and the last
# beyond a small allowance (RSS: 16 MiB; threads, fds: 4).
#
# Usage: scripts/soak.sh [JOBS]      CONCURRENCY=4 PORT=18477 scripts/soak.sh 2000
#
# The mix (round robin): print(1); a shell pipeline; an exit code; an uncaught exception;
# 1 MiB of output; output over a 64 KiB cap (Python and shell, at fd level); a timeout
# (300 ms); an impossible allocation; a 768 KiB stdin echoed; a 4-job batch; a request that
# is refused (400). Slow kinds are rarer: every kind's share is in KINDS below.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${1:-10000}
port=${PORT:-18477}
concurrency=${CONCURRENCY:-4}
log=target/soak-server.log
cargo build --release -q
. scripts/serve-lib.sh
start_bud_serve soak "$port" "$log" --queue 64
python3 - "$jobs" "$port" "$concurrency" "$SERVER" <<'PY'
import base64, collections, json, os, re, sys, threading, urllib.error, urllib.request

jobs, port, concurrency, pid = (int(a) for a in sys.argv[1:5])
base = f"http://127.0.0.1:{port}"
big_stdin = base64.b64encode(os.urandom(768 << 10)).decode()  # under the 1 MiB stdin limit

# kind: (weight, path, body, check(http status, answer) -> None or what was wrong)
def status_is(want, code=None):
    def check(http, a):
        if http != 200 or a.get("status") != want or (code is not None and a.get("exit_code") != code):
            return f"want {want}/{code}, got {http} {a.get('status')}/{a.get('exit_code')}"
    return check

def echo_check(http, a):
    if http != 200 or a.get("status") != "ok" or a.get("stdout_b64") != big_stdin:
        return f"stdin not echoed: {http} {a.get('status')}"

def batch_check(http, a):
    got = [r.get("stdout") for r in a.get("results", [])]
    if http != 200 or got != [f"{i}\n" for i in range(4)]:
        return f"batch: {http} {got}"

def refused_check(http, a):
    if http != 400 or a.get("error", {}).get("code") != "invalid_request":
        return f"want 400 invalid_request, got {http} {a}"

KINDS = {
    "print": (20, "/v1/exec", {"code": "print(1)"}, status_is("ok", 0)),
    "shell": (10, "/v1/exec", {"language": "shell", "code": "echo a b | tr a-z A-Z"}, status_is("ok", 0)),
    "exit": (10, "/v1/exec", {"code": "import sys; sys.exit(3)"}, status_is("error", 3)),
    "raise": (10, "/v1/exec", {"code": "1/0"}, status_is("error", 1)),
    "1MiB": (5, "/v1/exec", {"code": "import sys; sys.stdout.write('x' * (1 << 20))"}, status_is("ok", 0)),
    "flood": (2, "/v1/exec", {"code": "while True: print('y' * 1000)", "output_limit": 65536}, status_is("output_limit")),
    "fd-flood": (1, "/v1/exec", {"language": "shell", "code": "yes", "output_limit": 65536, "timeout_ms": 30000}, status_is("output_limit")),
    "timeout": (2, "/v1/exec", {"code": "while True: pass", "timeout_ms": 300}, status_is("timeout")),
    "memory": (1, "/v1/exec", {"code": "x = bytearray(1 << 40)"}, status_is("memory_limit")),
    "stdin": (2, "/v1/exec", {"code": "import sys; sys.stdout.buffer.write(sys.stdin.buffer.read())",
                              "stdin_b64": big_stdin, "output_b64": True}, echo_check),
    "batch": (5, "/v1/exec/batch", {"jobs": [{"code": f"print({i})"} for i in range(4)]}, batch_check),
    "refused": (5, "/v1/exec", {"code": "1", "timeout_ms": -1}, refused_check),
}
order = [k for k, (w, *_) in KINDS.items() for _ in range(w)]

def post(path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)

def proc():
    """The server's own RSS (outside mappings of 128 MiB and more: guest RAM, which warm
    VMs keep and the executor bounds), threads and fds."""
    own, size = 0, 0
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                size = int(m.group(2), 16) - int(m.group(1), 16)
            elif line.startswith("Rss:") and size < (128 << 20):
                own += int(line.split()[1])
    with open(f"/proc/{pid}/status") as f:
        threads = int(dict(l.split(":", 1) for l in f)["Threads"])
    return own // 1024, threads, len(os.listdir(f"/proc/{pid}/fd"))

lock = threading.Lock()
counts, wrong, done = collections.Counter(), [], [0]
checkpoints = []
nxt = iter(range(jobs))

def worker():
    while True:
        with lock:
            i = next(nxt, None)
        if i is None:
            return
        kind = order[i % len(order)]
        _, path, body, check = KINDS[kind]
        http, answer = post(path, body)
        problem = check(http, answer)
        with lock:
            counts[kind if problem is None else kind + " WRONG"] += 1
            if problem:
                wrong.append((kind, problem))
            done[0] += 1
            if done[0] % 1000 == 0:
                rss, threads, fds = proc()
                checkpoints.append((done[0], rss, threads, fds))
                print(f"[soak] {done[0]:6} jobs: server RSS {rss} MiB, {threads} threads, {fds} fds; "
                      f"wrong so far {len(wrong)}", flush=True)
                for kind, problem in wrong[-3:]:
                    print(f"[soak]   e.g. {kind}: {problem}", flush=True)

rss0, threads0, fds0 = proc()
print(f"[soak] start: server RSS {rss0} MiB, {threads0} threads, {fds0} fds; "
      f"{jobs} jobs, concurrency {concurrency}", flush=True)
ts = [threading.Thread(target=worker) for _ in range(concurrency)]
for t in ts: t.start()
for t in ts: t.join()
print("[soak] jobs by kind:", dict(sorted(counts.items())))
failed = False
if wrong:
    print(f"[soak] FAIL: {len(wrong)} wrong answers, first: {wrong[:3]}")
    failed = True
if len(checkpoints) >= 2:
    (_, r1, t1, f1), (_, r2, t2, f2) = checkpoints[0], checkpoints[-1]
    print(f"[soak] growth from {checkpoints[0][0]} to {checkpoints[-1][0]} jobs: "
          f"RSS {r2 - r1:+} MiB, threads {t2 - t1:+}, fds {f2 - f1:+}")
    if r2 - r1 > 16 or t2 - t1 > 4 or f2 - f1 > 4:
        print("[soak] FAIL: the server grew")
        failed = True
sys.exit(1 if failed else 0)
PY
