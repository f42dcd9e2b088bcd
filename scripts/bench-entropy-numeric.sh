#!/usr/bin/env bash
# Large random reads and a dense matrix product in bud against the host, side by side in one
# run (reported, never asserted):
#  - `os.urandom(1 MiB)` in a `python` job (the guest kernel's random source; on kvm_pvm
#    filled from the host's CSPRNG by guest kernel patch 0016) against host `python3 -c`;
#  - a 1500x1500 float64 product `a @ b` in a `datascience` job (numpy on the image's BLAS)
#    against the host's numpy (PyPI wheel of the same version, its bundled OpenBLAS limited to
#    one thread: OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1), in the venv bench-templates.sh
#    makes.
# Per case: the median wall time of the operation itself (timed inside the job / the host
# process), of the whole job over HTTP (bud's total_ms, the host process), their ratios, and
# the job's emulated guest-kernel instructions (timings.kvm.emulated_instructions). Also
# prints the BLAS the guest's numpy runs on and the OpenBLAS core it picked.
#
# Usage: scripts/bench-entropy-numeric.sh [REPS] [bud global options...]   (default 5)
#   e.g. scripts/bench-entropy-numeric.sh 5 --build-dir build/before --source-dir ../before
# to measure another kernel/image. CASES=urandom (or matmul) runs one case only.
# Starts its own `bud serve` (release build) on $PORT (default 18481), stopped by pid at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${1:-5}
shift || true
port=${PORT:-18481}
log=target/bench-entropy-numeric-server.log
venv=build/bench-venv
cases=${CASES:-urandom,matmul}

if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import numpy' 2>/dev/null; then
    echo "[bench] creating $venv with numpy from PyPI" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q numpy==1.24.2 >&2
fi
cargo build --release -q
. scripts/serve-lib.sh
templates=python
[[ $cases == *matmul* ]] && templates=python,datascience
start_bud_serve bench-entropy-numeric "$port" "$log" --templates "$templates" \
    --max-timeout-ms 600000 "$@"
[[ $cases == *matmul* ]] && wait_for_template bench-entropy-numeric "$port" "$log" datascience

python3 - "$reps" "$port" "$venv/bin/python" "$cases" <<'PY'
import json, os, statistics, subprocess, sys, time, urllib.request

reps, port, host_np, cases = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4].split(",")

URANDOM = ("import os, time\nt = time.perf_counter()\nb = os.urandom(1 << 20)\n"
           "print(time.perf_counter() - t, len(b))")
MATMUL = ("import time, numpy as np\nrng = np.random.default_rng(1)\n"
          "a = rng.random((1500, 1500)); b = rng.random((1500, 1500))\n"
          "t = time.perf_counter()\nc = a @ b\nprint(time.perf_counter() - t, round(float(c.sum()), 3))")
CORE = ("import ctypes, numpy\nnumpy.show_config()\n"
        "lib = ctypes.CDLL('libblas.so.3')\n"
        "try:\n    f = lib.openblas_get_corename; f.restype = ctypes.c_char_p\n"
        "    g = lib.openblas_get_config; g.restype = ctypes.c_char_p\n"
        "    print('OpenBLAS core:', f().decode(), '|', g().decode())\n"
        "except AttributeError:\n    print('libblas.so.3 is not OpenBLAS')\n"
        "print(open('/proc/self/maps').read().count('openblas') > 0 and 'openblas mapped' or 'no openblas mapped')")

def exec_job(template, code):
    body = json.dumps({"template": template, "code": code, "timeout_ms": 600000}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/exec", data=body,
                                 headers={"content-type": "application/json"})
    t = time.perf_counter()
    a = json.load(urllib.request.urlopen(req, timeout=900))
    wall = time.perf_counter() - t
    assert a["status"] == "ok", a
    return a, wall

def bud(template, code):
    a, wall = exec_job(template, code)
    kvm = a["timings"].get("kvm") or {}
    return float(a["stdout"].split()[0]), wall, kvm.get("emulated_instructions") or 0, a["stdout"]

def host(py, code, env):
    t = time.perf_counter()
    out = subprocess.run([py, "-c", code], capture_output=True, env={**os.environ, **env})
    wall = time.perf_counter() - t
    assert out.returncode == 0, out.stderr[-800:]
    return float(out.stdout.split()[0]), wall, out.stdout.decode()

ONE = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
SETUP = {"urandom": ("python", URANDOM, "python3", {}),
         "matmul": ("datascience", MATMUL, host_np, ONE)}
if "matmul" in cases:
    print(exec_job("datascience", CORE)[0]["stdout"])
    v = subprocess.run([host_np, "-c", "import numpy; print(numpy.__version__)"], capture_output=True,
                       text=True, env={**os.environ, **ONE, "OPENBLAS_VERBOSE": "2"})
    print("host: numpy", v.stdout.strip(), "| OpenBLAS", v.stderr.strip() or v.stdout.strip())
print(f"\n{reps} rounds, interleaved; medians\n")
print("| case | bud op | host op | op ratio | bud job (HTTP) | host process | emulated insns |")
print("|---|---:|---:|---:|---:|---:|---:|")
for name in cases:
    template, code, py, env = SETUP[name]
    # One untimed run each: the same answer both ways, and warm caches.
    b_out, h_out = bud(template, code)[3].split()[1], host(py, code, env)[2].split()[1]
    assert b_out == h_out, (b_out, h_out)
    bo, bw, bi, ho, hw = [], [], [], [], []
    for _ in range(reps):
        o, w, i, _ = bud(template, code); bo.append(o); bw.append(w); bi.append(i)
        o, w, _ = host(py, code, env); ho.append(o); hw.append(w)
    m = statistics.median
    print(f"| {name} | {m(bo) * 1e3:.1f} ms | {m(ho) * 1e3:.1f} ms | {m(bo) / m(ho):.2f}x | "
          f"{m(bw) * 1e3:.1f} ms | {m(hw) * 1e3:.1f} ms | {int(m(bi)):,d} |", flush=True)
PY
