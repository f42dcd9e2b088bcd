#!/usr/bin/env bash
# What session traces cost (docs/evidence.md): two `bud serve` side by side in one run, one
# with traces (the default) and one with `--no-trace`, each on its own fresh state
# directory, the same other options; requests alternate between them (A, B, A, B) so the
# machine's noise hits both alike.
#
#   scripts/bench-trace.sh                      # 400 cells and 400 one-shot jobs a server,
#                                               #   a 10 000-event trace
#   CELLS=1000 TRACE_EVENTS=2000 scripts/bench-trace.sh
#   SERVE_ARGS=--no-jail scripts/bench-trace.sh # options both servers get
#   BUD=path/to/bud scripts/bench-trace.sh      # this binary, no cargo build
#
# Steps: build the release binary; start both servers on 127.0.0.1 (ports $PORT and
# $PORT + 1; their pids are stopped on exit); wait for /v1/health; warm up each; then
#   1. session cells: one session a server, $CELLS cells `print(1+1)` each, alternating,
#      timed by the client (keep-alive): p50 / p90 / p99, traced / untraced p50;
#   2. one-shot jobs (POST /v1/exec, not traced: the control), the same;
#      for both, the server's own mean job time from /metrics (bud_job_total_seconds);
#   2a. one-shot jobs with `"trace": true` on the traced server against plain ones on the
#      untraced one (each such job writes its own trace: created, cell, ended, seal);
#   2b. $ENDS sessions a server: a cell writes a file, then DELETE timed (the traced server
#      takes its checkpoint of the work directory there);
#   3. emulated guest-kernel instructions per cell: perf's kvm:kvm_emulate_insn on each
#      server's pid over $PERF_CELLS alternating cells, beside bud_kvm_emulated_instructions;
#   4. a $TRACE_EVENTS-event trace on the traced server (one `cell` event a cell): GET
#      /v1/sessions/{id}/trace and .../trace/verify, $FETCHES times each, median and max and
#      bytes, while the session is open, then again once it is ended (DELETE: sealed);
#      the same for /trace/otlp, /trace.tar.gz and /review;
#   5. the ended trace's review page loaded $RENDERS times by Debian's chromium, headless
#      (when on PATH): the page's own data-rendered-ms and chromium's wall time.
# It measures and reports; it asserts no time. It exits non-zero if any request failed.
set -euo pipefail
cd "$(dirname "$0")/.."

CELLS=${CELLS:-400}
TRACE_EVENTS=${TRACE_EVENTS:-10000}
FETCHES=${FETCHES:-10}
RENDERS=${RENDERS:-5}
ENDS=${ENDS:-50}
PERF_CELLS=${PERF_CELLS:-100}
WARMUP=${WARMUP:-50}
PORT=${PORT:-18481}
SERVE_ARGS=${SERVE_ARGS:-}
CODE=${CODE:-print(1+1)}
DIR=${DIR:-target/bench-trace}

for tool in curl python3; do
    command -v "$tool" >/dev/null || { echo "[bench-trace] needs $tool" >&2; exit 1; }
done
if [ -z "${BUD:-}" ]; then
    cargo build --release --quiet
    BUD=${CARGO_TARGET_DIR:-target}/release/bud
fi

# Fresh state directories: no trace, session or key left from an earlier run.
rm -rf "$DIR"
mkdir -p "$DIR/traced" "$DIR/untraced"
PIDS=()
stop_servers() {
    for pid in "${PIDS[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then kill -TERM "$pid"; wait "$pid" || true; fi
    done
}
trap stop_servers EXIT

# start_server TAG PORT [serve options...]: starts it with its log in $DIR/TAG.log, appends
# its pid to PIDS and returns once /v1/health answers 200 (as serve-lib.sh's
# start_bud_serve, which keeps one server).
start_server() {
    local tag=$1 port=$2 log=$DIR/$1.log
    shift 2
    "$BUD" serve --port "$port" --state-dir "$DIR/$tag" "$@" >"$log" 2>&1 &
    PIDS+=($!)
    echo "[bench-trace] $tag: bud serve --port $port --state-dir $DIR/$tag $* (pid $!)" >&2
    for _ in $(seq 1800); do
        curl -sf "http://127.0.0.1:$port/v1/health" >/dev/null 2>&1 && return 0
        kill -0 "${PIDS[-1]}" 2>/dev/null || { echo "[bench-trace] $tag died; log: $log" >&2; tail -20 "$log" >&2; exit 1; }
        sleep 0.5
    done
    echo "[bench-trace] $tag not ready after 900 s; log: $log" >&2
    exit 1
}

# One after the other: a template the first has to boot and save, the second loads.
# shellcheck disable=SC2086 # SERVE_ARGS is a list of options
start_server traced "$PORT" $SERVE_ARGS
# shellcheck disable=SC2086
start_server untraced "$((PORT + 1))" --no-trace $SERVE_ARGS

PERF=$(command -v perf || true)
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
python3 - "$PORT" "${PIDS[0]}" "$((PORT + 1))" "${PIDS[1]}" "$CELLS" "$TRACE_EVENTS" \
    "$FETCHES" "$PERF_CELLS" "$WARMUP" "$CODE" "$PERF" "$DIR" "$LOAD_BEFORE" "$RENDERS" "$ENDS" <<'PY'
import http.client, json, os, re, shutil, signal, statistics, subprocess, sys, tempfile, time

(port_a, pid_a, port_b, pid_b, cells, trace_events, fetches, perf_cells, warmup, code,
 perf, state, load_before, renders_wanted, ends) = sys.argv[1:]
renders_wanted, ends = int(renders_wanted), int(ends)
cells, trace_events, fetches = int(cells), int(trace_events), int(fetches)
perf_cells, warmup = int(perf_cells), int(warmup)
BODY = json.dumps({"code": code}).encode()
failures = []


class Server:
    """One server: a keep-alive connection, opened again if the server closed it idle."""

    def __init__(self, name, port, pid):
        self.name, self.port, self.pid = name, int(port), int(pid)
        self.conn, self.reconnects = None, 0

    def request(self, method, path, body=None):
        """(status, body bytes, seconds from sending to the last byte)."""
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
            try:
                headers = {"content-type": "application/json"} if body is not None else {}
                t = time.perf_counter()
                self.conn.request(method, path, body=body, headers=headers)
                r = self.conn.getresponse()
                data = r.read()
                took = time.perf_counter() - t
                if r.getheader("connection", "").lower() == "close":
                    self.conn.close()
                    self.conn = None
                return r.status, data, took
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                # An idle connection the server closed (--header-timeout-ms): never sent.
                self.conn.close()
                self.conn = None
                self.reconnects += 1
                if attempt:
                    raise

    def json(self, method, path, body=None, want=(200,)):
        status, data, took = self.request(method, path, body)
        if status not in want:
            failures.append(f"{self.name} {method} {path}: {status} {data[:200]!r}")
            return None, took
        return (json.loads(data) if data else None), took

    def run(self, path, body=None):
        """Runs CODE; its client-side time in ms, or None if it failed."""
        r, took = self.json("POST", path, body or BODY)
        if r is None:
            return None
        if r.get("status") != "ok" or (code == "print(1+1)" and r.get("stdout") != "2\n"):
            failures.append(f"{self.name} POST {path}: {json.dumps(r)[:200]}")
            return None
        return took * 1e3

    def metrics(self):
        """{metric line's name and labels: value} of /metrics."""
        _, data, _ = self.request("GET", "/metrics")
        out = {}
        for line in data.decode().splitlines():
            if line and not line.startswith("#"):
                k, _, v = line.rpartition(" ")
                try:
                    out[k] = float(v)
                except ValueError:
                    pass
        return out

    def job_seconds(self):
        m = self.metrics()
        return m.get("bud_job_total_seconds_sum", 0.0), m.get("bud_job_total_seconds_count", 0.0)

    def emulated(self):
        return self.metrics().get("bud_kvm_emulated_instructions_total", 0.0)

    def session(self):
        r, _ = self.json("POST", "/v1/sessions", b"{}", want=(200, 201))
        if r is None:
            sys.exit(f"[bench-trace] {self.name}: no session: {failures[-1]}")
        return r["id"]


A = Server("traced", port_a, pid_a)
B = Server("untraced", port_b, pid_b)


def log(msg):
    print(f"[bench-trace] {msg}", file=sys.stderr, flush=True)


def pct(xs, p):
    """The p-th percentile, interpolated between the nearest ranks."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def alternate(n, path_a, path_b, body_a=None):
    """n requests to each, A, B, A, B: their times in ms (failed ones left out)."""
    ta, tb = [], []
    for _ in range(n):
        for s, path, out, body in ((A, path_a, ta, body_a), (B, path_b, tb, None)):
            ms = s.run(path, body)
            if ms is not None:
                out.append(ms)
    return ta, tb


def timed_phase(name, n, path_a, path_b, body_a=None):
    """The alternating run with each server's own mean job time over it (/metrics)."""
    sa0, ca0 = A.job_seconds()
    sb0, cb0 = B.job_seconds()
    log(f"{name}: {n} requests a server, alternating")
    ta, tb = alternate(n, path_a, path_b, body_a)
    sa1, ca1 = A.job_seconds()
    sb1, cb1 = B.job_seconds()
    server_a = (sa1 - sa0) * 1e3 / max(1, ca1 - ca0)
    server_b = (sb1 - sb0) * 1e3 / max(1, cb1 - cb0)
    return ta, tb, server_a, server_b


class Emulated:
    """kvm:kvm_emulate_insn events of one server's threads while the block runs (perf)."""

    def __init__(self, pid):
        self.pid, self.count = pid, None

    def __enter__(self):
        if not perf:
            return self
        self.out = tempfile.NamedTemporaryFile("r", suffix=".perf")
        self.perf = subprocess.Popen(
            [perf, "stat", "-x,", "-e", "kvm:kvm_emulate_insn", "-p", str(self.pid),
             "-o", self.out.name], stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        if not perf:
            return False
        self.perf.send_signal(signal.SIGINT)
        self.perf.wait()
        line = [l for l in open(self.out.name) if "kvm_emulate_insn" in l]
        self.count = int(line[0].split(",")[0]) if line and line[0][0].isdigit() else None
        return False


# Warm-up: one-shot jobs (warm VMs in the pool), then a session's first cells.
log(f"warm-up: {warmup} one-shot jobs and a session's first 10 cells on each")
for _ in range(warmup):
    A.run("/v1/exec")
    B.run("/v1/exec")
for s in (A, B):
    w = s.session()
    for _ in range(10):
        s.run(f"/v1/sessions/{w}/exec")
    s.json("DELETE", f"/v1/sessions/{w}", want=(200, 204))
warm_failures = len(failures)

# 1. Session cells.
sa, sb = A.session(), B.session()
for _ in range(5):
    A.run(f"/v1/sessions/{sa}/exec")
    B.run(f"/v1/sessions/{sb}/exec")
cell_a, cell_b, cell_srv_a, cell_srv_b = timed_phase(
    "session cells", cells, f"/v1/sessions/{sa}/exec", f"/v1/sessions/{sb}/exec")

# 3. Emulated instructions per cell, both servers watched at once, cells alternating.
emu = None
if perf_cells:
    log(f"emulated instructions: {perf_cells} cells a server under perf")
    ka, kb = A.emulated(), B.emulated()
    with Emulated(A.pid) as ea, Emulated(B.pid) as eb:
        time.sleep(0.3)  # perf attached
        alternate(perf_cells, f"/v1/sessions/{sa}/exec", f"/v1/sessions/{sb}/exec")
        time.sleep(0.1)
    emu = {
        "perf": [None if e.count is None else e.count / perf_cells for e in (ea, eb)],
        "kvm": [(A.emulated() - ka) / perf_cells, (B.emulated() - kb) / perf_cells],
    }
for s, sid in ((A, sa), (B, sb)):
    s.json("DELETE", f"/v1/sessions/{sid}", want=(200, 204))

# 2. One-shot jobs (not traced): the control.
exec_a, exec_b, exec_srv_a, exec_srv_b = timed_phase("one-shot jobs", cells, "/v1/exec", "/v1/exec")
# 2a. One-shot jobs that ask for a trace (traced server) against plain ones (untraced).
TRACED_BODY = json.dumps({"code": code, "trace": True}).encode()
texec_a, texec_b, texec_srv_a, texec_srv_b = timed_phase(
    "one-shot jobs with trace: true", cells, "/v1/exec", "/v1/exec", TRACED_BODY)

# 2b. Session ends: the traced server takes a checkpoint of the work directory at DELETE.
log(f"session ends: {ends} sessions a server (a cell writing one file, then DELETE timed)")
del_a, del_b = [], []
WRITE = json.dumps({"code": "open('out.txt', 'w').write('x' * 1000)"}).encode()
for _ in range(ends):
    for s, out in ((A, del_a), (B, del_b)):
        sid = s.session()
        s.json("POST", f"/v1/sessions/{sid}/exec", WRITE)
        _, took = s.json("DELETE", f"/v1/sessions/{sid}", want=(200, 204))
        out.append(took * 1e3)

# 4. A long trace on the traced server.
def trace_lines(sid):
    status, data, _ = A.request("GET", f"/v1/sessions/{sid}/trace")
    if status != 200:
        failures.append(f"traced GET trace: {status} {data[:200]!r}")
        return 0
    return data.count(b"\n")


ROUTES = ("trace", "trace/verify", "trace/otlp", "trace.tar.gz", "review")


def fetch_times(sid):
    """{route: (median ms, max ms, bytes, last body)} of FETCHES GETs each."""
    out = {}
    for route in ROUTES:
        times, size, body = [], 0, b""
        for _ in range(fetches):
            status, body, took = A.request("GET", f"/v1/sessions/{sid}/{route}")
            if status != 200:
                failures.append(f"traced GET {route}: {status} {body[:200]!r}")
            times.append(took * 1e3)
            size = len(body)
        out[route] = (statistics.median(times), max(times), size, body.count(b"\n"), body)
    return out


CHROMIUM = shutil.which("chromium")


def browser_renders(sid):
    """[(data-rendered-ms, chromium's wall ms)] of RENDERS headless loads of the review
    page (chromium resolving only loopback), or [] without chromium."""
    if not CHROMIUM:
        return []
    out = []
    for i in range(renders_wanted):
        with tempfile.TemporaryDirectory() as profile:
            t = time.perf_counter()
            r = subprocess.run(
                [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-extensions",
                 "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                 f"--user-data-dir={profile}", "--dump-dom",
                 f"http://127.0.0.1:{A.port}/v1/sessions/{sid}/review"],
                capture_output=True, text=True, timeout=300)
            wall = (time.perf_counter() - t) * 1e3
        m = re.search(r'data-rendered-ms="(\d+)"', r.stdout)
        if r.returncode != 0 or not m:
            failures.append(f"chromium review {i}: rc {r.returncode} {r.stderr[-200:]!r}")
            continue
        out.append((int(m.group(1)), wall))
    return out


long_times = []
t_long = time.perf_counter()
sl = A.session()
events = trace_lines(sl)
log(f"a {trace_events}-event trace: cells until its trace has {trace_events} lines")
while events < trace_events:
    for i in range(1, trace_events - events + 1):
        ms = A.run(f"/v1/sessions/{sl}/exec")
        if ms is not None:
            long_times.append(ms)
        if i % 2000 == 0:
            log(f"  {i} cells")
    before, events = events, trace_lines(sl)
    if events == before:
        sys.exit(f"[bench-trace] the trace stays at {events} lines")
t_long = time.perf_counter() - t_long
trace_file = os.path.join(state, "traced", "traces")
open_fetch = fetch_times(sl)
open_check = json.loads(open_fetch["trace/verify"][4] or b"{}")
A.json("DELETE", f"/v1/sessions/{sl}", want=(200, 204))
time.sleep(0.2)
ended_fetch = fetch_times(sl)
ended_check = json.loads(ended_fetch["trace/verify"][4] or b"{}")
renders = browser_renders(sl)
disk = sum(os.path.getsize(os.path.join(trace_file, f)) for f in os.listdir(trace_file)) \
    if os.path.isdir(trace_file) else 0
untraced_dir = os.path.join(state, "untraced", "traces")
untraced_files = len(os.listdir(untraced_dir)) if os.path.isdir(untraced_dir) else 0

# Summary.
load_after = " ".join(open("/proc/loadavg").read().split()[:3])
def row(label, ta, tb, srv_a, srv_b):
    pa, pb = pct(ta, 50), pct(tb, 50)
    print(f"  {label:<22} {'traced':<9} p50 {pa:7.2f}  p90 {pct(ta, 90):7.2f}  p99 {pct(ta, 99):7.2f}"
          f"  server {srv_a:6.2f}  (n {len(ta)})")
    print(f"  {'':<22} {'untraced':<9} p50 {pb:7.2f}  p90 {pct(tb, 90):7.2f}  p99 {pct(tb, 99):7.2f}"
          f"  server {srv_b:6.2f}  (n {len(tb)})")
    print(f"  {'':<22} traced/untraced p50 {pa / pb:.3f} ({(pa / pb - 1) * 100:+.1f} %),"
          f" p90 {pct(ta, 90) / pct(tb, 90):.3f}, p99 {pct(ta, 99) / pct(tb, 99):.3f};"
          f" server-side {srv_a / srv_b:.3f}")

print(f"bud session-trace cost: {code!r}, host {os.cpu_count()} cores,"
      f" load average {load_before} before, {load_after} after")
print(f"  servers: traced :{A.port} (pid {A.pid}), untraced :{B.port} --no-trace (pid {B.pid});"
      f" state dirs under {state}/")
print(f"  client-side ms per request (keep-alive), A/B alternating; server = mean"
      f" bud_job_total_seconds (clone + run + collect) over the run, ms")
row(f"session cells x{cells}", cell_a, cell_b, cell_srv_a, cell_srv_b)
row(f"one-shot jobs x{cells}", exec_a, exec_b, exec_srv_a, exec_srv_b)
row(f"jobs, trace: true x{cells}", texec_a, texec_b, texec_srv_a, texec_srv_b)
if ends:
    print(f"  session DELETE (one file in the work directory) x{ends}: traced p50"
          f" {pct(del_a, 50):.2f} ms (with its checkpoint), untraced {pct(del_b, 50):.2f} ms")
if emu:
    def f(v):
        return "n/a" if v is None else f"{v:,.0f}"
    print(f"  emulated instructions per cell ({perf_cells} cells a server):"
          f" perf kvm:kvm_emulate_insn traced {f(emu['perf'][0])}, untraced {f(emu['perf'][1])};"
          f" bud_kvm_emulated_instructions traced {f(emu['kvm'][0])}, untraced {f(emu['kvm'][1])}")
print(f"  {trace_events}-event trace: {len(long_times)} cells in {t_long:.1f} s"
      f" (p50 {pct(long_times, 50):.2f} ms; first 400 {pct(long_times[:400], 50):.2f},"
      f" last 400 {pct(long_times[-400:], 50):.2f}); GET x{fetches}, median / max ms, bytes:")
for label, fetched, check in (("open", open_fetch, open_check), ("ended", ended_fetch, ended_check)):
    t, v = fetched["trace"], fetched["trace/verify"]
    print(f"    {label:<6} trace {t[0]:8.1f} / {t[1]:8.1f}  {t[2]:>11,} B"
          f" {t[3]:>6} lines ({t[2] / max(1, t[3]):.0f} B each)   verify {v[0]:7.1f} / {v[1]:7.1f}"
          f"  -> ok {check.get('ok')}, events {check.get('events')}, sealed {check.get('sealed')}")
    for route in ROUTES[2:]:
        r = fetched[route]
        print(f"    {'':<6} {route:<13} {r[0]:8.1f} / {r[1]:8.1f}  {r[2]:>11,} B")
if renders:
    ms = [r[0] for r in renders]
    wall = [r[1] for r in renders]
    print(f"  review page of the ended {trace_events}-event trace in chromium --headless x{len(renders)}:"
          f" rendered (navigation to load + layout, the page's data-rendered-ms) median"
          f" {statistics.median(ms):.0f} ms, max {max(ms)} ms; chromium process wall median"
          f" {statistics.median(wall):.0f} ms (its start-up included)")
else:
    print("  review page in a browser: not measured (no chromium on PATH; apt-get install chromium)")
print(f"  traces on disk: traced {disk:,} B ({len(os.listdir(trace_file)) if os.path.isdir(trace_file) else 0} files),"
      f" untraced {untraced_files} files")
reconnects = A.reconnects + B.reconnects
print(f"  failures: {len(failures)} ({warm_failures} in the warm-up); reconnects {reconnects}")
for f_ in failures[:10]:
    print(f"    {f_}")
sys.exit(1 if failures else 0)
PY
