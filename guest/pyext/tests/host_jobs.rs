//! The job protocol's guest side (`guest/python/bud_jobs.py`, `bud_io.py`, `bud_shell.py`)
//! run on the host against a fake host: `tests/python/test_jobs.py`, a unittest suite, in the
//! host's CPython 3.11 (the same Debian build as the guest's) with the built `_bud`.
//!
//! Never rings: `tests/python/fakehost.py` stands in for `_bud.ring`. Fails, saying why,
//! without /usr/bin/python3.11 or the built guest's busybox (built first if need be); the suite itself says what
//! it skips (the clock call, which needs root in a real guest; syscall counts without
//! strace), and this test repeats those lines.

mod common;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

const PYTHON: &str = "/usr/bin/python3.11";

/// The built guest image's busybox, which stands in for the guest's /bin/sh. The guest is
/// brought up to date first, under the build lock, as every guest-bound test does: this
/// binary may run beside the one building it (`cargo xtask test` runs binaries in lanes),
/// and a half-built image must not be read.
fn busybox() -> Result<PathBuf, String> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    bud_guest::ensure(&bud_guest::BuildOptions::new(&repo), &mut |line: &str| {
        say(&format!("[guest build] {line}"))
    })
    .map_err(|e| {
        let mut text = format!("building the guest: {e}");
        let mut source = std::error::Error::source(&e);
        while let Some(cause) = source {
            text.push_str(&format!(": {cause}"));
            source = cause.source();
        }
        text
    })?;
    let busybox = repo.join("build/image/rootfs/bin/busybox");
    if busybox.is_file() {
        Ok(busybox)
    } else {
        Err(format!(
            "{} is missing after the guest build",
            busybox.display()
        ))
    }
}

fn say(line: &str) {
    // Straight to the stderr handle: libtest captures eprintln! of passing tests.
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// A temp dir holding `_bud.abi3.so`, guest/python/*.py and tests/python/*.py.
struct Stage(PathBuf);

impl Stage {
    fn new() -> Self {
        let so = common::built_extension()
            .expect("lib_bud.so next to the test binary (cargo builds it)");
        let dir = std::env::temp_dir().join(format!("bud-jobs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create stage dir");
        std::fs::copy(so, dir.join("_bud.abi3.so")).expect("copy extension");
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
        for source in [manifest.join("../python"), manifest.join("tests/python")] {
            for entry in std::fs::read_dir(&source).expect("read python dir") {
                let path = entry.expect("dir entry").path();
                if path.extension().is_some_and(|ext| ext == "py") {
                    let name = path.file_name().expect("file name");
                    std::fs::copy(&path, dir.join(name)).expect("copy python file");
                }
            }
        }
        Self(dir)
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn job_protocol_suite_passes_against_a_fake_host() {
    assert!(
        Path::new(PYTHON).is_file(),
        "{PYTHON} not found: this suite needs the guest's CPython 3.11 on the host \
         (Debian's python3.11 package)"
    );
    let stage = Stage::new();
    let mut command = Command::new(PYTHON);
    command
        .args(["-s", "-P", "-m", "unittest", "-v", "test_jobs"])
        .current_dir(&stage.0)
        .env("PYTHONPATH", &stage.0)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("LANG", "C.UTF-8")
        .env("BUD_TEST_PYTHON", PYTHON)
        .env_remove("PYTHONUNBUFFERED");
    let busybox = busybox().unwrap_or_else(|e| panic!("no busybox for the shell-job tests: {e}"));
    command.env("BUD_TEST_BUSYBOX", busybox);

    let out = command.output().expect("run python3.11 -m unittest");

    let report = String::from_utf8_lossy(&out.stderr);
    for line in report.lines() {
        if line.contains("SKIPPED") || line.contains("skipped") || line.contains("syscalls,") {
            say(line.trim());
        }
    }
    assert!(
        out.status.success(),
        "stdout:\n{}\nstderr:\n{report}",
        String::from_utf8_lossy(&out.stdout)
    );
}
