//! Runs every cargo-fuzz target of `fuzz/` (what a guest or a client controls: the mailbox
//! announcement, the result decoder, request bodies and paths, the template state file, the
//! virtio-net device's registers and rings)
//! for a bounded time each (`BUD_FUZZ_SECONDS`: CI 5, built unoptimized, whose build is
//! quicker; `scripts/fuzz.sh 300` for minutes, built optimized),
//! with libFuzzer's coverage guidance, on the machine's one (stable) toolchain
//! (`--sanitizer none`: no `-Z` flags).
//! cargo-fuzz is installed from crates.io into `build/tools` on first use; the corpus
//! grows in `build/fuzz/corpus/TARGET` from run to run, and a crash leaves its input in
//! `build/fuzz/artifacts/TARGET/` and fails this test with libFuzzer's report.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

const TARGETS: [&str; 5] = [
    "mailbox",
    "result",
    "request",
    "template_state",
    "virtio_net",
];
const CARGO_FUZZ_VERSION: &str = "0.13.2";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `build/tools/bin`, with cargo-fuzz in it (installed if missing, under the lock of its own
/// step: cargo installs no host package, so it never waits for a guest build).
fn tools(root: &Path) -> PathBuf {
    let bin = root.join("build/tools/bin");
    let _lock = bud_guest::BuildLock::acquire_step(
        &root.join("build"),
        "tools",
        "the cargo-fuzz install",
        &mut |l| eprintln!("[fuzz] {l}"),
    )
    .expect("taking the tools lock");
    if !bin.join("cargo-fuzz").is_file() {
        eprintln!("[fuzz] installing cargo-fuzz {CARGO_FUZZ_VERSION} into build/tools");
        let status = Command::new(env!("CARGO"))
            .args([
                "install",
                "cargo-fuzz",
                "--locked",
                "--version",
                CARGO_FUZZ_VERSION,
            ])
            .arg("--root")
            .arg(root.join("build/tools"))
            .status()
            .expect("cannot run cargo install");
        assert!(
            status.success(),
            "cargo install cargo-fuzz failed: {status}"
        );
    }
    bin
}

/// Real state files of the templates built here (if any yet) as seeds: mutations of a
/// valid state reach much deeper than random bytes past the magic and version.
fn seed_with_templates(root: &Path, corpus: &Path) {
    let Ok(dirs) = std::fs::read_dir(root.join("build/templates")) else {
        return;
    };
    for dir in dirs.flatten() {
        let state = dir.path().join("state");
        if state.is_file() {
            let name = format!("seed-{}", dir.file_name().to_string_lossy());
            std::fs::copy(&state, corpus.join(name)).unwrap();
        }
    }
}

/// A line on the process's stderr itself, past the test harness's capture, so that the
/// suite's log shows where the time went.
fn progress(line: &str) {
    use std::io::Write;
    // Progress only: a closed stderr loses nothing the test asserts.
    let _ = writeln!(std::io::stderr(), "[fuzz] {line}");
}

#[test]
fn every_fuzz_target_runs_clean_for_its_time() {
    let root = root();
    let started = std::time::Instant::now();
    let bin = tools(&root);
    progress(&format!(
        "cargo-fuzz ready after {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    // Positive: libFuzzer reads a total time of 0 as "no limit".
    let seconds = common::size("BUD_FUZZ_SECONDS", 5);
    // A short run's time is its build's: unoptimized (with debug assertions and overflow
    // checks, as cargo-fuzz's default) it builds in a fraction of cargo-fuzz's default
    // release build with one codegen unit. Runs of a minute and more fuzz optimized code.
    let mode: &[&str] = if seconds < 60 { &["--dev"] } else { &[] };
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    for target in TARGETS {
        let corpus = root.join("build/fuzz/corpus").join(target);
        let artifacts = root.join("build/fuzz/artifacts").join(target);
        std::fs::create_dir_all(&corpus).unwrap();
        std::fs::create_dir_all(&artifacts).unwrap();
        if target == "template_state" {
            seed_with_templates(&root, &corpus);
        }
        eprintln!("[fuzz] {target}: {seconds} s");
        let out = Command::new(env!("CARGO"))
            .current_dir(&root)
            .env("PATH", &path)
            .args(["fuzz", "run", "--sanitizer", "none"])
            .args(mode)
            .arg("--target-dir")
            .arg(root.join("build/fuzz/target"))
            .arg(target)
            .arg(&corpus)
            .arg("--")
            .arg(format!("-max_total_time={seconds}"))
            .arg(format!("-artifact_prefix={}/", artifacts.display()))
            .arg("-print_final_stats=1")
            .output()
            .expect("cannot run cargo fuzz");
        let report = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = report.lines().rev().take(40).collect();
        assert!(
            out.status.success(),
            "fuzz target {target} failed ({}):\n{}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
        let runs = report
            .lines()
            .find_map(|l| l.strip_prefix("stat::number_of_executed_units:"))
            .map(|n| n.trim().parse::<u64>().unwrap())
            .unwrap_or_else(|| panic!("{target}: no final stats in libFuzzer's report"));
        progress(&format!(
            "{target}: {runs} inputs, no failure ({:.1} s into the test)",
            started.elapsed().as_secs_f64()
        ));
        assert!(runs > 0, "{target} ran no input");
    }
}
