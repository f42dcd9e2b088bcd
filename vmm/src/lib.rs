//! bud's virtual machine monitor: a library that boots a small Linux guest on KVM to the guest
//! agent's READY doorbell, freezes it as a template, and runs every job in a copy-on-write
//! clone of that template.
//!
//! One module per concern:
//! - [`layout`]: every fixed guest address, port and IRQ; [`protocol`]: the host <-> guest
//!   doorbell codes and mailbox layout, shared verbatim with the guest.
//! - [`memory`]: the only code that maps guest RAM; [`paging`] and [`mailbox`]: reaching the
//!   memory the guest worker announced.
//! - [`host`]: hardware virtualization or kvm_pvm; [`cpuid`]: what the guest vCPU sees.
//! - [`mod@boot`]: boot protocol, MP table, entry state, boot to READY; [`devices`]: serial
//!   console, i8042, doorbell; [`vcpu`]: the run loop and kicks; [`vm`]: VM setup.
//! - [`manifest`]: what a template's image can run (runtimes, tools, kernels, packages,
//!   network), written by the image builder, shared verbatim with it.
//! - [`snapshot`]: capture and restore of CPU and device state; [`template`]: templates on
//!   disk and clones of them; [`session`]: VMs kept between requests, forked, and saved to
//!   and loaded from [`session_file`]s; [`reset`]: returning a VM that ran a job to its template's
//!   exact state; [`job`]: one job in one VM; [`timer`]: job deadlines; [`executor`]: warm
//!   VMs, clone pool, reaper, and running jobs from many threads.
//! - [`kernel_layout`]: where the guest kernel keeps its clock, CRNG and page tables (read
//!   from `vmlinux`); [`identity`]: each job's wall clock and CRNG, written by the host;
//!   [`kvm_stats`]: KVM's own per-vCPU counters (exits, emulated instructions, faults).
//!
//! This crate never starts an async runtime and never logs from the vCPU loop; the binaries
//! on top of it do that.

// Only what other crates use is `pub`; the docs of those items still point at the crate-private
// code behind them, for readers of `cargo doc --document-private-items`.
#![allow(rustdoc::private_intra_doc_links)]

#[cfg(not(target_arch = "x86_64"))]
compile_error!("bud supports x86_64 hosts and guests only");

pub mod beside;
pub mod boot;
pub mod cpuid;
pub mod devices;
pub mod executor;
pub mod files;
pub(crate) mod host;
pub(crate) mod host_identity;
pub mod host_memory;
pub mod identity;
pub mod job;
pub mod kernel_layout;
pub mod kvm_stats;
pub(crate) mod layer;
pub mod layout;
pub mod mailbox;
pub mod manifest;
pub mod memory;
pub(crate) mod memory_cap;
pub mod net;
pub(crate) mod paging;
pub mod process;
pub mod protocol;
pub mod requests;
pub(crate) mod reset;
pub mod session;
pub mod session_file;
pub mod snapshot;
pub mod template;
pub(crate) mod timer;
pub mod vcpu;
pub mod vm;

pub use boot::{BootConfig, BootError, ReadyGuest, boot};
pub use executor::{ExecError, Executor, ExecutorOptions, Reuse};
pub use host::HostKind;
pub use host_memory::PhysicalMonitor;
pub use job::{Cancel, CellError, CellOptions, Health, Job, JobResult, Language, Status, Unusable};
pub use manifest::{Manifest, ManifestError};
pub use net::{
    ConnectRequest, Egress, Headers, Interception, JobEgress, Limit, NoEgress, Refusal, Traffic,
    Verdict,
};
pub use template::{Template, TemplateSpec};
