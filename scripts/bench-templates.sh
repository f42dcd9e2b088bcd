#!/usr/bin/env bash
# The datascience template side by side with the host, in one run (reported, never
# asserted):
#  1. a pandas group-by job and a small plot job, sent to `bud serve` (template datascience:
#     numpy, pandas and matplotlib imported before the snapshot), against the same code run
#     as `python3 -c` on the host, imports included (the host's numpy/pandas/matplotlib are
#     PyPI's wheels of the same versions as the guest's Debian packages, in a virtual
#     environment under build/). Interleaved, one of each per round; medians and ratios.
#  2. the template's facts: boot time to READY (from the server log, when this run built
#     it), image size, memory file size, and the private memory a job leaves in its VM
#     (pages the resets copied back, per job).
#
# Usage: scripts/bench-templates.sh [ROUNDS]   (default 20)
# First use builds the datascience guest and boots its template (minutes) and creates the
# virtual environment (pip, from PyPI). Starts `bud serve` on $PORT, stopped by pid at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-20}
port=${PORT:-18473}
log=target/bench-templates-server.log
venv=build/bench-venv

if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import pandas, matplotlib' 2>/dev/null; then
    echo "[bench] creating $venv with numpy, pandas and matplotlib from PyPI" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q numpy==1.24.2 pandas==1.5.3 matplotlib==3.6.3 >&2
fi
cargo build --release -q
. scripts/serve-lib.sh
start_bud_serve bench-templates "$port" "$log" --templates python,datascience
wait_for_template bench-templates "$port" "$log" datascience

python3 - "$rounds" "$port" "$venv/bin/python" "$log" <<'PY'
import json, re, statistics, subprocess, sys, time, urllib.request

rounds, port, host_py, log = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
url = f"http://127.0.0.1:{port}"

def call(method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data, {"content-type": "application/json"},
                                 method=method)
    with urllib.request.urlopen(req, timeout=300) as r:
        raw = r.read()
        return json.loads(raw) if path != "/metrics" else raw.decode()

CSV = "city,year,value\n" + "".join(
    f"{c},{2000 + i % 20},{(i * 37) % 101 / 7:.3f}\n"
    for i, c in enumerate(["Oslo", "Lima", "Pune", "Kyiv", "Baku"] * 40))

GROUPBY = """import sys, io
import pandas as pd
df = pd.read_csv(io.StringIO(sys.stdin.read()))
out = df.groupby("city")["value"].agg(["mean", "sum", "count"]).round(3)
print(out.to_json(orient="index"))
"""
# The host saves the PNG itself; in bud the figure left open comes back in `results`.
PLOT = """import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(4, 3), dpi=80)
ax.plot(range(20), [x * x for x in range(20)], marker="o")
ax.bar(["a", "b", "c"], [3, 1, 2])
ax.set_title("squares")
"""
HOST_PLOT = PLOT + "import io\nbuf = io.BytesIO()\nfig.savefig(buf, format='png')\nprint(len(buf.getvalue()) > 1000)\n"

def bud_job(code, stdin=""):
    t = time.perf_counter()
    r = call("POST", "/v1/exec", {"template": "datascience", "code": code, "stdin": stdin})
    dt = time.perf_counter() - t
    assert r["status"] == "ok", r
    return dt, r

def host_job(code, stdin=""):
    t = time.perf_counter()
    out = subprocess.run([host_py, "-c", code], input=stdin.encode(), capture_output=True)
    dt = time.perf_counter() - t
    assert out.returncode == 0, out.stderr[-800:]
    return dt, out.stdout.decode()

# Same answers both ways before timing anything.
_, r = bud_job(GROUPBY, CSV)
_, h = host_job(GROUPBY, CSV)
assert r["stdout"] == h, (r["stdout"], h)
_, r = bud_job(PLOT)
assert len(r["results"]) == 1 and r["results"][0]["type"] == "image/png", r

before = call("GET", "/metrics")
times = {k: [] for k in ("bud group-by", "host group-by", "bud plot", "host plot")}
guest = {"bud group-by": [], "bud plot": []}
for _ in range(rounds):
    dt, r = bud_job(GROUPBY, CSV); times["bud group-by"].append(dt); guest["bud group-by"].append(r["timings"]["run_ms"])
    dt, _ = host_job(GROUPBY, CSV); times["host group-by"].append(dt)
    dt, r = bud_job(PLOT); times["bud plot"].append(dt); guest["bud plot"].append(r["timings"]["run_ms"])
    dt, _ = host_job(HOST_PLOT); times["host plot"].append(dt)
after = call("GET", "/metrics")

def metric(text, name):
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0

print(f"\n{rounds} rounds, interleaved; wall time per job (bud: HTTP round trip on loopback; "
      "host: `python3 -c` process, imports included)\n")
print("| job | median | p90 | vs host |")
print("|---|---:|---:|---:|")
for kind in ("group-by", "plot"):
    base = statistics.median(times[f"host {kind}"])
    for who in ("bud", "host"):
        v = sorted(times[f"{who} {kind}"])
        med = statistics.median(v)
        p90 = v[min(len(v) - 1, int(len(v) * 0.9))]
        print(f"| {who} {kind} | {med * 1e3:.1f} ms | {p90 * 1e3:.1f} ms | {med / base:.2f}x |")
for k, v in guest.items():
    print(f"\n{k}: the VM ran for a median {statistics.median(v):.1f} ms of it")

resets = metric(after, "bud_resets_total") - metric(before, "bud_resets_total")
pages = metric(after, "bud_reset_restored_pages_total") - metric(before, "bud_reset_restored_pages_total")
templates = {t["name"]: t for t in call("GET", "/v1/templates")["templates"]}
print("\n| template | image | memory file | guest RAM |")
print("|---|---:|---:|---:|")
for name, t in templates.items():
    print(f"| {name} | {t['image_bytes'] / 1e6:.1f} MB | {t['memory_file_bytes'] / 1e6:.1f} MB | "
          f"{t['ram_bytes'] >> 20} MiB |")
if resets:
    print(f"\nprivate memory a job leaves (pages its reset copied back; both templates): "
          f"{pages / resets * 4:.0f} KiB per job over {resets:.0f} resets")
booted = [l for l in open(log) if "template built" in l and "datascience" in l]
if booted:
    m = re.search(r"ready_s=([\d.]+)", booted[-1])
    print(f"datascience template boot to READY (this run built it): {float(m.group(1)):.1f} s")
PY
