//! Shared helpers for the KVM tests: a tiny 64-bit machine and hand-assembled guest code.
#![allow(dead_code)]

use kvm_bindings::kvm_sregs;
use vmm::boot::cpu;
use vmm::devices::console::ConsoleLog;
use vmm::memory::GuestRam;
use vmm::vm::{Machine, NetStart, SerialStart};

/// RAM of the test machine.
pub const RAM_SIZE: u64 = 2 << 20;
pub const CODE: u64 = 0x1_0000;
pub const USER_CODE: u64 = 0x1_1000;
pub const USER_STACK_TOP: u64 = 0x2_0000;
pub const GDT: u64 = 0x500;
/// GDT: null, null, kernel code (0x10), kernel data (0x18), TSS (0x20, two slots),
/// user data (0x30 | 3), user code (0x38 | 3).
pub const TEST_GDT: [u64; 8] = [
    0,
    0,
    0x00af_9b00_0000_ffff,
    0x00cf_9300_0000_ffff,
    0x008f_8b00_0000_ffff,
    0,
    0x00cf_f300_0000_ffff,
    0x00af_fb00_0000_ffff,
];
pub const USER_DATA_SELECTOR: u16 = 0x33;
pub const USER_CODE_SELECTOR: u16 = 0x3b;

pub fn require_kvm() {
    assert!(
        std::path::Path::new("/dev/kvm").exists(),
        "THIS TEST NEEDS /dev/kvm, which this machine does not have: it cannot run here"
    );
}

/// A 2 MiB machine in 64-bit mode at `CODE`, with the first 2 MiB mapped user-accessible.
pub fn machine(code: &[u8], user_code: &[u8]) -> Machine {
    require_kvm();
    let kvm = vmm::vm::open_kvm().unwrap();
    let ram = GuestRam::anonymous(RAM_SIZE).unwrap();
    cpu::write_boot_tables(&ram).unwrap();
    // First 2 MiB: present, writable, user, 2 MiB page.
    ram.write_u64(vmm::layout::PDE_START, 0x87).unwrap();
    for (i, e) in TEST_GDT.iter().enumerate() {
        ram.write_u64(GDT + i as u64 * 8, *e).unwrap();
    }
    ram.write(CODE, code).unwrap();
    ram.write(USER_CODE, user_code).unwrap();
    let m = Machine::create(
        &kvm,
        ram,
        ConsoleLog::new(16),
        SerialStart::Fresh,
        NetStart::None,
    )
    .unwrap();
    m.vcpu
        .set_cpuid2(&vmm::cpuid::guest_cpuid(&kvm, vmm::HostKind::detect()).unwrap())
        .unwrap();
    let mut sregs = cpu::long_mode_sregs(m.vcpu.get_sregs().unwrap());
    sregs.gdt.limit = (TEST_GDT.len() * 8 - 1) as u16;
    m.vcpu.set_sregs(&sregs).unwrap();
    let mut regs = cpu::entry_regs(CODE);
    regs.rsp = USER_STACK_TOP - 0x1000;
    m.vcpu.set_regs(&regs).unwrap();
    m
}

pub fn cpl(sregs: &kvm_sregs) -> u16 {
    sregs.cs.selector & 3
}

/// CPL0 code that rings the doorbell with 0xc0, then `iretq`s to `USER_CODE` at CPL3 with
/// IOPL 3 (so user-mode port I/O is allowed under hardware virtualization too).
///
/// ```text
/// 10000: 66 ba d0 0b           mov    dx, 0x0bd0
/// 10004: b8 c0 00 00 00        mov    eax, 0xc0
/// 10009: ef                    out    dx, eax
/// 1000a: 6a 33                 push   0x33            ; ss = user data
/// 1000c: 68 00 00 02 00        push   0x20000         ; rsp
/// 10011: 68 02 30 00 00        push   0x3002          ; rflags: IOPL=3
/// 10016: 6a 3b                 push   0x3b            ; cs = user code
/// 10018: 68 00 10 01 00        push   0x11000         ; rip
/// 1001d: 48 cf                 iretq
/// ```
pub const CPL0_THEN_USER: [u8; 31] = [
    0x66, 0xba, 0xd0, 0x0b, 0xb8, 0xc0, 0x00, 0x00, 0x00, 0xef, 0x6a, 0x33, 0x68, 0x00, 0x00, 0x02,
    0x00, 0x68, 0x02, 0x30, 0x00, 0x00, 0x6a, 0x3b, 0x68, 0x00, 0x10, 0x01, 0x00, 0x48, 0xcf,
];

/// CPL3 code: write "ok\n" to the serial port, ring the doorbell with 0xc3, spin.
///
/// ```text
/// 11000: 66 ba f8 03           mov    dx, 0x3f8
/// 11004: b0 6f                 mov    al, 'o'
/// 11006: ee                    out    dx, al
/// 11007: b0 6b                 mov    al, 'k'
/// 11009: ee                    out    dx, al
/// 1100a: b0 0a                 mov    al, '\n'
/// 1100c: ee                    out    dx, al
/// 1100d: 66 ba d0 0b           mov    dx, 0x0bd0
/// 11011: b8 c3 00 00 00        mov    eax, 0xc3
/// 11016: ef                    out    dx, eax
/// 11017: eb fe                 jmp    0x11017
/// ```
pub const USER_SERIAL_DOORBELL_SPIN: [u8; 25] = [
    0x66, 0xba, 0xf8, 0x03, 0xb0, 0x6f, 0xee, 0xb0, 0x6b, 0xee, 0xb0, 0x0a, 0xee, 0x66, 0xba, 0xd0,
    0x0b, 0xb8, 0xc3, 0x00, 0x00, 0x00, 0xef, 0xeb, 0xfe,
];
