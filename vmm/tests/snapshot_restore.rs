//! Capture a running machine's state and restore it into a new VM over a copy-on-write
//! mapping of its memory: the clone continues exactly where the original stopped, and the two
//! no longer share writes. Needs /dev/kvm; fails loudly without it.

mod common;

use std::fs::File;
use std::time::Duration;

use common::*;
use vmm::HostKind;
use vmm::devices::console::ConsoleLog;
use vmm::memory::GuestRam;
use vmm::snapshot::{self, MachineState};
use vmm::vcpu::VcpuStop;
use vmm::vm::{Machine, NetStart, SerialStart};

/// Runs the test program to its first doorbell (CPL0) and captures the machine there.
fn stopped_at_first_doorbell() -> (Machine, MachineState) {
    let mut m = machine(&CPL0_THEN_USER, &USER_SERIAL_DOORBELL_SPIN);
    assert_eq!(
        m.run_for(Duration::from_secs(10)).unwrap(),
        VcpuStop::Doorbell(0xc0)
    );
    let kvm = vmm::vm::open_kvm().unwrap();
    let cpuid = m
        .vcpu
        .get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .unwrap();
    let state = snapshot::capture(
        &kvm,
        &m.vm,
        &mut m.vcpu,
        HostKind::detect(),
        cpuid.as_slice().to_vec(),
        &m.bus,
        snapshot::MsrList::Probe,
    )
    .unwrap();
    (m, state)
}

fn clone_of(original: &Machine, state: &MachineState, name: &str) -> Machine {
    let path = std::env::temp_dir().join(format!("bud-snap-test-{}-{name}", std::process::id()));
    original
        .ram
        .write_sparse(&File::create(&path).unwrap())
        .unwrap();
    let ram = GuestRam::private_file(&path, RAM_SIZE).unwrap();
    std::fs::remove_file(&path).unwrap();
    let kvm = vmm::vm::open_kvm().unwrap();
    let m = Machine::create(
        &kvm,
        ram,
        ConsoleLog::new(16),
        SerialStart::Restore(&state.serial),
        NetStart::None,
    )
    .unwrap();
    snapshot::restore(&m.vm, &m.vcpu, state, snapshot::Target::NewVm).unwrap();
    m
}

#[test]
fn capture_completes_the_doorbell_out_so_rip_is_past_it() {
    let (_m, state) = stopped_at_first_doorbell();

    // The `out` at 0x10009 is one byte: a completed instruction leaves rip at 0x1000a.
    assert_eq!(state.regs.rip, CODE + 0xa);
}

#[test]
fn restored_clone_continues_into_user_mode_like_the_original() {
    let (mut original, state) = stopped_at_first_doorbell();
    let mut clone = clone_of(&original, &state, "continue");

    let clone_stop = clone.run_for(Duration::from_secs(10)).unwrap();
    let original_stop = original.run_for(Duration::from_secs(10)).unwrap();

    assert_eq!(clone_stop, VcpuStop::Doorbell(0xc3));
    assert_eq!(original_stop, VcpuStop::Doorbell(0xc3));
    assert_eq!(cpl(&clone.vcpu.get_sregs().unwrap()), 3);
    assert_eq!(clone.bus.console().tail(1), vec!["ok"]);
}

#[test]
fn state_captured_from_a_restored_clone_equals_the_original_state() {
    let (original, state) = stopped_at_first_doorbell();
    let mut clone = clone_of(&original, &state, "equal");
    let kvm = vmm::vm::open_kvm().unwrap();
    let again = snapshot::capture(
        &kvm,
        &clone.vm,
        &mut clone.vcpu,
        HostKind::detect(),
        state.cpuid.clone(),
        &clone.bus,
        snapshot::MsrList::Probe,
    )
    .unwrap();

    assert_eq!(again.regs, state.regs);
    assert_eq!(again.sregs, state.sregs);
    assert_eq!(again.fpu, state.fpu);
    assert_eq!(again.mp_state, state.mp_state);
    assert_eq!(again.debug_regs, state.debug_regs);
    assert_eq!(again.serial, state.serial);
    // Every MSR, by value, except the time-stamp counter, which runs on between the two
    // captures (the reset path's own check makes the same exception).
    const MSR_IA32_TSC: u32 = 0x10;
    let values = |s: &snapshot::MachineState| -> Vec<(u32, u64)> {
        s.msrs
            .iter()
            .map(|m| (m.index, if m.index == MSR_IA32_TSC { 0 } else { m.data }))
            .collect()
    };
    assert_eq!(values(&again), values(&state));
    // kvm_irqchip holds a union without PartialEq; its Debug output shows the PIC bytes.
    assert_eq!(
        format!("{:?}", again.pic_master),
        format!("{:?}", state.pic_master)
    );
}

#[test]
fn clone_writes_do_not_reach_the_original() {
    let (original, state) = stopped_at_first_doorbell();
    let clone = clone_of(&original, &state, "isolated");

    clone.ram.write(0x3_0000, b"clone").unwrap();
    let mut seen = [0u8; 5];
    original.ram.read(0x3_0000, &mut seen).unwrap();

    assert_eq!(seen, [0; 5]);
}

#[test]
fn state_file_round_trips_and_rejects_other_versions() {
    let (_m, machine_state) = stopped_at_first_doorbell();
    let regs = machine_state.regs;
    let ram = GuestRam::anonymous(RAM_SIZE).unwrap();
    // A mailbox located over a header written into the test machine's own RAM.
    let pml4 = 0x1000u64;
    let gva = 0x40_0000u64;
    ram.write_u64(pml4, 0x2000 | 7).unwrap();
    ram.write_u64(0x2000, 0x3000 | 7).unwrap();
    ram.write_u64(0x3000 + 2 * 8, 0x4000 | 7).unwrap();
    ram.write_u64(0x4000, 0x10_0000 | 7).unwrap();
    ram.write(0x10_0000, &vmm::protocol::MAILBOX_MAGIC.to_le_bytes())
        .unwrap();
    ram.write(0x10_0004, &vmm::protocol::PROTOCOL_VERSION.to_le_bytes())
        .unwrap();
    let mailbox = vmm::mailbox::Mailbox::locate(&ram, pml4, 0, gva, 4096).unwrap();
    let s = snapshot::SnapshotState {
        host_kind: HostKind::detect(),
        host_identity: "0123456789abcdef01234567".into(),
        ram_size: RAM_SIZE,
        machine: machine_state,
        mailbox,
        kernel: vmm::kernel_layout::KernelLayout::default(),
        ready_wall_ns: 1_795_000_000_123_456_789,
    };

    let bytes = s.to_bytes().unwrap();
    let back = snapshot::SnapshotState::from_bytes(&bytes).unwrap();
    let mut other_version = bytes.clone();
    other_version[8] = other_version[8].wrapping_add(1);

    assert_eq!(back.machine.regs, regs);
    assert_eq!(back.mailbox, s.mailbox);
    assert_eq!(back.ready_wall_ns, s.ready_wall_ns);
    assert_eq!(back.host_identity, s.host_identity);
    assert!(matches!(
        snapshot::SnapshotState::from_bytes(&other_version),
        Err(snapshot::SnapshotError::Version { .. })
    ));
    assert!(matches!(
        snapshot::SnapshotState::from_bytes(b"not a snapshot"),
        Err(snapshot::SnapshotError::BadMagic)
    ));
}
