//! Booting a guest from an ELF `vmlinux` and an uncompressed cpio initramfs up to the guest
//! agent's READY doorbell.
//!
//! The order: VM (memory registered before the irqchip, see [`crate::vm`]); kernel loaded at
//! 1 MiB (linux-loader), initramfs at the top of RAM, command line, MP table, RNG seed as
//! `setup_data`, zero page, boot GDT and identity page tables; vCPU CPUID, MSRs, FPU, LAPIC
//! LINTs, long-mode segment registers and entry registers; then run until the agent rings
//! READY, fails, the guest stops, or the timeout passes. Every failure carries the tail of the
//! serial console, where the guest tells its side of the story.

mod config;
pub mod cpu;
pub(crate) mod mptable;
pub(crate) mod params;

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvm_bindings::Msrs;
use kvm_ioctls::Kvm;
use linux_loader::loader::KernelLoader;
use linux_loader::loader::elf::Elf;
use vm_memory::GuestAddress;

use crate::cpuid::{self, CpuidError};
use crate::devices::console::{ConsoleLog, EchoFn};
use crate::host::HostKind;
use crate::layout::{
    CMDLINE_MAX_SIZE, CMDLINE_START, HIMEM_START, MAX_RAM_SIZE, MIN_RAM_SIZE, MPTABLE_START,
    SETUP_DATA_START, ZERO_PAGE_START,
};
use crate::mailbox::{Mailbox, MailboxError};
use crate::memory::{GuestRam, MemoryError, PAGE_SIZE};
use crate::protocol::{code, failure};
use crate::vcpu::{Kicker, VcpuError, VcpuStop};
use crate::vm::{Machine, NetStart, SerialStart, VmError};
pub use config::{BootConfig, DEFAULT_BOOT_TIMEOUT, DEFAULT_RAM_SIZE};

/// Console lines a boot error carries.
pub(crate) const ERROR_TAIL_LINES: usize = 30;

/// The last console lines, printed one per line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConsoleTail(pub Vec<String>);

impl fmt::Display for ConsoleTail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("  (the guest printed nothing)");
        }
        for (i, line) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "  | {line}")?;
        }
        Ok(())
    }
}

/// Errors of booting a guest.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("guest RAM of {0} bytes is outside {MIN_RAM_SIZE}..={MAX_RAM_SIZE} or not whole pages")]
    RamSize(u64),
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Cpuid(#[from] CpuidError),
    #[error("cannot open kernel {path}")]
    OpenKernel {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot load kernel {path} (an ELF vmlinux is expected)")]
    LoadKernel {
        path: PathBuf,
        source: linux_loader::loader::Error,
    },
    #[error("cannot read initramfs {path}")]
    ReadInitramfs {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "initramfs of {size} bytes does not fit between the kernel (ends at {kernel_end:#x}) and the end of RAM ({ram:#x})"
    )]
    InitramfsTooBig {
        size: u64,
        kernel_end: u64,
        ram: u64,
    },
    #[error("kernel command line is {0} bytes or holds a NUL; the limit is {CMDLINE_MAX_SIZE}")]
    Cmdline(usize),
    #[error("boot parameters: {0}")]
    Params(#[from] params::ParamsError),
    #[error("cannot read host randomness for the guest's RNG seed: {0}")]
    Entropy(std::io::Error),
    #[error("cannot start the profiler thread: {0}")]
    Profiler(std::io::Error),
    #[error("vCPU setup: {op} failed")]
    VcpuSetup {
        op: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("vCPU setup: KVM_SET_MSRS set {set} of {total} MSRs")]
    PartialMsrs { set: usize, total: usize },
    #[error("running the vCPU: {0}")]
    Run(#[from] VcpuError),
    #[error("guest stopped before READY ({stop:?}); console tail:\n{console}")]
    Stopped {
        stop: VcpuStop,
        console: ConsoleTail,
    },
    #[error("guest agent reported failure {what} (detail {detail:#x}); console tail:\n{console}")]
    AgentFailed {
        what: &'static str,
        detail: u64,
        console: ConsoleTail,
    },
    #[error("guest rang unknown doorbell code {code:#x} before READY; console tail:\n{console}")]
    UnexpectedDoorbell { code: u32, console: ConsoleTail },
    #[error("no READY within {after:?}; console tail:\n{console}")]
    Timeout {
        after: Duration,
        console: ConsoleTail,
    },
    #[error("the guest's READY announced a bad mailbox: {source}; console tail:\n{console}")]
    Mailbox {
        source: MailboxError,
        console: ConsoleTail,
    },
}

/// Where the time of a boot went.
#[derive(Debug, Clone, Copy, Default)]
pub struct BootTimings {
    /// VM creation, kernel and initramfs loading, vCPU setup.
    pub setup: Duration,
    /// From the first `KVM_RUN` to the agent's AGENT_STARTED doorbell.
    pub to_agent: Option<Duration>,
    /// From the first `KVM_RUN` to READY.
    pub to_ready: Duration,
}

/// A guest stopped at its READY doorbell: the warm worker is parked, the mailbox located.
#[derive(Debug)]
pub struct ReadyGuest {
    pub machine: Machine,
    pub mailbox: Mailbox,
    pub timings: BootTimings,
    pub cmdline: String,
    pub host_kind: HostKind,
    /// Instruction-pointer samples (rip -> count) when profiling was asked for.
    pub profile: HashMap<u64, u64>,
}

/// The last [`ERROR_TAIL_LINES`] lines of `m`'s console, for an error about its guest.
pub(crate) fn console_tail(m: &Machine) -> ConsoleTail {
    ConsoleTail(m.bus.console().tail(ERROR_TAIL_LINES))
}

/// Kicks a vCPU every `interval` until dropped (the boot loop records a sample per kick).
struct Sampler {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    fn start(kicker: Kicker, interval: Duration) -> Result<Self, BootError> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("bud-profiler".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(interval);
                    kicker.kick();
                }
            })
            .map_err(BootError::Profiler)?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join(); // the thread only sleeps and kicks
        }
    }
}

fn vcpu_op<T>(op: &'static str, r: Result<T, kvm_ioctls::Error>) -> Result<T, BootError> {
    r.map_err(|source| BootError::VcpuSetup { op, source })
}

fn host_seed() -> Result<[u8; params::RNG_SEED_SIZE], BootError> {
    let mut seed = [0u8; params::RNG_SEED_SIZE];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut seed))
        .map_err(BootError::Entropy)?;
    Ok(seed)
}

/// Where the initramfs lies in guest RAM: guest-physical start and length (whole pages).
#[derive(Debug, Clone, Copy)]
struct Initrd {
    addr: u64,
    len: u64,
}

/// Loads kernel, initramfs and boot structures into `ram`; returns the kernel entry point
/// and where the initramfs went.
fn load_guest(ram: &GuestRam, cfg: &BootConfig, cmdline: &str) -> Result<(u64, Initrd), BootError> {
    let mut kernel = File::open(&cfg.kernel).map_err(|source| BootError::OpenKernel {
        path: cfg.kernel.clone(),
        source,
    })?;
    let loaded = ram
        .with_guest_memory(|mem| {
            Elf::load(mem, None, &mut kernel, Some(GuestAddress(HIMEM_START)))
        })?
        .map_err(|source| BootError::LoadKernel {
            path: cfg.kernel.clone(),
            source,
        })?;

    let initrd = std::fs::read(&cfg.initramfs).map_err(|source| BootError::ReadInitramfs {
        path: cfg.initramfs.clone(),
        source,
    })?;
    let initrd_size = initrd.len() as u64;
    let initrd_addr = ram
        .len()
        .checked_sub(initrd_size)
        .map(|a| a & !(PAGE_SIZE - 1))
        .filter(|&a| a >= loaded.kernel_end)
        .ok_or(BootError::InitramfsTooBig {
            size: initrd_size,
            kernel_end: loaded.kernel_end,
            ram: ram.len(),
        })?;
    ram.write(initrd_addr, &initrd)?;

    if cmdline.len() >= CMDLINE_MAX_SIZE || cmdline.contains('\0') {
        return Err(BootError::Cmdline(cmdline.len()));
    }
    let mut cmdline_bytes = cmdline.as_bytes().to_vec();
    cmdline_bytes.push(0);
    ram.write(CMDLINE_START, &cmdline_bytes)?;

    ram.write(MPTABLE_START, &mptable::mptable(MPTABLE_START as u32))?;
    ram.write(
        SETUP_DATA_START,
        &params::rng_seed_setup_data(&host_seed()?),
    )?;
    let zero_page = params::ZeroPage {
        e820: params::e820_map(ram.len())?,
        cmdline_addr: CMDLINE_START,
        cmdline_size: cmdline_bytes.len(),
        initrd_addr,
        initrd_size,
        setup_data: SETUP_DATA_START,
    };
    ram.write(ZERO_PAGE_START, &zero_page.to_bytes()?)?;
    cpu::write_boot_tables(ram)?;
    let initrd = Initrd {
        addr: initrd_addr,
        len: initrd_size.next_multiple_of(PAGE_SIZE),
    };
    Ok((loaded.kernel_load.0, initrd))
}

/// Puts the vCPU in the state the kernel's 64-bit entry expects.
fn setup_vcpu(kvm: &Kvm, machine: &Machine, kind: HostKind, entry: u64) -> Result<(), BootError> {
    let vcpu = &machine.vcpu;
    vcpu_op(
        "KVM_SET_CPUID2",
        vcpu.set_cpuid2(&cpuid::guest_cpuid(kvm, kind)?),
    )?;
    let msrs = cpu::boot_msrs();
    let wrapped = Msrs::from_entries(&msrs).map_err(|_| BootError::PartialMsrs {
        set: 0,
        total: msrs.len(),
    })?;
    let set = vcpu_op("KVM_SET_MSRS", vcpu.set_msrs(&wrapped))?;
    if set != msrs.len() {
        return Err(BootError::PartialMsrs {
            set,
            total: msrs.len(),
        });
    }
    vcpu_op("KVM_SET_FPU", vcpu.set_fpu(&cpu::boot_fpu()))?;
    let mut lapic = vcpu_op("KVM_GET_LAPIC", vcpu.get_lapic())?;
    cpu::program_lints(&mut lapic.regs);
    vcpu_op("KVM_SET_LAPIC", vcpu.set_lapic(&lapic))?;
    let sregs = vcpu_op("KVM_GET_SREGS", vcpu.get_sregs())?;
    vcpu_op(
        "KVM_SET_SREGS",
        vcpu.set_sregs(&cpu::long_mode_sregs(sregs)),
    )?;
    vcpu_op("KVM_SET_REGS", vcpu.set_regs(&cpu::entry_regs(entry)))?;
    Ok(())
}

fn failure_name(what: u64) -> &'static str {
    match what {
        failure::MOUNT => "mount",
        failure::SPAWN => "spawn-worker",
        failure::WORKER_EXITED => "worker-exited",
        failure::IOPERM => "ioperm",
        _ => "unknown",
    }
}

/// Boots the guest described by `cfg` and runs it to the READY doorbell. `echo`, if given,
/// sees every console line as it completes.
pub fn boot(cfg: &BootConfig, echo: Option<EchoFn>) -> Result<ReadyGuest, BootError> {
    let started = Instant::now();
    if cfg.ram_size < MIN_RAM_SIZE || cfg.ram_size > MAX_RAM_SIZE || cfg.ram_size % PAGE_SIZE != 0 {
        return Err(BootError::RamSize(cfg.ram_size));
    }
    let kvm = crate::vm::open_kvm()?;
    let cmdline = cfg.cmdline();
    let mut console = ConsoleLog::default();
    console.set_echo(echo);
    let ram = GuestRam::anonymous(cfg.ram_size)?;
    let (entry, initrd) = load_guest(&ram, cfg, &cmdline)?;
    let net = if cfg.network {
        NetStart::Fresh
    } else {
        NetStart::None
    };
    let mut machine = Machine::create(&kvm, ram, console, SerialStart::Fresh, net)?;
    setup_vcpu(&kvm, &machine, cfg.host_kind, entry)?;

    let setup = started.elapsed();
    let first_run = Instant::now();
    machine.bus.console_mut().reset_clock(first_run);
    let mut to_agent = None;
    let mut profile = HashMap::new();
    let _sampler = cfg
        .profile_interval
        .map(|i| Sampler::start(machine.kicker.clone(), i));
    loop {
        let remaining = cfg.timeout.saturating_sub(first_run.elapsed());
        let stop = machine.run_for(remaining)?;
        match stop {
            VcpuStop::Kicked if cfg.profile_interval.is_some() && !remaining.is_zero() => {
                machine.kicker.reset();
                let rip = vcpu_op("KVM_GET_REGS", machine.vcpu.get_regs())?.rip;
                *profile.entry(rip).or_insert(0) += 1;
            }
            VcpuStop::Doorbell(code::AGENT_STARTED) => to_agent = Some(first_run.elapsed()),
            VcpuStop::Doorbell(code::READY) => {
                let to_ready = first_run.elapsed();
                // The image the guest kernel unpacked long before READY: retained, never
                // read again (config.rs, `retain_initrd`), so zeros in the template's memory
                // file, which holds only pages that are not zero.
                machine.ram.zero(initrd.addr, initrd.len)?;
                let regs = vcpu_op("KVM_GET_REGS", machine.vcpu.get_regs())?;
                let sregs = vcpu_op("KVM_GET_SREGS", machine.vcpu.get_sregs())?;
                let mailbox =
                    Mailbox::locate(&machine.ram, sregs.cr3, sregs.cr4, regs.rdi, regs.rsi)
                        .map_err(|source| BootError::Mailbox {
                            source,
                            console: console_tail(&machine),
                        })?;
                return Ok(ReadyGuest {
                    machine,
                    mailbox,
                    timings: BootTimings {
                        setup,
                        to_agent,
                        to_ready,
                    },
                    cmdline,
                    host_kind: cfg.host_kind,
                    profile,
                });
            }
            VcpuStop::Doorbell(code::FAILED) => {
                let regs = vcpu_op("KVM_GET_REGS", machine.vcpu.get_regs())?;
                return Err(BootError::AgentFailed {
                    what: failure_name(regs.rdi),
                    detail: regs.rsi,
                    console: console_tail(&machine),
                });
            }
            VcpuStop::Doorbell(code) => {
                return Err(BootError::UnexpectedDoorbell {
                    code,
                    console: console_tail(&machine),
                });
            }
            VcpuStop::Kicked => {
                return Err(BootError::Timeout {
                    after: cfg.timeout,
                    console: console_tail(&machine),
                });
            }
            stop => {
                return Err(BootError::Stopped {
                    stop,
                    console: console_tail(&machine),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_tail_prints_each_line_indented() {
        let tail = ConsoleTail(vec!["a".into(), "b".into()]);

        assert_eq!(tail.to_string(), "  | a\n  | b");
        assert_eq!(
            ConsoleTail::default().to_string(),
            "  (the guest printed nothing)"
        );
    }
}
