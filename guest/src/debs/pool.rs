//! The package pool: every `.deb` downloaded is also hard-linked into `<build>/debs-pool/`
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
//!
//! [`DebDirs::pool`]: super::DebDirs::pool
//! [`Apt::print_uris`]: crate::host::Apt::print_uris

use std::io;
use std::path::Path;

use rustix::io::Errno;

use super::{DebError, one_line};
use crate::hashes::HashCache;
use crate::host::AptFile;
use crate::recipe::package_name;

/// The pool of downloaded `.deb` files shared by the templates of a build directory, inside
/// it (see the module's doc).
pub const POOL_DIR: &str = "debs-pool";

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
pub(super) struct Pooled {
    pub(super) spec: String,
    pub(super) file: String,
    pub(super) sha256: String,
}

/// Links into `incoming` each package of `specs` whose file (as `files`, apt's
/// `--print-uris` answer, names it) is in `pool` with apt's sha256, and returns those, then
/// the specs left to download: one `files` does not name or gives no sha256 for, one the
/// pool lacks or holds other content for, one with an architecture (`name:arch`), and one
/// whose link failed (said on `progress`). A pool file's hash comes from `hashes` when known.
pub(super) fn take_from_pool(
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
pub(super) fn add_to_pool(
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
pub(super) fn download_line(downloading: &[String], pooled: &[String]) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

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
