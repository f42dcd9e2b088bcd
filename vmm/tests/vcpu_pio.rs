//! Hand-assembled guest code through bud's real vCPU loop on /dev/kvm: port-I/O exits from
//! guest kernel mode (CPL0) and guest user mode (CPL3), console output, and kicking a guest
//! that spins forever. Needs /dev/kvm; fails loudly without it.

use std::time::Duration;

use kvm_bindings::kvm_sregs;
use vmm::boot::cpu::{self, segment_from_gdt};
use vmm::devices::console::ConsoleLog;
use vmm::memory::GuestRam;
use vmm::protocol::DOORBELL_PORT;
use vmm::vcpu::VcpuStop;
use vmm::vm::{Machine, SerialStart};

const CODE: u64 = 0x1_0000;
const USER_CODE: u64 = 0x1_1000;
const USER_STACK_TOP: u64 = 0x2_0000;
const GDT: u64 = 0x500;
/// GDT: null, null, kernel code (0x10), kernel data (0x18), TSS (0x20, two slots),
/// user data (0x30 | 3), user code (0x38 | 3).
const TEST_GDT: [u64; 8] = [
    0,
    0,
    0x00af_9b00_0000_ffff,
    0x00cf_9300_0000_ffff,
    0x008f_8b00_0000_ffff,
    0,
    0x00cf_f300_0000_ffff,
    0x00af_fb00_0000_ffff,
];
const USER_DATA_SELECTOR: u16 = 0x33;
const USER_CODE_SELECTOR: u16 = 0x3b;

fn require_kvm() {
    assert!(
        std::path::Path::new("/dev/kvm").exists(),
        "THIS TEST NEEDS /dev/kvm, which this machine does not have: it cannot run here"
    );
}

/// A 2 MiB machine in 64-bit mode at `CODE`, with the first 2 MiB mapped user-accessible.
fn machine(code: &[u8], user_code: &[u8]) -> Machine {
    require_kvm();
    let kvm = vmm::vm::open_kvm().unwrap();
    let ram = GuestRam::anonymous(2 << 20).unwrap();
    cpu::write_boot_tables(&ram).unwrap();
    // First 2 MiB: present, writable, user, 2 MiB page.
    ram.write_u64(vmm::layout::PDE_START, 0x87).unwrap();
    for (i, e) in TEST_GDT.iter().enumerate() {
        ram.write_u64(GDT + i as u64 * 8, *e).unwrap();
    }
    ram.write(CODE, code).unwrap();
    ram.write(USER_CODE, user_code).unwrap();
    let m = Machine::create(&kvm, ram, ConsoleLog::new(16), SerialStart::Fresh).unwrap();
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

fn cpl(sregs: &kvm_sregs) -> u16 {
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
const CPL0_THEN_USER: [u8; 31] = [
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
const USER_SERIAL_DOORBELL_SPIN: [u8; 25] = [
    0x66, 0xba, 0xf8, 0x03, 0xb0, 0x6f, 0xee, 0xb0, 0x6b, 0xee, 0xb0, 0x0a, 0xee, 0x66, 0xba, 0xd0,
    0x0b, 0xb8, 0xc3, 0x00, 0x00, 0x00, 0xef, 0xeb, 0xfe,
];

#[test]
fn doorbell_from_cpl0_exits_with_its_code_in_kernel_mode() {
    let mut m = machine(&CPL0_THEN_USER, &USER_SERIAL_DOORBELL_SPIN);

    let stop = m.run_for(Duration::from_secs(10)).unwrap();
    let sregs = m.vcpu.get_sregs().unwrap();
    let regs = m.vcpu.get_regs().unwrap();

    assert_eq!(stop, VcpuStop::Doorbell(0xc0));
    assert_eq!(cpl(&sregs), 0);
    assert_eq!(regs.rax, 0xc0);
    assert_eq!(regs.rdx & 0xffff, u64::from(DOORBELL_PORT));
}

#[test]
fn serial_output_and_doorbell_from_cpl3_exit_in_user_mode() {
    let mut m = machine(&CPL0_THEN_USER, &USER_SERIAL_DOORBELL_SPIN);
    let first = m.run_for(Duration::from_secs(10)).unwrap();

    let second = m.run_for(Duration::from_secs(10)).unwrap();
    let sregs = m.vcpu.get_sregs().unwrap();

    assert_eq!(first, VcpuStop::Doorbell(0xc0));
    assert_eq!(second, VcpuStop::Doorbell(0xc3));
    assert_eq!(cpl(&sregs), 3);
    assert_eq!(sregs.cs.selector, USER_CODE_SELECTOR);
    assert_eq!(sregs.ss.selector, USER_DATA_SELECTOR);
    assert_eq!(m.bus.console().tail(1), vec!["ok"]);
}

#[test]
fn a_guest_spinning_in_user_mode_is_stopped_by_the_timeout_kick() {
    let mut m = machine(&CPL0_THEN_USER, &USER_SERIAL_DOORBELL_SPIN);
    m.run_for(Duration::from_secs(10)).unwrap();
    m.run_for(Duration::from_secs(10)).unwrap();

    let stop = m.run_for(Duration::from_millis(50)).unwrap();
    let regs = m.vcpu.get_regs().unwrap();

    assert_eq!(stop, VcpuStop::Kicked);
    assert_eq!(regs.rip, USER_CODE + 0x17, "parked on the jmp-to-self");
}

#[test]
fn kernel_mode_fault_with_no_idt_is_a_shutdown() {
    // 10000: 0f 0b    ud2   (no IDT: #UD -> #DF -> triple fault)
    let mut m = machine(&[0x0f, 0x0b], &[]);

    let stop = m.run_for(Duration::from_secs(10)).unwrap();

    assert_eq!(stop, VcpuStop::Shutdown);
}

#[test]
fn segment_helper_matches_the_user_code_descriptor() {
    let s = segment_from_gdt(TEST_GDT[7], USER_CODE_SELECTOR);

    assert_eq!((s.dpl, s.l, s.present), (3, 1, 1));
}
