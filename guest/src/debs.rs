//! The Debian packages the image is made of: fetched once with `apt-get download` into
//! `<build>/debs/` (a template's own packages into `<build>/debs-<template>/`), recorded with
//! their exact versions and sha256 in `manifest.tsv`, and unpacked with `dpkg-deb -x`.
//!
//! When the manifest already covers every package of the recipe and each file still has its
//! recorded sha256, nothing is fetched: no network, no apt. This module never installs anything
//! on the host.
//!
//! **The package pool.** Every `.deb` downloaded is also hard-linked into `<build>/debs-pool/`
//! ([`POOL_DIR`], passed in as [`DebDirs::pool`]) under its Debian file name
//! (`name_version_arch.deb`, one content per name within an archive), shared by every template
//! of the build directory. Before downloading what its manifest lacks, a directory asks apt
//! which files those packages are and their sha256, without downloading
//! ([`Apt::print_uris`]); each file whose pool copy has that sha256 is linked from the pool
//! (copied where a link cannot be made) and only the others are downloaded: a second template
//! that needs `jq` does not download it again. A pool file is used only when its sha256 is
//! apt's. The pool is a cache and nothing more: when `--print-uris` fails, or the pool cannot be
//! read or written, the build downloads as it would without it, saying why on its progress.
//!
//! Nothing is ever removed from the pool by a build: a template's directory keeps only the
//! files its manifest names (its other links are removed), but the pool keeps every version
//! any template downloaded. Delete the directory to clear it; the next builds download again.
//! The build directory's lock ([`crate::lock`]) serializes the builds that share the pool.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

use rustix::io::Errno;

use crate::hashes::{HashCache, HashError};
use crate::host::{Apt, AptFile, HostError};
use crate::recipe::{package_name, package_version};
use crate::run::{self, RunError};

/// The record of the packages in use, inside the debs directory.
pub const MANIFEST: &str = "manifest.tsv";
/// Where `apt-get download` writes before files are checked and moved into place.
const INCOMING: &str = "incoming";
/// The pool of downloaded `.deb` files shared by the templates of a build directory, inside
/// it (see the module's doc).
pub const POOL_DIR: &str = "debs-pool";

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
fn one_line(err: &dyn std::error::Error) -> String {
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

/// Whether `hard_link` failed where a copy can do: another file system (`EXDEV`), a file of
/// another user under `fs.protected_hardlinks` (`EPERM`), the link limit (`EMLINK`).
fn copy_instead(err: &io::Error) -> bool {
    matches!(
        Errno::from_io_error(err),
        Some(Errno::XDEV | Errno::PERM | Errno::MLINK)
    )
}

/// Makes the new path `to` hold `from`'s content: a hard link, else a copy (see
/// [`copy_instead`]). A failed copy leaves no `to` behind.
fn link_or_copy(from: &Path, to: &Path) -> Result<(), DebError> {
    let link_err = |source| DebError::Link {
        from: from.to_owned(),
        to: to.to_owned(),
        source,
    };
    match std::fs::hard_link(from, to) {
        Ok(()) => Ok(()),
        Err(err) if copy_instead(&err) => std::fs::copy(from, to).map(drop).map_err(|err| {
            let _ = std::fs::remove_file(to);
            link_err(err)
        }),
        Err(err) => Err(link_err(err)),
    }
}

/// A package linked from the pool into `incoming/`: its spec, file name and apt's sha256.
#[derive(Debug, PartialEq, Eq)]
struct Pooled {
    spec: String,
    file: String,
    sha256: String,
}

/// Links into `incoming` each package of `specs` whose file (as `files`, apt's
/// `--print-uris` answer, names it) is in `pool` with apt's sha256, and returns those, then
/// the specs left to download: one `files` does not name or gives no sha256 for, one the
/// pool lacks or holds other content for, one with an architecture (`name:arch`), and one
/// whose link failed (said on `progress`). A pool file's hash comes from `hashes` when known.
fn take_from_pool(
    specs: &[String],
    files: &[AptFile],
    pool: &Path,
    incoming: &Path,
    hashes: &mut HashCache,
    progress: &mut dyn FnMut(&str),
) -> (Vec<Pooled>, Vec<String>) {
    let mut pooled = Vec::new();
    let mut rest = Vec::new();
    for spec in specs {
        let name = package_name(spec);
        let file = files
            .iter()
            .filter(|_| !name.contains(':'))
            .find(|f| f.package() == name);
        let Some((file, sha256)) = file.and_then(|f| Some((&f.file, f.sha256.as_ref()?))) else {
            rest.push(spec.clone());
            continue;
        };
        let from = pool.join(file);
        let in_pool = from.is_file() && hashes.sha256(&from).is_ok_and(|sha| sha == *sha256);
        if !in_pool {
            rest.push(spec.clone());
            continue;
        }
        match link_or_copy(&from, &incoming.join(file)) {
            Ok(()) => pooled.push(Pooled {
                spec: spec.clone(),
                file: file.clone(),
                sha256: sha256.clone(),
            }),
            Err(err) => {
                progress(&format!("package pool: {}; downloading it", one_line(&err)));
                rest.push(spec.clone());
            }
        }
    }
    (pooled, rest)
}

/// Puts `deb`, just downloaded, with sha256 `sha`, into the pool as `pool/<file>`. A pool
/// file of that name with the same content is kept, one with other content (damaged)
/// replaced.
fn add_to_pool(
    deb: &Path,
    file: &str,
    sha: &str,
    pool: &Path,
    hashes: &mut HashCache,
) -> Result<(), DebError> {
    let pooled = pool.join(file);
    match std::fs::hard_link(deb, &pooled) {
        Ok(()) => {}
        Err(err)
            if err.kind() == io::ErrorKind::AlreadyExists
                && hashes.sha256(&pooled).is_ok_and(|s| s == sha) =>
        {
            return Ok(());
        }
        Err(err) if err.kind() == io::ErrorKind::AlreadyExists || copy_instead(&err) => {
            // Replaced in one step: a reader of the pool sees the old file or the new one.
            let tmp = pool.join(format!(".{file}.{}.tmp", std::process::id()));
            let _ = std::fs::remove_file(&tmp);
            link_or_copy(deb, &tmp)?;
            std::fs::rename(&tmp, &pooled).map_err(|source| {
                let _ = std::fs::remove_file(&tmp);
                DebError::Link {
                    from: deb.to_owned(),
                    to: pooled.clone(),
                    source,
                }
            })?;
        }
        Err(source) => {
            return Err(DebError::Link {
                from: deb.to_owned(),
                to: pooled,
                source,
            });
        }
    }
    // A new link changes the file's ctime, which the hash cache's stamp holds.
    hashes.remember(deb, sha)?;
    hashes.remember(&pooled, sha)?;
    Ok(())
}

/// The progress line of a download: the specs apt-get downloads, then how many of all came
/// from the pool, naming them (`apt-get download jq (2 of 3 from the pool: libjq1
/// libonig5)`). Without the pool it is `apt-get download` and the specs, as it always was.
fn download_line(downloading: &[String], pooled: &[String]) -> String {
    let total = downloading.len() + pooled.len();
    match (downloading.is_empty(), pooled.is_empty()) {
        (_, true) => format!("apt-get download {}", downloading.join(" ")),
        (true, false) => format!(
            "apt-get download: nothing, {total} of {total} from the pool: {}",
            pooled.join(" ")
        ),
        (false, false) => format!(
            "apt-get download {} ({} of {total} from the pool: {})",
            downloading.join(" "),
            pooled.len(),
            pooled.join(" ")
        ),
    }
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
/// not already cover (from the pool, else downloaded) (`refresh` re-resolves everything). Returns the packages in spec order
/// and rewrites the manifest to exactly them; `.deb` files nobody uses any more are removed.
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
    /// An empty directory of its own for one test.
    fn test_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("bud-debs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn sha_of(bytes: &[u8]) -> String {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(bytes))
    }

    fn apt_file(file: &str, sha256: Option<String>) -> AptFile {
        AptFile {
            uri: format!("http://deb.example/pool/{file}"),
            file: file.into(),
            size: 3,
            sha256,
        }
    }

    fn inode(path: &Path) -> u64 {
        use std::os::unix::fs::MetadataExt;
        path.metadata().unwrap().ino()
    }

    fn names_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn pool_files_with_apts_sha256_are_linked_and_the_rest_left_to_download() {
        let dir = test_dir("take");
        let (pool, incoming) = (dir.join("pool"), dir.join("incoming"));
        std::fs::create_dir_all(&pool).unwrap();
        std::fs::create_dir_all(&incoming).unwrap();
        for (file, bytes) in [
            ("a_1_all.deb", b"aaa"),
            ("b_2%3a1_all.deb", b"bad"),
            ("d_1_all.deb", b"ddd"),
            ("f_1_i386.deb", b"fff"),
        ] {
            std::fs::write(pool.join(file), bytes).unwrap();
        }
        let files = [
            apt_file("a_1_all.deb", Some(sha_of(b"aaa"))),
            // In the pool with other content: a damaged copy, or another archive's.
            apt_file("b_2%3a1_all.deb", Some(sha_of(b"bbb"))),
            apt_file("c_1_all.deb", Some(sha_of(b"ccc"))),
            apt_file("d_1_all.deb", None),
            apt_file("f_1_i386.deb", Some(sha_of(b"fff"))),
        ];
        let specs: Vec<String> = ["b=2:1", "a", "c", "d", "e", "f:i386"]
            .map(String::from)
            .to_vec();
        let mut hashes = HashCache::load(&dir.join("cache.tsv"));
        let mut lines = Vec::new();

        let (pooled, rest) =
            take_from_pool(&specs, &files, &pool, &incoming, &mut hashes, &mut |l| {
                lines.push(l.to_owned())
            });

        assert_eq!(
            pooled,
            [Pooled {
                spec: "a".into(),
                file: "a_1_all.deb".into(),
                sha256: sha_of(b"aaa"),
            }]
        );
        assert_eq!(rest, ["b=2:1", "c", "d", "e", "f:i386"]);
        assert_eq!(names_in(&incoming), ["a_1_all.deb"]);
        assert_eq!(
            inode(&incoming.join("a_1_all.deb")),
            inode(&pool.join("a_1_all.deb"))
        );
        assert_eq!(lines, Vec::<String>::new());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_link_from_the_pool_is_said_and_downloaded() {
        let dir = test_dir("take-fails");
        let pool = dir.join("pool");
        std::fs::create_dir_all(&pool).unwrap();
        std::fs::write(pool.join("a_1_all.deb"), b"aaa").unwrap();
        let files = [apt_file("a_1_all.deb", Some(sha_of(b"aaa")))];
        let mut hashes = HashCache::load(&dir.join("cache.tsv"));
        let mut lines = Vec::new();

        // No `incoming` directory to link into.
        let (pooled, rest) = take_from_pool(
            &["a".to_owned()],
            &files,
            &pool,
            &dir.join("incoming"),
            &mut hashes,
            &mut |l| lines.push(l.to_owned()),
        );

        assert_eq!(pooled, []);
        assert_eq!(rest, ["a"]);
        assert_eq!(lines.len(), 1);
        assert!(
            lines[0].starts_with("package pool: link ") && lines[0].ends_with("; downloading it"),
            "{lines:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_download_joins_the_pool_keeping_a_same_copy_and_replacing_a_damaged_one() {
        let dir = test_dir("add");
        let pool = dir.join("pool");
        std::fs::create_dir_all(&pool).unwrap();
        let mut hashes = HashCache::load(&dir.join("cache.tsv"));
        let deb = |name: &str, bytes: &[u8]| {
            let path = dir.join(name);
            std::fs::write(&path, bytes).unwrap();
            path
        };
        let (new, same, damaged) = (deb("n.deb", b"new"), deb("s.deb", b"s"), deb("d.deb", b"d"));
        std::fs::write(pool.join("s.deb"), b"s").unwrap();
        std::fs::write(pool.join("d.deb"), b"damaged").unwrap();
        let kept = inode(&pool.join("s.deb"));

        for (path, bytes) in [(&new, &b"new"[..]), (&same, b"s"), (&damaged, b"d")] {
            let file = path.file_name().unwrap().to_str().unwrap();
            add_to_pool(path, file, &sha_of(bytes), &pool, &mut hashes).unwrap();
        }

        assert_eq!(inode(&pool.join("n.deb")), inode(&new));
        assert_eq!(inode(&pool.join("s.deb")), kept);
        assert_eq!(std::fs::read(pool.join("d.deb")).unwrap(), b"d");
        assert_eq!(names_in(&pool), ["d.deb", "n.deb", "s.deb"]);
        // The new links' hashes are known without reading the files again.
        assert_eq!(hashes.sha256(&pool.join("n.deb")).unwrap(), sha_of(b"new"));
        assert_eq!(hashes.sha256(&new).unwrap(), sha_of(b"new"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn link_or_copy_links_and_copies_across_file_systems() {
        use std::os::unix::fs::MetadataExt;
        let dir = test_dir("link");
        std::fs::write(dir.join("a"), b"aaa").unwrap();

        link_or_copy(&dir.join("a"), &dir.join("b")).unwrap();
        let again = link_or_copy(&dir.join("a"), &dir.join("b"));

        assert_eq!(inode(&dir.join("b")), inode(&dir.join("a")));
        assert!(matches!(again, Err(DebError::Link { .. })), "{again:?}");
        // Where /dev/shm is another file system (a tmpfs), a link to it is a copy.
        let shm = Path::new("/dev/shm");
        let dev = |p: &Path| p.metadata().map(|m| m.dev()).ok();
        if shm.is_dir() && dev(shm) != dev(&dir) {
            let other = shm.join(format!("bud-debs-link-{}", std::process::id()));
            let copied = link_or_copy(&dir.join("a"), &other);
            let bytes = std::fs::read(&other);
            let _ = std::fs::remove_file(&other);
            copied.unwrap();
            assert_eq!(bytes.unwrap(), b"aaa");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn links_across_file_systems_are_copies() {
        let errno = |e: Errno| io::Error::from_raw_os_error(e.raw_os_error());

        assert!(copy_instead(&errno(Errno::XDEV)));
        assert!(copy_instead(&errno(Errno::PERM)));
        assert!(!copy_instead(&errno(Errno::EXIST)));
        assert!(!copy_instead(&errno(Errno::NOENT)));
    }

    #[test]
    fn the_download_line_starts_as_it_always_did_and_counts_the_pool() {
        let specs = |s: &[&str]| s.iter().map(|s| s.to_string()).collect::<Vec<_>>();

        assert_eq!(
            download_line(&specs(&["jq", "libjq1"]), &[]),
            "apt-get download jq libjq1"
        );
        assert_eq!(
            download_line(&specs(&["jq"]), &specs(&["libjq1", "libonig5"])),
            "apt-get download jq (2 of 3 from the pool: libjq1 libonig5)"
        );
        assert_eq!(
            download_line(&[], &specs(&["jq", "libjq1"])),
            "apt-get download: nothing, 2 of 2 from the pool: jq libjq1"
        );
    }
}
