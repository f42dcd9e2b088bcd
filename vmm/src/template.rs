//! Templates: a guest booted once to READY and frozen on disk, and the clones made from it.
//!
//! A template lives in its own directory, named by a hash of everything that shapes it
//! (kernel and initramfs bytes, command line, RAM size, host kind, snapshot format and
//! protocol versions), so a changed input makes a new template instead of reusing a stale
//! one. It holds three files:
//! - `state`: the [`SnapshotState`] (magic, format version, bincode);
//! - `memory`: guest RAM, sparse, read-only. It is written once, fsynced and renamed into
//!   place; afterwards nothing writes it: clones map it `MAP_PRIVATE`, so their writes land in
//!   private copy-on-write pages of the clone;
//! - `manifest.json`: what the image can run ([`Manifest`]), copied from beside the
//!   initramfs, where the image builder writes it. [`Template::load_or_build`] reads the one
//!   beside the initramfs (a function of the image's contents, so not part of the key);
//!   [`Template::load`] of a bare directory reads the copy.
//!
//! A new `bud` process finds the directory and loads the template without booting.

use std::fs::{self, File};
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvm_bindings::KVM_MAX_CPUID_ENTRIES;
use kvm_ioctls::Kvm;
use sha2::{Digest, Sha256};

use crate::boot::{self, BootConfig, BootError, BootTimings};
use crate::devices::console::{ConsoleLog, EchoFn};
use crate::host::HostKind;
use crate::host_identity::host_identity;
use crate::kernel_layout::KernelLayout;
use crate::manifest::{MANIFEST_FILE, Manifest, ManifestError};
use crate::memory::{GuestRam, MemoryError};
use crate::protocol::{PROTOCOL_VERSION, header};
use crate::snapshot::{self, SNAPSHOT_FORMAT_VERSION, SnapshotError, SnapshotState};
use crate::vm::{Machine, NetStart, SerialStart, VmError};

mod derive;
pub use derive::Layer;

/// How [`Template::load_or`] makes a template that is not saved yet: in its directory, from
/// the image's manifest.
type Make<'a> = Box<dyn FnOnce(&Path, Manifest) -> Result<Template, TemplateError> + 'a>;

const STATE_FILE: &str = "state";
const MEMORY_FILE: &str = "memory";
/// A template's pins: one file per holder (a server's state directory) that still needs
/// the template (sessions paused on it); pruning never removes a pinned template.
pub const PINS_DIR: &str = "pins";
/// Templates of one name kept under a root: building a new one removes all but this many
/// of that name's most recent (each holds up to a guest's RAM of sparse data). Processes that still map a removed
/// template keep working: the file lives until its last mapping goes.
pub(crate) const TEMPLATES_KEPT: usize = 3;

/// Errors of building, loading or cloning a template.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("no saved template at {0} (its first boot has not run, or its files were removed)")]
    NotSaved(PathBuf),
    #[error("cannot read {path}")]
    ReadInput {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write template file {path}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read template file {path}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("booting the template guest: {0}")]
    Boot(#[from] BootError),
    #[error("template state: {0}")]
    Snapshot(#[from] SnapshotError),
    #[error("KVM_GET_CPUID2 for the template failed: {0}")]
    GetCpuid(kvm_ioctls::Error),
    #[error("template was made on a {made} host, this host is {this}")]
    WrongHost { made: HostKind, this: HostKind },
    #[error(
        "template was made under another CPU or KVM (identity {made}, this host's {this}): it is never restored here"
    )]
    WrongIdentity { made: String, this: String },
    #[error("host identity: {0}")]
    Identity(#[from] crate::host_identity::IdentityError),
    #[error("clone memory: {0}")]
    Memory(#[from] MemoryError),
    #[error("clone VM: {0}")]
    Vm(#[from] VmError),
    #[error("guest kernel layout: {0}")]
    Kernel(#[from] crate::kernel_layout::LayoutError),
    #[error("reading the READY wall clock from the mailbox: {0}")]
    Mailbox(#[from] crate::mailbox::MailboxError),
    #[error("listing the template's page tables: {0}")]
    Paging(#[from] crate::paging::PagingError),
    #[error("template manifest (`bud guest build` writes it)")]
    Manifest(#[from] ManifestError),
    #[error("a layer cannot go on this parent: {0}")]
    LayerMismatch(String),
    #[error("running the layer in a clone of the parent: {0}")]
    LayerRequest(#[from] crate::job::JobError),
    #[error("the layer failed in the guest:\n{stderr}\nconsole:\n{console}")]
    LayerFailed {
        stderr: String,
        console: crate::boot::ConsoleTail,
    },
    #[error("the layer did not reach READY within {after:?}; console:\n{console}")]
    LayerTimeout {
        after: Duration,
        console: crate::boot::ConsoleTail,
    },
    #[error("the layer's clone stopped ({stop}); console:\n{console}")]
    LayerStopped {
        stop: String,
        console: crate::boot::ConsoleTail,
    },
}

/// Where a template is made or found.
#[derive(Debug, Clone)]
pub struct TemplateSpec {
    pub boot: BootConfig,
    /// Directory holding all templates (each in a subdirectory named by its key).
    pub root: PathBuf,
}

/// How a template was obtained.
#[derive(Debug, Clone, Copy)]
pub enum Origin {
    /// Booted now; the boot's timings, the capture time and the memory write time.
    Built {
        boot: BootTimings,
        capture: Duration,
        write: Duration,
    },
    /// Made now from its parent template's snapshot with a layer ([`derive`]): the layer's
    /// run in a clone of the parent, the capture and the memory write.
    Derived {
        layer: Duration,
        capture: Duration,
        write: Duration,
    },
    /// Loaded from disk.
    Loaded { load: Duration },
}

/// A frozen READY guest on disk, ready to be cloned.
#[derive(Debug)]
pub struct Template {
    dir: PathBuf,
    state: SnapshotState,
    memory: File,
    /// The memory file mapped read-only: what a reset restores pages from.
    pristine: GuestRam,
    /// Every page-table page of the template, as a bitmap (None: the kernel does not say
    /// where they are). A reset under shadow paging drops KVM's mappings only when a job
    /// changed one of these pages (see [`crate::reset`]).
    page_tables: Option<Vec<u64>>,
    origin: Origin,
    /// What the image can run.
    manifest: Manifest,
}

/// What a template built from an image of `manifest` offers: the image's manifest, and a
/// network card if the template was booted with one (the image builder cannot know).
fn offered(mut manifest: Manifest, state: &SnapshotState) -> Manifest {
    if state.machine.net.is_some() {
        manifest.network = crate::manifest::Network::Card;
    }
    manifest
}

/// Where the image builder leaves the manifest of `initramfs`: beside it.
pub fn manifest_path(initramfs: &Path) -> PathBuf {
    initramfs.with_file_name(MANIFEST_FILE)
}

fn hash_file(h: &mut Sha256, path: &Path) -> Result<(), TemplateError> {
    let read_err = |source| TemplateError::ReadInput {
        path: path.to_path_buf(),
        source,
    };
    let mut f = File::open(path).map_err(read_err)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(read_err)?;
        if n == 0 {
            return Ok(());
        }
        h.update(&buf[..n]);
    }
}

/// What the VMM itself makes of a template's boot beyond its inputs, part of the key: bump it
/// when that changes what a template holds, so templates made before are made again.
/// 1: the retained initramfs zeroed at READY (`boot()`).
/// 2: the network card's MTU 65 500 (was 65 520), in the card's config a template holds.
const TEMPLATE_BOOT_VERSION: u32 = 2;

/// The key naming a template: a hash of its inputs, this host's CPU and KVM identity among
/// them ([`crate::host_identity`]): another host gets its own template, never this one.
pub(crate) fn template_key(cfg: &BootConfig) -> Result<String, TemplateError> {
    let mut h = Sha256::new();
    h.update(b"bud-template\0");
    h.update(env!("CARGO_PKG_VERSION").as_bytes());
    h.update(SNAPSHOT_FORMAT_VERSION.to_le_bytes());
    h.update(PROTOCOL_VERSION.to_le_bytes());
    h.update(TEMPLATE_BOOT_VERSION.to_le_bytes());
    h.update(cfg.host_kind.name().as_bytes());
    let kvm = crate::vm::open_kvm()?;
    h.update(host_identity(&kvm, cfg.host_kind)?.as_bytes());
    h.update(cfg.ram_size.to_le_bytes());
    h.update(cfg.cmdline().as_bytes());
    h.update([0]);
    hash_file(&mut h, &cfg.kernel)?;
    hash_file(&mut h, &cfg.initramfs)?;
    let digest = h.finalize();
    Ok(digest.iter().take(12).map(|b| format!("{b:02x}")).collect())
}

/// Opens a template's memory file (read-only; clones map it copy-on-write).
fn open_memory(dir: &Path) -> Result<File, TemplateError> {
    let path = dir.join(MEMORY_FILE);
    File::open(&path).map_err(|source| TemplateError::Read { path, source })
}

/// Opens `path` and holds an exclusive `flock` on it until the file is dropped.
fn lock_file(path: &Path) -> Result<File, TemplateError> {
    let err = |source| TemplateError::Write {
        path: path.to_path_buf(),
        source,
    };
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).map_err(err)?;
    }
    let file = File::create(path).map_err(err)?;
    loop {
        // SAFETY: flock on a descriptor we own; it touches no memory.
        let rc = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&file), libc::LOCK_EX) };
        if rc == 0 {
            return Ok(file);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(err(e));
        }
    }
}

fn write_file(
    path: &Path,
    f: impl FnOnce(&File) -> std::io::Result<()>,
) -> Result<(), TemplateError> {
    let err = |source| TemplateError::Write {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("tmp");
    let file = File::create(&tmp).map_err(err)?;
    f(&file).map_err(err)?;
    file.sync_all().map_err(err)?;
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o444)).map_err(err)?;
    fs::rename(&tmp, path).map_err(err)
}

impl Template {
    /// Loads the template for `spec` if it exists on disk, or boots and saves it.
    ///
    /// Processes that ask for the same template at once (a server and a `bud run`, two test
    /// binaries) take turns on a lock file beside it: one boots, the others then load.
    pub fn load_or_build(spec: &TemplateSpec, echo: Option<EchoFn>) -> Result<Self, TemplateError> {
        Self::load_or(
            spec,
            Some(Box::new(|dir, manifest| {
                Self::build(&spec.boot, dir, manifest, echo)
            })),
        )
    }

    /// The template of `spec` as saved by an earlier first boot; never boots (an error
    /// when there is none). For a caller that may not boot: a jailed server loading a
    /// template its builder process booted.
    pub fn load_saved(spec: &TemplateSpec) -> Result<Self, TemplateError> {
        Self::load_or(spec, None)
    }

    /// [`Self::load_or_build`]'s work: the saved template of `spec`, or the one `make`
    /// makes in its directory (`None` forbids making one).
    fn load_or(spec: &TemplateSpec, make: Option<Make<'_>>) -> Result<Self, TemplateError> {
        let manifest = Manifest::load(&manifest_path(&spec.boot.initramfs))?;
        let key = template_key(&spec.boot)?;
        let dir = spec.root.join(&key);
        // A template made under another CPU/KVM identity (which the key should have kept
        // apart) is rebuilt here, never restored.
        let found = |dir: &Path| match dir.join(STATE_FILE).exists() {
            true => match Self::load(dir) {
                Err(TemplateError::WrongIdentity { .. }) => None,
                loaded => Some(loaded.map(|mut t| {
                    // The copy of a template made before manifests (or before the
                    // builder's derivation changed) brought up to date. Best effort: the
                    // template in hand has it, and only `load` of the bare directory
                    // (a paused session's template, gone from the build) reads the copy.
                    let _ = manifest.write(&dir.join(MANIFEST_FILE));
                    t.manifest = offered(manifest.clone(), &t.state);
                    t
                })),
            },
            false => None,
        };
        if let Some(loaded) = found(&dir) {
            return loaded;
        }
        let Some(make) = make else {
            return Err(TemplateError::NotSaved(dir));
        };
        let _lock = lock_file(&spec.root.join(format!("{key}.lock")))?;
        if let Some(loaded) = found(&dir) {
            return loaded;
        }
        make(&dir, manifest)
    }

    /// Boots the guest to READY, captures it and writes the template into `dir`.
    pub(crate) fn build(
        cfg: &BootConfig,
        dir: &Path,
        manifest: Manifest,
        echo: Option<EchoFn>,
    ) -> Result<Self, TemplateError> {
        // A kernel without bud's layouts cannot give clones their identity: fail before booting.
        let kernel = KernelLayout::from_vmlinux(&cfg.kernel)?;
        let kvm = crate::vm::open_kvm()?;
        let mut ready = boot::boot(cfg, echo)?;
        let frozen = freeze(
            &kvm,
            &mut ready.machine,
            &ready.mailbox,
            cfg,
            kernel,
            dir,
            &manifest,
        )?;
        let boot_timings = ready.timings;
        drop(ready);
        Self::open(
            dir,
            frozen.state,
            manifest,
            Origin::Built {
                boot: boot_timings,
                capture: frozen.capture,
                write: frozen.write,
            },
        )
    }

    /// Loads a template directory written by [`Template::build`], with the manifest copied
    /// into it (an empty one for a template made before manifests were).
    pub fn load(dir: &Path) -> Result<Self, TemplateError> {
        let started = Instant::now();
        let state_path = dir.join(STATE_FILE);
        let bytes = fs::read(&state_path).map_err(|source| TemplateError::Read {
            path: state_path,
            source,
        })?;
        let state = SnapshotState::from_bytes(&bytes)?;
        let this = HostKind::detect();
        if state.host_kind != this {
            return Err(TemplateError::WrongHost {
                made: state.host_kind,
                this,
            });
        }
        let here = host_identity(&crate::vm::open_kvm()?, this)?;
        if state.host_identity != here {
            return Err(TemplateError::WrongIdentity {
                made: state.host_identity,
                this: here,
            });
        }
        let copy = dir.join(MANIFEST_FILE);
        let manifest = match copy.exists() {
            true => Manifest::load(&copy)?,
            false => Manifest::default(),
        };
        let mut template = Self::open(
            dir,
            state,
            manifest,
            Origin::Loaded {
                load: Duration::ZERO,
            },
        )?;
        template.origin = Origin::Loaded {
            load: started.elapsed(),
        };
        Ok(template)
    }

    /// The template in `dir` around its decoded state: its memory file opened and mapped
    /// read-only, and its page tables listed.
    fn open(
        dir: &Path,
        state: SnapshotState,
        manifest: Manifest,
        origin: Origin,
    ) -> Result<Self, TemplateError> {
        let memory = open_memory(dir)?;
        let manifest = offered(manifest, &state);
        // Made now, while the process may still make folders (a jailed server may not):
        // pins are files in it.
        let _ = fs::create_dir_all(dir.join(PINS_DIR));
        let pristine = GuestRam::pristine(&memory, state.ram_size)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            page_tables: page_tables(&pristine, &state)?,
            pristine,
            state,
            memory,
            origin,
            manifest,
        })
    }

    /// What the template's image can run.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The template's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The template's key (its directory's name), which session files name.
    pub fn key(&self) -> String {
        self.dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// Pins the template for `holder` (a name of the caller's, a plain file name): while
    /// any pin is there, building another template never prunes this one.
    pub fn pin(&self, holder: &str) -> std::io::Result<()> {
        fs::write(self.dir.join(PINS_DIR).join(holder), b"")
    }

    /// Removes `holder`'s pin of the template in `dir`, if there was one.
    pub fn unpin(dir: &Path, holder: &str) {
        let _ = fs::remove_file(dir.join(PINS_DIR).join(holder));
    }

    /// The frozen state.
    pub fn state(&self) -> &SnapshotState {
        &self.state
    }

    /// The template's memory, mapped read-only.
    pub(crate) fn pristine(&self) -> &GuestRam {
        &self.pristine
    }

    /// Every page-table page of the template, as a bitmap over guest pages (None when the
    /// guest kernel does not publish where they are).
    pub(crate) fn page_tables(&self) -> Option<&[u64]> {
        self.page_tables.as_deref()
    }

    /// How this template was obtained.
    pub fn origin(&self) -> Origin {
        self.origin
    }

    /// Bytes the template's (sparse) memory file holds on disk: the guest memory that is not
    /// zero, what a clone can share.
    pub fn memory_file_bytes(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        self.memory.metadata().map_or(0, |m| m.blocks() * 512)
    }

    /// A new copy-on-write mapping of the template's memory (what a clone runs on).
    pub(crate) fn private_ram(&self) -> Result<GuestRam, TemplateError> {
        Ok(GuestRam::private_fd(&self.memory, self.state.ram_size)?)
    }

    /// Creates a clone: a new VM over a copy-on-write mapping of the memory file, with the
    /// template's state restored (order in [`snapshot::restore`]). The clone has not run yet.
    pub fn clone_machine(&self, kvm: &Kvm) -> Result<Machine, TemplateError> {
        let ram = self.private_ram()?;
        let machine = Machine::create(
            kvm,
            ram,
            ConsoleLog::default(),
            SerialStart::Restore(&self.state.machine.serial),
            NetStart::from_state(self.state.machine.net.as_ref()),
        )?;
        snapshot::restore(
            &machine.vm,
            &machine.vcpu,
            &self.state.machine,
            snapshot::Target::NewVm,
        )?;
        Ok(machine)
    }
}

/// A template written by [`freeze`]: its state and where the time went.
struct Frozen {
    state: SnapshotState,
    capture: Duration,
    write: Duration,
}

/// Captures `machine` (booted as `cfg` says, or a clone of a template booted so), stopped at
/// its worker's READY doorbell with its mailbox at `mailbox`, and writes it into `dir` as a
/// template (older templates of the same name
/// pruned first): the memory file, the manifest, then the state file, whose presence marks
/// a complete template. The one way a template is written, after a first boot
/// ([`Template::build`]) or a layer ([`derive`]).
fn freeze(
    kvm: &Kvm,
    machine: &mut Machine,
    mailbox: &crate::mailbox::Mailbox,
    cfg: &BootConfig,
    kernel: KernelLayout,
    dir: &Path,
    manifest: &Manifest,
) -> Result<Frozen, TemplateError> {
    let (host_kind, ram_size) = (cfg.host_kind, cfg.ram_size);
    // Capture at once: a clone's wall clock at resume is the guest's READY reading plus
    // however long the host took from that exit to reading the clock (see
    // `SnapshotState::ready_wall_ns`), so nothing slow may come before the capture.
    let captured = Instant::now();
    let cpuid = machine
        .vcpu
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .map_err(TemplateError::GetCpuid)?;
    let captured_machine = snapshot::capture(
        kvm,
        &machine.vm,
        &mut machine.vcpu,
        host_kind,
        cpuid.as_slice().to_vec(),
        &machine.bus,
        snapshot::MsrList::Probe,
    )?;
    let ready_wall_ns = mailbox.read_u64(&machine.ram, header::READY_WALL_NS as u64)?;
    let state = SnapshotState {
        host_kind,
        host_identity: host_identity(kvm, host_kind)?,
        ram_size,
        machine: captured_machine,
        mailbox: mailbox.clone(),
        kernel,
        ready_wall_ns,
    };
    let capture = captured.elapsed();
    if let Some(root) = dir.parent() {
        prune(root, dir, &manifest.name, TEMPLATES_KEPT - 1);
    }

    let written = Instant::now();
    fs::create_dir_all(dir).map_err(|source| TemplateError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let ram = &machine.ram;
    write_file(&dir.join(MEMORY_FILE), |f| ram.write_sparse(f).map(|_| ()))?;
    manifest.write(&dir.join(MANIFEST_FILE))?;
    let bytes = state.to_bytes()?;
    write_file(&dir.join(STATE_FILE), |mut f| {
        std::io::Write::write_all(&mut f, &bytes)
    })?;
    Ok(Frozen {
        state,
        capture,
        write: written.elapsed(),
    })
}

/// The template's page-table pages: those reachable from the kernel's PGD, every mm's PGD
/// and the worker's CR3, read from the template's own (trusted) memory.
fn page_tables(ram: &GuestRam, s: &SnapshotState) -> Result<Option<Vec<u64>>, TemplateError> {
    let Some(mm) = &s.kernel.mm else {
        return Ok(None);
    };
    let sregs = &s.machine.sregs;
    Ok(Some(crate::paging::all_table_pages(
        ram,
        mm,
        sregs.cr4,
        &[sregs.cr3],
    )?))
}

/// Whether the template in `dir` has a pin ([`Template::pin`]).
fn pinned(dir: &Path) -> bool {
    fs::read_dir(dir.join(PINS_DIR)).is_ok_and(|mut d| d.next().is_some())
}

/// The name in the manifest copy of the template in `dir` ("" without one).
fn name_of(dir: &Path) -> String {
    Manifest::load(&dir.join(MANIFEST_FILE)).map_or_else(|_| String::new(), |m| m.name)
}

/// Removes all but the `keep` most recent unpinned directories of template `name` under
/// `root` (never `current`, never a pinned one, never another template's: every template
/// of a build directory shares the root, and a server or a restart loads them from it).
/// Best effort: a directory that cannot be removed is left for the next time.
fn prune(root: &Path, current: &Path, name: &str, keep: usize) {
    let Ok(entries) = fs::read_dir(root) else {
        return;
    };
    let mut dirs: Vec<(std::time::SystemTime, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.as_path() != current && p.join(STATE_FILE).exists())
        .filter(|p| !pinned(p) && name_of(p) == name)
        .filter_map(|p| Some((fs::metadata(p.join(STATE_FILE)).ok()?.modified().ok()?, p)))
        .collect();
    dirs.sort_by_key(|d| std::cmp::Reverse(d.0));
    for (_, old) in dirs.into_iter().skip(keep) {
        let _ = fs::remove_dir_all(&old);
        let _ = fs::remove_file(old.with_extension("lock"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pruning_keeps_the_newest_the_current_every_pinned_and_other_names_templates() {
        let root = std::env::temp_dir().join(format!("bud-prune-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let named = |n: &str| Manifest {
            format: crate::manifest::MANIFEST_FORMAT,
            name: n.to_owned(),
            ..Manifest::default()
        };
        for name in ["a", "b", "c", "d", "other"] {
            let d = root.join(name);
            fs::create_dir_all(d.join(PINS_DIR)).unwrap();
            fs::write(d.join(STATE_FILE), name).unwrap();
            let of = if name == "other" { "node" } else { "python" };
            named(of).write(&d.join(MANIFEST_FILE)).unwrap();
            // Distinct modification times, oldest first.
            std::thread::sleep(Duration::from_millis(20));
        }
        fs::write(root.join("a").join(PINS_DIR).join("state-1"), b"").unwrap();

        prune(&root, &root.join("d"), "python", 1);
        let mut left: Vec<String> = fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();

        assert_eq!(left, ["a", "c", "d", "other"]);
        fs::remove_file(root.join("a").join(PINS_DIR).join("state-1")).unwrap();
        prune(&root, &root.join("d"), "python", 1);
        assert!(!root.join("a").exists(), "an unpinned old template stayed");
        assert!(
            root.join("other").exists(),
            "another template's newest was pruned"
        );
        fs::remove_dir_all(&root).unwrap();
    }
}
