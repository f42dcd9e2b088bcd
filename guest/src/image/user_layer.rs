//! What a user template's definitions add to the image (`crate::user`): their Debian
//! packages whole, their wheels, their files, and the worker's part of the template
//! manifest (environment, working directory, warm-up code).
//!
//! - **Debian packages**: every file and link of each package a definition names (not the
//!   libraries found for them: those give only what an ELF file loads, as for every
//!   template), but documentation, manual pages, locales and lintian overrides. Unpacked
//!   with `dpkg-deb -x`: no maintainer script runs.
//! - **Wheels**: unpacked by `crate::wheels`, then every `.py` compiled by the guest's
//!   interpreter to a sourceless unchecked-hash `.pyc` in its place, as Debian's
//!   `dist-packages` are (`site.rs`): one initramfs entry per module.
//! - **npm packages** are not staged here: the layers' `npm` lists join the base template's
//!   (`Layers::site`), and the whole list is installed and staged as one tree
//!   (`crate::npm`), on a built-in template's image as on a user template's.
//! - **Archives**: each file of a directory given as a tar archive (`crate::archive`),
//!   at the archive's directory, mode 0644 or 0755; staged as files are.
//! - **Files**: written as given, mode 0644, at their absolute paths; those under the work
//!   directory (`/tmp`, `/home/user`: tmpfs mounts over the image) are staged under
//!   [`HOME_FILES`] and copied into place by the worker before the snapshot, owned by the
//!   guest's user.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use super::{ImageError, UserInputs};
use crate::debs::{self, Package};
use crate::python::{self, CompileJob};
use crate::stage::Staging;
use crate::wheels;

/// Where files for the work directory wait in the image (by their absolute path below it).
const HOME_FILES: &str = "usr/lib/bud/home";
/// The mounts over the image whose files the worker puts in place.
const MOUNTED: &[&str] = &["/tmp/", "/home/user/"];

/// Where a definition's file at `path` is staged: (staging path, whether the worker copies
/// it to `path`).
fn staged_at(path: &str) -> (String, bool) {
    let rel = path.trim_start_matches('/');
    if MOUNTED.iter().any(|m| path.starts_with(m)) {
        (format!("{HOME_FILES}/{rel}"), true)
    } else {
        (rel.to_owned(), false)
    }
}

/// Where each layer's warm-up code goes, `{i}` its place bottom up.
fn warm_path(i: usize) -> String {
    format!("usr/lib/bud/user_warm_{i}.py")
}

/// Parts of a package the image leaves out (from the root).
const LEFT_OUT: &[&str] = &[
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "usr/share/lintian",
    "usr/share/bug",
    "usr/share/doc-base",
    "usr/share/menu",
];

/// What [`stage`] put in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UserReport {
    pub package_files: usize,
    pub wheel_files: usize,
    pub modules: usize,
    pub files: usize,
    /// The files for the work directory, which the worker copies into place: (staged path
    /// in the guest, destination), those of `files` first, then the archives'.
    pub home: Vec<(String, String)>,
}

/// Stages the user layers (module docs). `site_packages` are the template's Debian packages
/// (the ones named and the libraries found), their `.deb` files in `site_debs_dir`; the
/// guest's interpreter for compiling is in the unpacked tree at `root`.
pub fn stage(
    user: &UserInputs,
    site_packages: &[Package],
    site_debs_dir: &Path,
    root: &Path,
    staging: &Staging,
    work_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<UserReport, ImageError> {
    let mut report = UserReport::default();
    let named: Vec<String> = user
        .layers
        .apt()
        .iter()
        .map(|s| crate::recipe::package_name(s).to_owned())
        .collect();
    for package in site_packages.iter().filter(|p| named.contains(&p.name)) {
        let alone = Staging::reset(&work_dir.join("whole").join(&package.name))?;
        debs::extract(
            std::slice::from_ref(package),
            site_debs_dir,
            alone.root(),
            progress,
        )
        .map_err(ImageError::Extract)?;
        report.package_files += copy_tree(alone.root(), staging)?;
    }

    // The base image's own modules there (pip's shim) stay as they are: a user template's
    // image then only adds to its parent's, which a layer needs (`crate::layer`).
    let site_dir = staging.path(wheels::SITE_DIR);
    let before: std::collections::HashSet<String> = match site_dir.is_dir() {
        true => crate::stage::files_under(&site_dir)?.into_iter().collect(),
        false => Default::default(),
    };
    let unpacked = wheels::unpack(&user.wheels, staging).map_err(ImageError::Wheels)?;
    report.wheel_files = unpacked.files + unpacked.scripts;
    let mut jobs = Vec::new();
    for rel in crate::stage::files_under(&site_dir)? {
        if before.contains(&rel) {
            continue;
        }
        if let Some(stem) = rel.strip_suffix(".py") {
            let guest = format!("{}/{rel}", wheels::SITE_DIR);
            jobs.push(CompileJob {
                source: staging.path(&guest),
                cfile: staging.path(&format!("{guest}c")),
                dfile: format!("/{}/{stem}.py", wheels::SITE_DIR),
            });
        }
    }
    report.modules = jobs.len();
    python::compile(root, &jobs, false, work_dir, "wheels", progress)?;
    for job in &jobs {
        std::fs::remove_file(&job.source).map_err(|source| ImageError::Create {
            path: job.source.clone(),
            source,
        })?;
    }

    let mut stage_file = |path: String, data: &[u8]| -> Result<String, ImageError> {
        let (rel, for_home) = staged_at(&path);
        staging.write(&rel, data)?;
        if for_home {
            report.home.push((format!("/{rel}"), path));
        }
        report.files += 1;
        Ok(rel)
    };
    for (path, content) in user.layers.files() {
        stage_file(path, content.as_bytes())?;
    }
    for (path, file) in archive_files(&user.layers)? {
        let rel = stage_file(path, &file.data)?;
        if file.executable {
            let staged = staging.path(&rel);
            std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o755)).map_err(
                |source| ImageError::Create {
                    path: staged,
                    source,
                },
            )?;
        }
    }
    for (i, code) in user.layers.warm().iter().enumerate() {
        staging.write(&warm_path(i), code.as_bytes())?;
    }
    progress(&format!(
        "user layers: {} files of Debian packages, {} of wheels ({} modules compiled), {} files",
        report.package_files, report.wheel_files, report.modules, report.files
    ));
    Ok(report)
}

/// The worker's part of the template manifest (`/usr/lib/bud/template.json`): the
/// environment, the files [`stage`] left for the work directory (`home`), the working
/// directory and the warm-up files, which must succeed.
pub fn manifest_fields(
    user: &UserInputs,
    home: &[(String, String)],
) -> BTreeMap<&'static str, serde_json::Value> {
    let warm: Vec<String> = (0..user.layers.warm().len())
        .map(|i| format!("/{}", warm_path(i)))
        .collect();
    BTreeMap::from([
        ("env", serde_json::json!(user.layers.env())),
        ("home_files", serde_json::json!(home)),
        ("workdir", serde_json::json!(user.layers.workdir())),
        ("user_warm", serde_json::json!(warm)),
    ])
}

/// Every file of the layers' archives (`crate::archive`), at its guest path, bottom up.
/// Checked with the definitions; a stored definition is taken as it was checked.
fn archive_files(
    layers: &crate::user::Layers,
) -> Result<Vec<(String, crate::archive::ArchiveFile)>, ImageError> {
    let mut out = Vec::new();
    for (dir, text) in layers.archives() {
        let files = crate::archive::files(&text, &crate::archive::ArchiveLimits::UNLIMITED)
            .map_err(|why| ImageError::UserArchive {
                dir: dir.clone(),
                why,
            })?;
        out.extend(files.into_iter().map(|f| (format!("{dir}/{}", f.path), f)));
    }
    Ok(out)
}

/// Copies every file and symlink under `from` (but [`LEFT_OUT`]) into the staging tree at the
/// same path; returns how many.
fn copy_tree(from: &Path, staging: &Staging) -> Result<usize, ImageError> {
    let mut count = 0;
    let mut dirs = vec![String::new()];
    while let Some(dir) = dirs.pop() {
        let host = from.join(&dir);
        let list_err = |source| ImageError::Create {
            path: host.clone(),
            source,
        };
        let mut entries: Vec<_> = std::fs::read_dir(&host)
            .map_err(list_err)?
            .collect::<Result<_, _>>()
            .map_err(list_err)?;
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            let name = entry.file_name().to_string_lossy().into_owned();
            let rel = if dir.is_empty() {
                name
            } else {
                format!("{dir}/{name}")
            };
            if LEFT_OUT
                .iter()
                .any(|l| rel == *l || rel.starts_with(&format!("{l}/")))
            {
                continue;
            }
            let kind = entry.file_type().map_err(list_err)?;
            if kind.is_dir() {
                dirs.push(rel);
            } else if kind.is_symlink() {
                let target = std::fs::read_link(entry.path()).map_err(list_err)?;
                staging.symlink(&rel, &target.to_string_lossy())?;
                count += 1;
            } else if kind.is_file() {
                staging.copy(&entry.path(), &rel)?;
                count += 1;
            }
        }
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_in_the_work_directory_wait_for_the_worker() {
        assert_eq!(
            staged_at("/etc/app.conf"),
            ("etc/app.conf".to_owned(), false)
        );
        assert_eq!(
            staged_at("/home/user/p/README"),
            ("usr/lib/bud/home/home/user/p/README".to_owned(), true)
        );
        assert_eq!(
            staged_at("/tmp/x"),
            ("usr/lib/bud/home/tmp/x".to_owned(), true)
        );
        assert_eq!(staged_at("/tmpfile"), ("tmpfile".to_owned(), false));
    }

    #[test]
    fn a_package_tree_is_copied_without_its_documentation() {
        let base = std::env::temp_dir().join(format!("bud-user-layer-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let from = base.join("pkg");
        for (rel, text) in [
            ("usr/bin/jq", "elf"),
            ("usr/share/doc/jq/copyright", "c"),
            ("usr/share/man/man1/jq.1.gz", "m"),
            ("usr/share/jq/data", "d"),
        ] {
            std::fs::create_dir_all(from.join(rel).parent().unwrap()).unwrap();
            std::fs::write(from.join(rel), text).unwrap();
        }
        std::os::unix::fs::symlink("jq", from.join("usr/bin/jq-link")).unwrap();
        let staging = Staging::reset(&base.join("rootfs")).unwrap();

        let count = copy_tree(&from, &staging).unwrap();

        assert_eq!(count, 3);
        assert_eq!(
            std::fs::read_to_string(staging.path("usr/bin/jq")).unwrap(),
            "elf"
        );
        assert_eq!(
            std::fs::read_link(staging.path("usr/bin/jq-link")).unwrap(),
            Path::new("jq")
        );
        assert!(staging.contains("usr/share/jq/data"));
        assert!(!staging.contains("usr/share/doc/jq/copyright"));
        assert!(!staging.contains("usr/share/man"));
        std::fs::remove_dir_all(&base).unwrap();
    }
}
