//! The `_bud` extension and the worker, loaded in the host's CPython 3.11 (the same Debian
//! build as the guest's).
//!
//! Never rings: an `out` from host user space faults (or, with ioperm, reaches a real port).
//! These tests check that `ring`/`ready` refuse without the doorbell permission instead.
//! Without /usr/bin/python3.11 they fail, saying so (Debian's `python3.11` package).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const PYTHON: &str = "/usr/bin/python3.11";

/// A temp dir of its own for test `name` (tests run in parallel, and overwriting a loaded
/// extension would SIGBUS the python using it), holding `_bud.abi3.so` and the worker's
/// Python files, as /usr/lib/bud does.
fn stage(name: &str) -> Stage {
    assert!(
        Path::new(PYTHON).is_file(),
        "{PYTHON} not found: these tests need the guest's CPython 3.11 on the host \
         (Debian's python3.11 package)"
    );
    let so =
        common::built_extension().expect("lib_bud.so next to the test binary (cargo builds it)");
    let dir = std::env::temp_dir().join(format!("bud-pyext-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create stage dir");
    std::fs::copy(so, dir.join("_bud.abi3.so")).expect("copy extension");
    let python_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python");
    for entry in std::fs::read_dir(python_dir).expect("read guest/python") {
        let path = entry.expect("dir entry").path();
        if path.extension().is_some_and(|ext| ext == "py") {
            let name = path.file_name().expect("file name");
            std::fs::copy(&path, dir.join(name)).expect("copy python file");
        }
    }
    Stage(dir)
}

/// The staged directory, removed when the test ends.
struct Stage(PathBuf);

impl std::ops::Deref for Stage {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn python(dir: &Path, args: &[&str]) -> Output {
    Command::new(PYTHON)
        .args(["-s", "-P"])
        .args(args)
        .env("PYTHONPATH", dir)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .current_dir(dir)
        .output()
        .expect("run python3.11")
}

fn check(dir: &Path, script: &str) {
    let out = python(dir, &["-c", script]);

    assert!(
        out.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn mailbox_is_a_writable_view_with_the_protocol_header() {
    let dir = stage("header");

    check(
        &dir,
        r#"
import struct, _bud
view = _bud.create_mailbox(doorbell=False)
assert len(view) == _bud.MAILBOX_DEFAULT_SIZE == _bud.mailbox_size()
assert not view.readonly and view.format == "B"
assert _bud.mailbox_address() % _bud.PAGE_SIZE == 0
assert struct.unpack_from("<II", view, 0) == (_bud.MAILBOX_MAGIC, _bud.PROTOCOL_VERSION)
assert bytes(view[:4]) == b"BUDM"
assert not any(view[8:_bud.HEADER_SIZE])
view[_bud.HEADER_SIZE:_bud.HEADER_SIZE + 5] = b"hello"
assert bytes(_bud.mailbox()[_bud.HEADER_SIZE:_bud.HEADER_SIZE + 5]) == b"hello"
"#,
    );
}

#[test]
fn mailbox_pages_are_locked_and_resident() {
    let dir = stage("locked");

    check(
        &dir,
        r#"
import _bud
_bud.create_mailbox(doorbell=False)
start = f"{_bud.mailbox_address():x}-"
block = open("/proc/self/smaps").read().split(start, 1)[1].split("VmFlags")[0]
fields = {l.split(":")[0]: int(l.split()[1]) for l in block.splitlines()[1:] if l.endswith("kB")}
size_kib = _bud.mailbox_size() >> 10
assert fields["Rss"] == fields["Locked"] == size_kib, fields
"#,
    );
}

#[test]
fn second_mailbox_and_bad_sizes_are_refused() {
    let dir = stage("refused");

    check(
        &dir,
        r#"
import _bud
for size in (0, 4097, _bud.MAILBOX_MAX_SIZE + 4096):
    try:
        _bud.create_mailbox(size, doorbell=False)
    except ValueError:
        pass
    else:
        raise AssertionError(size)
_bud.create_mailbox(doorbell=False)
try:
    _bud.create_mailbox(doorbell=False)
except RuntimeError:
    pass
else:
    raise AssertionError("second mailbox")
"#,
    );
}

#[test]
fn ring_and_ready_refuse_without_the_doorbell_permission() {
    let dir = stage("ring");

    check(
        &dir,
        r#"
import _bud
_bud.create_mailbox(doorbell=False)
for call in (lambda: _bud.ring(_bud.READY), _bud.ready):
    try:
        call()
    except RuntimeError as e:
        assert "doorbell permission" in str(e)
    else:
        raise AssertionError("rang on the host")
"#,
    );
}

#[test]
fn worker_dry_run_warms_up_without_ringing() {
    let dir = stage("dry-run");

    let out = python(&dir, &["-m", "bud_worker", "--dry-run"]);

    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.starts_with("dry run: template python: imports"),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!stdout.contains("missing"), "{stdout}");
    assert!(!stdout.contains("warm job failed"), "{stdout}");
}

#[test]
fn worker_without_a_mode_refuses_with_usage_status() {
    let dir = stage("usage");

    let out = python(&dir, &["-m", "bud_worker"]);

    assert_eq!(out.status.code(), Some(64));
}

#[test]
fn a_child_spawned_while_the_thread_is_a_user_runs_as_that_user_alone() {
    let dir = stage("creds");

    // Only root may take another user's ids; elsewhere the refusal is checked.
    check(
        &dir,
        r#"
import os, subprocess, threading, _bud
if os.geteuid() != 0:
    try:
        _bud.thread_as_user(65534, 65534, [65534])
    except PermissionError:
        pass
    else:
        raise AssertionError("took another user's ids without root")
    assert os.getresuid() == (os.getuid(),) * 3
    raise SystemExit(0)
seen = {}
other = threading.Thread(target=lambda: (ready.wait(), seen.update(other=os.getresuid())))
ready = threading.Event()
other.start()
_bud.thread_as_user(65534, 65534, [65534])
try:
    ready.set()
    other.join()
    here = (os.getresuid(), os.getresgid(), os.getgroups())
    out = subprocess.run(["sh", "-c", "id -u; id -g; id -G; grep -E '^Cap(Prm|Eff)' /proc/self/status"],
                         capture_output=True, text=True, cwd="/").stdout
finally:
    _bud.thread_as_root([])
# The thread was the user, the process's other thread root all along; the child the user
# alone, without capabilities; and the thread is root again.
assert here == ((65534, 65534, 0), (65534, 65534, 0), [65534]), here
assert seen["other"] == (0, 0, 0), seen
assert out == "65534\n65534\n65534\nCapPrm:\t0000000000000000\nCapEff:\t0000000000000000\n", out
assert (os.getresuid(), os.getresgid(), os.getgroups()) == ((0, 0, 0), (0, 0, 0), []), os.getgroups()
"#,
    );
}
