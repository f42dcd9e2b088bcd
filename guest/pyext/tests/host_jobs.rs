//! The job protocol's guest side (`guest/python/bud_jobs.py`, `bud_io.py`, `bud_shell.py`)
//! run on the host against a fake host: `tests/python/test_jobs.py`, a unittest suite, in the
//! host's CPython 3.11 (the same Debian build as the guest's) with the built `_bud`.
//!
//! Never rings: `tests/python/fakehost.py` stands in for `_bud.ring`. Fails, saying why,
//! without /usr/bin/python3.11 or a busybox (the built guest's); the suite itself says what
//! it skips (the clock call, which needs root in a real guest; syscall counts without
//! strace), and this test repeats those lines.

mod common;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

const PYTHON: &str = "/usr/bin/python3.11";

/// Busybox binaries that can stand in for the guest's /bin/sh, best first: the one in the
/// built guest image, then the host's.
fn busybox() -> Option<PathBuf> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    [
        manifest.join("../../build/image/rootfs/bin/busybox"),
        PathBuf::from("/usr/bin/busybox"),
        PathBuf::from("/bin/busybox"),
    ]
    .into_iter()
    .find(|p| p.is_file())
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
    let busybox = busybox().expect(
        "no busybox for the shell-job tests: build the guest first (`bud guest build`, or the \
         root crate's tests, which `cargo test --workspace` runs before these)",
    );
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
