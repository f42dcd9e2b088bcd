//! Python virtual environments in the build directory for the tools the tests run (the E2B
//! and Piston clients, kubernetes-validate): `<build>/<name>` made from a pinned
//! requirements file under a lock of its own ([`BuildLock::acquire_step`]), once, and made again when the file changes
//! (the file's copy inside the venv is the stamp).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::BuildLock;

/// Why a venv could not be made.
#[derive(Debug, thiserror::Error)]
pub enum VenvError {
    #[error(transparent)]
    Lock(#[from] crate::lock::LockError),
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what} failed:\n{output}")]
    Command { what: String, output: String },
}

/// The python of venv `<build_dir>/<name>` with `requirements` installed (from the
/// machine's package index), made or remade if needed.
pub fn ensure(
    build_dir: &Path,
    name: &str,
    requirements: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, VenvError> {
    // pip only, no host package: a lock of its own, not the guest build's.
    let _lock = BuildLock::acquire_step(build_dir, name, name, progress)?;
    let venv = build_dir.join(name);
    let python = venv.join("bin/python");
    let stamp = venv.join("requirements.txt");
    let wanted = std::fs::read(requirements).map_err(|source| VenvError::Read {
        path: requirements.to_owned(),
        source,
    })?;
    if std::fs::read(&stamp).ok().as_deref() == Some(&wanted[..]) && python.exists() {
        return Ok(python);
    }
    progress(&format!(
        "making {} from {}",
        venv.display(),
        requirements.display()
    ));
    let run = |what: &str, cmd: &mut Command| {
        let fail = |output: String| VenvError::Command {
            what: what.to_owned(),
            output,
        };
        let out = cmd.output().map_err(|e| fail(e.to_string()))?;
        if out.status.success() {
            return Ok(());
        }
        Err(fail(format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )))
    };
    let _ = std::fs::remove_dir_all(&venv);
    run(
        "python3 -m venv",
        Command::new("python3").arg("-m").arg("venv").arg(&venv),
    )?;
    run(
        "pip install",
        Command::new(&python)
            .args(["-m", "pip", "install", "-q", "-r"])
            .arg(requirements),
    )?;
    std::fs::write(&stamp, &wanted).map_err(|source| VenvError::Read {
        path: stamp.clone(),
        source,
    })?;
    Ok(python)
}
