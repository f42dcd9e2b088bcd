"""What a code context as a kernel process costs under kvm_pvm, in the guest: a process
start, a fresh python3, a fresh bud_kernel's first cell and its next cells (over its stdin
and stderr, as the server drives it), and the two fork-based alternatives (forking the
worker; forking a small pre-started interpreter). Run in the guest:
    cargo build --release && target/release/bud guest build
    target/release/bud run --local --timeout-ms 300000 scripts/bench_context_kernel.py
(docs/measurements.md, "Code contexts as kernels")."""

import json
import os
import subprocess
import time

MARK = "\x1ebench-mark "


def ms(since):
    return (time.perf_counter() - since) * 1000


def spawn(argv):
    t = time.perf_counter()
    pid = os.posix_spawn(argv[0], argv, os.environ)
    os.waitpid(pid, 0)
    return ms(t)


def kernel_cells(codes):
    """A fresh kernel: the first cell's time (the kernel's start included), then each
    next one's."""
    kernel = subprocess.Popen(["python3", "-m", "bud_kernel"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    times = []
    for seq, code in enumerate(codes, 1):
        t = time.perf_counter()
        line = {"seq": seq, "code": code, "env": {}, "mark": MARK, "cwd": "/home/user"}
        kernel.stdin.write((json.dumps(line) + "\n").encode())
        kernel.stdin.flush()
        err = b""
        while MARK.encode() not in err or not err.endswith(b"\n"):
            err += os.read(kernel.stderr.fileno(), 1 << 16)
        times.append(ms(t))
    kernel.stdin.close()
    kernel.wait()
    return times


def fork_cell():
    t = time.perf_counter()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, str(sum(range(1000))).encode())
        os._exit(0)
    os.close(w)
    os.read(r, 100)
    os.waitpid(pid, 0)
    return ms(t)


ZYGOTE = r'''
import os, sys, time, bud_exec
for line in sys.stdin:
    t = time.perf_counter()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        bud_exec.exec_cell("x = sum(range(1000))\nx", {})
        os.write(w, b"ok")
        os._exit(0)
    os.close(w)
    os.read(r, 100)
    os.waitpid(pid, 0)
    sys.stdout.write(f"{(time.perf_counter() - t) * 1000:.0f}\n")
    sys.stdout.flush()
'''


def zygote_forks(n):
    z = subprocess.Popen(["python3", "-c", ZYGOTE], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    times = []
    for _ in range(n):
        z.stdin.write(b"go\n")
        z.stdin.flush()
        times.append(float(z.stdout.readline()))
    z.stdin.close()
    z.wait()
    return times


print(f"/bin/true: {spawn(['/bin/true']):.0f} ms")
print(f"python3 -c pass: {spawn(['/usr/bin/python3', '-c', 'pass']):.0f} ms")
cells = kernel_cells(["x = 1", "x + 1", "print(x)", "1 / 0", "[x] * 3"])
print(f"fresh kernel, first cell: {cells[0]:.0f} ms; next cells: "
      + ", ".join(f"{c:.1f}" for c in cells[1:]) + " ms")
print("fork of this worker + a cell + wait: "
      + ", ".join(f"{fork_cell():.0f}" for _ in range(3)) + " ms")
print("fork of a small interpreter + a cell + wait: "
      + ", ".join(f"{z:.0f}" for z in zygote_forks(3)) + " ms")
