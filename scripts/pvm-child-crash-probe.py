"""The guest-process crash of issue 11 item 6, reduced (run it in a bud guest):

    target/release/bud run --local --timeout-ms 120000 scripts/pvm-child-crash-probe.py

For each mode the job starts /bin/true (busybox, static) 6 times and, while the child
starts, the parent does MODE for 1.5 s; it prints how many children did not exit 0. Under
kvm_pvm (2026-11-23) the child dies of SIGSEGV (busybox: a NULL read at 0x4a4d02 in glibc's
__ctype_init, the TLS locale pointer read as 0) or CPython fails in its path setup, when
the parent makes non-trivial system calls meanwhile (stat, listdir, kill(pid, 0), waitpid:
4-6 of 6), and never when it spins in user mode, calls getpid or sched_yield, sleeps, or
just waits (0 of 6). The same counts in a freshly booted VM (no snapshot involved).
"""
import os
import subprocess
import sys
import time

MODES = {
    "wait": lambda p: None,
    "spin": lambda p: None,
    "getpid": lambda p: os.getpid(),
    "sched_yield": lambda p: os.sched_yield(),
    "sleep5ms": lambda p: time.sleep(0.005),
    "stat": lambda p: os.stat("/"),
    "listdir": lambda p: os.listdir("/usr/lib"),
    "kill-self-0": lambda p: os.kill(os.getpid(), 0),
    "kill-child-0": lambda p: os.kill(p.pid, 0),
}


def trial(mode, n=6):
    bad = 0
    for _ in range(n):
        p = subprocess.Popen(["/bin/true"])
        if mode != "wait":
            started = time.perf_counter()
            while time.perf_counter() - started < 1.5:
                try:
                    MODES[mode](p)
                except OSError:
                    pass
        p.wait()
        bad += p.returncode != 0
    return bad


for mode in sys.argv[1:] or MODES:
    print(f"{mode:12} {trial(mode)} of 6 failed", flush=True)
