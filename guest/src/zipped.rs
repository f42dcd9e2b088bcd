//! Pure-Python packages shipped as one precompiled zip each (the recipe's `python.zipped`):
//! a wheel of the unpacked packages (Debian's pip) is unpacked by the guest's python, its
//! modules compiled by it as the standard library is (unchecked-hash pycs beside where the
//! sources were, no sources, no column positions), and packed with its data files into one
//! archive that `zipimport` reads.
//!
//! Why, measured (pip 23.0.1, `python3.11 -m pip --version` on the host): from the wheel
//! itself, which holds sources only, 1.57 s and 28 779 page faults (every module compiled at
//! every run, and the compiler's memory churn); from a zip of pycs, 0.43 s and 8 661. On
//! kvm_pvm every page fault and system call of a guest process is emulated kernel work, so
//! the faults are most of what a run of pip costs there. One archive instead of pip's ~800
//! files also keeps the image's entry count (each one is guest-kernel time at every template
//! boot) where it was.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::python::{self, CompileJob, PythonError, guest_python};
use crate::recipe::pattern_drops;
use crate::run::{self, RunError};
use crate::stage::{Staging, files_under};

/// Unpacks the wheel `argv[1]` into the directory `argv[2]`.
const UNPACK_SCRIPT: &str =
    "import sys, zipfile\nzipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])\n";

/// Why a zipped package could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ZippedError {
    #[error(
        "recipe python.zipped `{dest}`: pattern `{pattern}` matches {found} files of the packages, not one"
    )]
    NotOne {
        dest: String,
        pattern: String,
        found: usize,
    },
    #[error("unpack {wheel} with the guest's python")]
    Unpack {
        wheel: PathBuf,
        #[source]
        source: RunError,
    },
    #[error("python")]
    Python(#[from] PythonError),
}

/// Stages every zip `zipped` names (guest path -> wheel pattern), from the packages unpacked
/// at `root`, working in `work_dir`. Returns how many modules were compiled.
pub fn stage(
    zipped: &BTreeMap<String, String>,
    root: &Path,
    staging: &Staging,
    work_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<usize, ZippedError> {
    let mut compiled = 0;
    for (i, (dest, pattern)) in zipped.iter().enumerate() {
        let wheel = find_one(root, dest, pattern)?;
        let unpacked =
            Staging::reset(&work_dir.join(format!("zipped-{i}"))).map_err(PythonError::from)?;
        let mut cmd = guest_python(root);
        cmd.args(["-S", "-c", UNPACK_SCRIPT])
            .arg(&wheel)
            .arg(unpacked.root());
        run::run(&mut cmd, false, progress).map_err(|source| ZippedError::Unpack {
            wheel: wheel.clone(),
            source,
        })?;
        let pycs =
            Staging::reset(&work_dir.join(format!("zipped-{i}-pyc"))).map_err(PythonError::from)?;
        let mut files: BTreeMap<String, PathBuf> = BTreeMap::new();
        let mut jobs = Vec::new();
        for rel in files_under(unpacked.root()).map_err(PythonError::from)? {
            let host = unpacked.path(&rel);
            if rel.ends_with(".py") {
                let job = CompileJob {
                    source: host,
                    cfile: pycs.path(&format!("{rel}c")),
                    dfile: format!("/{dest}/{rel}"),
                };
                files.insert(format!("{rel}c"), job.cfile.clone());
                jobs.push(job);
            } else {
                files.insert(rel, host);
            }
        }
        python::compile(
            root,
            &jobs,
            false,
            work_dir,
            &format!("zipped-{i}"),
            progress,
        )?;
        compiled += jobs.len();
        let zip = staging.parent_of(dest).map_err(PythonError::from)?;
        python::write_zip(&files, &zip)?;
        progress(&format!(
            "{dest}: {} modules of {} compiled, {} files in all",
            jobs.len(),
            wheel.file_name().unwrap_or_default().to_string_lossy(),
            files.len()
        ));
    }
    Ok(compiled)
}

/// The one file of the packages at `root` that `pattern` matches.
fn find_one(root: &Path, dest: &str, pattern: &str) -> Result<PathBuf, ZippedError> {
    let (dir, name) = pattern.rsplit_once('/').unwrap_or(("", pattern));
    let found: Vec<String> = match python::sorted_dir(&root.join(dir)) {
        Ok(entries) => entries
            .into_iter()
            .filter(|(n, t)| t.is_file() && pattern_drops(name, n))
            .map(|(n, _)| n)
            .collect(),
        Err(_) => Vec::new(),
    };
    match found.as_slice() {
        [one] => Ok(root.join(dir).join(one)),
        _ => Err(ZippedError::NotOne {
            dest: dest.to_owned(),
            pattern: pattern.to_owned(),
            found: found.len(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pattern_must_match_exactly_one_file() {
        let root = std::env::temp_dir().join(format!("bud-zipped-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("w")).unwrap();
        for n in ["pip-23.0.1-py3-none-any.whl", "setuptools-66.whl"] {
            std::fs::write(root.join("w").join(n), b"PK").unwrap();
        }

        assert_eq!(
            find_one(&root, "p.zip", "w/pip-*.whl").unwrap(),
            root.join("w/pip-23.0.1-py3-none-any.whl")
        );
        for (pattern, n) in [("w/*.whl", 2), ("w/wheel-*.whl", 0), ("nowhere/*.whl", 0)] {
            assert!(
                matches!(find_one(&root, "p.zip", pattern), Err(ZippedError::NotOne { found, .. }) if found == n),
                "{pattern}"
            );
        }
    }
}
