#!/usr/bin/env python3
"""Where a guest's emulated kernel instructions go: `perf script` output of
`kvm:kvm_emulate_insn` events (read on stdin), each event's guest `rip` placed in the guest
kernel's symbol table (`nm -n` of its vmlinux, as System.map has it), counted by function.

    perf record -e kvm:kvm_emulate_insn -p "$SERVER_PID" -o emu.data -- sleep 20
    perf script -i emu.data -F trace | scripts/emulated_profile.py build/kernel/vmlinux [TOP]

Prints each function's share of the events, most first, and the total. On kvm_pvm, guest
kernel mode is emulated instruction by instruction: this is what a guest operation costs.
"""

import bisect
import collections
import re
import subprocess
import sys

# The tracepoint's trace text: `CSBASE:RIP:INSTRUCTION BYTES (MODE)`, e.g.
# `0:ffffffff81400bf0:0f 1f 00 (prot64)`.
RIP = re.compile(r"^\s*[0-9a-fA-F]+:([0-9a-fA-F]+):")


def symbols(vmlinux):
    out = subprocess.run(["nm", "-n", vmlinux], check=True, capture_output=True, text=True)
    addrs, names = [], []
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "tTwW":
            addrs.append(int(parts[0], 16))
            names.append(parts[2])
    return addrs, names


def main():
    vmlinux = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    addrs, names = symbols(vmlinux)
    counts = collections.Counter()
    total = 0
    for line in sys.stdin:
        m = RIP.search(line)
        if not m:
            continue
        rip = int(m.group(1), 16)
        i = bisect.bisect_right(addrs, rip) - 1
        counts[names[i] if i >= 0 else f"?{rip:#x}"] += 1
        total += 1
    if total == 0:
        sys.exit("no kvm_emulate_insn events with a rip on stdin")
    for name, n in counts.most_common(top):
        print(f"{n:9d} {100 * n / total:5.1f}%  {name}")
    print(f"{total:9d} events")


if __name__ == "__main__":
    main()
