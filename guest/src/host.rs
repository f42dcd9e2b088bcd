//! The host's own tools: finding programs on `PATH` and installing Debian packages with
//! `apt-get` when one is missing.
//!
//! `apt-get update` runs at most once per [`Apt`] and only after a plain attempt failed, so a
//! machine whose package lists are fresh never touches the network for it. This module never
//! installs anything the caller did not name.
//!
//! bud's own apt runs are serialized by the build lock ([`crate::lock`]); an apt run outside
//! bud (another shell, unattended upgrades) is waited for: installs and downloads through
//! apt's `DPkg::Lock::Timeout`, and `update`, which in Debian 12's apt (2.6) ignores that
//! option for the lists lock (measured: it fails at once), by retrying while apt says a lock
//! is held.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::run::{self, RunError};

/// How long an apt run waits for another apt run's locks.
const APT_LOCK_WAIT: Duration = Duration::from_secs(600);

/// Programs the image build and its tests run, with the Debian package that provides each.
pub const REQUIRED_TOOLS: &[(&str, &str)] = &[
    ("cpio", "cpio"),
    ("dpkg-deb", "dpkg"),
    ("strip", "binutils"),
];

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("`apt-get` not found: the guest image is built from Debian packages")]
    NoAptGet,
    #[error("apt-get update")]
    Update(#[source] RunError),
    #[error("apt-get install {packages}")]
    Install {
        packages: String,
        #[source]
        source: RunError,
    },
    #[error("apt-get download {packages}")]
    Download {
        packages: String,
        #[source]
        source: RunError,
    },
    #[error("`{program}` still missing after installing package `{package}`")]
    StillMissing { program: String, package: String },
}

/// Looks `name` up on `PATH` the way a shell would.
pub fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// apt-get, run non-interactively, with `update` done at most once.
#[derive(Debug, Default)]
pub struct Apt {
    updated: bool,
}

impl Apt {
    pub fn new() -> Self {
        Apt::default()
    }

    fn command(args: &[&str]) -> Command {
        let mut cmd = Command::new("apt-get");
        cmd.env("DEBIAN_FRONTEND", "noninteractive")
            .arg("-o")
            .arg(format!("DPkg::Lock::Timeout={}", APT_LOCK_WAIT.as_secs()))
            .args(args);
        cmd
    }

    fn update(&mut self, progress: &mut dyn FnMut(&str)) -> Result<(), HostError> {
        let deadline = Instant::now() + APT_LOCK_WAIT;
        loop {
            match run::run(&mut Self::command(&["update", "-q"]), false, progress) {
                Ok(_) => break,
                Err(RunError::Failed { ref tail, .. })
                    if tail.contains("Could not get lock") && Instant::now() < deadline =>
                {
                    progress("another apt run holds apt's lock; waiting for it");
                    std::thread::sleep(Duration::from_secs(2));
                }
                Err(e) => return Err(HostError::Update(e)),
            }
        }
        self.updated = true;
        Ok(())
    }

    /// Runs `attempt`; when it fails and the lists were not refreshed yet, runs `apt-get
    /// update` and tries once more. `wrap` names the failing operation.
    fn with_update_retry(
        &mut self,
        progress: &mut dyn FnMut(&str),
        wrap: impl Fn(RunError) -> HostError,
        mut attempt: impl FnMut(&mut dyn FnMut(&str)) -> Result<(), RunError>,
    ) -> Result<(), HostError> {
        match attempt(progress) {
            Ok(()) => Ok(()),
            Err(_) if !self.updated => {
                progress("apt-get failed; refreshing the package lists and trying again");
                self.update(progress)?;
                attempt(progress).map_err(wrap)
            }
            Err(err) => Err(wrap(err)),
        }
    }

    /// Installs `packages` with `--no-install-recommends`.
    pub fn install(
        &mut self,
        packages: &[&str],
        progress: &mut dyn FnMut(&str),
    ) -> Result<(), HostError> {
        if find_program("apt-get").is_none() {
            return Err(HostError::NoAptGet);
        }
        let mut args = vec!["install", "-y", "-q", "--no-install-recommends"];
        args.extend_from_slice(packages);
        let wrap = |source| HostError::Install {
            packages: packages.join(" "),
            source,
        };
        self.with_update_retry(progress, wrap, |p| {
            run::run(&mut Self::command(&args), false, p).map(|_| ())
        })
    }

    /// Downloads the `.deb` files of `specs` (`name` or `name=version`) into `dir`.
    pub fn download(
        &mut self,
        specs: &[String],
        dir: &Path,
        progress: &mut dyn FnMut(&str),
    ) -> Result<(), HostError> {
        if find_program("apt-get").is_none() {
            return Err(HostError::NoAptGet);
        }
        // Run as root, apt drops to the `_apt` user to download unless told otherwise, and
        // that user cannot write to our build directory.
        let specs: Vec<String> = specs
            .iter()
            .map(|spec| downloadable(spec, progress))
            .collect();
        let mut args = vec!["download", "-q", "-o", "APT::Sandbox::User=root"];
        args.extend(specs.iter().map(String::as_str));
        let wrap = |source| HostError::Download {
            packages: specs.join(" "),
            source,
        };
        self.with_update_retry(progress, wrap, |p| {
            run::run(Self::command(&args).current_dir(dir), false, p).map(|_| ())
        })
    }
}

/// `spec` as `apt-get download` can fetch it: an unpinned package whose candidate version
/// comes from no repository (a version installed on the host from a source that is gone,
/// such as a third-party repository) is pinned to the newest version a repository has, so
/// that what an image holds does not depend on what the host has installed.
fn downloadable(spec: &str, progress: &mut dyn FnMut(&str)) -> String {
    if spec.contains('=') {
        return spec.to_owned();
    }
    let out = |args: &[&str]| {
        let mut cmd = Command::new("apt-cache");
        cmd.args(args).arg(spec);
        run::stdout_of(&mut cmd, &mut |_| {})
            .map(|o| String::from_utf8_lossy(&o).into_owned())
            .unwrap_or_default()
    };
    let candidate = out(&["policy"]).lines().find_map(|l| {
        l.trim()
            .strip_prefix("Candidate:")
            .map(|v| v.trim().to_owned())
    });
    // `apt-cache madison` lists the versions the repositories have, newest first.
    let in_repositories: Vec<String> = out(&["madison"])
        .lines()
        .filter(|l| l.trim_end().ends_with("Packages"))
        .filter_map(|l| l.split('|').nth(1).map(|v| v.trim().to_owned()))
        .collect();
    match (candidate, in_repositories.first()) {
        (Some(c), Some(newest)) if !in_repositories.contains(&c) => {
            progress(&format!(
                "{spec}: the candidate {c} is in no repository (installed from elsewhere); \
                 taking {newest}"
            ));
            format!("{spec}={newest}")
        }
        _ => spec.to_owned(),
    }
}

/// Makes sure every program of [`REQUIRED_TOOLS`] is on `PATH`, installing what is missing.
pub fn ensure_tools(apt: &mut Apt, progress: &mut dyn FnMut(&str)) -> Result<(), HostError> {
    let missing: Vec<(&str, &str)> = REQUIRED_TOOLS
        .iter()
        .copied()
        .filter(|(prog, _)| find_program(prog).is_none())
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let packages: Vec<&str> = missing.iter().map(|(_, pkg)| *pkg).collect();
    progress(&format!("installing host packages: {}", packages.join(" ")));
    apt.install(&packages, progress)?;
    for (program, package) in missing {
        if find_program(program).is_none() {
            return Err(HostError::StillMissing {
                program: program.into(),
                package: package.into(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_sh_and_not_a_made_up_name() {
        assert!(find_program("sh").is_some());
        assert!(find_program("bud-no-such-program-here").is_none());
    }
}
