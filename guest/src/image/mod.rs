//! The guest initramfs: assembled from unpacked Debian packages, bud's agent, extension and
//! Python modules, and the recipe in `guest/image/`, into an uncompressed `newc` cpio.
//!
//! This module owns the image layout (the `*_PATH` constants below are the contract with the
//! agent and the VMM) and the input hash that decides whether an image is still current. Same
//! inputs give the same bytes: entries are sorted, mtimes and owners fixed, pycs carry no
//! timestamps. It never downloads anything; `debs.rs` does that first.
//!
//! This file holds the layout and the build; `key` decides whether a recorded image is still
//! current (the input hash), and `report` says what a build put in the image.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::cpio::{CpioError, Entry, Tree};
use crate::debs::{self, DebError, Package};
use crate::hashes::{HashCache, HashError};
use crate::libs::{self, LibError};
use crate::python::{self, PythonError};
use crate::recipe::{self, Busybox, Recipe, RecipeError, Site};
use crate::run::{self, RunError};
use crate::site::{self, SiteError};
use crate::stage::{StageError, Staging, files_under};

mod extras;
mod key;
mod passwd;
mod report;
mod user_layer;

use key::current;
use report::{report, write_contents};

pub use key::input_key;
pub use report::ImageReport;

/// Bump when the builder's own logic changes what it produces: part of the input hash.
pub const BUILDER_VERSION: u32 = 4;

/// The agent, run by the kernel as PID 1.
pub const INIT_PATH: &str = "init";
/// bud's Python modules (and the extension), importable once on `sys.path`.
pub const BUD_PYTHON_DIR: &str = "usr/lib/bud";
/// The `_bud` CPython extension module.
pub const EXTENSION_PATH: &str = "usr/lib/bud/_bud.abi3.so";
/// busybox itself; its applets are symlinks to this path.
pub const BUSYBOX_PATH: &str = "bin/busybox";

/// The addon's name beside a kernel runtime's files.
pub const KERNEL_ADDON_NAME: &str = "bud.node";

/// A kernel runtime's files (source path, path in the image): bud's files of it under
/// `usr/lib/bud/<dir name>/`, and the addon as [`KERNEL_ADDON_NAME`] beside them.
pub fn kernel_files(
    inputs: &ImageInputs,
    runtime: &recipe::KernelRuntime,
) -> Result<Vec<(PathBuf, String)>, ImageError> {
    let dir = inputs.source_dir.join(&runtime.files);
    let name = Path::new(&runtime.files)
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    let mut files = Vec::new();
    for rel in files_under(&dir)? {
        files.push((dir.join(&rel), format!("{BUD_PYTHON_DIR}/{name}/{rel}")));
    }
    if !inputs.kernel_addon.is_file() {
        return Err(ImageError::MissingInput {
            what: "kernel addon",
            path: inputs.kernel_addon.clone(),
        });
    }
    files.push((
        inputs.kernel_addon.clone(),
        format!("{BUD_PYTHON_DIR}/{name}/{KERNEL_ADDON_NAME}"),
    ));
    Ok(files)
}

/// The staged files inside the image work directory (what the archive is made of; kept).
pub const ROOTFS_DIR: &str = "rootfs";
/// The archive inside the image work directory.
pub const IMAGE_FILE: &str = "initramfs.cpio";
/// Input hash, sha256 and size of the current archive.
const KEY_FILE: &str = "initramfs.key";
/// Every file of the image with its size, largest first.
pub const CONTENTS_FILE: &str = "contents.txt";

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("recipe")]
    Recipe(#[from] RecipeError),
    #[error("hash input")]
    HashInput(#[from] HashError),
    #[error("{what} not found at {path}")]
    MissingInput { what: &'static str, path: PathBuf },
    #[error("unpack packages")]
    Extract(#[source] DebError),
    #[error("stage files")]
    Stage(#[from] StageError),
    #[error("the archive for {dir}: {why}")]
    UserArchive { dir: String, why: String },
    #[error("list busybox applets")]
    BusyboxList(#[source] RunError),
    #[error("busybox has no `{0}` applet, which the recipe requires")]
    MissingApplet(String),
    #[error("strip debug sections of {path}")]
    Strip {
        path: PathBuf,
        #[source]
        source: RunError,
    },
    #[error("stage Python")]
    Python(#[from] PythonError),
    #[error("stage the template's packages")]
    Site(#[from] SiteError),
    #[error("stage the recipe's certificate bundles")]
    Extras(#[from] extras::ExtraError),
    #[error("stage the recipe's zipped packages")]
    Zipped(#[from] crate::zipped::ZippedError),
    #[error("resolve shared libraries")]
    Libs(#[from] LibError),
    #[error("unpack the template's wheels")]
    Wheels(#[source] crate::wheels::WheelError),
    #[error("stage the template's npm packages")]
    Npm(#[source] crate::npm::NpmError),
    #[error("write archive {path}")]
    Archive {
        path: PathBuf,
        #[source]
        source: CpioError,
    },
    #[error("create {path}")]
    Create {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("finish {path}")]
    Finish {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Everything the image is made of.
#[derive(Debug, Clone)]
pub struct ImageInputs {
    /// `guest/image`: recipe.toml and overlay/.
    pub recipe_dir: PathBuf,
    /// The agent binary (`target/guest/release/bud-agent`).
    pub agent: PathBuf,
    /// The extension (`target/guest/release/lib_bud.so`).
    pub extension: PathBuf,
    /// A kernel runtime's Node-API addon (`target/guest/release/libbud_nodeext.so`), staged
    /// as `bud.node` beside the kernel's files when the site has a runtime.
    pub kernel_addon: PathBuf,
    /// The source tree (a kernel runtime's `files` are relative to it).
    pub source_dir: PathBuf,
    /// `guest/python`: bud's Python modules.
    pub python_dir: PathBuf,
    /// Where the `.deb` files of `packages` are.
    pub debs_dir: PathBuf,
    pub packages: Vec<Package>,
    /// The template this image is for ([`recipe::BASE_TEMPLATE`] or a template recipe).
    pub template: String,
    /// The template recipe's additions (none for the base template).
    pub site: Option<Site>,
    /// Where the `.deb` files of `site_packages` are.
    pub site_debs_dir: PathBuf,
    /// The template's packages: those it lists, then the libraries they need.
    pub site_packages: Vec<Package>,
    /// A user template's layers and wheels (`crate::user`); `None` for a built-in one.
    pub user: Option<UserInputs>,
    /// The template's npm packages, installed in the cache (`crate::npm`): the site's
    /// `npm` list with the user layers'; `None` when it names none.
    pub npm: Option<crate::npm::NpmTree>,
    /// A certificate (PEM) added to each of the recipe's certificate bundles: bud's egress
    /// CA ([`crate::egress_ca`]), so the guest trusts the certificates bud answers its TLS
    /// with where a rule sets headers on HTTPS. `None`: the bundles as the packages make them.
    pub trusted: Option<String>,
}

/// What a user template adds ([`user_layer`]).
#[derive(Debug, Clone)]
pub struct UserInputs {
    pub layers: crate::user::Layers,
    pub wheels: Vec<crate::wheels::Wheel>,
}

/// A finished image.
#[derive(Debug, Clone)]
pub struct Image {
    pub path: PathBuf,
    pub sha256: String,
    pub size: u64,
    /// The input hash it was built from.
    pub input_key: String,
    /// Set when this call built it; `None` when the recorded image was still current.
    pub report: Option<ImageReport>,
}

/// Returns the image in `work_dir` if it is current for `inputs`, else builds it.
pub fn ensure(
    inputs: &ImageInputs,
    work_dir: &Path,
    hashes: &mut HashCache,
    progress: &mut dyn FnMut(&str),
) -> Result<Image, ImageError> {
    let key = input_key(inputs, hashes)?;
    if let Some(image) = current(work_dir, &key) {
        return Ok(image);
    }
    build(inputs, work_dir, &key, progress)
}

/// Builds the image into `work_dir/initramfs.cpio` (written to a temporary file and renamed)
/// and records `key` for it.
pub fn build(
    inputs: &ImageInputs,
    work_dir: &Path,
    key: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<Image, ImageError> {
    let recipe = Recipe::load(&inputs.recipe_dir)?;
    std::fs::create_dir_all(work_dir).map_err(|source| ImageError::Create {
        path: work_dir.to_owned(),
        source,
    })?;

    progress("unpacking packages");
    let unpacked = Staging::reset(&work_dir.join("unpacked"))?;
    let root = unpacked.root();
    debs::extract(&inputs.packages, &inputs.debs_dir, root, progress)
        .map_err(ImageError::Extract)?;
    debs::extract(&inputs.site_packages, &inputs.site_debs_dir, root, progress)
        .map_err(ImageError::Extract)?;

    progress("staging files");
    let staging = Staging::reset(&work_dir.join(ROOTFS_DIR))?;
    stage_busybox(&recipe.busybox, root, &staging, progress)?;
    staging.copy(&root.join(python::INTERPRETER), python::INTERPRETER)?;
    for (from, to) in [
        (&inputs.agent, INIT_PATH),
        (&inputs.extension, EXTENSION_PATH),
    ] {
        staging.copy(from, to)?;
        strip_debug(&staging.path(to), progress)?;
    }
    let bud_jobs = python::stage_bud_modules(&inputs.python_dir, BUD_PYTHON_DIR, &staging)?;
    if let Some(runtime) = inputs.site.as_ref().and_then(|s| s.runtime.as_ref()) {
        for (from, to) in kernel_files(inputs, runtime)? {
            staging.copy(&from, &to)?;
        }
    }
    let overlay = inputs.recipe_dir.join(recipe::OVERLAY_DIR);
    if overlay.exists() {
        for rel in files_under(&overlay)? {
            staging.copy(&overlay.join(&rel), &rel)?;
        }
    }
    for dir in recipe.rootfs.dirs.keys() {
        staging.mkdir(dir)?;
    }
    for (path, target) in &recipe.rootfs.links {
        staging.symlink(path, target)?;
    }
    extras::stage(&recipe.rootfs, root, inputs.trusted.as_deref(), &staging)?;

    progress("compiling and packing the standard library with the guest's python");
    let modules = python::stage_stdlib(&recipe.python, root, &staging, work_dir, progress)?;
    progress(&format!(
        "{modules} standard library modules, {} of bud",
        bud_jobs.len()
    ));
    python::compile(root, &bud_jobs, true, work_dir, "bud", progress)?;
    crate::zipped::stage(&recipe.python.zipped, root, &staging, work_dir, progress)?;
    if let Some(site) = &inputs.site {
        progress("compiling and staging the template's dist-packages");
        site::stage_site(site, root, &staging, work_dir, progress)?;
    }
    let mut home = Vec::new();
    if let Some(user) = &inputs.user {
        progress("staging the user template's packages, wheels and files");
        home = user_layer::stage(
            user,
            &inputs.site_packages,
            &inputs.site_debs_dir,
            root,
            &staging,
            work_dir,
            progress,
        )?
        .home;
    }
    if let Some(tree) = &inputs.npm {
        crate::npm::check_search_path(root).map_err(ImageError::Npm)?;
        let staged = crate::npm::stage(tree, &staging).map_err(ImageError::Npm)?;
        progress(&format!(
            "npm packages: {} files, {} links, {} programs in /{}",
            staged.files,
            staged.links,
            staged.programs,
            crate::npm::BIN_DIR
        ));
    }
    passwd::fix_login_shells(&staging)?;
    // The manifest lists the Python the template offers: the interpreter's package and the
    // packages the template recipe names (not the libraries found for them).
    let listed: Vec<Package> = inputs
        .packages
        .iter()
        .filter(|p| p.name.starts_with("python3"))
        .chain(inputs.site_packages.iter().filter(|p| {
            inputs
                .site
                .as_ref()
                .is_some_and(|s| s.debs.iter().any(|d| recipe::package_name(d) == p.name))
        }))
        .cloned()
        .collect();
    // The worker's manifest: a user template's part, and the npm packages (name to version).
    let mut worker_fields = inputs
        .user
        .as_ref()
        .map(|user| user_layer::manifest_fields(user, &home));
    if let Some(tree) = &inputs.npm {
        worker_fields
            .get_or_insert_with(Default::default)
            .insert("npm_packages", serde_json::json!(tree.packages));
    }
    site::write_manifest(
        &inputs.template,
        inputs.site.as_ref(),
        &listed,
        &inputs.recipe_dir,
        worker_fields,
        &staging,
    )?;

    progress("resolving shared libraries");
    let no_alternatives = Default::default();
    let alternatives = inputs
        .site
        .as_ref()
        .map_or(&no_alternatives, |s| &s.alternatives);
    let elf_files = libs::complete(&staging, root, alternatives)?;
    for file in elf_files.iter().filter(|f| f.runpath.is_some()) {
        progress(&format!(
            "note: /{} has a RUNPATH the image ignores",
            file.path
        ));
    }

    progress("writing the archive");
    let mut tree = Tree::new();
    let archive_err = |source| ImageError::Archive {
        path: work_dir.join(IMAGE_FILE),
        source,
    };
    tree.add_dir_tree(staging.root()).map_err(archive_err)?;
    for (dir, mode) in &recipe.rootfs.dirs {
        tree.insert(Entry::dir(dir, *mode)).map_err(archive_err)?;
    }
    for dev in &recipe.rootfs.char_devs {
        tree.insert(Entry::char_dev(&dev.path, dev.mode, dev.major, dev.minor))
            .map_err(archive_err)?;
    }
    tree.add_missing_parents();
    let report = report(&tree, elf_files);
    write_contents(work_dir, &report.largest_all)?;
    let (sha256, size) = write_archive(tree, work_dir)?;
    let key_text = format!("{key}\n{sha256}\n{size}\n");
    write_atomically(&work_dir.join(KEY_FILE), key_text.as_bytes())?;
    Ok(Image {
        path: work_dir.join(IMAGE_FILE),
        sha256,
        size,
        input_key: key.to_owned(),
        report: Some(report.public),
    })
}

/// Copies busybox and links every applet it lists, except the excluded ones, to it.
fn stage_busybox(
    recipe: &Busybox,
    root: &Path,
    staging: &Staging,
    progress: &mut dyn FnMut(&str),
) -> Result<(), ImageError> {
    let busybox = root.join(BUSYBOX_PATH);
    let list = run::stdout_of(Command::new(&busybox).arg("--list-full"), progress)
        .map_err(ImageError::BusyboxList)?;
    let list = String::from_utf8_lossy(&list);
    let applets: Vec<(&str, &str)> = list
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|path| (path, path.rsplit_once('/').map_or(path, |(_, name)| name)))
        .collect();
    for required in &recipe.require {
        if !applets.iter().any(|(_, name)| name == required) {
            return Err(ImageError::MissingApplet(required.clone()));
        }
    }
    for excluded in &recipe.exclude {
        if !applets.iter().any(|(_, name)| name == excluded) {
            progress(&format!(
                "note: excluded applet `{excluded}` is not in this busybox"
            ));
        }
    }
    staging.copy(&busybox, BUSYBOX_PATH)?;
    let target = format!("/{BUSYBOX_PATH}");
    for (path, name) in applets {
        if path != BUSYBOX_PATH && !recipe.exclude.iter().any(|e| e == name) {
            staging.symlink(path, &target)?;
        }
    }
    Ok(())
}

/// Drops the debug sections of a staged copy of bud's own binaries (cargo's release profile
/// keeps line tables: about 90 % of the file). Symbols stay, so guest backtraces keep function
/// names; the unstripped originals stay in the target directory for symbolizing.
fn strip_debug(path: &Path, progress: &mut dyn FnMut(&str)) -> Result<(), ImageError> {
    run::run(
        Command::new("strip").arg("--strip-debug").arg(path),
        false,
        progress,
    )
    .map(|_| ())
    .map_err(|source| ImageError::Strip {
        path: path.to_owned(),
        source,
    })
}

/// Writes the tree to a temporary file, syncs and renames it into place; returns its sha256
/// and size.
fn write_archive(tree: Tree, work_dir: &Path) -> Result<(String, u64), ImageError> {
    let path = work_dir.join(IMAGE_FILE);
    let tmp = work_dir.join(format!("{IMAGE_FILE}.tmp"));
    let file = std::fs::File::create(&tmp).map_err(|source| ImageError::Create {
        path: tmp.clone(),
        source,
    })?;
    let mut sink = HashingWriter {
        inner: BufWriter::new(file),
        hasher: Sha256::new(),
    };
    let size = tree
        .write(&mut sink)
        .map_err(|source| ImageError::Archive {
            path: path.clone(),
            source,
        })?;
    let finish_err = |source| ImageError::Finish {
        path: path.clone(),
        source,
    };
    let file = sink
        .inner
        .into_inner()
        .map_err(|e| finish_err(e.into_error()))?;
    file.sync_all().map_err(finish_err)?;
    std::fs::rename(&tmp, &path).map_err(finish_err)?;
    Ok((hex::encode(sink.hasher.finalize()), size))
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ImageError> {
    let tmp = path.with_extension("tmp");
    let finish_err = |source| ImageError::Finish {
        path: path.to_owned(),
        source,
    };
    std::fs::write(&tmp, bytes).map_err(finish_err)?;
    std::fs::rename(&tmp, path).map_err(finish_err)
}

/// Passes bytes through while hashing them.
struct HashingWriter<W: Write> {
    inner: W,
    hasher: Sha256,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}
