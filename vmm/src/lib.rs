//! bud's virtual machine monitor: a library that boots a small Linux guest on KVM, runs it to
//! the guest agent's READY doorbell, and (next) snapshots and clones it.
//!
//! One module per concern: [`layout`] (every fixed address, port and IRQ), [`memory`] (the only
//! code that maps guest RAM), [`host`] (hardware virtualization or kvm_pvm), [`cpuid`],
//! [`boot`] (boot protocol, MP table, entry state), [`devices`] (serial console, i8042,
//! doorbell), [`vcpu`] (the run loop), [`vm`] (VM setup), [`paging`] and [`mailbox`] (reaching
//! guest memory the worker announced), [`protocol`] (shared with the guest).
//!
//! This crate never starts an async runtime and never logs from the vCPU loop; the binaries
//! on top of it do that.

#[cfg(not(target_arch = "x86_64"))]
compile_error!("bud supports x86_64 hosts and guests only");

pub mod boot;
pub mod cpuid;
pub mod devices;
pub mod executor;
pub mod host;
pub mod job;
pub mod layout;
pub mod mailbox;
pub mod memory;
pub mod paging;
pub mod protocol;
pub mod snapshot;
pub mod template;
pub mod timer;
pub mod vcpu;
pub mod vm;

pub use boot::{BootConfig, BootError, ReadyGuest, boot};
pub use executor::{ExecError, Executor};
pub use host::HostKind;
pub use job::{Job, JobResult, Language, Status};
pub use template::{Template, TemplateSpec};
