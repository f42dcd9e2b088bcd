"""Prints which MSRs this machine's KVM lists (KVM_GET_MSR_INDEX_LIST on /dev/kvm), by range:
for scripts/hwvirt/stage2.sh and docs/platform.md. bud captures all of them but the Hyper-V
range (vmm/src/snapshot.rs, msr_candidates). Standard library only."""

import fcntl
import struct
import sys

KVM_GET_MSR_INDEX_LIST = 0xC004AE02  # _IOWR(KVMIO, 0x02, struct kvm_msr_list)
MAX = 1024


def main():
    with open("/dev/kvm", "rb", buffering=0) as kvm:
        buf = bytearray(struct.pack("I", MAX) + bytes(4 * MAX))
        fcntl.ioctl(kvm, KVM_GET_MSR_INDEX_LIST, buf)
    n = struct.unpack_from("I", buf)[0]
    msrs = struct.unpack_from(f"{n}I", buf, 4)
    hyperv = [m for m in msrs if 0x4000_0000 <= m <= 0x4000_01FF]
    kvm_pv = [m for m in msrs if 0x4B56_4D00 <= m <= 0x4B56_4DFF or m in (0x11, 0x12)]
    print(f"hwvirt-stage2: NOTE KVM lists {n} MSRs: {len(hyperv)} Hyper-V "
          f"({' '.join(hex(m) for m in hyperv) or 'none'}), {len(kvm_pv)} KVM paravirtual "
          f"({' '.join(hex(m) for m in kvm_pv)})")


if __name__ == "__main__":
    sys.exit(main())
