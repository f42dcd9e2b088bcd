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
//!
//! [`Apt::print_uris`] asks apt which files a download would fetch, with their sha256, without
//! fetching them (`apt-get download --print-uris`), so that a file already at hand (the package
//! pool of [`crate::debs`]) need not be downloaded again.

use std::collections::HashMap;
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
    #[error("apt-get download --print-uris {packages}")]
    PrintUris {
        packages: String,
        #[source]
        source: RunError,
    },
    #[error("unexpected line from apt-get download --print-uris: `{line}`")]
    UriLine { line: String },
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
    /// [`downloadable`]'s answer for each spec asked about since the last `update`, so that
    /// [`Apt::print_uris`] and then [`Apt::download`] of the same spec ask apt-cache once.
    downloadable: HashMap<String, String>,
}

/// One file `apt-get download --print-uris` names: a line `'URI' FILE SIZE HASHTYPE:HEX`,
/// such as `'http://deb.debian.org/debian/pool/main/p/pcre3/libpcre3_8.39-15_amd64.deb'
/// libpcre3_2%3a8.39-15_amd64.deb 340864 SHA256:993e…`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AptFile {
    pub uri: String,
    /// The name `apt-get download` saves it under, `name_version_arch.deb` with the
    /// version's epoch colon written `%3a`.
    pub file: String,
    pub size: u64,
    /// Lowercase hex; `None` when apt gives another kind of hash.
    pub sha256: Option<String>,
}

impl AptFile {
    /// The package's name: the file name up to its first `_`.
    pub fn package(&self) -> &str {
        self.file.split('_').next().unwrap_or_default()
    }

    fn parse(line: &str) -> Option<AptFile> {
        let rest = line.strip_prefix('\'')?;
        let (uri, rest) = rest.split_once('\'')?;
        let mut fields = rest.split_ascii_whitespace();
        let (file, size, hash) = (fields.next()?, fields.next()?, fields.next()?);
        let plain_name = !file.contains('/') && !file.starts_with('.');
        if uri.is_empty() || fields.next().is_some() || !plain_name || !file.ends_with(".deb") {
            return None;
        }
        let (kind, hex) = hash.split_once(':')?;
        if kind.is_empty() || hex.is_empty() || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let sha256 = match kind {
            "SHA256" if hex.len() == 64 => Some(hex.to_ascii_lowercase()),
            "SHA256" => return None,
            _ => None,
        };
        Some(AptFile {
            uri: uri.to_owned(),
            file: file.to_owned(),
            size: size.parse().ok()?,
            sha256,
        })
    }
}

/// The files of `apt-get download --print-uris`'s output, one a line (blank lines skipped);
/// any other line is an error, naming it.
pub fn parse_print_uris(text: &str) -> Result<Vec<AptFile>, HostError> {
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            AptFile::parse(line.trim()).ok_or_else(|| HostError::UriLine {
                line: line.to_owned(),
            })
        })
        .collect()
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
        // The lists changed: a candidate may be in a repository now.
        self.downloadable.clear();
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

    /// `specs` as `apt-get download` can fetch them ([`downloadable`]), each asked about once
    /// per package-list state.
    fn downloadable_specs(
        &mut self,
        specs: &[String],
        progress: &mut dyn FnMut(&str),
    ) -> Vec<String> {
        specs
            .iter()
            .map(|spec| {
                self.downloadable
                    .entry(spec.clone())
                    .or_insert_with(|| downloadable(spec, progress))
                    .clone()
            })
            .collect()
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
        let specs = self.downloadable_specs(specs, progress);
        // Run as root, apt drops to the `_apt` user to download unless told otherwise, and
        // that user cannot write to our build directory.
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

    /// The files [`Apt::download`] of `specs` would fetch, with their sha256, from the
    /// package lists alone: nothing is downloaded. Not retried after an `apt-get update`:
    /// the caller falls back to downloading, which is.
    pub fn print_uris(
        &mut self,
        specs: &[String],
        progress: &mut dyn FnMut(&str),
    ) -> Result<Vec<AptFile>, HostError> {
        if find_program("apt-get").is_none() {
            return Err(HostError::NoAptGet);
        }
        let specs = self.downloadable_specs(specs, progress);
        let mut args = vec![
            "download",
            "--print-uris",
            "-q",
            "-o",
            "APT::Sandbox::User=root",
        ];
        args.extend(specs.iter().map(String::as_str));
        let out = run::stdout_of(&mut Self::command(&args), progress).map_err(|source| {
            HostError::PrintUris {
                packages: specs.join(" "),
                source,
            }
        })?;
        parse_print_uris(&String::from_utf8_lossy(&out))
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

    // As apt 2.6 of Debian 12 prints them (`apt-get download --print-uris jq libpcre3`), but
    // libpcre3's hash in upper case, which the parser lowers.
    const JQ: &str = "'http://deb.debian.org/debian-security/pool/updates/main/j/jq/\
                      jq_1.6-2.1%2bdeb12u3_amd64.deb' jq_1.6-2.1+deb12u3_amd64.deb 64432 \
                      SHA256:c25f3fda201207ed98b1d63686f2d81b9dfeb99f1ab2d1d35fb3f7b6a1c107dc";
    const PCRE: &str = "'http://deb.debian.org/debian/pool/main/p/pcre3/\
                        libpcre3_8.39-15_amd64.deb' libpcre3_2%3a8.39-15_amd64.deb 340864 \
                        SHA256:993EA623CE5B42D67F653F2FAAA7EF15E7C9D72BFCB93E22A1EAFF7AA3532303";

    #[test]
    fn print_uris_lines_parse_with_the_epoch_left_quoted() {
        let files = parse_print_uris(&format!("{JQ}\n\n{PCRE}\n")).unwrap();

        assert_eq!(files.len(), 2);
        assert_eq!(
            files[0],
            AptFile {
                uri: "http://deb.debian.org/debian-security/pool/updates/main/j/jq/\
                      jq_1.6-2.1%2bdeb12u3_amd64.deb"
                    .into(),
                file: "jq_1.6-2.1+deb12u3_amd64.deb".into(),
                size: 64432,
                sha256: Some(
                    "c25f3fda201207ed98b1d63686f2d81b9dfeb99f1ab2d1d35fb3f7b6a1c107dc".into()
                ),
            }
        );
        assert_eq!(files[1].file, "libpcre3_2%3a8.39-15_amd64.deb");
        assert_eq!(files[1].package(), "libpcre3");
        assert_eq!(
            files[1].sha256.as_deref(),
            Some("993ea623ce5b42d67f653f2faaa7ef15e7c9d72bfcb93e22a1eaff7aa3532303")
        );
        assert_eq!(parse_print_uris("").unwrap(), []);
    }

    #[test]
    fn print_uris_line_with_another_hash_has_no_sha256() {
        let line = "'http://h/p/a_1_all.deb' a_1_all.deb 10 SHA512:abcdef";

        let files = parse_print_uris(line).unwrap();

        assert_eq!(files[0].sha256, None);
        assert_eq!(files[0].package(), "a");
    }

    #[test]
    fn malformed_print_uris_lines_are_refused_by_name() {
        let sha = "SHA256:".to_owned() + &"ab".repeat(32);
        let bad = [
            format!("http://h/a_1_all.deb a_1_all.deb 10 {sha}"),
            format!("'http://h/a_1_all.deb a_1_all.deb 10 {sha}"),
            format!("'' a_1_all.deb 10 {sha}"),
            "'http://h/a_1_all.deb' a_1_all.deb 10".to_owned(),
            format!("'http://h/a_1_all.deb' a_1_all.deb ten {sha}"),
            format!("'http://h/a_1_all.deb' a_1_all.deb -1 {sha}"),
            format!("'http://h/a_1_all.deb' ../a_1_all.deb 10 {sha}"),
            format!("'http://h/a_1_all.deb' .a_1_all.deb 10 {sha}"),
            format!("'http://h/a_1_all.tar' a_1_all.tar 10 {sha}"),
            format!("'http://h/a_1_all.deb' a_1_all.deb 10 {sha} extra"),
            "'http://h/a_1_all.deb' a_1_all.deb 10 SHA256:abcd".to_owned(),
            "'http://h/a_1_all.deb' a_1_all.deb 10 SHA256:".to_owned() + &"zz".repeat(32),
            "'http://h/a_1_all.deb' a_1_all.deb 10 d41d8cd98f00b204e9800998ecf8427e".to_owned(),
            "E: Unable to locate package nosuch".to_owned(),
        ];

        for line in bad {
            let text = format!("{JQ}\n{line}\n");
            match parse_print_uris(&text) {
                Err(HostError::UriLine { line: named }) => assert_eq!(named, line),
                other => panic!("{line}: {other:?}"),
            }
        }
    }
}
