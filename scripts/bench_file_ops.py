"""What a file operation costs in the guest, where every system call is emulated guest
kernel work: bud_session.file_op (what the host's file requests run) on a 1 KiB file and a
directory of 100 files (half with an E2B metadata key), each the way it runs now (paths
opened with one openat2 beneath the work directory) and the resolving way (realpath and a
stat per check), which every path took before session 16 and a path the one open cannot
take still does, medians of 20 rounds (5 for listings). Since session 16's review the
resolving way also reads and lists through a descriptor, so its column is no longer the
old cost of reads (~14 ms) and listings (259 ms for 100 entries at 95522aa). Run in the
guest:
    target/release/bud run --local --timeout-ms 120000 scripts/bench_file_ops.py
(docs/measurements.md, "File operations in the guest")."""

import os
import statistics
import time

import _bud
import bud_session

D = "bench-files"
os.makedirs(f"/tmp/{D}", exist_ok=True)
with open("/tmp/one.txt", "wb") as f:
    f.write(b"x" * 1024)
for i in range(100):
    with open(f"/tmp/{D}/f{i}", "w") as f:
        f.write("x")
    if i % 2 == 0:
        os.setxattr(f"/tmp/{D}/f{i}", "user.e2b.k", b"v")
sink = []
OPS = [
    ("read 1 KiB", _bud.FILE_OP_READ, b"one.txt", b"", 20),
    ("write 1 KiB", _bud.FILE_OP_WRITE, b"w.txt", b"y" * 1024, 20),
    ("write 1 KiB in a subdirectory", _bud.FILE_OP_WRITE, f"{D}/w.txt".encode(), b"y" * 1024, 20),
    ("append 1 KiB", _bud.FILE_OP_APPEND, b"a.txt", b"y" * 1024, 20),
    ("stat", _bud.FILE_OP_STAT, b"one.txt", b"", 20),
    ("list 100 entries", _bud.FILE_OP_LIST, D.encode(), b"", 5),
    ("list 100 entries with metadata", _bud.FILE_OP_LIST | _bud.FILE_OP_METADATA,
     D.encode(), b"", 5),
]


def median_ms(op, path, data, rounds):
    times = []
    for _ in range(rounds):
        sink.clear()
        t = time.perf_counter()
        bud_session.file_op(op, path, data, sink.append)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


fd = bud_session._WORKDIR_FD
print(f"{'operation':34} {'one open':>9} {'resolving':>10}")
for name, op, path, data, rounds in OPS:
    bud_session._WORKDIR_FD = fd
    fast = median_ms(op, path, data, rounds)
    bud_session._WORKDIR_FD = None  # the resolving path only
    slow = median_ms(op, path, data, rounds)
    print(f"{name:34} {fast:7.1f} ms {slow:8.1f} ms")
bud_session._WORKDIR_FD = fd
