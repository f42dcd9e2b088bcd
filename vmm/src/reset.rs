//! Reset: returning a VM that ran a job to exactly its template's READY state, in place, so
//! the next job reuses the VM (its memory mapped, its private pages already copied) instead of
//! a new clone.
//!
//! The state a clone has, and how [`reset`] returns each part to the template:
//! - **Guest RAM.** Clone RAM is a `MAP_PRIVATE` mapping of the template's memory file, so a
//!   page can differ from the template only if it holds a private copy, whoever wrote it: the
//!   guest, KVM on its behalf (kvm-clock, steal time), or the host (the job request, the
//!   clone's clock and CRNG). `/proc/self/pagemap` lists those pages
//!   ([`GuestRam::private_pages`](crate::memory::GuestRam::private_pages)); each is compared
//!   with the template's memory file (mapped read-only) and copied back where it differs.
//!   The copy keeps the page private and mapped, so the next job pays no copy-on-write fault.
//!   KVM's dirty log is not used: it would only repeat what pagemap says, and its write
//!   protection costs the guest a fault on the first write to every page of every job.
//! - **What KVM derived from guest memory.** Under shadow paging (kvm_pvm; hardware without
//!   EPT/NPT, see [`HostKind::shadow_paging`](crate::HostKind::shadow_paging)) KVM keeps
//!   shadow page tables built from the guest's page tables, kept in sync by write-protecting
//!   the guest pages it shadows (or, for unsync leaf tables, re-read at the guest's next TLB
//!   flush), and it sets accessed/dirty bits in guest page tables itself. A host write
//!   bypasses all of that. So if any restored page is one of the template's page-table pages
//!   (every table reachable from `init_top_pgt` and from every mm's PGD on the kernel's
//!   `pgd_list`, listed once per template, see [`crate::paging::all_table_pages`]), the RAM
//!   slot is deleted and re-added ([`Machine::forget_mappings`]): KVM drops every shadow page
//!   and mapping, and the next job refaults what it touches (about 16 ms of a trivial job on
//!   kvm_pvm). Otherwise KVM's mappings are kept, and this is why that is exact:
//!   1. Every shadow page reachable from a page table the template uses shadows one of the
//!      template's page-table pages (by induction from the roots: a link in a shadow page
//!      mirrors an entry of the guest table it shadows, and none of those changed), whose
//!      bytes the job left as the template has them; a synced shadow of it saw every guest
//!      write (write protection), and an unsync one is re-read from guest memory.
//!   2. Any other shadow page (tables of processes the job started, tables it freed) is
//!      unreachable from the template's tables. It can only become reachable when the guest
//!      makes its page a page table again, and Linux allocates page tables zeroed
//!      (`GFP_PGTABLE_*` has `__GFP_ZERO`): those writes go through KVM's write tracking,
//!      which zaps the stale entries (or the page, if unsync, is re-read when KVM finds it).
//!   3. Leaf mappings of data pages stay valid: a reset copies into the same host pages.
//!   4. Accessed/dirty bits KVM set in a template page table change that page: it is then
//!      restored, and the mappings are dropped.
//!
//!   With EPT/NPT the guest's page tables are only read by the CPU from guest memory, and
//!   nothing is derived from their contents: the step is never needed.
//! - **vCPU and VM state**, restored before the memory (restoring the kvm-clock MSRs makes
//!   KVM write its wall-clock struct into guest memory at once). First the instruction
//!   behind the job's last exit is completed ([`snapshot::complete_pending_io`]), so no
//!   completion is left to land on the restored registers, and interrupts still on their way
//!   into the irqchip are flushed ([`Machine::quiesce_irqs`]); then [`snapshot::restore`] in its documented order: PIT, kvm-clock,
//!   both PICs and the IOAPIC; registers, special registers, FPU/XSAVE and XCRs, debug
//!   registers, LAPIC, every MSR (all or nothing), MP state and pending events. CPUID is left:
//!   it is the template's already, and KVM refuses to change it after the first run.
//! - **Devices.** The serial console returns to the template's registers with an empty log;
//!   the i8042 and the doorbell have no state; a pending kick is cleared. A network card
//!   ([`crate::net`]) returns to the template's registers and queues by value, its irqfd
//!   quiesced with the serial's, and gets a brand-new stack: every host connection closed,
//!   every DNS name forgotten, no learned neighbour, no queued frame, no pending host work;
//!   it is quiescent already, since only the vCPU thread (which is here) runs it. What the
//!   card wrote into guest memory (receive buffers, used rings) is private pages, restored
//!   with the rest of RAM below.
//!
//! The kvm-clock is pinned once more when the next job starts ([`crate::job::give_identity`]).
//!
//! [`verify`] checks a reset by value, independently of the dirty log: every page of guest
//! RAM against the template file, and the captured vCPU and VM state against the template's
//! (fields that move with time, and nothing else, compared within a bound). The test suite
//! runs it after every job of every kind.

use std::time::{Duration, Instant};

use kvm_ioctls::Kvm;

use crate::memory::{self, MemoryError};
use crate::snapshot::{self, MachineState, SnapshotError};
use crate::template::Template;
use crate::vm::{Machine, VmError};

/// Guest-physical pages a verify failure lists at most.
const VERIFY_PAGES_SHOWN: usize = 16;
/// The most a time-derived value may have moved between a reset and its verification.
const TIME_SLACK: Duration = Duration::from_secs(2);

/// Errors of resetting or verifying a VM. Any of them means the VM must not run again.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ResetError {
    #[error("reset: {0}")]
    Vm(#[from] VmError),
    #[error("reset: restoring guest RAM: {0}")]
    Memory(#[from] MemoryError),
    #[error("reset: reading /proc/self/pagemap: {0}")]
    Pagemap(std::io::Error),
    #[error("reset: restoring vCPU and VM state: {0}")]
    State(#[from] SnapshotError),
    #[error("reset: restoring the serial console: {0}")]
    Device(#[from] crate::devices::DeviceError),
    #[error("reset: restoring the network card: {0}")]
    Net(#[from] crate::net::NetError),
    #[error("reset: the VM and its template disagree on having a network card")]
    NetMismatch,
    #[error("reset verification failed: {}", .0.join("; "))]
    Verify(Vec<String>),
}

/// What a reset did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ResetStats {
    /// Pages holding a private copy (compared with the template).
    pub(crate) private_pages: u64,
    /// Of those, pages that differed and were copied back.
    pub(crate) restored_pages: u64,
    /// Whether KVM's mappings were dropped (shadow paging).
    pub(crate) forgot_mappings: bool,
    pub(crate) time: Duration,
}

/// Returns `m`, a VM cloned from `t` that has run since, to `t`'s READY state (module docs).
pub(crate) fn reset(m: &mut Machine, t: &Template) -> Result<ResetStats, ResetError> {
    let started = Instant::now();
    snapshot::complete_pending_io(&mut m.vcpu)?;
    m.quiesce_irqs()?;
    // State before memory: restoring some MSRs makes KVM write guest memory at once (the
    // kvm-clock wall-clock struct), and the memory restore must come after that.
    let s = &t.state().machine;
    snapshot::restore(&m.vm, &m.vcpu, s, snapshot::Target::SameVm)?;
    m.bus.restore_serial(&s.serial)?;
    match (m.bus.nic_mut(), &s.net) {
        (Some(nic), Some(state)) => nic.restore(state, &m.ram)?,
        (None, None) => {}
        _ => return Err(ResetError::NetMismatch),
    }
    m.kicker.reset();
    let private = m.ram.private_pages().map_err(ResetError::Pagemap)?;
    let differ = m.ram.differing_in(t.pristine(), &private)?;
    let restored_pages = m.ram.copy_pages_from(t.pristine(), &differ)?;
    // Under shadow paging, drop KVM's mappings if the job changed a page table (module docs).
    let changed_tables = match t.page_tables() {
        Some(tables) => differ.iter().zip(tables).any(|(d, t)| d & t != 0),
        None => true,
    };
    let forgot_mappings = changed_tables && t.state().host_kind.shadow_paging();
    if forgot_mappings {
        m.forget_mappings()?;
    }
    Ok(ResetStats {
        private_pages: count(&private),
        restored_pages,
        forgot_mappings,
        time: started.elapsed(),
    })
}

fn count(bitmap: &[u64]) -> u64 {
    bitmap.iter().map(|w| u64::from(w.count_ones())).sum()
}

/// Checks that `m` is exactly at `t`'s READY state: all of guest RAM against the template's
/// memory, and the vCPU and VM state by value. Returns every difference found.
pub(crate) fn verify(kvm: &Kvm, m: &mut Machine, t: &Template) -> Result<(), ResetError> {
    let s = t.state();
    // The CPU and device state first, right after the reset: reading all of guest RAM takes
    // tens of milliseconds, in which timers of a correctly reset VM may fire.
    let indices: Vec<u32> = s.machine.msrs.iter().map(|e| e.index).collect();
    let now = snapshot::capture(
        kvm,
        &m.vm,
        &mut m.vcpu,
        s.host_kind,
        s.machine.cpuid.clone(),
        &m.bus,
        snapshot::MsrList::These(&indices),
    )?;
    let mut diffs = differences(&s.machine, &now);
    if m.bus.nic().is_some_and(|n| !n.is_host_side_pristine()) {
        diffs.push("the network card's host side is not empty".into());
    }
    let pages = m.ram.differing_pages(t.pristine(), VERIFY_PAGES_SHOWN)?;
    if !pages.is_empty() {
        diffs.push(format!(
            "guest RAM differs from the template at page(s) {}",
            pages
                .iter()
                .map(|p| format!("{:#x}", p * memory::PAGE_SIZE))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    if diffs.is_empty() {
        Ok(())
    } else {
        Err(ResetError::Verify(diffs))
    }
}

/// Offset of the LAPIC timer's current count (moves with time) in the register page.
const APIC_TMCCT: usize = 0x390;

/// Every difference between two captured states, by field. Exact, except the values that
/// move with time: the TSC, the LAPIC timer's current count, the PIT channels' load times
/// and the kvm-clock, which must be within 2 s of the template's. CPUID is not
/// compared (a reset leaves it; KVM refuses to change it).
pub(crate) fn differences(want: &MachineState, got: &MachineState) -> Vec<String> {
    let mut d = Vec::new();
    let mut field = |name: &str, same: bool| {
        if !same {
            d.push(format!("{name} differs"));
        }
    };
    field("general registers", want.regs == got.regs);
    field("special registers", want.sregs == got.sregs);
    field("FPU", want.fpu == got.fpu);
    field(
        "XSAVE",
        want.xsave.as_ref().map(|x| x.region) == got.xsave.as_ref().map(|x| x.region),
    );
    field("XCRs", want.xcrs == got.xcrs);
    field("events", want.events == got.events);
    field("MP state", want.mp_state == got.mp_state);
    field("debug registers", want.debug_regs == got.debug_regs);
    // `kvm_irqchip` holds a union (no `PartialEq`): compare its serialized bytes.
    let chip = |c: &kvm_bindings::kvm_irqchip| bincode::serialize(c).ok();
    field(
        "PIC master",
        chip(&want.pic_master) == chip(&got.pic_master),
    );
    field("PIC slave", chip(&want.pic_slave) == chip(&got.pic_slave));
    field("IOAPIC", chip(&want.ioapic) == chip(&got.ioapic));
    field("serial console", want.serial == got.serial);
    field("network card", want.net == got.net);
    let lapic = |l: &kvm_bindings::kvm_lapic_state| {
        let mut regs = l.regs;
        regs[APIC_TMCCT..APIC_TMCCT + 4].fill(0);
        regs
    };
    let (wl, gl) = (lapic(&want.lapic), lapic(&got.lapic));
    let lapic_diffs: Vec<String> = (0..wl.len())
        .step_by(16)
        .filter(|&reg| wl[reg..reg + 4] != gl[reg..reg + 4])
        .map(|reg| {
            format!(
                "LAPIC register {reg:#x} is {:x?}, the template's {:x?}",
                &gl[reg..reg + 4],
                &wl[reg..reg + 4]
            )
        })
        .collect();
    let pit = |p: &kvm_bindings::kvm_pit_state2| {
        let mut p = *p;
        for c in &mut p.channels {
            c.count_load_time = 0;
        }
        p
    };
    field("PIT", pit(&want.pit) == pit(&got.pit));
    d.extend(lapic_diffs);
    let slack = TIME_SLACK.as_nanos() as u64;
    if got.clock.clock.abs_diff(want.clock.clock) > slack {
        d.push(format!(
            "kvm-clock {} ns, the template's {} ns",
            got.clock.clock, want.clock.clock
        ));
    }
    if want.msrs.len() != got.msrs.len() {
        d.push(format!(
            "{} MSRs captured, the template has {}",
            got.msrs.len(),
            want.msrs.len()
        ));
    }
    for (w, g) in want.msrs.iter().zip(&got.msrs) {
        if w.index != g.index {
            d.push(format!("MSR order differs at {:#x}", w.index));
            break;
        }
        if w.index == crate::snapshot::MSR_IA32_TSC || w.data == g.data {
            continue;
        }
        d.push(format!(
            "MSR {:#x} is {:#x}, the template's {:#x}",
            w.index, g.data, w.data
        ));
    }
    d
}
