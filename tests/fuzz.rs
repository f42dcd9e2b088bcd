//! Runs every libFuzzer target of `fuzz/` (what a guest or a client controls: the mailbox
//! announcement, the result decoder, request bodies and paths, the template state file, the
//! virtio-net device's registers and rings, the names in a guest connection's bytes)
//! for a bounded time each (`BUD_FUZZ_SECONDS`: CI 5, built unoptimized, whose build is
//! quicker; `scripts/fuzz.sh 300` for minutes, built optimized),
//! with libFuzzer's coverage guidance, on the machine's one (stable) toolchain.
//!
//! The targets are built here with cargo itself and the coverage instrumentation that
//! libFuzzer reads (see [`COVERAGE_FLAGS`]), then each binary is run directly: the same build
//! `cargo fuzz run --sanitizer none` makes, without installing cargo-fuzz (a release build of
//! ~60 crates, 1.5-2.5 minutes of CI's two cores every clean run, for a wrapper around these
//! two commands). `cargo fuzz` still works on `fuzz/` for anyone who has it.
//! The corpus grows in `build/fuzz/corpus/TARGET` from run to run, and a crash leaves its
//! input in `build/fuzz/artifacts/TARGET/` and fails this test with libFuzzer's report.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

const TARGETS: [&str; 6] = [
    "mailbox",
    "result",
    "request",
    "template_state",
    "virtio_net",
    "names",
];

/// The rustc flags of a libFuzzer build (those cargo-fuzz 0.13 passes with `--sanitizer
/// none`): LLVM's SanitizerCoverage with the 8-bit edge counters and the table of their
/// code addresses that libFuzzer's feedback reads, comparisons traced (so it learns the
/// magic numbers and lengths a parser checks), the stack depth traced, branches kept
/// unfolded (each edge a counter), `cfg(fuzzing)` for code that asks, and debug
/// assertions in every build.
const COVERAGE_FLAGS: &str = "-Cpasses=sancov-module \
    -Cllvm-args=-sanitizer-coverage-level=4 \
    -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
    -Cllvm-args=-sanitizer-coverage-pc-table \
    -Cllvm-args=-sanitizer-coverage-trace-compares \
    -Cllvm-args=-sanitizer-coverage-stack-depth \
    -Cllvm-args=-simplifycfg-branch-fold-threshold=0 \
    --cfg fuzzing \
    -Cdebug-assertions";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The host's target triple (`rustc -vV`). Naming it to cargo keeps the flags off build
/// scripts and proc macros, which run on the host and need no instrumentation.
fn host_triple() -> String {
    let out = Command::new("rustc")
        .arg("-vV")
        .output()
        .expect("cannot run rustc -vV");
    assert!(out.status.success(), "rustc -vV failed: {}", out.status);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .map(str::to_owned)
        .expect("rustc -vV names no host triple")
}

/// Builds every target (one cargo run) and returns the folder of the binaries. `optimized`:
/// a release build with one codegen unit (as cargo-fuzz's default: the coverage passes keep
/// ThinLTO from inlining across units), for runs long enough to repay its build.
fn build(root: &Path, optimized: bool) -> PathBuf {
    let triple = host_triple();
    let target_dir = root.join("build/fuzz/target");
    let mut flags = COVERAGE_FLAGS.to_owned();
    if optimized {
        flags.push_str(" -Ccodegen-units=1");
    }
    let mut cargo = Command::new(env!("CARGO"));
    cargo
        .current_dir(root)
        .env("RUSTFLAGS", flags)
        .args(["build", "--bins", "--manifest-path"])
        .arg(root.join("fuzz/Cargo.toml"))
        .args(["--target", &triple])
        .arg("--target-dir")
        .arg(&target_dir);
    if optimized {
        cargo.args(["--release", "--config", "profile.release.debug=true"]);
    }
    let status = cargo.status().expect("cannot run cargo build");
    assert!(
        status.success(),
        "building the fuzz targets failed: {status}"
    );
    target_dir
        .join(triple)
        .join(if optimized { "release" } else { "debug" })
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
    // Positive: libFuzzer reads a total time of 0 as "no limit".
    let seconds = common::size("BUD_FUZZ_SECONDS", 5);
    // A short run's time is its build's: unoptimized (with debug assertions and overflow
    // checks) it builds in a fraction of the optimized build with one codegen unit. Runs of a
    // minute and more fuzz optimized code.
    let bin = build(&root, seconds >= 60);
    progress(&format!(
        "targets built after {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    for target in TARGETS {
        let corpus = root.join("build/fuzz/corpus").join(target);
        let artifacts = root.join("build/fuzz/artifacts").join(target);
        std::fs::create_dir_all(&corpus).unwrap();
        std::fs::create_dir_all(&artifacts).unwrap();
        if target == "template_state" {
            seed_with_templates(&root, &corpus);
        }
        eprintln!("[fuzz] {target}: {seconds} s");
        let out = Command::new(bin.join(target))
            .current_dir(&root)
            .arg(&corpus)
            .arg(format!("-max_total_time={seconds}"))
            .arg(format!("-artifact_prefix={}/", artifacts.display()))
            .arg("-print_final_stats=1")
            .output()
            .unwrap_or_else(|e| panic!("cannot run the fuzz target {target}: {e}"));
        let report = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = report.lines().rev().take(40).collect();
        assert!(
            out.status.success(),
            "fuzz target {target} failed ({}):\n{}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
        // Without the coverage instrumentation libFuzzer still runs, blind: its banner
        // counts the edge counters the build put in.
        let counters = report
            .lines()
            .find_map(|l| {
                let (_, rest) = l.split_once("modules")?;
                let (n, _) = rest.trim_start().strip_prefix('(')?.split_once(' ')?;
                n.parse::<u64>().ok()
            })
            .unwrap_or_else(|| panic!("{target}: libFuzzer's banner names no counters:\n{report}"));
        assert!(counters > 0, "{target}: built without coverage counters");
        let runs = report
            .lines()
            .find_map(|l| l.strip_prefix("stat::number_of_executed_units:"))
            .map(|n| n.trim().parse::<u64>().unwrap())
            .unwrap_or_else(|| panic!("{target}: no final stats in libFuzzer's report"));
        progress(&format!(
            "{target}: {runs} inputs over {counters} edge counters, no failure ({:.1} s into the test)",
            started.elapsed().as_secs_f64()
        ));
        assert!(runs > 0, "{target} ran no input");
    }
}
