//! The Debian packages the image is made of: fetched once with `apt-get download` into
//! `<build>/debs/` (a template's own packages into `<build>/debs-<template>/`), recorded with
//! their exact versions and sha256 in `manifest.tsv`, and unpacked with `dpkg-deb -x`.
//!
//! When the manifest already covers every package of the recipe and each file still has its
//! recorded sha256, nothing is fetched: no network, no apt. This module never installs anything
//! on the host.
//!
//! Every `.deb` downloaded also goes into the package pool ([`POOL_DIR`]) shared by the
//! templates of the build directory, and is taken from there when another needs it: see the
//! `pool` module.

mod pool;

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::hashes::{HashCache, HashError};
use crate::host::{Apt, HostError};
use crate::recipe::{package_name, package_version};
use crate::run::{self, RunError};

pub use pool::POOL_DIR;
use pool::{add_to_pool, download_line, take_from_pool};

/// The record of the packages in use, inside the debs directory.
pub const MANIFEST: &str = "manifest.tsv";
/// Where `apt-get download` writes before files are checked and moved into place.
const INCOMING: &str = "incoming";

/// Where a template's packages are kept.
#[derive(Debug, Clone, Copy)]
pub struct DebDirs<'a> {
    /// The template's own directory: its manifest and the `.deb` files it uses.
    pub dir: &'a Path,
    /// The pool shared with the build directory's other templates, `<build>/`[`POOL_DIR`];
    /// made when missing.
    pub pool: &'a Path,
}

#[derive(Debug, thiserror::Error)]
pub enum DebError {
    #[error("create {path}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("hash package")]
    Hash(#[from] HashError),
    #[error("download packages")]
    Download(#[source] HostError),
    #[error("list downloaded packages in {path}")]
    ListIncoming {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("read control fields of {path}")]
    Control {
        path: PathBuf,
        #[source]
        source: RunError,
    },
    #[error("{path} has no Package or Version field")]
    NoControlFields { path: PathBuf },
    #[error("apt-get did not download `{0}`")]
    NotDownloaded(String),
    #[error("move {from} into the cache")]
    Move {
        from: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("write {path}")]
    WriteManifest {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("link {from} to {to}")]
    Link {
        from: PathBuf,
        to: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("remove stale {path}")]
    RemoveStale {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("unpack {deb}")]
    Extract {
        deb: PathBuf,
        #[source]
        source: RunError,
    },
}

/// One package as used: the exact version and the sha256 of its `.deb`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Package {
    pub name: String,
    pub version: String,
    pub sha256: String,
    /// File name inside the debs directory.
    pub file: String,
}

impl Package {
    fn to_line(&self) -> String {
        format!(
            "{}\t{}\t{}\t{}",
            self.name, self.version, self.sha256, self.file
        )
    }

    fn from_line(line: &str) -> Option<Package> {
        if line.starts_with('#') {
            return None;
        }
        let mut fields = line.split('\t');
        let package = Package {
            name: fields.next()?.to_owned(),
            version: fields.next()?.to_owned(),
            sha256: fields.next()?.to_owned(),
            file: fields.next()?.to_owned(),
        };
        (fields.next().is_none() && !package.file.contains('/')).then_some(package)
    }
}

/// Reads the manifest of `dir`; a missing or unreadable one is an empty cache.
pub fn read_manifest(dir: &Path) -> Vec<Package> {
    std::fs::read_to_string(dir.join(MANIFEST))
        .map(|text| text.lines().filter_map(Package::from_line).collect())
        .unwrap_or_default()
}

fn write_manifest(dir: &Path, packages: &[Package]) -> Result<(), DebError> {
    let path = dir.join(MANIFEST);
    let tmp = dir.join(format!("{MANIFEST}.tmp"));
    let mut text = String::from("# name\tversion\tsha256\tfile\n");
    for package in packages {
        text.push_str(&package.to_line());
        text.push('\n');
    }
    let write_err = |source| DebError::WriteManifest {
        path: path.clone(),
        source,
    };
    std::fs::write(&tmp, text).map_err(write_err)?;
    std::fs::rename(&tmp, &path).map_err(write_err)
}

/// A cached package still good for `spec`: same name, pinned version if any, and a file
/// whose sha256 is the recorded one.
fn cached<'a>(
    cache: &'a [Package],
    spec: &str,
    dir: &Path,
    hashes: &mut HashCache,
) -> Option<&'a Package> {
    let package = cache.iter().find(|p| p.name == package_name(spec))?;
    if package_version(spec).is_some_and(|v| v != package.version) {
        return None;
    }
    let sha = hashes.sha256(&dir.join(&package.file)).ok()?;
    (sha == package.sha256).then_some(package)
}

fn control_fields(deb: &Path) -> Result<(String, String), DebError> {
    let mut cmd = Command::new("dpkg-deb");
    cmd.arg("-f").arg(deb).args(["Package", "Version"]);
    let out = run::stdout_of(&mut cmd, &mut |_| {}).map_err(|source| DebError::Control {
        path: deb.to_owned(),
        source,
    })?;
    let text = String::from_utf8_lossy(&out);
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().into())
    };
    match (field("Package"), field("Version")) {
        (Some(name), Some(version)) => Ok((name, version)),
        _ => Err(DebError::NoControlFields {
            path: deb.to_owned(),
        }),
    }
}

/// `err` and its sources on one progress line (a failed command's last output included).
pub(super) fn one_line(err: &dyn std::error::Error) -> String {
    let mut text = String::new();
    let mut next = Some(err);
    while let Some(err) = next {
        if !text.is_empty() {
            text.push_str(": ");
        }
        let message = err.to_string();
        let lines: Vec<&str> = message.lines().filter(|l| !l.trim().is_empty()).collect();
        text.push_str(&lines.join(" "));
        next = err.source();
    }
    text
}

/// Gets `specs` into `incoming/`, from the pool where it has them and else with `apt-get
/// download`, then moves each `.deb` into `dirs.dir`, describes it, and adds a downloaded
/// one to the pool.
fn download(
    specs: &[String],
    dirs: DebDirs,
    apt: &mut Apt,
    hashes: &mut HashCache,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<Package>, DebError> {
    let DebDirs { dir, pool } = dirs;
    let incoming = dir.join(INCOMING);
    let _ = std::fs::remove_dir_all(&incoming);
    std::fs::create_dir_all(&incoming).map_err(|source| DebError::CreateDir {
        path: incoming.clone(),
        source,
    })?;
    let pool = match std::fs::create_dir_all(pool) {
        Ok(()) => Some(pool),
        Err(source) => {
            let err = DebError::CreateDir {
                path: pool.to_owned(),
                source,
            };
            progress(&format!("not using the package pool: {}", one_line(&err)));
            None
        }
    };
    let (pooled, rest) = match pool.map(|pool| (pool, apt.print_uris(specs, progress))) {
        None => (Vec::new(), specs.to_vec()),
        Some((pool, Ok(files))) => take_from_pool(specs, &files, pool, &incoming, hashes, progress),
        Some((_, Err(err))) => {
            progress(&format!(
                "not using the package pool: {}; downloading everything",
                one_line(&err)
            ));
            (Vec::new(), specs.to_vec())
        }
    };
    let pooled_specs: Vec<String> = pooled.iter().map(|p| p.spec.clone()).collect();
    progress(&download_line(&rest, &pooled_specs));
    if !rest.is_empty() {
        apt.download(&rest, &incoming, progress)
            .map_err(DebError::Download)?;
    }
    let list_err = |source| DebError::ListIncoming {
        path: incoming.clone(),
        source,
    };
    let mut fetched = Vec::new();
    for dirent in std::fs::read_dir(&incoming).map_err(list_err)? {
        let from = dirent.map_err(list_err)?.path();
        let (name, version) = control_fields(&from)?;
        let file = from
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        let to = dir.join(&file);
        std::fs::rename(&from, &to).map_err(|source| DebError::Move { from, source })?;
        let sha256 = match pooled.iter().find(|p| p.file == file) {
            Some(p) => {
                // Checked against apt's sha256 in the pool just now; the move changed the
                // ctime of the pool's file too (one inode), unless it was copied.
                hashes.remember(&to, &p.sha256)?;
                if let Some(pool) = pool {
                    // Advisory, as the pool: a miss only costs hashing it next time.
                    let _ = hashes.remember(&pool.join(&file), &p.sha256);
                }
                p.sha256.clone()
            }
            None => {
                let sha256 = hashes.sha256(&to)?;
                if let Some(pool) = pool
                    && let Err(err) = add_to_pool(&to, &file, &sha256, pool, hashes)
                {
                    progress(&format!(
                        "not added to the package pool: {}",
                        one_line(&err)
                    ));
                }
                sha256
            }
        };
        fetched.push(Package {
            name,
            version,
            sha256,
            file,
        });
    }
    let _ = std::fs::remove_dir(&incoming);
    Ok(fetched)
}

/// Makes sure every package of `specs` is in `dirs.dir`, getting only what the manifest does
/// not already cover, from the pool or else downloaded (`refresh` re-resolves everything).
/// Returns the packages in spec order and rewrites the manifest to exactly them; `.deb`
/// files nobody uses any more are removed.
pub fn fetch(
    specs: &[String],
    dirs: DebDirs,
    apt: &mut Apt,
    refresh: bool,
    hashes: &mut HashCache,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<Package>, DebError> {
    fetch_some(specs, dirs, apt, refresh, true, hashes, progress)
}

/// [`fetch`] of `specs` and of every shared-library package they depend on, transitively:
/// the first alternative of each `Depends` clause whose name starts with `lib` (not
/// `libjs-`, which is JavaScript), unless `provided` (the base image's packages) has it.
/// Only the libraries some ELF file of the image loads are copied out of them later
/// (`libs::complete`), so a dependency the image does not need costs a download, nothing
/// more. Returns `specs`' packages first, then the libraries found.
pub fn fetch_with_libraries(
    specs: &[String],
    provided: &[Package],
    dirs: DebDirs,
    apt: &mut Apt,
    refresh: bool,
    hashes: &mut HashCache,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<Package>, DebError> {
    let mut all: Vec<String> = specs.to_vec();
    let mut refresh = refresh;
    // Packages whose Depends were read already (each round only reads the new ones).
    let mut read = 0;
    loop {
        let packages = fetch_some(&all, dirs, apt, refresh, false, hashes, progress)?;
        refresh = false;
        let mut added = false;
        let unread = packages.len();
        for p in &packages[read..] {
            for name in library_dependencies(&dirs.dir.join(&p.file))? {
                let known = all.iter().any(|s| package_name(s) == name)
                    || provided.iter().any(|b| b.name == name);
                if !known {
                    all.push(name);
                    added = true;
                }
            }
        }
        read = unread;
        if !added {
            return fetch(&all, dirs, apt, false, hashes, progress);
        }
    }
}

/// The library packages a `.deb` depends on (see [`fetch_with_libraries`]).
fn library_dependencies(deb: &Path) -> Result<Vec<String>, DebError> {
    let mut cmd = Command::new("dpkg-deb");
    cmd.arg("-f").arg(deb).arg("Depends");
    let out = run::stdout_of(&mut cmd, &mut |_| {}).map_err(|source| DebError::Control {
        path: deb.to_owned(),
        source,
    })?;
    Ok(parse_library_dependencies(&String::from_utf8_lossy(&out)))
}

fn parse_library_dependencies(depends: &str) -> Vec<String> {
    depends
        .split(',')
        .filter_map(|clause| {
            let first = clause.split('|').next()?.trim();
            let name = first.split([' ', '(']).next()?.trim();
            let name = name.split_once(':').map_or(name, |(n, _)| n);
            (name.starts_with("lib") && !name.starts_with("libjs-")).then(|| name.to_owned())
        })
        .collect()
}

fn fetch_some(
    specs: &[String],
    dirs: DebDirs,
    apt: &mut Apt,
    refresh: bool,
    prune: bool,
    hashes: &mut HashCache,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<Package>, DebError> {
    let dir = dirs.dir;
    std::fs::create_dir_all(dir).map_err(|source| DebError::CreateDir {
        path: dir.to_owned(),
        source,
    })?;
    let cache = if refresh {
        Vec::new()
    } else {
        read_manifest(dir)
    };
    let missing: Vec<String> = specs
        .iter()
        .filter(|spec| cached(&cache, spec, dir, hashes).is_none())
        .cloned()
        .collect();
    let fetched = if missing.is_empty() {
        Vec::new()
    } else {
        download(&missing, dirs, apt, hashes, progress)?
    };
    let mut packages = Vec::with_capacity(specs.len());
    for spec in specs {
        let name = package_name(spec);
        let found = fetched.iter().chain(&cache).find(|p| p.name == name);
        packages.push(
            found
                .cloned()
                .ok_or_else(|| DebError::NotDownloaded(spec.clone()))?,
        );
    }
    // Without pruning the manifest keeps what it had too (a closure is fetched in rounds).
    let mut recorded = packages.clone();
    if !prune {
        let kept = cache
            .iter()
            .filter(|c| !recorded.iter().any(|p| p.name == c.name));
        recorded.extend(kept.cloned().collect::<Vec<_>>());
    }
    if !fetched.is_empty() || cache != recorded {
        write_manifest(dir, &recorded)?;
    }
    if prune {
        remove_unused(dir, &packages)?;
    }
    Ok(packages)
}

fn remove_unused(dir: &Path, packages: &[Package]) -> Result<(), DebError> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if name.ends_with(".deb") && !packages.iter().any(|p| p.file == name) {
            std::fs::remove_file(&path).map_err(|source| DebError::RemoveStale { path, source })?;
        }
    }
    Ok(())
}

/// Unpacks every package into `dest` (which should be empty), in the given order.
pub fn extract(
    packages: &[Package],
    dir: &Path,
    dest: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<(), DebError> {
    std::fs::create_dir_all(dest).map_err(|source| DebError::CreateDir {
        path: dest.to_owned(),
        source,
    })?;
    for package in packages {
        let deb = dir.join(&package.file);
        run::run(
            Command::new("dpkg-deb").arg("-x").arg(&deb).arg(dest),
            false,
            progress,
        )
        .map_err(|source| DebError::Extract { deb, source })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_dependencies_take_the_first_alternative_of_lib_packages() {
        let depends = "python3-pkg-resources, python3 (<< 3.12), libblas3 | libblas.so.3, \
                       libc6 (>= 2.35), libjs-jquery, zlib1g, libstdc++6:amd64 (>= 11)";
        assert_eq!(
            parse_library_dependencies(depends),
            ["libblas3", "libc6", "libstdc++6"]
        );
    }

    #[test]
    fn manifest_line_round_trips() {
        let package = Package {
            name: "zlib1g".into(),
            version: "1:1.2.13.dfsg-1".into(),
            sha256: "ab".repeat(32),
            file: "zlib1g_1%3a1.2.13.dfsg-1_amd64.deb".into(),
        };

        let parsed = Package::from_line(&package.to_line());

        assert_eq!(parsed, Some(package));
        assert_eq!(
            Package::from_line("# name\tversion\tsha256\tfile\textra"),
            None
        );
        assert_eq!(Package::from_line("a\tb\tc\t../evil.deb"), None);
    }

    #[test]
    fn cached_package_needs_matching_pin_and_hash() {
        let dir = std::env::temp_dir().join(format!("bud-debs-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a.deb"), b"abc").unwrap();
        let sha = crate::hashes::sha256_file(&dir.join("a.deb")).unwrap();
        let mut hashes = HashCache::load(&dir.join("cache.tsv"));
        let record = |sha: &str| Package {
            name: "a".into(),
            version: "1.0".into(),
            sha256: sha.into(),
            file: "a.deb".into(),
        };
        let good = [record(&sha)];
        let bad = [record(&"0".repeat(64))];

        assert!(cached(&good, "a", &dir, &mut hashes).is_some());
        assert!(cached(&good, "a=1.0", &dir, &mut hashes).is_some());
        assert!(cached(&good, "a=2.0", &dir, &mut hashes).is_none());
        assert!(cached(&good, "b", &dir, &mut hashes).is_none());
        assert!(cached(&bad, "a", &dir, &mut hashes).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
