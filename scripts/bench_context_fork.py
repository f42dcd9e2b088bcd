"""What a code context as its own process (E2B's model: a kernel per context) would cost
under kvm_pvm: the datascience worker (pandas and numpy imported, ~150 MB resident) forks,
the child runs a small pandas cell and exits, the parent waits; then the same cell in the
parent. Run in the guest:
    target/release/bud run --local --template datascience --timeout-ms 60000 \\
        scripts/bench_context_fork.py
(docs/measurements.md, "A code context as a process")."""

import os
import time

import pandas


def small_cell():
    t = time.perf_counter()
    int(pandas.DataFrame({"a": range(1000)}).a.sum())
    return (time.perf_counter() - t) * 1000


start = time.perf_counter()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, f"{small_cell():.1f}".encode())
    os._exit(0)
os.close(w)
in_child = os.read(r, 100).decode()
os.waitpid(pid, 0)
forked = (time.perf_counter() - start) * 1000
in_parent = small_cell()
with open("/proc/self/status") as f:
    rss = [line.split()[1] for line in f if line.startswith("VmRSS")][0]
print(f"fork + child's cell + wait: {forked:.0f} ms; the cell in the child {in_child} ms,"
      f" in the parent {in_parent:.1f} ms; parent resident {int(rss) // 1024} MiB")
