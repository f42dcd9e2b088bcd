//! A template's Python packages: what `guest/image/templates/<name>.toml` ([`Site`]) adds to
//! the base image.
//!
//! - **Packages**: Debian bookworm's `python3-*` packages, listed by name; the shared-library
//!   packages they depend on are found by the builder (`debs::fetch_with_libraries`) and only
//!   the libraries an ELF file of the image loads are copied (`libs::complete`).
//! - **Programs and data** (`share`): any other file or directory of the unpacked packages,
//!   such as `bin/bash` or `usr/bin/git` (the `tools` template), staged as it is (permission
//!   bits kept); `libs::complete` then adds the shared libraries they load.
//! - **`dist-packages`** ([`stage_site`]): every file under `usr/lib/python3/dist-packages`
//!   of the unpacked packages, minus the recipe's `drop` patterns, as plain files (extension
//!   modules and data files must be files; a zip like the standard library's would need a
//!   package split between the zip and the disk). Each `.py` becomes a sourceless
//!   unchecked-hash `.pyc` in its place, compiled by the guest's interpreter: one initramfs
//!   entry instead of two, and half the bytes (the guest kernel unpacks about 1 MB/s and
//!   40 ms per entry on kvm_pvm). Symlinks are followed inside the unpacked tree (Debian
//!   links `matplotlib/mpl-data` to `/usr/share/matplotlib`, and its fonts to
//!   `fonts-dejavu-core`) and staged as the files they point at.
//! - **The worker's manifest** ([`write_manifest`]), `/usr/lib/bud/template.json` in the
//!   image: the template's name, the modules the worker imports before READY, its warm-up
//!   code, and the Python packages with their versions. The base image has one too, with
//!   nothing to preload. (What the host reads of a template, its runtimes, tools and
//!   packages, is the other manifest, beside the image: `crate::manifest`.)

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::debs::Package;
use crate::python::{self, CompileJob, PythonError};
use crate::recipe::{self, Site};
use crate::stage::{self, StageError, Staging};

/// Where Debian's `python3-*` packages put their modules, relative to the root (on the
/// guest interpreter's default `sys.path`: Debian's `site.py` adds it).
pub const DIST_PACKAGES: &str = "usr/lib/python3/dist-packages";
/// The template manifest in the image.
pub const MANIFEST_PATH: &str = "usr/lib/bud/template.json";
/// The template's warm-up code in the image.
pub const WARM_PATH: &str = "usr/lib/bud/template_warm.py";

#[derive(Debug, thiserror::Error)]
pub enum SiteError {
    #[error("walk {path}")]
    Walk {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("stage {0}")]
    Stage(#[from] StageError),
    #[error("compile dist-packages")]
    Python(#[from] PythonError),
    #[error(
        "the packages of the template have no {DIST_PACKAGES}, and it names modules to preload"
    )]
    NoDistPackages,
    #[error("the packages of the template have no {0} (listed in `share`)")]
    NoShare(String),
    #[error("read warm-up code {path}")]
    ReadWarm {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "runtime {runtime}: its interpreter {interpreter} is not in the image (looked for in {}): \
         add the Debian package that has it to `apt`",
        crate::program::SEARCH_DIRS.iter().map(|d| format!("/{d}")).collect::<Vec<_>>().join(", ")
    )]
    ProgramMissing {
        runtime: String,
        interpreter: String,
    },
}

/// What [`stage_site`] put in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SiteReport {
    /// Modules compiled to sourceless pycs.
    pub modules: usize,
    /// Other files (extension modules, data).
    pub files: usize,
    /// Paths dropped by the recipe (a dropped directory counts once).
    pub dropped: usize,
    /// Symlinks that point outside the unpacked packages (left out).
    pub dangling: usize,
}

/// Every file under `start` (a path inside the unpacked tree at `root`), symlinks followed
/// inside the tree: (path relative to `start`, host path), sorted, minus what `drop` drops
/// (patterns against `prefix` + the relative path). Counts drops and dangling links.
fn walk(
    root: &Path,
    start: &str,
    prefix: &str,
    drop: &[String],
    report: &mut SiteReport,
) -> Result<Vec<(String, PathBuf)>, SiteError> {
    let mut files = Vec::new();
    let mut pending = vec![(start.to_owned(), String::new())];
    while let Some((real, logical)) = pending.pop() {
        let dir = root.join(&real);
        let walk_err = |source| SiteError::Walk {
            path: dir.clone(),
            source,
        };
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .map_err(walk_err)?
            .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect::<Result<_, _>>()
            .map_err(walk_err)?;
        names.sort();
        for name in names {
            let logical = if logical.is_empty() {
                name.clone()
            } else {
                format!("{logical}/{name}")
            };
            let matched = format!("{prefix}{logical}");
            if drop.iter().any(|p| recipe::pattern_drops(p, &matched)) {
                report.dropped += 1;
                continue;
            }
            let Some(hops) = stage::resolve_in(root, &format!("{real}/{name}"))? else {
                report.dangling += 1;
                continue;
            };
            let target = hops.last().map(|h| h.path.clone()).unwrap_or_default();
            let host = root.join(&target);
            if host.is_dir() {
                pending.push((target, logical));
            } else {
                files.push((logical, host));
            }
        }
    }
    files.sort();
    Ok(files)
}

/// Stages `dist-packages` of the unpacked packages at `root`, and the recipe's `share`
/// paths, files or directories (module docs).
pub fn stage_site(
    site: &Site,
    root: &Path,
    staging: &Staging,
    work_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<SiteReport, SiteError> {
    let mut report = SiteReport::default();
    let mut jobs = Vec::new();
    // A template of programs rather than Python packages (`tools`: bash, curl, git) has no
    // dist-packages; what it needs comes through `share`. One that names Python modules to
    // preload must have them.
    let dist_packages = if root.join(DIST_PACKAGES).is_dir() {
        walk(root, DIST_PACKAGES, "", &site.drop, &mut report)?
    } else if site.preload.is_empty() {
        Vec::new()
    } else {
        return Err(SiteError::NoDistPackages);
    };
    for (logical, host) in dist_packages {
        let guest = format!("{DIST_PACKAGES}/{logical}");
        if let Some(stem) = logical.strip_suffix(".py") {
            jobs.push(CompileJob {
                source: host,
                cfile: staging.path(&format!("{guest}c")),
                dfile: format!("/{DIST_PACKAGES}/{stem}.py"),
            });
        } else {
            staging.copy(&host, &guest)?;
            report.files += 1;
        }
    }
    for path in &site.share {
        let Some(hops) = stage::resolve_in(root, path)? else {
            return Err(SiteError::NoShare(path.clone()));
        };
        let host = root.join(hops.last().map(|h| h.path.as_str()).unwrap_or_default());
        if !host.is_dir() {
            staging.copy(&host, path)?;
            report.files += 1;
            continue;
        }
        for (logical, host) in walk(root, path, &format!("{path}/"), &site.drop, &mut report)? {
            staging.copy(&host, &format!("{path}/{logical}"))?;
            report.files += 1;
        }
    }
    report.modules = jobs.len();
    progress(&format!(
        "dist-packages and shared data: {} modules to compile, {} other files, {} paths dropped",
        report.modules, report.files, report.dropped
    ));
    python::compile(root, &jobs, false, work_dir, "site", progress)?;
    Ok(report)
}

/// Writes the template manifest (module docs) and the warm-up code into the image.
/// `recipe_dir` holds `templates/` (where the warm-up file is); `user` is a user template's
/// part of it (`image::user_layer`).
pub fn write_manifest(
    name: &str,
    site: Option<&Site>,
    packages: &[Package],
    recipe_dir: &Path,
    user: Option<BTreeMap<&'static str, serde_json::Value>>,
    staging: &Staging,
) -> Result<(), SiteError> {
    let mut warm = None;
    if let Some(file) = site.and_then(|s| s.warm.as_ref()) {
        let path = recipe_dir.join(recipe::TEMPLATES_DIR).join(file);
        let code = std::fs::read(&path).map_err(|source| SiteError::ReadWarm { path, source })?;
        staging.write(WARM_PATH, &code)?;
        warm = Some(format!("/{WARM_PATH}"));
    }
    let versions: BTreeMap<&str, &str> = packages
        .iter()
        .map(|p| (p.name.as_str(), p.version.as_str()))
        .collect();
    // The kernel runtime the worker starts before READY (guest/python/bud_runtime.py).
    let runtime = site.and_then(|s| s.runtime.as_ref()).map(|r| {
        serde_json::json!({
            "name": r.name,
            "interpreter": r.interpreter,
            "kernel": r.kernel,
            "default": r.default,
            "dialects": r.dialects.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(),
        })
    });
    // The program runtimes, in wire order, each with its interpreter's path in the image
    // (guest/python/bud_program.py).
    let mut programs = Vec::new();
    for p in site.iter().flat_map(|s| &s.programs) {
        let interpreter =
            crate::program::resolve(staging.root(), &p.command[0]).ok_or_else(|| {
                SiteError::ProgramMissing {
                    runtime: p.name.clone(),
                    interpreter: p.command[0].clone(),
                }
            })?;
        let command: Vec<&str> = std::iter::once(interpreter.as_str())
            .chain(p.command[1..].iter().map(String::as_str))
            .collect();
        programs.push(serde_json::json!({
            "name": p.name,
            "command": command,
            "extension": p.extension,
        }));
    }
    let mut manifest = serde_json::json!({
        "name": name,
        "preload": site.map(|s| s.preload.clone()).unwrap_or_default(),
        "kernels": site.map_or(0, |s| s.kernels),
        "warm": warm,
        "packages": versions,
        "runtime": runtime,
        "programs": programs,
    });
    if let Some(object) = manifest.as_object_mut() {
        for (key, value) in user.into_iter().flatten() {
            object.insert(key.to_owned(), value);
        }
    }
    staging.write(
        MANIFEST_PATH,
        serde_json::to_string_pretty(&manifest)
            .unwrap_or_default()
            .as_bytes(),
    )?;
    Ok(())
}
