"""What E2B's file metadata costs a listing in the guest: a directory of 100 files (half
with a user.e2b.* attribute) listed as bud lists it without metadata (scandir + lstat) and
with it (+ listxattr per entry, getxattr per key), medians of 5 rounds. Run in the guest:
    target/release/bud run --local scripts/bench_metadata.py
(docs/measurements.md, "File metadata")."""

import os
import statistics
import time

D = "/tmp/metadata-bench"
os.makedirs(D, exist_ok=True)
for i in range(100):
    with open(f"{D}/f{i}", "w") as f:
        f.write("x")
    if i % 2 == 0:
        os.setxattr(f"{D}/f{i}", "user.e2b.k", b"v")


def plain():
    return [e.stat(follow_symlinks=False) for e in os.scandir(D)]


def with_metadata():
    out = []
    for e in os.scandir(D):
        out.append(e.stat(follow_symlinks=False))
        for name in os.listxattr(e.path, follow_symlinks=False):
            if name.startswith("user.e2b."):
                os.getxattr(e.path, name, follow_symlinks=False)
    return out


for f in (plain, with_metadata):
    times = []
    for _ in range(5):
        t = time.perf_counter()
        f()
        times.append((time.perf_counter() - t) * 1000)
    print(f"{f.__name__}: median {statistics.median(times):.1f} ms for 100 entries")
