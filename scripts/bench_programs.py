#!/usr/bin/env python3
"""What a program runtime costs (docs/templates.md, "Runtimes of your own"; issue 57), against
a running `bud serve` (scripts/bench-programs.sh starts one), beside the host in one run:

1. a user template `bench-langs-RUN` on `python` with Debian's `lua5.4` and two runtimes of
   its own, `lua` (lua5.4) and `awk` (busybox awk): POST to ready;
2. one-shot jobs on it, alternating (lua, awk, shell, python, ...): wall time over HTTP and
   the job's emulated guest-kernel instructions (p50, p90);
3. the host running the same programs (the image's own `lua5.4`, the host's busybox or awk,
   `sh -c`), each a process, as the guest's jobs are.

It measures and prints; it asserts no time. It exits non-zero if a build or a job failed.
"""

import os
import shutil
import statistics
import subprocess
import sys
import time

from bench_user_templates import BUILD_DIR, RUN, build, call, pct

JOBS = int(os.environ.get("JOBS", "100"))
NAME = f"bench-langs-{RUN}"
DEFINITION = {
    "name": NAME,
    "apt": ["lua5.4"],
    "runtimes": [
        {"name": "lua", "command": ["lua5.4"], "extension": ".lua", "package": "lua5.4"},
        {"name": "awk", "command": ["/bin/busybox", "awk", "-f"]},
    ],
}
# (runtime, code): each prints 2.
CASES = [("lua", "print(1 + 1)"), ("awk", "BEGIN { print 1 + 1 }"),
         ("shell", "echo 2"), ("python", "print(1 + 1)")]


def jobs():
    """JOBS jobs of each case, alternating: {runtime: ([ms], [emulated instructions])}."""
    import json
    out = {r: ([], []) for r, _ in CASES}
    for _ in range(JOBS):
        for runtime, code in CASES:
            started = time.monotonic()
            status, body = call("POST", "/v1/exec", {"template": NAME, "language": runtime,
                                                     "code": code, "timeout_ms": 60000})
            ms = (time.monotonic() - started) * 1e3
            r = json.loads(body) if status == 200 else {}
            if r.get("status") != "ok" or r.get("stdout") != "2\n":
                sys.exit(f"{runtime} job: {status} {body[:300]!r}")
            out[runtime][0].append(ms)
            out[runtime][1].append(r["timings"]["kvm"]["emulated_instructions"])
    return out


def host():
    """The same programs started on the host: {name: [ms]} (a name missing: not here)."""
    lua = os.path.join(BUILD_DIR, f"image-{NAME}", "rootfs", "usr", "bin", "lua5.4")
    awk = shutil.which("busybox")
    commands = {
        "lua": [lua, "-e", "print(1 + 1)"],
        "awk": [awk, "awk", "BEGIN { print 1 + 1 }"] if awk else ["awk", "BEGIN { print 1 + 1 }"],
        "shell": ["sh", "-c", "echo 2"],
        "python": [sys.executable, "-c", "print(1 + 1)"],
    }
    out = {}
    for name, argv in commands.items():
        try:
            times = []
            for _ in range(JOBS):
                started = time.monotonic()
                subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
                times.append((time.monotonic() - started) * 1e3)
            out[name] = times
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"host {name}: not measured ({e})")
    return out


def main():
    seconds, _ = build(DEFINITION)
    print(f"[bench-programs] {NAME}: python + lua5.4, runtimes lua and awk: ready in "
          f"{seconds:.1f} s")
    jobs()  # warm-up: every VM of the pool used once
    rows = jobs()
    on_host = host()
    for runtime, (ms, insns) in rows.items():
        line = (f"{runtime:>6} job over HTTP: p50 {statistics.median(ms):7.2f} ms, p90 "
                f"{pct(ms, 90):7.2f} ms, emulated instructions p50 "
                f"{statistics.median(insns):9.0f}")
        if runtime in on_host:
            h = statistics.median(on_host[runtime])
            line += f"; host process p50 {h:6.2f} ms, {statistics.median(ms) / h:.1f}x"
        print(line)
    call("DELETE", f"/v1/templates/{NAME}")


if __name__ == "__main__":
    main()
