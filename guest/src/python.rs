//! CPython in the image: which parts of the standard library go in, how they are packed, and
//! compiling them (and bud's own `guest/python/*.py`) to `.pyc` with the guest's own
//! interpreter.
//!
//! The pure-Python standard library ships as one deflated archive, `/usr/lib/python311.zip`,
//! which is already first on the interpreter's default `sys.path` (see `zip.rs` for why);
//! extension modules stay files in `lib-dynload/`. Every `.pyc` is an unchecked-hash pyc
//! (PEP 552): no source mtime inside, never revalidated or rewritten in the guest. Compilation
//! runs with `PYTHONHASHSEED=0` and a clean environment so that set constants and everything
//! else marshal writes come out the same on every build. This module never runs the host's
//! Python.
//!
//! One file although over 500 lines: choosing, compiling and packing the standard library is
//! one path through about 400 lines, and the rest is its unit tests, kept below the code.

use std::collections::BTreeMap;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::recipe::{self, Python};
use crate::run::{self, RunError};
use crate::stage::{StageError, Staging};
use crate::zip::{self, ZipEntry, ZipError};

/// The guest interpreter, relative to the root.
pub const INTERPRETER: &str = "usr/bin/python3.11";
/// The standard library directory, relative to the root: only `lib-dynload/` is left in it.
/// (The interpreter still finds its prefix, /usr, through the zip: 3.11's getpath takes
/// `lib/python311.zip` as a landmark too.)
pub const STDLIB_DIR: &str = "usr/lib/python3.11";
/// The zipped pure-Python standard library, relative to the root.
pub const STDLIB_ZIP: &str = "usr/lib/python311.zip";
/// Where compiled extension modules live, relative to [`STDLIB_DIR`].
pub const DYNLOAD_DIR: &str = "lib-dynload";
/// `sys.implementation.cache_tag` of the guest interpreter.
pub const CACHE_TAG: &str = "cpython-311";

/// Compiles the files listed (tab-separated source, pyc, displayed name) in `argv[1]`.
const COMPILE_SCRIPT: &str = r#"
import sys, py_compile
mode = py_compile.PycInvalidationMode.UNCHECKED_HASH
with open(sys.argv[1], encoding="utf-8") as jobs:
    for line in jobs:
        source, cfile, dfile = line.rstrip("\n").split("\t")
        py_compile.compile(source, cfile=cfile, dfile=dfile, doraise=True, optimize=0,
                           invalidation_mode=mode)
"#;

#[derive(Debug, thiserror::Error)]
pub enum PythonError {
    #[error("walk {path}")]
    Walk {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: only symlinks from one .py file to another in the same tree are supported")]
    UnsupportedSymlink { path: String },
    #[error("stage Python file")]
    Stage(#[from] StageError),
    #[error("write compile list {path}")]
    WriteJobs {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("compile .pyc files with the guest's python")]
    Compile(#[source] RunError),
    #[error("read {path} for the archive")]
    ReadForZip {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("create {path}")]
    CreateZip {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("write {path}")]
    Zip {
        path: PathBuf,
        #[source]
        source: ZipError,
    },
}

/// One `.py` to compile: host source, host pyc path and the path the code object reports as
/// its file name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileJob {
    pub source: PathBuf,
    pub cfile: PathBuf,
    pub dfile: String,
}

/// Sorted entries of one directory.
pub(crate) fn sorted_dir(dir: &Path) -> Result<Vec<(String, std::fs::FileType)>, PythonError> {
    let walk_err = |source| PythonError::Walk {
        path: dir.to_owned(),
        source,
    };
    let mut out = Vec::new();
    for dirent in std::fs::read_dir(dir).map_err(walk_err)? {
        let dirent = dirent.map_err(walk_err)?;
        let file_type = dirent.file_type().map_err(walk_err)?;
        out.push((dirent.file_name().to_string_lossy().into_owned(), file_type));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// `name.py` -> `__pycache__/name.cpython-311.pyc` in the same directory.
fn cached_pyc(rel: &str) -> String {
    let (dir, file) = rel.rsplit_once('/').map_or(("", rel), |(d, f)| (d, f));
    let stem = file.strip_suffix(".py").unwrap_or(file);
    let pyc = format!("__pycache__/{stem}.{CACHE_TAG}.pyc");
    if dir.is_empty() {
        pyc
    } else {
        format!("{dir}/{pyc}")
    }
}

/// Module name of a lib-dynload file: `_ssl.cpython-311-x86_64-linux-gnu.so` -> `_ssl`.
fn extension_module(file: &str) -> &str {
    file.split_once('.').map_or(file, |(name, _)| name)
}

/// The standard library the recipe keeps, as found in the unpacked packages. Paths are
/// relative to the library directory (`json/__init__.py`), each with its host file.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StdlibSelection {
    /// Pure-Python modules (a `.py` symlink counts, read through).
    pub modules: Vec<(String, PathBuf)>,
    /// Other files that go into the archive (the license text).
    pub data: Vec<(String, PathBuf)>,
    /// Extension modules (`lib-dynload/...so`).
    pub extensions: Vec<(String, PathBuf)>,
}

struct StdlibWalk<'a> {
    recipe: &'a Python,
    lib: PathBuf,
    selection: StdlibSelection,
}

impl StdlibWalk<'_> {
    fn dropped(&self, rel: &str) -> bool {
        if self
            .recipe
            .drop
            .iter()
            .any(|pattern| recipe::pattern_drops(pattern, rel))
        {
            return true;
        }
        let dynload = rel
            .strip_prefix(DYNLOAD_DIR)
            .and_then(|r| r.strip_prefix('/'));
        dynload.is_some_and(|file| {
            self.recipe
                .drop_dynload
                .iter()
                .any(|m| m == extension_module(file))
        })
    }

    fn walk(&mut self, rel_dir: &str) -> Result<(), PythonError> {
        let host_dir = self.lib.join(rel_dir);
        for (name, file_type) in sorted_dir(&host_dir)? {
            let rel = if rel_dir.is_empty() {
                name.clone()
            } else {
                format!("{rel_dir}/{name}")
            };
            let host = host_dir.join(&name);
            if self.dropped(&rel) {
                continue;
            }
            if file_type.is_dir() {
                self.walk(&rel)?;
            } else if file_type.is_symlink() {
                self.check_symlink(&rel, &host)?;
                self.selection.modules.push((rel, host));
            } else if rel.starts_with(&format!("{DYNLOAD_DIR}/")) {
                self.selection.extensions.push((rel, host));
            } else if name.ends_with(".py") {
                self.selection.modules.push((rel, host));
            } else {
                self.selection.data.push((rel, host));
            }
        }
        Ok(())
    }

    /// Only a symlink from one `.py` to another in the same directory (Debian's
    /// sysconfigdata alias) is understood; it becomes a module of its own.
    fn check_symlink(&self, rel: &str, host: &Path) -> Result<(), PythonError> {
        let unsupported = || PythonError::UnsupportedSymlink {
            path: rel.to_owned(),
        };
        let target = std::fs::read_link(host).map_err(|_| unsupported())?;
        let target = target.to_str().ok_or_else(unsupported)?;
        let same_dir_py = !target.contains('/') && target.ends_with(".py") && rel.ends_with(".py");
        if same_dir_py && host.is_file() {
            Ok(())
        } else {
            Err(unsupported())
        }
    }
}

/// Walks the standard library of the unpacked packages at `root` and keeps what the recipe
/// does not drop.
pub fn select_stdlib(recipe: &Python, root: &Path) -> Result<StdlibSelection, PythonError> {
    let mut walk = StdlibWalk {
        recipe,
        lib: root.join(STDLIB_DIR),
        selection: StdlibSelection::default(),
    };
    walk.walk("")?;
    Ok(walk.selection)
}

/// Every directory above the archive members, as `dir/` entries.
fn parent_dirs(names: &[String]) -> Vec<String> {
    let mut dirs = std::collections::BTreeSet::new();
    for name in names {
        let mut rest = name.as_str();
        while let Some((dir, _)) = rest.rsplit_once('/') {
            dirs.insert(format!("{dir}/"));
            rest = dir;
        }
    }
    dirs.into_iter().collect()
}

fn read_for_zip(path: &Path) -> Result<Vec<u8>, PythonError> {
    std::fs::read(path).map_err(|source| PythonError::ReadForZip {
        path: path.to_owned(),
        source,
    })
}

/// Stages the standard library the recipe keeps: extension modules into `lib-dynload/`, the
/// rest compiled by the guest's python (in `work_dir`) and packed into [`STDLIB_ZIP`], with
/// the sources when the recipe ships them. Returns how many modules were compiled.
pub fn stage_stdlib(
    recipe: &Python,
    root: &Path,
    staging: &Staging,
    work_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<usize, PythonError> {
    let selection = select_stdlib(recipe, root)?;
    for (rel, host) in &selection.extensions {
        staging.copy(host, &format!("{STDLIB_DIR}/{rel}"))?;
    }
    let pyc_dir = Staging::reset(&work_dir.join("stdlib-pyc"))?;
    let jobs: Vec<CompileJob> = selection
        .modules
        .iter()
        .map(|(rel, host)| CompileJob {
            source: host.clone(),
            cfile: pyc_dir.path(&format!("{rel}c")),
            dfile: format!("/{STDLIB_ZIP}/{rel}"),
        })
        .collect();
    // Column positions only draw `^^^` under source lines: dead weight without sources.
    compile(
        root,
        &jobs,
        recipe.ship_sources,
        work_dir,
        "stdlib",
        progress,
    )?;

    let mut files: BTreeMap<String, PathBuf> = BTreeMap::new();
    for ((rel, host), job) in selection.modules.iter().zip(&jobs) {
        files.insert(format!("{rel}c"), job.cfile.clone());
        if recipe.ship_sources {
            files.insert(rel.clone(), host.clone());
        }
    }
    for (rel, host) in &selection.data {
        files.insert(rel.clone(), host.clone());
    }
    write_zip(&files, &staging.path(STDLIB_ZIP))?;
    Ok(jobs.len())
}

/// Packs `files` (archive name -> host file) and the directories above them into a new
/// archive at `path`.
pub(crate) fn write_zip(files: &BTreeMap<String, PathBuf>, path: &Path) -> Result<(), PythonError> {
    let names: Vec<String> = files.keys().cloned().collect();
    let mut entries: BTreeMap<String, Vec<u8>> = parent_dirs(&names)
        .into_iter()
        .map(|dir| (dir, Vec::new()))
        .collect();
    for (name, host) in files {
        entries.insert(name.clone(), read_for_zip(host)?);
    }
    let entries: Vec<ZipEntry> = entries
        .into_iter()
        .map(|(name, data)| ZipEntry { name, data })
        .collect();
    let file = std::fs::File::create(path).map_err(|source| PythonError::CreateZip {
        path: path.to_owned(),
        source,
    })?;
    zip::write(BufWriter::new(file), &entries).map_err(|source| PythonError::Zip {
        path: path.to_owned(),
        source,
    })?;
    Ok(())
}

/// bud's own modules: the `*.py` files directly in `dir` (none if `dir` is missing), sorted.
pub fn bud_modules(dir: &Path) -> Result<Vec<PathBuf>, PythonError> {
    if !dir.exists() {
        return Ok(Vec::new());
    }
    Ok(sorted_dir(dir)?
        .into_iter()
        .filter(|(name, file_type)| file_type.is_file() && name.ends_with(".py"))
        .map(|(name, _)| dir.join(name))
        .collect())
}

/// Stages bud's own modules ([`bud_modules`] of `dir`) at `guest_dir`, sources included, and
/// returns them to compile into `__pycache__/`.
pub fn stage_bud_modules(
    dir: &Path,
    guest_dir: &str,
    staging: &Staging,
) -> Result<Vec<CompileJob>, PythonError> {
    let mut jobs = Vec::new();
    for source in bud_modules(dir)? {
        let name = source
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let guest = format!("{guest_dir}/{name}");
        staging.copy(&source, &guest)?;
        jobs.push(CompileJob {
            cfile: staging.path(&cached_pyc(&guest)),
            dfile: format!("/{guest}"),
            source,
        });
    }
    Ok(jobs)
}

/// Compiles `jobs` with the interpreter of the unpacked packages at `root`, run on the host
/// with `PYTHONHOME` pointing into them. `work_dir` holds the job list (`name` tells lists
/// apart). Without `debug_ranges` the code objects carry no column positions (PEP 657): they
/// only draw the `^^^` markers under a traceback's source line, so they are dead weight (about
/// a quarter of a pyc) where no source ships.
pub fn compile(
    root: &Path,
    jobs: &[CompileJob],
    debug_ranges: bool,
    work_dir: &Path,
    name: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<(), PythonError> {
    if jobs.is_empty() {
        return Ok(());
    }
    let list = work_dir.join(format!("compile-{name}.tsv"));
    let mut text = String::new();
    for job in jobs {
        text.push_str(&format!(
            "{}\t{}\t{}\n",
            job.source.display(),
            job.cfile.display(),
            job.dfile
        ));
    }
    std::fs::write(&list, text).map_err(|source| PythonError::WriteJobs {
        path: list.clone(),
        source,
    })?;
    let mut cmd = guest_python(root);
    if !debug_ranges {
        cmd.env("PYTHONNODEBUGRANGES", "1");
    }
    cmd.args(["-S", "-c", COMPILE_SCRIPT]).arg(&list);
    run::run(&mut cmd, false, progress).map_err(PythonError::Compile)?;
    Ok(())
}

/// A command running the guest's interpreter from the unpacked tree at `root` on the host,
/// with a clean, fixed environment.
pub fn guest_python(root: &Path) -> Command {
    let mut cmd = Command::new(root.join(INTERPRETER));
    cmd.env_clear()
        .env("PYTHONHOME", root.join("usr"))
        .env("PYTHONHASHSEED", "0")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("LC_ALL", "C.UTF-8");
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_pyc_path_uses_the_cache_tag() {
        assert_eq!(
            cached_pyc("usr/lib/bud/worker.py"),
            "usr/lib/bud/__pycache__/worker.cpython-311.pyc"
        );
        assert_eq!(cached_pyc("a.py"), "__pycache__/a.cpython-311.pyc");
    }

    #[test]
    fn extension_module_name_is_the_part_before_the_first_dot() {
        assert_eq!(
            extension_module("_ssl.cpython-311-x86_64-linux-gnu.so"),
            "_ssl"
        );
        assert_eq!(extension_module("mmap.so"), "mmap");
    }

    fn python(ship_sources: bool) -> Python {
        Python {
            ship_sources,
            drop: vec!["test".into(), "**/tests".into()],
            drop_dynload: vec!["_ssl".into()],
            zipped: Default::default(),
        }
    }

    /// A fake unpacked tree: a few modules, a test package, a dropped extension, an alias.
    fn fake_tree(root: &Path) {
        let lib = root.join(STDLIB_DIR);
        std::fs::create_dir_all(lib.join("json/tests")).unwrap();
        std::fs::create_dir_all(lib.join("test")).unwrap();
        std::fs::create_dir_all(lib.join(DYNLOAD_DIR)).unwrap();
        std::fs::write(lib.join("os.py"), "x = 1\n").unwrap();
        std::fs::write(lib.join("json/__init__.py"), "").unwrap();
        std::fs::write(lib.join("json/tests/t.py"), "").unwrap();
        std::fs::write(lib.join("test/t.py"), "").unwrap();
        std::fs::write(lib.join("data.txt"), "d").unwrap();
        std::fs::write(
            lib.join("lib-dynload/_ssl.cpython-311-x86_64-linux-gnu.so"),
            "",
        )
        .unwrap();
        std::fs::write(
            lib.join("lib-dynload/mmap.cpython-311-x86_64-linux-gnu.so"),
            "",
        )
        .unwrap();
        std::os::unix::fs::symlink("os.py", lib.join("alias.py")).unwrap();
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("bud-python-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn selection_keeps_modules_data_and_extensions_the_recipe_does_not_drop() {
        let root = scratch("select");
        fake_tree(&root);
        let lib = root.join(STDLIB_DIR);

        let selection = select_stdlib(&python(false), &root).unwrap();

        let modules: Vec<&str> = selection.modules.iter().map(|(r, _)| r.as_str()).collect();
        assert_eq!(modules, ["alias.py", "json/__init__.py", "os.py"]);
        assert_eq!(selection.modules[0].1, lib.join("alias.py"));
        assert_eq!(
            selection.data,
            [("data.txt".to_owned(), lib.join("data.txt"))]
        );
        let extensions: Vec<&str> = selection
            .extensions
            .iter()
            .map(|(r, _)| r.as_str())
            .collect();
        assert_eq!(
            extensions,
            ["lib-dynload/mmap.cpython-311-x86_64-linux-gnu.so"]
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn symlink_out_of_the_directory_is_refused() {
        let root = scratch("badlink");
        fake_tree(&root);
        std::os::unix::fs::symlink("/etc/x.py", root.join(STDLIB_DIR).join("bad.py")).unwrap();

        let err = select_stdlib(&python(false), &root).unwrap_err();

        assert!(matches!(err, PythonError::UnsupportedSymlink { path } if path == "bad.py"));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn parent_dirs_lists_every_level_once() {
        let names = [
            "a/b/c.pyc".to_owned(),
            "a/d.pyc".to_owned(),
            "e.pyc".to_owned(),
        ];

        assert_eq!(parent_dirs(&names), ["a/", "a/b/"]);
    }
}
