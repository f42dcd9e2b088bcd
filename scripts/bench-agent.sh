#!/usr/bin/env bash
# An agent's loop through E2B's SDK against bud, step by step (reported, never asserted),
# beside the same steps on the host (subprocesses and files in a temporary directory):
#   create a sandbox; 10 commands (`echo N`); write a 64 KiB file and read it back; start a
#   background process (a ticker printing a line every 0.2 s); connect to it and read its
#   next line; one command while it runs; kill it (and see its end); kill the sandbox.
# Per step: median wall time over the rounds (ms), the host's, and the emulated
# guest-kernel instructions KVM counted for the bud server's VMs during the step (perf's
# kvm:kvm_emulate_insn on the server's pid: the noise-free cost on this noisy machine).
#
# Usage: scripts/bench-agent.sh [ROUNDS]   (default 10)
# First use builds the guests and templates (minutes) and the client venv (pip, PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-10}
port=${PORT:-18477}
log=target/bench-agent-server.log
venv=build/compat-venv

. scripts/serve-lib.sh
ensure_compat_venv "$venv"
cargo build --release -q
start_bud_serve bench-agent "$port" "$log"

E2B_API_URL="http://127.0.0.1:$port" E2B_SANDBOX_URL="http://127.0.0.1:$port" \
E2B_API_KEY=bench "$venv/bin/python" - "$rounds" "$SERVER" <<'PY'
import os, signal, statistics, subprocess, sys, tempfile, threading, time

from e2b import CommandExitException, Sandbox

rounds, server = int(sys.argv[1]), int(sys.argv[2])
TICKER = "i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.2; done"
DATA = "x" * (64 << 10)


class Emulated:
    """kvm:kvm_emulate_insn events of the server's threads while the block runs."""

    def __enter__(self):
        self.out = tempfile.NamedTemporaryFile("r", suffix=".perf")
        self.perf = subprocess.Popen(
            ["perf", "stat", "-x,", "-e", "kvm:kvm_emulate_insn", "-p", str(server),
             "-o", self.out.name], stderr=subprocess.DEVNULL)
        time.sleep(0.15)  # perf attached
        return self

    def __exit__(self, *exc):
        self.perf.send_signal(signal.SIGINT)
        self.perf.wait()
        line = [l for l in open(self.out.name) if "kvm_emulate_insn" in l]
        self.count = int(line[0].split(",")[0]) if line and line[0][0].isdigit() else None
        return False


def step(times, insns, name, fn):
    with Emulated() as e:
        t = time.perf_counter()
        r = fn()
        took = time.perf_counter() - t
    times.setdefault(name, []).append(took)
    insns.setdefault(name, []).append(e.count)
    return r


def bud_round(times, insns):
    sbx = step(times, insns, "create sandbox", lambda: Sandbox.create(template="base"))
    def ten():
        for i in range(10):
            assert sbx.commands.run(f"echo {i}").stdout == f"{i}\n"
    step(times, insns, "10 commands", ten)
    step(times, insns, "write 64 KiB", lambda: sbx.files.write("/home/user/data.txt", DATA))
    assert step(times, insns, "read 64 KiB", lambda: sbx.files.read("/home/user/data.txt")) == DATA
    h = step(times, insns, "start background",
             lambda: sbx.commands.run(TICKER, background=True, timeout=0))
    def connect():
        c = sbx.commands.connect(h.pid, timeout=0)
        for out, _, _ in c:
            if out and "tick" in out:
                break
        c.disconnect()
    step(times, insns, "connect, next line", connect)
    step(times, insns, "command beside it",
         lambda: sbx.commands.run("echo beside").stdout)
    def kill():
        assert sbx.commands.kill(h.pid)
        try:
            h.wait()
        except CommandExitException:
            pass
    step(times, insns, "kill, see its end", kill)
    step(times, insns, "kill sandbox", sbx.kill)


def host_round(times):
    def t(name, fn):
        s = time.perf_counter()
        r = fn()
        times.setdefault(name, []).append(time.perf_counter() - s)
        return r
    d = t("create sandbox", lambda: tempfile.TemporaryDirectory())
    def ten():
        for i in range(10):
            assert subprocess.run(["/bin/sh", "-c", f"echo {i}"], capture_output=True,
                                  text=True).stdout == f"{i}\n"
    t("10 commands", ten)
    path = os.path.join(d.name, "data.txt")
    t("write 64 KiB", lambda: open(path, "w").write(DATA))
    t("read 64 KiB", lambda: open(path).read())
    p = t("start background", lambda: subprocess.Popen(["/bin/sh", "-c", TICKER],
                                                      stdout=subprocess.PIPE, text=True,
                                                      start_new_session=True))
    t("connect, next line", p.stdout.readline)
    t("command beside it", lambda: subprocess.run(["/bin/sh", "-c", "echo beside"],
                                                  capture_output=True))
    def kill():
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    t("kill, see its end", kill)
    t("kill sandbox", d.cleanup)


bud_round({}, {})  # warm: the SDK's imports, the server's first sandbox
bud, insns, host = {}, {}, {}
for _ in range(rounds):
    bud_round(bud, insns)
    host_round(host)
print(f"{rounds} rounds; p50 ms; emulated guest-kernel instructions per step (median)")
print(f"  {'step':22s} {'bud':>9s} {'host':>9s} {'ratio':>8s} {'emulated':>12s}")
total_b = total_h = 0
for name in bud:
    b = statistics.median(bud[name]) * 1e3
    h = statistics.median(host[name]) * 1e3
    total_b += b
    total_h += h
    counts = [c for c in insns[name] if c is not None]
    e = f"{statistics.median(counts):,.0f}" if counts else "n/a"
    print(f"  {name:22s} {b:9.2f} {h:9.2f} {b / h:7.1f}x {e:>12s}")
print(f"  {'whole loop':22s} {total_b:9.2f} {total_h:9.2f} {total_b / total_h:7.1f}x")
PY
