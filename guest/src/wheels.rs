//! A user template's Python packages: wheels for the guest's interpreter, fetched by pip on
//! the host and unpacked into the image. Nothing of a package runs on the host.
//!
//! - **Fetch** ([`fetch`]): `pip download` with binary-only resolution for the guest's
//!   platform (CPython 3.11, glibc 2.36 x86_64: every `manylinux` tag up to 2.36, `abi3`
//!   and pure-Python wheels), so pip's resolver picks the versions and the dependencies but
//!   never builds a source distribution (which would run its `setup.py`): a requirement
//!   that exists only as an sdist fails, named. pip is Debian's own (the `python3-pip-whl`
//!   wheel of the base image's packages), run from its wheel by the host's `python3`, with
//!   the host's pip configuration (its index, certificates and proxies). Downloads land in
//!   one cache directory shared by every build (`<build>/wheels/`), where pip finds them
//!   again: a second build of the same requirements fetches nothing but the index pages.
//! - **Unpack** ([`unpack`]): each wheel's files go where pip would install them for the
//!   guest's `/usr/bin/python3` (purelib and platlib into [`SITE_DIR`], scripts into
//!   [`SCRIPTS_DIR`] with their `#!python` line pointed at the guest interpreter, console
//!   scripts of `entry_points.txt` written as small launchers), read with the `zip` crate.
//!   Paths that would leave their directory are refused.
//!
//! Why pip: its resolver is what users' requirements mean (markers, extras, conflicts).
//! Why not `pip install --target`: it would install for the host's interpreter (scripts'
//! `#!` lines, the tags checked against the host) and may build sdists.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::run::{self, RunError};
use crate::stage::{StageError, Staging};

/// Where the wheels' modules go in the image: on the guest interpreter's default `sys.path`
/// (Debian's `site.py` puts `/usr/local/lib/python3.11/dist-packages` before the distro's
/// `/usr/lib/python3/dist-packages`, as for a `pip install` in the guest).
pub const SITE_DIR: &str = "usr/local/lib/python3.11/dist-packages";
/// Where their scripts go (on the worker's `PATH`).
pub const SCRIPTS_DIR: &str = "usr/local/bin";
/// The guest interpreter a script's `#!python` line becomes.
const GUEST_PYTHON: &str = "/usr/bin/python3";
/// The guest's highest glibc (Debian bookworm): `manylinux_2_N` wheels up to it load.
const GLIBC_MINOR: u32 = 36;

#[derive(Debug, thiserror::Error)]
pub enum WheelError {
    #[error("pip needs the host's python3 (Debian's `python3` package)")]
    NoPython,
    #[error("create {path}")]
    Create {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{requirement}: no wheel for the guest's Python (CPython 3.11, manylinux x86_64, or pure \
         Python) in the index, or no such package or version; bud never builds a package from \
         source (an sdist's setup.py would run on the host), so sdist-only packages are refused"
    )]
    NoWheel { requirement: String },
    #[error("the requirements conflict:\n{0}")]
    Conflict(String),
    #[error("pip download")]
    Pip(#[source] RunError),
    #[error("pip said it saved {0}, which is not there")]
    Lost(PathBuf),
    #[error("open wheel {wheel}")]
    Open {
        wheel: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("read wheel {wheel}: {why}")]
    Read { wheel: PathBuf, why: String },
    #[error("wheel {wheel}: entry {entry:?} would leave its directory")]
    Escapes { wheel: PathBuf, entry: String },
    #[error("stage wheel files")]
    Stage(#[from] StageError),
}

/// A wheel fetched for the template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wheel {
    /// The file in the wheel cache.
    pub path: PathBuf,
    /// Project name and version, from the file name.
    pub name: String,
    pub version: String,
}

impl Wheel {
    /// Parses `{name}-{version}(-{build})?-{python}-{abi}-{platform}.whl`.
    fn from_path(path: PathBuf) -> Option<Wheel> {
        let file = path.file_name()?.to_str()?.strip_suffix(".whl")?.to_owned();
        let mut parts = file.split('-');
        let name = parts.next()?.to_owned();
        let version = parts.next()?.to_owned();
        (parts.count() >= 3).then_some(Wheel {
            path,
            name,
            version,
        })
    }
}

/// The `--platform` tags of the guest: manylinux_2_N for every N up to the guest's glibc,
/// and the legacy aliases (pip adds pure-Python wheels itself).
fn platforms() -> Vec<String> {
    let mut tags: Vec<String> = (5..=GLIBC_MINOR)
        .rev()
        .map(|minor| format!("manylinux_2_{minor}_x86_64"))
        .collect();
    tags.extend(
        [
            "manylinux2014_x86_64",
            "manylinux2010_x86_64",
            "manylinux1_x86_64",
        ]
        .map(String::from),
    );
    tags
}

/// The pip of Debian's `python3-pip-whl` unpacked under `pip_root` (the wheel file itself:
/// `python3 <wheel>/pip` runs pip from it).
pub fn pip_wheel(pip_root: &Path) -> Option<PathBuf> {
    let dir = pip_root.join("usr/share/python-wheels");
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("pip-") && n.ends_with(".whl"))
        })
        .collect();
    found.sort();
    found.pop()
}

/// Fetches wheels for `requirements` and their dependencies into `cache` (module docs);
/// returns them sorted by name. Progress lines are pip's own.
pub fn fetch(
    requirements: &[String],
    pip: &Path,
    cache: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<Wheel>, WheelError> {
    if requirements.is_empty() {
        return Ok(Vec::new());
    }
    let python = crate::host::find_program("python3").ok_or(WheelError::NoPython)?;
    let cache = &std::path::absolute(cache).map_err(|source| WheelError::Create {
        path: cache.to_owned(),
        source,
    })?;
    std::fs::create_dir_all(cache).map_err(|source| WheelError::Create {
        path: cache.to_owned(),
        source,
    })?;
    // As a file, so that no requirement is ever read as an option (they are checked not to
    // start with `-` too).
    let list = cache.join(format!(".requirements-{}.txt", std::process::id()));
    std::fs::write(&list, requirements.join("\n") + "\n").map_err(|source| WheelError::Create {
        path: list.clone(),
        source,
    })?;
    let mut cmd = Command::new(python);
    cmd.arg(pip.join("pip"))
        .args(["download", "--only-binary=:all:", "--no-input"])
        .args(["--disable-pip-version-check", "--progress-bar", "off"])
        .args(["--python-version", "3.11", "--implementation", "cp"])
        .args(["--abi", "cp311", "--abi", "abi3", "--abi", "none"]);
    for tag in platforms() {
        cmd.args(["--platform", &tag]);
    }
    // pip names what it saved relative to its working directory: the cache.
    cmd.current_dir(cache)
        .arg("--dest")
        .arg(cache)
        .arg("-r")
        .arg(&list);
    progress(&format!("pip download {}", requirements.join(" ")));
    let mut saved = BTreeSet::new();
    let mut missing = None;
    let mut conflict = Vec::new();
    let result = run::run(&mut cmd, false, &mut |line: &str| {
        progress(line);
        let line = line.trim();
        for prefix in ["Saved ", "File was already downloaded "] {
            if let Some(path) = line.strip_prefix(prefix) {
                saved.insert(PathBuf::from(path.trim()));
            }
        }
        if let Some(name) = line.strip_prefix("ERROR: No matching distribution found for ") {
            missing = Some(name.trim().to_owned());
        }
        if line.contains("conflict") || line.starts_with("The conflict is caused by") {
            conflict.push(line.to_owned());
        }
    });
    let _ = std::fs::remove_file(&list);
    if let Err(e) = result {
        return Err(match (missing, conflict.is_empty()) {
            (_, false) => WheelError::Conflict(conflict.join("\n")),
            (Some(requirement), true) => WheelError::NoWheel { requirement },
            (None, true) => WheelError::Pip(e),
        });
    }
    let mut wheels = Vec::new();
    for path in saved {
        let path = if path.is_absolute() {
            path
        } else {
            cache.join(path)
        };
        if !path.is_file() {
            return Err(WheelError::Lost(path));
        }
        // pip only saves wheels here (binary-only); anything else is not ours to unpack.
        if let Some(wheel) = Wheel::from_path(path) {
            wheels.push(wheel);
        }
    }
    wheels.sort_by_key(|w| w.name.to_lowercase());
    Ok(wheels)
}

/// What [`unpack`] put in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UnpackReport {
    pub files: usize,
    pub scripts: usize,
}

/// Unpacks `wheels` into the staging tree (module docs).
pub fn unpack(wheels: &[Wheel], staging: &Staging) -> Result<UnpackReport, WheelError> {
    let mut report = UnpackReport::default();
    for wheel in wheels {
        let path = &wheel.path;
        let read_err = |e: &dyn std::fmt::Display| WheelError::Read {
            wheel: path.clone(),
            why: e.to_string(),
        };
        let file = std::fs::File::open(path).map_err(|source| WheelError::Open {
            wheel: path.clone(),
            source,
        })?;
        let mut archive = ::zip::ZipArchive::new(file).map_err(|e| read_err(&e))?;
        let mut entry_points = None;
        for i in 0..archive.len() {
            let mut entry = archive.by_index(i).map_err(|e| read_err(&e))?;
            if entry.is_dir() {
                continue;
            }
            let name = entry.name().to_owned();
            let Some(dest) = destination(&name) else {
                return Err(WheelError::Escapes {
                    wheel: path.clone(),
                    entry: name,
                });
            };
            let mut bytes = Vec::with_capacity(entry.size() as usize);
            entry.read_to_end(&mut bytes).map_err(|e| read_err(&e))?;
            let executable = entry.unix_mode().is_some_and(|m| m & 0o111 != 0);
            let dest = match dest {
                Place::Skip => continue,
                Place::Site(rel) => {
                    if rel.ends_with(".dist-info/entry_points.txt") {
                        entry_points = Some(String::from_utf8_lossy(&bytes).into_owned());
                    }
                    format!("{SITE_DIR}/{rel}")
                }
                Place::Script(rel) => {
                    report.scripts += 1;
                    bytes = fix_shebang(bytes);
                    stage_executable(staging, &format!("{SCRIPTS_DIR}/{rel}"), &bytes)?;
                    continue;
                }
                Place::Data(rel) => format!("usr/local/{rel}"),
            };
            staging.write(&dest, &bytes)?;
            if executable {
                set_mode(staging, &dest, 0o755)?;
            }
            report.files += 1;
        }
        for (script, target) in console_scripts(entry_points.as_deref().unwrap_or_default()) {
            stage_executable(
                staging,
                &format!("{SCRIPTS_DIR}/{script}"),
                launcher(&target).as_bytes(),
            )?;
            report.scripts += 1;
        }
    }
    Ok(report)
}

/// Where a wheel's entry goes.
#[derive(Debug, PartialEq, Eq)]
enum Place {
    Site(String),
    Script(String),
    Data(String),
    Skip,
}

/// The place of wheel entry `name`, or `None` if it would leave its directory.
fn destination(name: &str) -> Option<Place> {
    let clean = !name.is_empty()
        && !name.starts_with('/')
        && name
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..");
    if !clean || name.contains('\\') {
        return None;
    }
    let Some((first, rest)) = name.split_once('/') else {
        return Some(Place::Site(name.to_owned()));
    };
    if !first.ends_with(".data") {
        return Some(Place::Site(name.to_owned()));
    }
    let (scheme, rel) = rest.split_once('/')?;
    Some(match scheme {
        "purelib" | "platlib" => Place::Site(rel.to_owned()),
        "scripts" => Place::Script(rel.to_owned()),
        "data" => Place::Data(rel.to_owned()),
        // C headers: nothing in the guest compiles against them.
        _ => Place::Skip,
    })
}

/// A script's `#!python` (or `#!pythonw`) line pointed at the guest's interpreter.
fn fix_shebang(bytes: Vec<u8>) -> Vec<u8> {
    for old in [&b"#!pythonw"[..], b"#!python"] {
        if let Some(rest) = bytes.strip_prefix(old)
            && rest.first().is_none_or(|b| b.is_ascii_whitespace())
        {
            let mut fixed = format!("#!{GUEST_PYTHON}").into_bytes();
            fixed.extend_from_slice(rest);
            return fixed;
        }
    }
    bytes
}

/// `(script name, "module:object")` of the `[console_scripts]` section.
fn console_scripts(text: &str) -> Vec<(String, String)> {
    let mut section = "";
    let mut out = Vec::new();
    for line in text.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name;
        } else if section == "console_scripts"
            && let Some((name, target)) = line.split_once('=')
        {
            let (name, target) = (name.trim(), target.trim());
            let target = target.split_once('[').map_or(target, |(t, _)| t).trim();
            let good = !name.is_empty()
                && !name.contains('/')
                && name != "."
                && name != ".."
                && target.contains(':');
            if good {
                out.push((name.to_owned(), target.to_owned()));
            }
        }
    }
    out
}

/// The launcher pip writes for a console script `module:object`.
fn launcher(target: &str) -> String {
    let (module, object) = target.split_once(':').unwrap_or((target, ""));
    let top = object.split('.').next().unwrap_or_default();
    format!(
        "#!{GUEST_PYTHON}\nimport sys\nfrom {module} import {top}\nif __name__ == \"__main__\":\n    sys.exit({object}())\n"
    )
}

fn stage_executable(staging: &Staging, rel: &str, bytes: &[u8]) -> Result<(), WheelError> {
    staging.write(rel, bytes)?;
    set_mode(staging, rel, 0o755)
}

fn set_mode(staging: &Staging, rel: &str, mode: u32) -> Result<(), WheelError> {
    use std::os::unix::fs::PermissionsExt;
    let path = staging.path(rel);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
        .map_err(|source| WheelError::Create { path, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wheel_names_parse() {
        let w = Wheel::from_path("/c/tabulate-0.9.0-py3-none-any.whl".into()).unwrap();
        assert_eq!((w.name.as_str(), w.version.as_str()), ("tabulate", "0.9.0"));
        let built = Wheel::from_path("/c/x-1.0-1-cp311-cp311-manylinux_2_17_x86_64.whl".into());
        assert_eq!(built.unwrap().version, "1.0");
        assert_eq!(Wheel::from_path("/c/x-1.0.tar.gz".into()), None);
        assert_eq!(Wheel::from_path("/c/x-1.0-py3.whl".into()), None);
    }

    #[test]
    fn entries_go_where_pip_puts_them() {
        assert_eq!(
            destination("tabulate/__init__.py"),
            Some(Place::Site("tabulate/__init__.py".into()))
        );
        assert_eq!(
            destination("x-1.data/purelib/x/a.py"),
            Some(Place::Site("x/a.py".into()))
        );
        assert_eq!(
            destination("x-1.data/platlib/x/a.so"),
            Some(Place::Site("x/a.so".into()))
        );
        assert_eq!(
            destination("x-1.data/scripts/tool"),
            Some(Place::Script("tool".into()))
        );
        assert_eq!(
            destination("x-1.data/data/share/x/f"),
            Some(Place::Data("share/x/f".into()))
        );
        assert_eq!(destination("x-1.data/headers/x.h"), Some(Place::Skip));
        assert_eq!(destination("../evil"), None);
        assert_eq!(destination("a/../../evil"), None);
        assert_eq!(destination("/etc/passwd"), None);
        assert_eq!(destination("x-1.data/scripts/../../x"), None);
    }

    #[test]
    fn shebangs_and_console_scripts() {
        assert_eq!(
            fix_shebang(b"#!python\nprint(1)".to_vec()),
            b"#!/usr/bin/python3\nprint(1)"
        );
        assert_eq!(fix_shebang(b"#!/bin/sh\n".to_vec()), b"#!/bin/sh\n");
        assert_eq!(fix_shebang(b"#!python3.11\n".to_vec()), b"#!python3.11\n");
        let text = "[console_scripts]\ntabulate = tabulate:_main\nbad/name = x:y\n\
                    extra = pkg.cli:main [cli]\n[gui_scripts]\ng = a:b\n";
        assert_eq!(
            console_scripts(text),
            [
                ("tabulate".to_owned(), "tabulate:_main".to_owned()),
                ("extra".to_owned(), "pkg.cli:main".to_owned())
            ]
        );
        assert!(launcher("pkg.cli:main").contains("from pkg.cli import main\n"));
        assert!(launcher("a:B.run").ends_with("sys.exit(B.run())\n"));
    }

    #[test]
    fn platforms_cover_every_manylinux_up_to_the_guest_glibc() {
        let tags = platforms();
        assert_eq!(tags[0], "manylinux_2_36_x86_64");
        assert!(tags.contains(&"manylinux_2_17_x86_64".to_owned()));
        assert!(tags.contains(&"manylinux2014_x86_64".to_owned()));
        assert!(!tags.iter().any(|t| t.contains("_2_37_")));
    }
}
