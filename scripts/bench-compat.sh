#!/usr/bin/env bash
# The compat layers side by side with bud's native API, in one run (reported, never
# asserted), through the real clients (the venv of server/tests/compat/requirements.txt):
#  1. E2B: `Sandbox.create()` + the first `run_code("1+1")` (the SDK, HTTP on loopback),
#     for template `base` (bud's python) and `code-interpreter-v1` (datascience), against
#     the native `POST /v1/sessions` + `POST /v1/sessions/{id}/exec` on one keep-alive
#     connection. The sandbox/session is deleted after each round, untimed.
#  2. Piston: `execute("python", print(1))` through aiopyston, and as a raw POST, against
#     the native `POST /v1/exec`.
# One of each per round, interleaved; medians (p50) and ratios to native.
#
# Usage: scripts/bench-compat.sh [ROUNDS]   (default 30)
# First use builds the guests and templates (minutes) and the client venv (pip, PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-30}
port=${PORT:-18474}
log=target/bench-compat-server.log
venv=build/compat-venv

. scripts/serve-lib.sh
ensure_compat_venv "$venv"
cargo build --release -q
start_bud_serve bench-compat "$port" "$log" --templates python,datascience
wait_for_template bench-compat "$port" "$log" datascience

E2B_API_URL="http://127.0.0.1:$port" E2B_SANDBOX_URL="http://127.0.0.1:$port" \
E2B_API_KEY=bench "$venv/bin/python" - "$rounds" "$port" <<'PY'
import asyncio, http.client, json, statistics, sys, time

from e2b_code_interpreter import Sandbox
from pyston import File, PystonClient

rounds, port = int(sys.argv[1]), int(sys.argv[2])
conn = http.client.HTTPConnection("127.0.0.1", port)

def call(method, path, body=None):
    conn.request(method, path, json.dumps(body) if body is not None else None,
                 {"content-type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    return r.status, (json.loads(data) if data else None)

def e2b(template):
    t = time.perf_counter()
    sbx = Sandbox.create(template=template)
    text = sbx.run_code("1+1").text
    took = time.perf_counter() - t
    assert text == "2", text
    sbx.kill()
    return took

def native(template):
    t = time.perf_counter()
    status, s = call("POST", "/v1/sessions", {"template": template})
    assert status == 201, s
    status, r = call("POST", f"/v1/sessions/{s['id']}/exec", {"code": "1+1"})
    took = time.perf_counter() - t
    assert r["result"]["text/plain"] == "2", r
    call("DELETE", f"/v1/sessions/{s['id']}")
    return took

piston = None

async def pyston_print():
    t = time.perf_counter()
    out = await piston.execute("python", [File("print(1)")])
    took = time.perf_counter() - t
    assert out.run_stage.stdout == "1\n", out.raw_json
    return took

def piston_raw():
    t = time.perf_counter()
    status, r = call("POST", "/api/v2/execute",
                     {"language": "python", "version": "*", "files": [{"content": "print(1)"}]})
    took = time.perf_counter() - t
    assert status == 200 and r["run"]["stdout"] == "1\n", r
    return took

def exec_native():
    t = time.perf_counter()
    status, r = call("POST", "/v1/exec", {"code": "print(1)"})
    took = time.perf_counter() - t
    assert status == 200 and r["stdout"] == "1\n", r
    return took

async def main():
    global piston
    piston = PystonClient(base_url=f"http://127.0.0.1:{port}/api/v2/piston/")
    await pyston_print()  # reads the runtime versions once
    for template in ("base", "code-interpreter-v1"):
        e2b(template)
    times = {k: [] for k in ("e2b base", "native python", "e2b code-interpreter-v1",
                             "native datascience", "aiopyston", "piston raw", "native exec")}
    for _ in range(rounds):
        times["e2b base"].append(e2b("base"))
        times["native python"].append(native("python"))
        times["e2b code-interpreter-v1"].append(e2b("code-interpreter-v1"))
        times["native datascience"].append(native("datascience"))
        times["aiopyston"].append(await pyston_print())
        times["piston raw"].append(piston_raw())
        times["native exec"].append(exec_native())
    await piston.close_session()
    piston._http_session.__class__.__del__ = lambda self: None  # aiopyston's __del__ needs a live loop
    p50 = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{rounds} rounds, p50 ms (ratio to the native call)")
    for k, ref in (("e2b base", "native python"), ("e2b code-interpreter-v1", "native datascience"),
                   ("aiopyston", "native exec"), ("piston raw", "native exec")):
        print(f"  {k:28s} {p50[k]:8.2f}   {ref:20s} {p50[ref]:8.2f}   {p50[k] / p50[ref]:.2f}x")

asyncio.run(main())
PY
