//! Shared libraries of the image: every ELF file staged gets the interpreter and the
//! `DT_NEEDED` libraries it loads, transitively, taken from the unpacked Debian packages.
//!
//! The guest has no `/etc/ld.so.cache`, so its loader searches only its built-in system
//! directories; [`LIBRARY_DIRS`] mirrors them (Debian glibc: `ld.so --help`), and a library is
//! placed where the package put it, symlinks included, so the guest finds the same file the
//! resolution here found. A library that cannot be found fails the build by name.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::elf::{self, ElfError};
use crate::stage::{self, StageError, Staging};

/// The guest loader's search directories, in its order (relative to the root).
pub const LIBRARY_DIRS: &[&str] = &[
    "lib/x86_64-linux-gnu",
    "usr/lib/x86_64-linux-gnu",
    "lib",
    "usr/lib",
];

#[derive(Debug, thiserror::Error)]
pub enum LibError {
    #[error("walk {path}")]
    Walk {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parse ELF {path}")]
    Parse {
        path: String,
        #[source]
        source: ElfError,
    },
    #[error("library {library} (needed by /{needed_by}) is in none of the packages")]
    Missing { library: String, needed_by: String },
    #[error(
        "library {library} (needed by /{needed_by}) is not in usr/lib/x86_64-linux-gnu/{dir}, \
         the alternative the template recipe chose"
    )]
    MissingAlternative {
        library: String,
        dir: String,
        needed_by: String,
    },
    #[error("interpreter {interpreter} (of /{needed_by}) is in none of the packages")]
    MissingInterpreter {
        interpreter: String,
        needed_by: String,
    },
    #[error("/{path}: {what} {name} does not resolve inside the image")]
    Unresolved {
        path: String,
        what: &'static str,
        name: String,
    },
    #[error("stage library")]
    Stage(#[from] StageError),
}

/// One ELF file of the image and what it loads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElfFile {
    /// Guest path without the leading `/`.
    pub path: String,
    pub interpreter: Option<String>,
    pub needed: Vec<String>,
    pub runpath: Option<String>,
}

/// Guest paths (relative) of every regular file under `root` that starts with the ELF magic.
fn elf_files(root: &Path) -> Result<Vec<String>, LibError> {
    let mut out = Vec::new();
    let mut dirs = vec![root.to_owned()];
    while let Some(dir) = dirs.pop() {
        let walk_err = |source| LibError::Walk {
            path: dir.clone(),
            source,
        };
        for dirent in std::fs::read_dir(&dir).map_err(walk_err)? {
            let dirent = dirent.map_err(walk_err)?;
            let file_type = dirent.file_type().map_err(walk_err)?;
            let path = dirent.path();
            if file_type.is_dir() {
                dirs.push(path);
            } else if file_type.is_file() && starts_with_elf_magic(&path)? {
                let rel = path.strip_prefix(root).unwrap_or(&path);
                out.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    Ok(out)
}

fn starts_with_elf_magic(path: &Path) -> Result<bool, LibError> {
    let mut magic = [0u8; 4];
    let mut file = std::fs::File::open(path).map_err(|source| LibError::Read {
        path: path.into(),
        source,
    })?;
    Ok(file.read_exact(&mut magic).is_ok() && elf::is_elf(&magic))
}

fn describe(root: &Path, rel: &str) -> Result<ElfFile, LibError> {
    let host = root.join(rel);
    let bytes = std::fs::read(&host).map_err(|source| LibError::Read { path: host, source })?;
    let dynamic = elf::parse(&bytes).map_err(|source| LibError::Parse {
        path: rel.to_owned(),
        source,
    })?;
    Ok(ElfFile {
        path: rel.to_owned(),
        interpreter: dynamic.interpreter,
        needed: dynamic.needed,
        runpath: dynamic.runpath,
    })
}

/// Where the guest loader would find library `name` under `root`: the hops from the search
/// directory entry to the real file.
fn find_library(root: &Path, name: &str) -> Result<Option<Vec<stage::Hop>>, LibError> {
    for dir in LIBRARY_DIRS {
        if let Some(hops) = stage::resolve_in(root, &format!("{dir}/{name}"))? {
            return Ok(Some(hops));
        }
    }
    Ok(None)
}

/// Whether `file`'s own `DT_RUNPATH`/`DT_RPATH` finds library `name` inside `root`, as the
/// loader searches it before the system directories: `$ORIGIN` is the file's directory
/// (wheels from the package index bundle their libraries beside their extension modules,
/// `numpy.libs/` with `$ORIGIN/../numpy.libs`), an absolute entry is a path in the image.
fn in_runpath(root: &Path, file: &ElfFile, name: &str) -> Result<bool, LibError> {
    let Some(runpath) = &file.runpath else {
        return Ok(false);
    };
    let origin = Path::new(&file.path)
        .parent()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    for entry in runpath.split(':').filter(|e| !e.is_empty()) {
        let dir = entry
            .replace("${ORIGIN}", &format!("/{origin}"))
            .replace("$ORIGIN", &format!("/{origin}"));
        // A relative entry is relative to the process's working directory: never ours.
        if !dir.starts_with('/') {
            continue;
        }
        let Ok(dir) = stage::normalize("", &dir) else {
            continue;
        };
        if stage::resolve_in(root, &format!("{dir}/{name}"))?.is_some() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Where Debian's alternatives keep libraries that several packages provide (BLAS and LAPACK:
/// `blas/libblas.so.3`, `lapack/liblapack.so.3`, ...), one directory below this one;
/// `update-alternatives` links the chosen one into this directory when a package is
/// installed, which unpacking alone never does.
const ALTERNATIVES_PARENT: &str = "usr/lib/x86_64-linux-gnu";

/// A library found only in a subdirectory of [`ALTERNATIVES_PARENT`]: the subdirectory's name
/// and the hops to the file. The subdirectory is `chosen` when the template recipe names one
/// (its `alternatives`: OpenBLAS's `openblas-serial` over the reference `blas`), else the
/// first one, by name. The image gets the link `update-alternatives` would have made.
fn find_alternative(
    root: &Path,
    name: &str,
    chosen: Option<&str>,
) -> Result<Option<(String, Vec<stage::Hop>)>, LibError> {
    if let Some(dir) = chosen {
        let hops = stage::resolve_in(root, &format!("{ALTERNATIVES_PARENT}/{dir}/{name}"))?;
        return Ok(hops.map(|hops| (dir.to_owned(), hops)));
    }
    let parent = root.join(ALTERNATIVES_PARENT);
    let Ok(entries) = std::fs::read_dir(&parent) else {
        return Ok(None);
    };
    let mut dirs: Vec<String> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    dirs.sort();
    for dir in dirs {
        if let Some(hops) = stage::resolve_in(root, &format!("{ALTERNATIVES_PARENT}/{dir}/{name}"))?
        {
            return Ok(Some((dir, hops)));
        }
    }
    Ok(None)
}

/// Copies a resolved path into the staging tree: its symlinks as symlinks, the final file as
/// a copy. Returns the guest path of the real file.
fn install(staging: &Staging, source: &Path, hops: &[stage::Hop]) -> Result<String, LibError> {
    let mut real = String::new();
    for hop in hops {
        match &hop.link {
            Some(target) => staging.symlink(&hop.path, target)?,
            None => {
                staging.copy(&source.join(&hop.path), &hop.path)?;
                real.clone_from(&hop.path);
            }
        }
    }
    Ok(real)
}

/// Adds to `staging` the interpreter and every library its ELF files need, transitively,
/// taken from the unpacked packages under `source`; a library several packages provide comes
/// from the alternative `alternatives` names for it (library file name -> subdirectory of
/// `usr/lib/x86_64-linux-gnu`), if any. Returns the ELF files of the finished image, each
/// with what it loads.
pub fn complete(
    staging: &Staging,
    source: &Path,
    alternatives: &BTreeMap<String, String>,
) -> Result<Vec<ElfFile>, LibError> {
    let root = staging.root();
    let mut queue = elf_files(root)?;
    let mut done = BTreeSet::new();
    while let Some(rel) = queue.pop() {
        if !done.insert(rel.clone()) {
            continue;
        }
        let file = describe(root, &rel)?;
        if let Some(interp) = &file.interpreter {
            let guest = stage::normalize("", interp)?;
            if stage::resolve_in(root, &guest)?.is_none() {
                let hops = stage::resolve_in(source, &guest)?.ok_or_else(|| {
                    LibError::MissingInterpreter {
                        interpreter: interp.clone(),
                        needed_by: rel.clone(),
                    }
                })?;
                queue.push(install(staging, source, &hops)?);
            }
        }
        for name in &file.needed {
            if in_runpath(root, &file, name)? || find_library(root, name)?.is_some() {
                continue;
            }
            if let Some(hops) = find_library(source, name)? {
                queue.push(install(staging, source, &hops)?);
                continue;
            }
            let chosen = alternatives.get(name).map(String::as_str);
            let (dir, hops) =
                find_alternative(source, name, chosen)?.ok_or_else(|| match chosen {
                    Some(dir) => LibError::MissingAlternative {
                        library: name.clone(),
                        dir: dir.to_owned(),
                        needed_by: rel.clone(),
                    },
                    None => LibError::Missing {
                        library: name.clone(),
                        needed_by: rel.clone(),
                    },
                })?;
            let real = install(staging, source, &hops)?;
            staging.symlink(
                &format!("{ALTERNATIVES_PARENT}/{name}"),
                &format!("{dir}/{name}"),
            )?;
            queue.push(real);
        }
    }
    check(root)
}

/// Checks that every ELF file under `root` finds its interpreter and each `DT_NEEDED` library
/// inside `root`, the way the guest loader searches. Returns them all.
pub fn check(root: &Path) -> Result<Vec<ElfFile>, LibError> {
    let mut files = Vec::new();
    for rel in elf_files(root)? {
        let file = describe(root, &rel)?;
        if let Some(interp) = &file.interpreter {
            let found = stage::resolve_in(root, &stage::normalize("", interp)?)?;
            if found.is_none() {
                let (path, name) = (rel.clone(), interp.clone());
                return Err(LibError::Unresolved {
                    path,
                    what: "interpreter",
                    name,
                });
            }
        }
        for name in &file.needed {
            if !in_runpath(root, &file, name)? && find_library(root, name)?.is_none() {
                let (path, name) = (rel.clone(), name.clone());
                return Err(LibError::Unresolved {
                    path,
                    what: "library",
                    name,
                });
            }
        }
        files.push(file);
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("bud-libs-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// The host's own libc stands in for the packages: this test binary needs it.
    fn host_source(dir: &Path) {
        for lib in [
            "libc.so.6",
            "libgcc_s.so.1",
            "libm.so.6",
            "ld-linux-x86-64.so.2",
        ] {
            let from = Path::new("/lib/x86_64-linux-gnu").join(lib);
            let to = dir.join("lib/x86_64-linux-gnu").join(lib);
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(from, to).unwrap();
        }
        std::fs::create_dir_all(dir.join("lib64")).unwrap();
        std::os::unix::fs::symlink(
            "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
            dir.join("lib64/ld-linux-x86-64.so.2"),
        )
        .unwrap();
    }

    #[test]
    fn a_library_beside_its_user_through_origin_is_found_there() {
        let root = scratch("origin");
        let lib = root.join("usr/local/lib/python3.11/dist-packages/numpy.libs/libx.so.1");
        std::fs::create_dir_all(lib.parent().unwrap()).unwrap();
        std::fs::write(&lib, b"").unwrap();
        let module = |runpath: &str| ElfFile {
            path: "usr/local/lib/python3.11/dist-packages/numpy/core/_m.so".into(),
            interpreter: None,
            needed: vec!["libx.so.1".into()],
            runpath: Some(runpath.into()),
        };

        assert!(in_runpath(&root, &module("$ORIGIN/../../numpy.libs"), "libx.so.1").unwrap());
        assert!(
            in_runpath(
                &root,
                &module("/nowhere:${ORIGIN}/../../numpy.libs"),
                "libx.so.1"
            )
            .unwrap()
        );
        assert!(!in_runpath(&root, &module("$ORIGIN"), "libx.so.1").unwrap());
        assert!(!in_runpath(&root, &module("numpy.libs"), "libx.so.1").unwrap());
        assert!(
            !in_runpath(
                &root,
                &module("$ORIGIN/../../../../../../../.."),
                "libx.so.1"
            )
            .unwrap()
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn complete_adds_interpreter_and_libraries_of_a_binary() {
        let root = scratch("complete");
        let source = root.join("src");
        host_source(&source);
        let staging = Staging::reset(&root.join("stage")).unwrap();
        staging
            .copy(&std::env::current_exe().unwrap(), "init")
            .unwrap();

        let files = complete(&staging, &source, &BTreeMap::new()).unwrap();

        assert!(staging.contains("lib/x86_64-linux-gnu/libc.so.6"));
        let ld = std::fs::read_link(staging.path("lib64/ld-linux-x86-64.so.2")).unwrap();
        assert_eq!(ld, Path::new("/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"));
        assert!(files.iter().any(|f| f.path == "init"));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn missing_library_is_named() {
        let root = scratch("missing");
        let staging = Staging::reset(&root.join("stage")).unwrap();
        staging
            .copy(&std::env::current_exe().unwrap(), "init")
            .unwrap();

        let err = complete(&staging, &root.join("empty-source"), &BTreeMap::new()).unwrap_err();

        assert!(
            matches!(&err, LibError::Missing { needed_by, .. } | LibError::MissingInterpreter { needed_by, .. } if needed_by == "init"),
            "{err}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// Source and staging for a binary that needs `libgcc_s.so.1` (this test binary), which the source holds only
    /// as two alternatives (`a-first` and `b-chosen`, as `blas` and `openblas-serial`).
    fn with_alternatives(name: &str) -> (PathBuf, PathBuf, Staging) {
        let root = scratch(name);
        let source = root.join("src");
        host_source(&source);
        let lib = source.join("lib/x86_64-linux-gnu/libgcc_s.so.1");
        for dir in ["a-first", "b-chosen"] {
            let to = source
                .join(ALTERNATIVES_PARENT)
                .join(dir)
                .join("libgcc_s.so.1");
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(&lib, to).unwrap();
        }
        std::fs::remove_file(lib).unwrap();
        let staging = Staging::reset(&root.join("stage")).unwrap();
        staging
            .copy(&std::env::current_exe().unwrap(), "init")
            .unwrap();
        (root, source, staging)
    }

    #[test]
    fn an_alternative_the_recipe_chooses_is_linked_and_others_take_the_first() {
        let (root, source, staging) = with_alternatives("alternatives");
        let chosen = BTreeMap::from([("libgcc_s.so.1".to_owned(), "b-chosen".to_owned())]);
        let (root2, source2, staging2) = with_alternatives("alternatives-default");

        complete(&staging, &source, &chosen).unwrap();
        complete(&staging2, &source2, &BTreeMap::new()).unwrap();

        let link = |s: &Staging| {
            std::fs::read_link(s.path(&format!("{ALTERNATIVES_PARENT}/libgcc_s.so.1"))).unwrap()
        };
        assert_eq!(link(&staging), Path::new("b-chosen/libgcc_s.so.1"));
        assert!(staging.contains(&format!("{ALTERNATIVES_PARENT}/b-chosen/libgcc_s.so.1")));
        assert!(!staging.contains(&format!("{ALTERNATIVES_PARENT}/a-first/libgcc_s.so.1")));
        assert_eq!(link(&staging2), Path::new("a-first/libgcc_s.so.1"));
        std::fs::remove_dir_all(&root).unwrap();
        std::fs::remove_dir_all(&root2).unwrap();
    }

    #[test]
    fn a_chosen_alternative_the_packages_lack_is_named() {
        let (root, source, staging) = with_alternatives("alternatives-missing");
        let chosen = BTreeMap::from([("libgcc_s.so.1".to_owned(), "c-absent".to_owned())]);

        let err = complete(&staging, &source, &chosen).unwrap_err();

        assert!(
            matches!(&err, LibError::MissingAlternative { dir, .. } if dir == "c-absent"),
            "{err}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn check_reports_an_unresolved_library() {
        let root = scratch("check");
        std::fs::copy(std::env::current_exe().unwrap(), root.join("init")).unwrap();

        let err = check(&root).unwrap_err();

        assert!(matches!(err, LibError::Unresolved { .. }), "{err}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
