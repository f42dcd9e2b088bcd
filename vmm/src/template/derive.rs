//! A template made from its parent's snapshot instead of a first boot: a user template that
//! only adds files (packages, wheels, the user's files) and warm-up code to a template that
//! is already saved.
//!
//! A first boot costs a minute or more on kvm_pvm (the guest kernel unpacks the whole image
//! and the worker warms up, all of it emulated guest-kernel work), and would redo exactly
//! what the parent's first boot did. Here a clone of the parent gets the layer instead: the
//! files the child's image adds, as one `newc` archive written by file requests, then one
//! [`crate::protocol::language::LAYER`] request. The worker unpacks the archive, applies
//! the child's part of the worker manifest (environment, home files, working directory)
//! and runs the child's own warm-up code, then rings READY as at the end of a first boot.
//! The clone is frozen there, as a booted guest is ([`super::freeze`]), into the directory
//! of the child's key: every later load and clone cannot tell how it was made.
//!
//! What may go in a layer is decided by the image builder (`bud_guest::layer`): only
//! files the parent's image does not have, so nothing the parent's running processes
//! loaded changes under them. What must match is checked here: the same guest kernel, RAM
//! size, network card and host kind as the parent's snapshot.

use std::path::Path;
use std::time::{Duration, Instant};

use super::{Make, Origin, Template, TemplateError, TemplateSpec, freeze};
use crate::boot::{BootConfig, console_tail};
use crate::devices::console::EchoFn;
use crate::job::{
    Collected, Job, Kind, Request, Status, give_identity, run_request, write_request,
};
use crate::kernel_layout::KernelLayout;
use crate::mailbox::Mailbox;
use crate::manifest::Manifest;
use crate::protocol::{code, file_op};
use crate::session::FILE_CHUNK;
use crate::vcpu::VcpuStop;
use crate::vm::Machine;

/// Where the archive waits in the clone until the worker has unpacked (and removed) it:
/// as file requests name it (relative to the work directory, `/tmp`), and as the layer
/// request names it.
const ARCHIVE_FILE: &str = ".bud-layer.cpio";
const ARCHIVE_PATH: &str = "/tmp/.bud-layer.cpio";
/// The layer's own output kept for its error (its warm-up's prints; the traceback).
const OUTPUT_KEPT: usize = 64 << 10;

/// What a layer adds to its parent (module docs).
#[derive(Debug, Clone, Copy)]
pub struct Layer<'a> {
    /// A `newc` cpio of the files the child's image has and the parent's does not.
    pub archive: &'a [u8],
    /// The first of the child manifest's `user_warm` files to run (those before it are the
    /// parent's, which ran in its own first boot or layer).
    pub warm_from: usize,
    /// How long the clone may take from its first request to READY.
    pub timeout: Duration,
}

impl Template {
    /// The saved template of `spec`, or one made now from `parent` with `layer` (module
    /// docs) and saved under `spec`'s key: the key of the child's own image, so a server
    /// loads it as it would a booted one. `echo` sees the clone's console.
    pub fn load_or_derive(
        spec: &TemplateSpec,
        parent: &Template,
        layer: &Layer<'_>,
        echo: Option<EchoFn>,
    ) -> Result<Self, TemplateError> {
        let make: Make<'_> =
            Box::new(|dir, manifest| derive(parent, &spec.boot, dir, manifest, layer, echo));
        Self::load_or(spec, Some(make))
    }
}

/// Why `parent` cannot take a layer for a child booted as `cfg`, if it cannot.
fn mismatch(parent: &Template, cfg: &BootConfig, kernel: &KernelLayout) -> Option<String> {
    let s = &parent.state;
    if s.ram_size != cfg.ram_size {
        return Some(format!(
            "the child has {} MiB of guest RAM, the parent {} MiB",
            cfg.ram_size >> 20,
            s.ram_size >> 20
        ));
    }
    if s.machine.net.is_some() != cfg.network {
        return Some("one of the two has a network card, the other not".to_owned());
    }
    if s.host_kind != cfg.host_kind {
        return Some(format!(
            "the parent was made on a {} host, the child is for {}",
            s.host_kind.name(),
            cfg.host_kind.name()
        ));
    }
    if &s.kernel != kernel {
        return Some("the child's guest kernel is not the parent's".to_owned());
    }
    None
}

fn derive(
    parent: &Template,
    cfg: &BootConfig,
    dir: &Path,
    manifest: Manifest,
    layer: &Layer<'_>,
    echo: Option<EchoFn>,
) -> Result<Template, TemplateError> {
    let kernel = KernelLayout::from_vmlinux(&cfg.kernel)?;
    if let Some(why) = mismatch(parent, cfg, &kernel) {
        return Err(TemplateError::LayerMismatch(why));
    }
    let kvm = crate::vm::open_kvm()?;
    let started = Instant::now();
    let mut m = parent.clone_machine(&kvm)?;
    m.bus.console_mut().set_echo(echo);
    m.bus.console_mut().reset_clock(started);
    give_identity(&m, &parent.state)?;
    let sequence = send_archive(&mut m, parent, layer)?;
    run_layer(&mut m, parent, layer, sequence + 1)?;
    let layer_time = started.elapsed();
    // The worker's mailbox as READY names it (the parent's: the same process and memory).
    let vcpu_err = |e| crate::job::JobError::Run(crate::vcpu::VcpuError::Run(e));
    let regs = m.vcpu.get_regs().map_err(vcpu_err)?;
    let sregs = m.vcpu.get_sregs().map_err(vcpu_err)?;
    let mailbox = Mailbox::locate(&m.ram, sregs.cr3, sregs.cr4, regs.rdi, regs.rsi)?;
    let frozen = freeze(&kvm, &mut m, &mailbox, cfg, kernel, dir, &manifest)?;
    drop(m);
    Template::open(
        dir,
        frozen.state,
        manifest,
        Origin::Derived {
            layer: layer_time,
            capture: frozen.capture,
            write: frozen.write,
        },
    )
}

/// Writes the archive into the clone at [`ARCHIVE_FILE`] in file requests of at most
/// [`FILE_CHUNK`] bytes; returns the last request's sequence number.
fn send_archive(
    m: &mut Machine,
    parent: &Template,
    layer: &Layer<'_>,
) -> Result<u32, TemplateError> {
    let mut sequence = 0;
    let chunks = layer.archive.chunks(FILE_CHUNK);
    let empty = layer.archive.is_empty().then_some(&[][..]);
    for (i, chunk) in chunks.chain(empty).enumerate() {
        sequence += 1;
        let op = if i == 0 {
            file_op::WRITE
        } else {
            file_op::APPEND
        };
        let mut job = Job::python(ARCHIVE_FILE.as_bytes().to_vec());
        job.stdin = chunk.to_vec();
        job.timeout = layer.timeout;
        let request = Request {
            job: &job,
            kind: Kind::File(op),
            sequence,
            interrupt_grace: None,
            beside: None,
        };
        let (result, _) = run_request(m, &parent.state, &request, &mut |_, _| {})?;
        if result.status != Status::Ok {
            return Err(TemplateError::LayerFailed {
                stderr: format!(
                    "writing the layer's archive ({:?}): {}",
                    result.status,
                    String::from_utf8_lossy(&result.stderr)
                ),
                console: console_tail(m),
            });
        }
    }
    Ok(sequence)
}

/// Sends the LAYER request and runs the clone until the worker rings READY (the layer
/// applied) or DONE (it failed: its error on stderr).
fn run_layer(
    m: &mut Machine,
    parent: &Template,
    layer: &Layer<'_>,
    sequence: u32,
) -> Result<(), TemplateError> {
    let code = serde_json::json!({"archive": ARCHIVE_PATH, "warm_from": layer.warm_from});
    let mut job = Job::python(code.to_string());
    job.timeout = layer.timeout;
    let mb = &parent.state.mailbox;
    let request = Request {
        job: &job,
        kind: Kind::Layer,
        sequence,
        interrupt_grace: None,
        beside: None,
    };
    write_request(&m.ram, mb, &request)?;
    m.kicker.reset();
    let deadline = Instant::now() + layer.timeout;
    let mut out = Collected::new(OUTPUT_KEPT, None);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let stop = m.run_for(left).map_err(crate::job::JobError::from)?;
        match stop {
            VcpuStop::Doorbell(code::READY) => return Ok(()),
            VcpuStop::Doorbell(code::FLUSH) => out
                .drain(&m.ram, mb, true)
                .map_err(crate::job::JobError::from)?,
            VcpuStop::Doorbell(code::DONE) => {
                out.drain(&m.ram, mb, false)
                    .map_err(crate::job::JobError::from)?;
                let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
                text.push_str(&String::from_utf8_lossy(&out.stderr));
                return Err(TemplateError::LayerFailed {
                    stderr: text,
                    console: console_tail(m),
                });
            }
            VcpuStop::Kicked if Instant::now() < deadline => m.kicker.reset(),
            VcpuStop::Kicked => {
                return Err(TemplateError::LayerTimeout {
                    after: layer.timeout,
                    console: console_tail(m),
                });
            }
            stop => {
                return Err(TemplateError::LayerStopped {
                    stop: format!("{stop:?}"),
                    console: console_tail(m),
                });
            }
        }
    }
}
