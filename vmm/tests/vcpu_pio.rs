//! Hand-assembled guest code through bud's real vCPU loop on /dev/kvm: port-I/O exits from
//! guest kernel mode (CPL0) and guest user mode (CPL3), console output, and kicking a guest
//! that spins forever. Needs /dev/kvm; fails loudly without it.

mod common;

use std::time::Duration;

use common::*;
use vmm::boot::cpu::segment_from_gdt;
use vmm::protocol::DOORBELL_PORT;
use vmm::vcpu::VcpuStop;

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
