//! Defence in depth for a session file's machine state: checked against its template before
//! any of it reaches KVM, even when the file's MAC is good (a key can leak; a node of the
//! cluster can be wrong).
//!
//! The machine's *settings* come from the template, not from the file: the CPUID table and
//! the MSR index list must be the template's, entry for entry, and so must the MSRs that
//! describe the CPU rather than hold guest state ([`PINNED_MSRS`]), the LAPIC's id and base,
//! whether the state carries XSAVE, and which irqchip each chip is. The rest is guest state
//! the guest could have set itself; each field is checked to be in the range KVM accepts,
//! so that a crafted value is refused here with what was wrong rather than by an ioctl, and
//! nothing reaches an `unsafe` call whose invariant it would break (the XSAVE area's size
//! follows from the CPUID, checked here and again at the call).
//!
//! What the guest sees after a load is then what a fork child of the template sees: the
//! template's CPU, and a VM that goes back to the warm pool holds the template's settings.

use kvm_bindings::{
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_MP_STATE_HALTED,
    KVM_MP_STATE_RUNNABLE, KVM_PIT_FLAGS_HPET_LEGACY, kvm_cpuid_entry2,
};

use crate::snapshot::MachineState;

/// MSRs that describe the CPU (capabilities, microcode, virtualization controls), which a
/// guest cannot set but a host-initiated `KVM_SET_MSRS` can: a file's values must be its
/// template's. (0x3a feature control, 0x8b microcode revision, 0x10a arch capabilities,
/// 0xce platform info, 0xcf core capabilities, 0x1a0 misc enable, 0x345 perf capabilities,
/// 0x480-0x491 VMX capabilities, AMD's HWCR, VM_CR, VM_HSAVE_PA and DE_CFG.)
const PINNED_MSRS: &[std::ops::RangeInclusive<u32>] = &[
    0x3a..=0x3a,
    0x8b..=0x8b,
    0x10a..=0x10a,
    0xce..=0xcf,
    0x1a0..=0x1a0,
    0x345..=0x345,
    0x480..=0x491,
    0xc001_0015..=0xc001_0015,
    0xc001_0114..=0xc001_0114,
    0xc001_0117..=0xc001_0117,
    0xc001_1029..=0xc001_1029,
];

/// The LAPIC's id register (xAPIC: bits 24-31) in `kvm_lapic_state`.
const APIC_ID: usize = 0x20;
// RFLAGS: bit 1 is always 1; bits 3, 5, 15 and 22-63 are reserved (0).
const RFLAGS_FIXED1: u64 = 1 << 1;
const RFLAGS_RESERVED: u64 = (1 << 3) | (1 << 5) | (1 << 15) | !((1 << 22) - 1);
// Virtualization interfaces the CPUID policy hides ([`crate::cpuid`]).
const CR4_VMXE: u64 = 1 << 13;
const CR4_SMXE: u64 = 1 << 14;
const EFER_SVME: u64 = 1 << 12;
/// MXCSR bits 16-31 are reserved; `kvm_xsave` keeps MXCSR in its 7th word.
const MXCSR_RESERVED: u32 = 0xffff_0000;
const XSAVE_MXCSR_WORD: usize = 6;
/// KVM's `KVM_MAX_XCRS`.
const MAX_XCRS: u32 = 16;
/// PIT channel modes 0-5; counts up to 0x10000 (0 means 0x10000).
const PIT_MAX_MODE: u8 = 5;
const PIT_MAX_COUNT: u32 = 0x1_0000;
/// The mode KVM gives a channel at reset, until the guest programs it.
const PIT_UNPROGRAMMED: u8 = 0xff;
/// KVM's PIT access states: LSB 1, MSB 2, WORD0 3, WORD1 4 (0 before any access).
const PIT_MAX_RW_STATE: u8 = 4;
/// vm-superio's receive FIFO.
const SERIAL_FIFO: usize = 64;
/// Most guest monotonic time a session can have run past its template: ten years.
const MAX_GUEST_NS_PAST_TEMPLATE: u64 = 10 * 366 * 24 * 3600 * 1_000_000_000;
/// Valid `kvm_vcpu_events` flags (KVM_VCPUEVENT_VALID_*: NMI pending, SIPI vector,
/// shadow, SMM, payload, triple fault).
const EVENT_FLAGS: u32 = 0x3f;
/// `KVM_PIT_FLAGS_SPEAKER_DUMMY` (Linux 5.x; not in kvm-bindings).
const PIT_FLAGS_SPEAKER_DUMMY: u32 = 2;

fn fields(e: &kvm_cpuid_entry2) -> (u32, u32, u32, u32, u32, u32, u32) {
    (e.function, e.index, e.flags, e.eax, e.ebx, e.ecx, e.edx)
}

fn pinned(index: u32) -> bool {
    PINNED_MSRS.iter().any(|r| r.contains(&index))
}

/// Checks `file`'s machine state against its template's `t` (module docs); `Err` says what
/// was wrong.
pub(crate) fn machine(file: &MachineState, t: &MachineState) -> Result<(), String> {
    settings(file, t)?;
    cpu(file)?;
    devices(file, t)
}

/// What must be the template's.
fn settings(file: &MachineState, t: &MachineState) -> Result<(), String> {
    if file.cpuid.len() != t.cpuid.len()
        || file
            .cpuid
            .iter()
            .zip(&t.cpuid)
            .any(|(a, b)| fields(a) != fields(b))
    {
        let differs = file
            .cpuid
            .iter()
            .zip(&t.cpuid)
            .find(|(a, b)| fields(a) != fields(b))
            .map_or(String::new(), |(a, _)| {
                format!(" (first at leaf {:#x}.{})", a.function, a.index)
            });
        return Err(format!(
            "its CPUID ({} entries) is not the template's ({} entries){differs}",
            file.cpuid.len(),
            t.cpuid.len()
        ));
    }
    let indices = |s: &MachineState| s.msrs.iter().map(|e| e.index).collect::<Vec<_>>();
    if indices(file) != indices(t) {
        return Err(format!(
            "its MSR list ({} MSRs) is not the template's ({} MSRs)",
            file.msrs.len(),
            t.msrs.len()
        ));
    }
    if let Some((a, _)) = file
        .msrs
        .iter()
        .zip(&t.msrs)
        .find(|(a, b)| pinned(a.index) && a.data != b.data)
    {
        return Err(format!(
            "MSR {:#x} describes the CPU and is not the template's",
            a.index
        ));
    }
    if file.lapic.regs[APIC_ID..APIC_ID + 4] != t.lapic.regs[APIC_ID..APIC_ID + 4]
        || file.sregs.apic_base != t.sregs.apic_base
    {
        return Err("its local APIC's id or base is not the template's".into());
    }
    if file.xsave.is_some() != t.xsave.is_some() || file.xcrs.is_some() != t.xcrs.is_some() {
        return Err("it carries XSAVE state where its template does not, or the reverse".into());
    }
    let chips = [
        (file.pic_master.chip_id, KVM_IRQCHIP_PIC_MASTER),
        (file.pic_slave.chip_id, KVM_IRQCHIP_PIC_SLAVE),
        (file.ioapic.chip_id, KVM_IRQCHIP_IOAPIC),
    ];
    if chips.iter().any(|(found, want)| found != want) {
        return Err("its interrupt controllers are not in their places".into());
    }
    Ok(())
}

/// The vCPU's own state, in the ranges KVM accepts.
fn cpu(file: &MachineState) -> Result<(), String> {
    let rflags = file.regs.rflags;
    if rflags & RFLAGS_FIXED1 == 0 || rflags & RFLAGS_RESERVED != 0 {
        return Err(format!("RFLAGS {rflags:#x} has reserved bits wrong"));
    }
    if file.sregs.cr4 & (CR4_VMXE | CR4_SMXE) != 0 || file.sregs.efer & EFER_SVME != 0 {
        return Err("it turns on a virtualization extension (CR4.VMXE/SMXE, EFER.SVME)".into());
    }
    if file.fpu.mxcsr & MXCSR_RESERVED != 0 {
        return Err(format!("MXCSR {:#x} has reserved bits set", file.fpu.mxcsr));
    }
    if let Some(x) = &file.xsave
        && x.region[XSAVE_MXCSR_WORD] & MXCSR_RESERVED != 0
    {
        return Err("the XSAVE area's MXCSR has reserved bits set".into());
    }
    if let Some(x) = &file.xcrs
        && (x.nr_xcrs > MAX_XCRS || x.flags != 0)
    {
        return Err(format!("{} XCRs (flags {:#x})", x.nr_xcrs, x.flags));
    }
    let e = &file.events;
    if e.exception.nr >= 32
        || e.flags & !EVENT_FLAGS != 0
        || e.exception.injected > 1
        || e.exception.pending > 1
        || e.smi.smm != 0
        || e.smi.pending != 0
    {
        return Err(format!(
            "its pending events are out of range (exception {}, flags {:#x}, SMM {})",
            e.exception.nr, e.flags, e.smi.smm
        ));
    }
    if ![KVM_MP_STATE_RUNNABLE, KVM_MP_STATE_HALTED].contains(&file.mp_state.mp_state) {
        return Err(format!(
            "MP state {} (a stopped vCPU is runnable or halted)",
            file.mp_state.mp_state
        ));
    }
    let d = &file.debug_regs;
    if d.dr6 >> 32 != 0 || d.dr7 >> 32 != 0 || d.flags != 0 {
        return Err("its debug registers are out of range".into());
    }
    Ok(())
}

/// The devices' state, in the ranges they accept.
fn devices(file: &MachineState, t: &MachineState) -> Result<(), String> {
    let pit = &file.pit;
    if pit.flags & !(KVM_PIT_FLAGS_HPET_LEGACY | PIT_FLAGS_SPEAKER_DUMMY) != 0 {
        return Err(format!("its PIT flags {:#x} are unknown", pit.flags));
    }
    if let Some((i, c)) = pit.channels.iter().enumerate().find(|(_, c)| {
        (c.mode > PIT_MAX_MODE && c.mode != PIT_UNPROGRAMMED)
            || c.count > PIT_MAX_COUNT
            || c.rw_mode > PIT_MAX_RW_STATE
            || c.read_state > PIT_MAX_RW_STATE
            || c.write_state > PIT_MAX_RW_STATE
    }) {
        return Err(format!(
            "its PIT channel {i} is out of range (mode {}, count {:#x}, access {}/{}/{})",
            c.mode, c.count, c.rw_mode, c.read_state, c.write_state
        ));
    }
    let clock = file.clock.clock;
    if clock < t.clock.clock || clock - t.clock.clock > MAX_GUEST_NS_PAST_TEMPLATE {
        return Err(format!(
            "its clock ({clock} ns) is before its template's or years after it"
        ));
    }
    if file.serial.in_buffer.len() > SERIAL_FIFO {
        return Err(format!(
            "its serial port holds {} bytes, its FIFO {SERIAL_FIFO}",
            file.serial.in_buffer.len()
        ));
    }
    // The card's registers and queues are checked again when restored (`restore_net`:
    // queue sizes, rings inside RAM, features within the offer).
    match (&file.net, &t.net) {
        (None, None) => {}
        (Some(f), Some(t)) if f.config == t.config => {}
        (Some(_), Some(_)) => return Err("its network card's config is not the template's".into()),
        _ => {
            return Err("it has a network card where its template has none, or the reverse".into());
        }
    }
    Ok(())
}

/// Whether the largest XSAVE area `cpuid` allows (leaf 0xd, sub-leaf 0, ECX: every feature
/// the CPUID offers) fits KVM's 4 KiB `kvm_xsave`, which `KVM_SET_XSAVE` reads whole only
/// then. A CPUID without leaf 0xd offers no XSAVE.
pub(crate) fn xsave_fits(cpuid: &[kvm_cpuid_entry2]) -> bool {
    cpuid
        .iter()
        .find(|e| e.function == 0xd && e.index == 0)
        .is_none_or(|e| e.ecx as usize <= std::mem::size_of::<kvm_bindings::kvm_xsave>())
}

#[cfg(test)]
pub(crate) mod tests {
    use kvm_bindings::{kvm_fpu, kvm_msr_entry};
    use vm_superio::serial::SerialState;

    use super::*;
    use crate::snapshot::FpuState;

    /// A plausible template state: a CPUID without VMX, three MSRs (the TSC first, one of
    /// them pinned), the chips in their places, runnable, RFLAGS's fixed bit.
    pub(crate) fn state() -> MachineState {
        let mut s = MachineState {
            cpuid: vec![
                kvm_cpuid_entry2 {
                    function: 0,
                    eax: 0xd,
                    ..Default::default()
                },
                kvm_cpuid_entry2 {
                    function: 1,
                    ecx: 1 << 31,
                    ..Default::default()
                },
                kvm_cpuid_entry2 {
                    function: 0xd,
                    index: 0,
                    eax: 7,
                    ecx: 0x340,
                    ..Default::default()
                },
            ],
            regs: Default::default(),
            sregs: Default::default(),
            fpu: FpuState::from(&kvm_fpu {
                mxcsr: 0x1f80,
                ..Default::default()
            }),
            xsave: None,
            xcrs: None,
            lapic: Default::default(),
            msrs: [0x10, 0x10a, 0x6e0]
                .into_iter()
                .map(|index| kvm_msr_entry {
                    index,
                    data: 5,
                    ..Default::default()
                })
                .collect(),
            events: Default::default(),
            mp_state: Default::default(),
            debug_regs: Default::default(),
            pic_master: Default::default(),
            pic_slave: Default::default(),
            ioapic: Default::default(),
            pit: Default::default(),
            clock: Default::default(),
            serial: SerialState {
                baud_divisor_low: 0,
                baud_divisor_high: 0,
                interrupt_enable: 0,
                interrupt_identification: 0,
                line_control: 0,
                line_status: 0,
                modem_control: 0,
                modem_status: 0,
                scratch: 0,
                in_buffer: Vec::new(),
            },
            net: None,
        };
        s.regs.rflags = 0x202;
        s.sregs.apic_base = 0xfee0_0900;
        s.lapic.regs[APIC_ID + 3] = 0;
        s.pic_slave.chip_id = KVM_IRQCHIP_PIC_SLAVE;
        s.ioapic.chip_id = KVM_IRQCHIP_IOAPIC;
        s.clock.clock = 1_000_000;
        s
    }

    fn refused(change: impl FnOnce(&mut MachineState)) -> String {
        let t = state();
        let mut f = state();
        change(&mut f);
        machine(&f, &t).expect_err("a changed state must be refused")
    }

    #[test]
    fn the_templates_own_state_and_a_later_one_pass() {
        let t = state();
        let mut later = state();
        later.regs.rip = 0xffff_ffff_8100_0000;
        later.msrs[0].data = 1 << 40; // the TSC went on
        later.msrs[2].data = 77; // TSC_DEADLINE: guest state
        later.clock.clock += 5_000_000_000;
        later.serial.in_buffer = vec![b'x'; 64];
        later.pit.channels[0].rw_mode = 4; // WORD1: between the two bytes of a count
        later.pit.channels[0].count = 0x1_0000;
        later.pit.channels[1].mode = PIT_UNPROGRAMMED;

        assert_eq!(machine(&t, &t), Ok(()));
        assert_eq!(machine(&later, &t), Ok(()));
    }

    #[test]
    fn a_foreign_cpuid_or_msr_list_is_refused() {
        let vmx = refused(|f| f.cpuid[1].ecx |= 1 << 5);
        let amx = refused(|f| f.cpuid[2].ecx = 0x2b00);
        let extra_leaf = refused(|f| f.cpuid.push(kvm_cpuid_entry2::default()));
        let msr_dropped = refused(|f| {
            f.msrs.pop();
        });
        let msr_added = refused(|f| {
            f.msrs.push(kvm_msr_entry {
                index: 0x3a,
                ..Default::default()
            })
        });
        let arch_caps = refused(|f| f.msrs[1].data = u64::MAX);

        assert!(vmx.contains("CPUID") && vmx.contains("leaf 0x1"), "{vmx}");
        assert!(amx.contains("leaf 0xd"), "{amx}");
        assert!(extra_leaf.contains("4 entries"), "{extra_leaf}");
        assert!(msr_dropped.contains("MSR list"), "{msr_dropped}");
        assert!(msr_added.contains("MSR list"), "{msr_added}");
        assert!(arch_caps.contains("MSR 0x10a"), "{arch_caps}");
    }

    #[test]
    fn settings_of_the_template_stay_the_templates() {
        let apic_id = refused(|f| f.lapic.regs[APIC_ID + 3] = 9);
        let apic_base = refused(|f| f.sregs.apic_base = 0xdead_0900);
        let xsave = refused(|f| f.xsave = Some(Default::default()));
        let chips = refused(|f| f.pic_master.chip_id = KVM_IRQCHIP_IOAPIC);

        assert!(apic_id.contains("APIC"), "{apic_id}");
        assert!(apic_base.contains("APIC"), "{apic_base}");
        assert!(xsave.contains("XSAVE"), "{xsave}");
        assert!(chips.contains("interrupt controllers"), "{chips}");
    }

    #[test]
    fn vcpu_fields_out_of_range_are_refused() {
        type Change = Box<dyn FnOnce(&mut MachineState)>;
        let cases: [(&str, Change); 10] = [
            ("RFLAGS", Box::new(|f| f.regs.rflags = 0x200)),
            ("RFLAGS", Box::new(|f| f.regs.rflags = u64::MAX)),
            ("virtualization", Box::new(|f| f.sregs.cr4 |= CR4_VMXE)),
            ("virtualization", Box::new(|f| f.sregs.efer |= EFER_SVME)),
            ("MXCSR", Box::new(|f| f.fpu.mxcsr = 0xffff_ffff)),
            ("pending events", Box::new(|f| f.events.exception.nr = 32)),
            ("pending events", Box::new(|f| f.events.smi.smm = 1)),
            ("pending events", Box::new(|f| f.events.flags = 0x8000)),
            ("MP state", Box::new(|f| f.mp_state.mp_state = 9)),
            ("debug registers", Box::new(|f| f.debug_regs.dr7 = 1 << 40)),
        ];

        for (what, change) in cases {
            let why = refused(change);
            assert!(why.contains(what), "{what}: {why}");
        }
    }

    #[test]
    fn device_fields_out_of_range_are_refused() {
        let pit_mode = refused(|f| f.pit.channels[0].mode = 6);
        let pit_access = refused(|f| f.pit.channels[1].rw_mode = 5);
        let pit_count = refused(|f| f.pit.channels[2].count = u32::MAX);
        let pit_flags = refused(|f| f.pit.flags = u32::MAX);
        let clock_back = refused(|f| f.clock.clock = 1);
        let clock_far = refused(|f| f.clock.clock = u64::MAX);
        let serial = refused(|f| f.serial.in_buffer = vec![0; 65]);
        let card = refused(|f| {
            f.net = Some(crate::devices::virtio::net::NetDeviceState {
                config: Default::default(),
                transport: crate::devices::virtio::mmio::TransportState {
                    status: 0,
                    device_features_sel: 0,
                    driver_features_sel: 0,
                    driver_features: 0,
                    queue_sel: 0,
                    interrupt_status: 0,
                    config_generation: 0,
                    queues: Vec::new(),
                },
            })
        });

        assert!(card.contains("network card"), "{card}");
        assert!(pit_mode.contains("PIT"), "{pit_mode}");
        assert!(pit_access.contains("PIT channel 1"), "{pit_access}");
        assert!(pit_count.contains("PIT"), "{pit_count}");
        assert!(pit_flags.contains("PIT"), "{pit_flags}");
        assert!(clock_back.contains("clock"), "{clock_back}");
        assert!(clock_far.contains("clock"), "{clock_far}");
        assert!(serial.contains("serial"), "{serial}");
    }

    #[test]
    fn an_xsave_area_over_4_kib_does_not_fit() {
        let leaf = |ecx| kvm_cpuid_entry2 {
            function: 0xd,
            index: 0,
            ecx,
            ..Default::default()
        };

        assert!(xsave_fits(&[leaf(0x340)]));
        assert!(xsave_fits(&[leaf(4096)]));
        assert!(!xsave_fits(&[leaf(0x2b00)]), "AMX's 11 008 bytes");
        assert!(xsave_fits(&[]));
    }
}
