//! The vCPU run loop: enter the guest, turn each exit into a device access or a stop.
//!
//! [`handle_exit`] is a free function from one `VcpuExit` to an [`ExitAction`], unit-tested
//! without KVM. [`run`] loops over `KVM_RUN` until an exit says stop or someone [`Kicker::kick`]s
//! the vCPU. The loop takes no locks, allocates nothing and does not log.
//!
//! The network card's helper thread pokes the vCPU the same way ([`Kicker::poke`]) without
//! asking it to stop: the loop serves the card (`PortBus::serve_nic`) and goes back in.
//!
//! Kicking: another thread cannot interrupt `KVM_RUN` except by a signal. The kick signal's
//! handler sets `kvm_run.immediate_exit` of the vCPU running on that thread, so a kick that
//! lands just before the ioctl enters the guest still makes it return at once (`EINTR`) instead
//! of being lost; the loop then sees the kick flag and stops.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use kvm_bindings::kvm_run;
use kvm_ioctls::{VcpuExit, VcpuFd};

use crate::devices::{PortBus, PortEvent};
use crate::memory::GuestRam;

/// Why the run loop stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VcpuStop {
    /// The guest rang the doorbell with this code.
    Doorbell(u32),
    /// The guest pulsed the i8042 reset line (reboot, or panic with `panic=-1`).
    Reset,
    /// The guest kernel reported that the worker process is exiting, with its wait status
    /// ([`crate::devices::exit_report`]). The guest is in the middle of that exit.
    WorkerExited(u32),
    /// Triple fault (or another shutdown condition).
    Shutdown,
    /// A `hlt` reached user space (with the in-kernel irqchip this means "halted for good").
    Halted,
    /// Someone kicked the vCPU (deadline, cancellation, snapshot).
    Kicked,
    /// The guest's free memory fell below the armed memory cap's floor
    /// ([`crate::memory_cap`]); the guest is in the middle of the allocation that crossed it.
    MemoryLimit,
    /// KVM could not run or emulate the guest.
    InternalError { suberror: u32, data: Vec<u64> },
    /// KVM could not enter the guest.
    FailEntry { reason: u64 },
    /// An exit bud does not handle.
    Unexpected(String),
}

/// What the run loop does after an exit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ExitAction {
    Continue,
    Stop(VcpuStop),
}

/// Errors of running a vCPU.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("KVM_RUN failed: {0}")]
    Run(kvm_ioctls::Error),
    #[error("cannot install the vCPU kick signal handler: {0}")]
    SignalHandler(std::io::Error),
}

/// Turns one exit into an action, doing the device access it asks for (a host-zero, host-copy
/// or host-random request writes `ram`).
pub(crate) fn handle_exit(exit: VcpuExit<'_>, bus: &mut PortBus, ram: &GuestRam) -> ExitAction {
    bus.note_exit();
    let event = match exit {
        VcpuExit::IoOut(port, data) => bus.write(port, data),
        VcpuExit::IoIn(port, data) => bus.read(port, data),
        // The network card's window, if the VM has one; nothing else is MMIO here (the
        // IOAPIC and LAPIC live in KVM): other reads see all-ones, writes are swallowed.
        VcpuExit::MmioRead(addr, data) => bus.mmio_read(addr, data),
        VcpuExit::MmioWrite(addr, data) => bus.mmio_write(addr, data, ram),
        VcpuExit::Hlt => return ExitAction::Stop(VcpuStop::Halted),
        VcpuExit::Shutdown => return ExitAction::Stop(VcpuStop::Shutdown),
        VcpuExit::FailEntry(reason, _cpu) => {
            return ExitAction::Stop(VcpuStop::FailEntry { reason });
        }
        VcpuExit::InternalError => {
            return ExitAction::Stop(VcpuStop::InternalError {
                suberror: 0,
                data: Vec::new(),
            });
        }
        other => return ExitAction::Stop(VcpuStop::Unexpected(format!("{other:?}"))),
    };
    match event {
        PortEvent::Handled => ExitAction::Continue,
        PortEvent::Doorbell(code) => ExitAction::Stop(VcpuStop::Doorbell(code)),
        PortEvent::Reset => ExitAction::Stop(VcpuStop::Reset),
        PortEvent::WorkerExit(status) => ExitAction::Stop(VcpuStop::WorkerExited(status)),
        PortEvent::Copy(block) => match crate::devices::host_copy::serve(ram, block) {
            Ok(_) => ExitAction::Continue,
            Err(e) => ExitAction::Stop(VcpuStop::Unexpected(format!(
                "the guest sent a host-copy request the host cannot serve: {e}"
            ))),
        },
        PortEvent::Random { addr, len, fill } => {
            match crate::devices::host_random::serve(ram, addr, len, fill) {
                Ok(()) => ExitAction::Continue,
                Err(e) => ExitAction::Stop(VcpuStop::Unexpected(format!(
                    "the guest sent a host-random request the host cannot serve: {e}"
                ))),
            }
        }
        PortEvent::Zero { addr, len } => match ram.zero(addr, len) {
            Ok(()) if bus.memory_cap().is_some_and(|cap| cap.crossed(ram)) => {
                ExitAction::Stop(VcpuStop::MemoryLimit)
            }
            Ok(()) => ExitAction::Continue,
            Err(e) => ExitAction::Stop(VcpuStop::Unexpected(format!(
                "the guest asked the host to zero memory it does not have: {e}"
            ))),
        },
    }
}

thread_local! {
    /// The `kvm_run` of the vCPU currently running on this thread (null when none).
    static RUNNING: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

fn kick_signal() -> libc::c_int {
    libc::SIGRTMIN() + 2
}

extern "C" fn on_kick_signal(_: libc::c_int) {
    // Only a thread-local read and a volatile byte store: async-signal-safe.
    let run = RUNNING.with(Cell::get);
    if !run.is_null() {
        // SAFETY: `RUNNING` is set only while a `KickGuard` on this thread borrows the vCPU
        // whose `kvm_run` this is, so the pointer is live; `immediate_exit` is a plain byte
        // that KVM reads on ioctl entry.
        unsafe { std::ptr::addr_of_mut!((*run).immediate_exit).write_volatile(1) };
    }
}

fn install_kick_handler() -> Result<(), VcpuError> {
    static ERRNO: OnceLock<i32> = OnceLock::new();
    let errno = *ERRNO.get_or_init(|| {
        // SAFETY: a zeroed `sigaction` is a valid "no flags, empty mask" value; the handler is
        // an `extern "C" fn(c_int)` that only does async-signal-safe work; no SA_RESTART, so
        // KVM_RUN returns EINTR.
        let rc = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_kick_signal as *const () as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(kick_signal(), &sa, std::ptr::null_mut())
        };
        if rc == 0 {
            0
        } else {
            std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EINVAL)
        }
    });
    match errno {
        0 => Ok(()),
        errno => Err(VcpuError::SignalHandler(std::io::Error::from_raw_os_error(
            errno,
        ))),
    }
}

#[derive(Debug, Default)]
struct KickState {
    requested: AtomicBool,
    /// The thread inside [`run`], if any. Guarded so a kick never signals a thread that left.
    thread: Mutex<Option<libc::pthread_t>>,
}

/// A handle that stops a running vCPU from another thread. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub(crate) struct Kicker(Arc<KickState>);

impl Kicker {
    /// A new kicker for one vCPU.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Makes the vCPU's run loop return [`VcpuStop::Kicked`] as soon as possible (at once if
    /// it is not running: the next [`run`] returns immediately).
    pub(crate) fn kick(&self) {
        self.0.requested.store(true, Ordering::SeqCst);
        let thread = self.0.thread.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = *thread {
            // SAFETY: `t` is a live thread: it is registered only while inside `run`, and it
            // deregisters under this same lock before leaving.
            unsafe { libc::pthread_kill(t, kick_signal()) };
        }
    }

    /// Interrupts `KVM_RUN` without asking the loop to stop (the network card's helper
    /// thread has work for it); nothing happens if the vCPU is not running, and the next
    /// [`run`] serves the card first.
    pub(crate) fn poke(&self) {
        let thread = self.0.thread.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = *thread {
            // SAFETY: as in `kick`: `t` is registered only while inside `run`.
            unsafe { libc::pthread_kill(t, kick_signal()) };
        }
    }

    /// Clears a pending kick.
    pub(crate) fn reset(&self) {
        self.0.requested.store(false, Ordering::SeqCst);
    }

    /// Whether a kick is pending.
    pub(crate) fn is_kicked(&self) -> bool {
        self.0.requested.load(Ordering::SeqCst)
    }
}

/// Registers this thread as the vCPU's while it runs.
struct KickGuard<'a> {
    kicker: &'a Kicker,
}

impl<'a> KickGuard<'a> {
    fn enter(kicker: &'a Kicker, run: *mut kvm_run) -> Self {
        RUNNING.with(|r| r.set(run));
        // SAFETY: pthread_self has no preconditions.
        let me = unsafe { libc::pthread_self() };
        *kicker.0.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(me);
        Self { kicker }
    }
}

impl Drop for KickGuard<'_> {
    fn drop(&mut self) {
        *self
            .kicker
            .0
            .thread
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = None;
        RUNNING.with(|r| r.set(std::ptr::null_mut()));
    }
}

/// Runs the vCPU until an exit stops it or `kicker` kicks it.
pub(crate) fn run(
    vcpu: &mut VcpuFd,
    bus: &mut PortBus,
    ram: &GuestRam,
    kicker: &Kicker,
) -> Result<VcpuStop, VcpuError> {
    install_kick_handler()?;
    let run_ptr: *mut kvm_run = vcpu.get_kvm_run();
    let _guard = KickGuard::enter(kicker, run_ptr);
    loop {
        if kicker.is_kicked() {
            return Ok(VcpuStop::Kicked);
        }
        if bus.nic_pending() {
            bus.serve_nic(ram);
        }
        match vcpu.run() {
            Ok(VcpuExit::InternalError) => {
                return Ok(VcpuStop::InternalError {
                    suberror: internal_error_suberror(vcpu),
                    data: internal_error_data(vcpu),
                });
            }
            Ok(exit) => match handle_exit(exit, bus, ram) {
                ExitAction::Continue => {}
                ExitAction::Stop(stop) => return Ok(stop),
            },
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                vcpu.set_kvm_immediate_exit(0);
            }
            Err(e) => return Err(VcpuError::Run(e)),
        }
    }
}

fn internal_error_suberror(vcpu: &mut VcpuFd) -> u32 {
    // SAFETY: after a KVM_EXIT_INTERNAL_ERROR exit the `internal` member of the union is the
    // one KVM filled in.
    unsafe { vcpu.get_kvm_run().__bindgen_anon_1.internal.suberror }
}

fn internal_error_data(vcpu: &mut VcpuFd) -> Vec<u64> {
    // SAFETY: as above; `ndata` is clamped to the array length before slicing.
    let internal = unsafe { vcpu.get_kvm_run().__bindgen_anon_1.internal };
    let n = (internal.ndata as usize).min(internal.data.len());
    internal.data[..n].to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::console::ConsoleLog;
    use vmm_sys_util::eventfd::EventFd;

    fn bus() -> PortBus {
        PortBus::new(
            EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            ConsoleLog::new(8),
        )
    }

    fn ram() -> GuestRam {
        GuestRam::anonymous(4 << 20).unwrap()
    }

    /// A host-zero request is served either way; it stops the vCPU only when a cap is armed
    /// and the guest's free pages are then below its floor.
    #[test]
    fn a_host_zero_request_stops_at_the_memory_cap_only_once_crossed() {
        use crate::memory_cap::{MemoryCap, MemoryLayout};
        let layout = MemoryLayout {
            free_pages: 0x1000,
            min_free_kbytes: 0x1008,
        };
        let ram = ram();
        // min_free_kbytes 4096: floor 1 024 + 256 pages.
        ram.write(0x1008, &4096i32.to_le_bytes()).unwrap();
        let request = 0x200u32.to_le_bytes(); // page 0x200, order 0
        let mut unarmed = bus();
        let mut armed = bus();
        armed.set_memory_cap(MemoryCap::read(&ram, Some(&layout)));

        ram.write(0x1000, &1280u64.to_le_bytes()).unwrap();
        ram.write(0x20_0000, &[1]).unwrap();
        let at_floor = handle_exit(
            VcpuExit::IoOut(crate::devices::host_zero::PORT, &request),
            &mut armed,
            &ram,
        );
        ram.write(0x1000, &1279u64.to_le_bytes()).unwrap();
        let below_unarmed = handle_exit(
            VcpuExit::IoOut(crate::devices::host_zero::PORT, &request),
            &mut unarmed,
            &ram,
        );
        ram.write(0x20_0000, &[1]).unwrap();
        let below = handle_exit(
            VcpuExit::IoOut(crate::devices::host_zero::PORT, &request),
            &mut armed,
            &ram,
        );

        assert_eq!(at_floor, ExitAction::Continue);
        assert_eq!(below_unarmed, ExitAction::Continue);
        assert_eq!(below, ExitAction::Stop(VcpuStop::MemoryLimit));
        assert_eq!(
            ram.read_u64(0x20_0000).unwrap(),
            0,
            "the page was zeroed first"
        );
    }

    #[test]
    fn doorbell_out_stops_with_its_code() {
        let mut bus = bus();
        let data = 0x1234u32.to_le_bytes();

        let action = handle_exit(
            VcpuExit::IoOut(crate::protocol::DOORBELL_PORT, &data),
            &mut bus,
            &ram(),
        );

        assert_eq!(action, ExitAction::Stop(VcpuStop::Doorbell(0x1234)));
    }

    #[test]
    fn serial_out_continues_and_reset_stops() {
        let mut bus = bus();
        let ram = ram();

        let serial = handle_exit(VcpuExit::IoOut(0x3f8, b"x"), &mut bus, &ram);
        let reset = handle_exit(VcpuExit::IoOut(0x64, &[0xfe]), &mut bus, &ram);
        let exit = handle_exit(
            VcpuExit::IoOut(crate::devices::exit_report::PORT, &0x700u32.to_le_bytes()),
            &mut bus,
            &ram,
        );

        assert_eq!(serial, ExitAction::Continue);
        assert_eq!(reset, ExitAction::Stop(VcpuStop::Reset));
        assert_eq!(exit, ExitAction::Stop(VcpuStop::WorkerExited(0x700)));
    }

    #[test]
    fn mmio_reads_see_all_ones_and_shutdown_stops() {
        let mut bus = bus();
        let ram = ram();
        let mut data = [0u8; 4];

        let read = handle_exit(VcpuExit::MmioRead(0xd000_0000, &mut data), &mut bus, &ram);
        let shutdown = handle_exit(VcpuExit::Shutdown, &mut bus, &ram);

        assert_eq!(read, ExitAction::Continue);
        assert_eq!(data, [0xff; 4]);
        assert_eq!(shutdown, ExitAction::Stop(VcpuStop::Shutdown));
    }

    #[test]
    fn a_host_zero_request_zeroes_guest_ram_and_one_past_its_end_stops_the_vm() {
        let mut bus = bus();
        let ram = ram();
        ram.write(0x20_0000, &[0xaa; 4096]).unwrap();
        ram.write(0x40_0000 - 8, &[0xbb; 8]).unwrap();
        let huge_at_2m = (0x200u32 | (9 << crate::devices::host_zero::PFN_BITS)).to_le_bytes();
        let huge_at_4m = (0x400u32 | (9 << crate::devices::host_zero::PFN_BITS)).to_le_bytes();

        let zeroed = handle_exit(
            VcpuExit::IoOut(crate::devices::host_zero::PORT, &huge_at_2m),
            &mut bus,
            &ram,
        );
        let outside = handle_exit(
            VcpuExit::IoOut(crate::devices::host_zero::PORT, &huge_at_4m),
            &mut bus,
            &ram,
        );
        let mut back = [1u8; 4096];
        ram.read(0x20_0000, &mut back).unwrap();
        let mut last = [1u8; 8];
        ram.read(0x40_0000 - 8, &mut last).unwrap();

        assert_eq!(zeroed, ExitAction::Continue);
        assert_eq!(back, [0u8; 4096]);
        assert_eq!(last, [0u8; 8]);
        let ExitAction::Stop(VcpuStop::Unexpected(why)) = outside else {
            panic!("{outside:?}");
        };
        assert!(why.contains("outside guest RAM"), "{why}");
    }

    #[test]
    fn a_host_random_request_fills_guest_ram_a_wipe_zeroes_it_and_one_past_its_end_stops_the_vm() {
        use crate::devices::host_random::{PFN_BITS, PORT, WIPE};
        let mut bus = bus();
        let ram = ram();
        ram.write(0x30_0000, &[0xaa; 64 << 10]).unwrap();
        ram.write(0x40_0000 - 8, &[0xbb; 8]).unwrap();
        let fill_at_3m = 0x300u32 | (4 << PFN_BITS);
        let past_the_end = (0x400u32 - 1) | (1 << PFN_BITS);
        let mut first = vec![0u8; 64 << 10];
        let mut second = vec![0u8; 64 << 10];
        let mut wiped = vec![1u8; 64 << 10];

        let filled = handle_exit(
            VcpuExit::IoOut(PORT, &fill_at_3m.to_le_bytes()),
            &mut bus,
            &ram,
        );
        ram.read(0x30_0000, &mut first).unwrap();
        handle_exit(
            VcpuExit::IoOut(PORT, &fill_at_3m.to_le_bytes()),
            &mut bus,
            &ram,
        );
        ram.read(0x30_0000, &mut second).unwrap();
        let wipe = handle_exit(
            VcpuExit::IoOut(PORT, &(fill_at_3m | WIPE).to_le_bytes()),
            &mut bus,
            &ram,
        );
        ram.read(0x30_0000, &mut wiped).unwrap();
        let outside = handle_exit(
            VcpuExit::IoOut(PORT, &past_the_end.to_le_bytes()),
            &mut bus,
            &ram,
        );
        let too_large = handle_exit(
            VcpuExit::IoOut(PORT, &(9u32 << PFN_BITS).to_le_bytes()),
            &mut bus,
            &ram,
        );
        let mut last = [0u8; 8];
        ram.read(0x40_0000 - 8, &mut last).unwrap();

        assert_eq!(filled, ExitAction::Continue);
        assert_eq!(wipe, ExitAction::Continue);
        // Fresh host bytes each time: not the old contents, not zeros, never the same twice.
        assert!(first.chunks(8).all(|c| c != [0xaa; 8]));
        assert!(first.chunks(4096).all(|page| page.iter().any(|&b| b != 0)));
        assert_ne!(first, second);
        assert!(wiped.iter().all(|&b| b == 0));
        let ExitAction::Stop(VcpuStop::Unexpected(why)) = outside else {
            panic!("{outside:?}");
        };
        assert!(why.contains("outside guest RAM"), "{why}");
        let ExitAction::Stop(VcpuStop::Unexpected(why)) = too_large else {
            panic!("{too_large:?}");
        };
        assert!(why.contains("larger than one exit"), "{why}");
        assert_eq!(last, [0xbb; 8]);
    }

    #[test]
    fn a_kick_before_running_is_kept_until_reset() {
        let kicker = Kicker::new();

        kicker.kick();
        let before = kicker.is_kicked();
        kicker.reset();

        assert!(before);
        assert!(!kicker.is_kicked());
    }
}
