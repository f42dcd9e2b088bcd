//! bud on hardware virtualization, in CI: `scripts/test-hwvirt.sh` in its short mode boots a
//! first-level VM under QEMU's TCG (an emulated AMD CPU with SVM and nested paging), loads
//! kvm_amd in it, and runs this build's `bud` on that `/dev/kvm`: `bud run` (the first boots
//! and saves the template), the guest's CPUID, and `bud serve --verify-resets` under every
//! kind of job, each answer checked (docs/platform.md). The test asserts that the harness
//! passed and that each of its checks reported PASS.
//!
//! It needs root (the harness installs QEMU with apt-get on first use and exports `/` to the
//! VM) and the network on first use (the Debian kernel and busybox packages); it never
//! skips: anything missing fails it with the harness's own message. The number of jobs is
//! `BUD_HWVIRT_JOBS` (default 30: every kind of job, the three rare ones once each; under TCG
//! a verified request took ~3.4 s on 2026-11-26, so 100 cost CI ~6 min);
//! `scripts/test-hwvirt.sh` alone runs 200, `--full` the whole suite in the nested VM).

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Instant;

/// The PASS lines the short mode must print (one per check of scripts/hwvirt/stage2.sh).
const CHECKS: [&str; 7] = [
    "PASS bud run, first",
    "PASS bud run, a clone of the saved template",
    "PASS the guest sees no svm, vmx or smx",
    "PASS bud serve under",
    "PASS bud serve stopped cleanly on SIGTERM",
    "PASS trivial jobs on warm VMs",
    "hwvirt: PASSED (short mode)",
];

#[test]
fn the_short_mode_passes_under_nested_svm() {
    // The guest is built on this host first, through the tests' shared path (the harness's
    // VM finds it up to date and never builds it).
    common::guest();
    let jobs = common::size("BUD_HWVIRT_JOBS", 30);
    let script = common::source_dir().join("scripts/test-hwvirt.sh");
    let started = Instant::now();

    let mut child = Command::new("bash")
        .arg(&script)
        .arg("--jobs")
        .arg(jobs.to_string())
        .env("BUD", env!("CARGO_BIN_EXE_bud"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", script.display()));
    let mut out = Vec::new();
    for line in BufReader::new(child.stdout.take().expect("piped stdout")).lines() {
        let line = line.expect("reading the harness's output");
        eprintln!("{line}");
        out.push(line);
    }
    let status = child.wait().expect("waiting for the harness");

    let failed: Vec<&String> = out
        .iter()
        .filter(|l| l.starts_with("hwvirt-stage2: FAIL") || l.starts_with("hwvirt: FAIL"))
        .collect();
    let missing: Vec<&str> = CHECKS
        .iter()
        .copied()
        .filter(|c| !out.iter().any(|l| l.contains(c)))
        .collect();
    eprintln!("the harness took {:.0} s", started.elapsed().as_secs_f64());
    assert!(
        failed.is_empty(),
        "the harness reported failures: {failed:#?}"
    );
    assert!(missing.is_empty(), "checks that did not pass: {missing:?}");
    assert!(
        status.success(),
        "scripts/test-hwvirt.sh exited with {status}"
    );
}
