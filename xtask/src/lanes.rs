//! Runs the suite's jobs in lanes side by side and reports each as it ends.
//!
//! Why not `cargo test --workspace`: it runs one test binary after another, and most of
//! bud's binaries spend their time in one emulated guest vCPU, one QEMU TCG thread or one
//! first-use build step, so one of the machine's two cores idles for most of a run (a clean
//! clone's run took 2 504 s on 2026-11-28, most of it in nine binaries run in turn). Two
//! lanes by default: the first-use builds are jobs of their own that the others wait for
//! (`hints`), so the second lane runs what needs no guest while the kernel builds, and tests
//! or the next template boot while one template boots on one core (figures in
//! docs/measurements.md, "Session 21"). Before the builds were jobs, two lanes did not pay
//! (2026-11-28, 44 min 33 s against 41 min 44 s in one): the lane that happened to build
//! the guest held the chain while the other's binaries waited on the build lock.
//! Why not cargo-nextest: it runs each
//! test in a process of its own, so every test would redo what a binary's tests share once
//! (the guest's up-to-date check, a template's load, an executor or a server's template),
//! and the ordering that matters here is by binary (the one that builds the guest first).
//!
//! Each binary runs its tests on `CPUs / lanes` threads (at least 1; `RUST_TEST_THREADS`
//! when set wins), so the runnable guest vCPUs never outnumber the cores, as in the
//! one-after-another suite whose job timeouts were set for it: with two lanes of two test
//! threads each on a loaded day, jobs in `tests/reset.rs` ran past their limits. A cargo
//! build a test runs (`tests/fuzz.rs` builds its targets) gets as many jobs
//! (`CARGO_BUILD_JOBS`, unless set): with cargo's default of one per CPU, the fuzz build
//! took both cores from the other lane's template boot, the head of every guest test's
//! chain (the `python` template's first boot took 125 s beside it against 78 s beside a
//! one-thread job). The build jobs keep the whole machine: nothing but short binaries runs
//! beside the kernel build.
//!
//! Each binary's output goes to `target/xtask/logs/<label>.log`, in full; a binary that
//! fails has its log printed whole when it ends, with the command that reruns it. The first
//! use builds take `build/build.lock` (and a lock per template) wherever they run, so a
//! binary run alone builds what it needs itself and two never build the same thing.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::hints;
use crate::suite::{self, Job, SuiteError};

/// How often the runner says what is still running.
const HEARTBEAT: Duration = Duration::from_secs(120);
/// The most of a failed binary's log printed (its tail); the whole log stays on disk.
const PRINTED_LOG: usize = 512 * 1024;

/// What a lane tells the runner.
enum Event {
    Started(String),
    Ended(Outcome),
}

/// How one job ended.
#[derive(Debug)]
struct Outcome {
    job: Job,
    seconds: f64,
    /// The exit status, or why it could not start.
    status: Result<ExitStatus, String>,
    log: PathBuf,
    counts: Counts,
}

impl Outcome {
    fn passed(&self) -> bool {
        matches!(&self.status, Ok(s) if s.success())
    }
}

/// The sum of a log's `test result:` lines.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Counts {
    passed: u64,
    failed: u64,
    ignored: u64,
}

impl Counts {
    fn of_log(text: &str) -> Counts {
        let mut counts = Counts::default();
        for line in text.lines() {
            let Some(rest) = line.trim_start().strip_prefix("test result: ") else {
                continue;
            };
            for part in rest.split(';') {
                let mut words = part.split_whitespace().rev();
                let (Some(what), Some(n)) = (words.next(), words.next()) else {
                    continue;
                };
                let Ok(n) = n.parse::<u64>() else { continue };
                match what {
                    "passed" => counts.passed += n,
                    "failed" => counts.failed += n,
                    "ignored" => counts.ignored += n,
                    _ => {}
                }
            }
        }
        counts
    }

    fn add(&mut self, other: Counts) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.ignored += other.ignored;
    }
}

/// Builds, orders and runs the suite in `lanes` lanes; true if every job passed.
pub fn run_suite(lanes: usize, picks: &[String], passed_on: &[String]) -> Result<bool, SuiteError> {
    let root = suite::workspace_root();
    let started = Instant::now();
    say("building the test binaries");
    let jobs = hints::order(suite::jobs_of(&root, suite::build(&root)?, picks)?);
    let built = started.elapsed();
    let log_dir = root.join("target/xtask/logs");
    fs::create_dir_all(&log_dir).map_err(|e| SuiteError::Log(log_dir.clone(), e))?;
    let total = jobs.len();
    let lanes = lanes.min(total.max(1));
    let threads = std::env::var("RUST_TEST_THREADS").unwrap_or_else(|_| {
        let cpus = thread::available_parallelism().map_or(1, |n| n.get());
        (cpus / lanes).max(1).to_string()
    });
    say(&format!(
        "{total} jobs built in {}; running them in {lanes} lanes of {threads} test thread(s), \
         logs in {}",
        minutes(built.as_secs_f64()),
        log_dir.display()
    ));

    let board = Arc::new(Board::new(jobs));
    let (tx, rx) = mpsc::channel();
    let mut workers = Vec::new();
    for _ in 0..lanes {
        let (board, tx, log_dir) = (board.clone(), tx.clone(), log_dir.clone());
        let threads = threads.clone();
        let passed_on = passed_on.to_vec();
        workers.push(thread::spawn(move || {
            while let Some(job) = board.take() {
                let label = job.label.clone();
                if tx.send(Event::Started(label.clone())).is_err() {
                    break;
                }
                let outcome = run_one(job, &log_dir, &passed_on, &threads);
                board.ended(label);
                if tx.send(Event::Ended(outcome)).is_err() {
                    break;
                }
            }
        }));
    }
    drop(tx);

    let mut running: HashMap<String, Instant> = HashMap::new();
    let mut ended: Vec<Outcome> = Vec::new();
    while ended.len() < total {
        match rx.recv_timeout(HEARTBEAT) {
            Ok(Event::Started(label)) => {
                running.insert(label, Instant::now());
            }
            Ok(Event::Ended(outcome)) => {
                running.remove(&outcome.job.label);
                report(&outcome, started);
                ended.push(outcome);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let mut now: Vec<String> = running
                    .iter()
                    .map(|(label, since)| {
                        format!("{label} ({})", minutes(since.elapsed().as_secs_f64()))
                    })
                    .collect();
                now.sort();
                say(&format!(
                    "{}: {} of {total} done; running {}",
                    minutes(started.elapsed().as_secs_f64()),
                    ended.len(),
                    now.join(", ")
                ));
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    for worker in workers {
        // A lane thread only panics on a poisoned queue, which needs a panic first.
        worker.join().expect("a lane thread panicked");
    }
    summarize(
        &root,
        &ended,
        started.elapsed().as_secs_f64(),
        built.as_secs_f64(),
    )
}

/// The jobs not yet taken, and which have ended: what the lanes share.
struct Board {
    state: Mutex<BoardState>,
    changed: Condvar,
}

struct BoardState {
    queue: Vec<Job>,
    /// The labels of every job of the run.
    in_run: HashSet<String>,
    ended: HashSet<String>,
}

impl Board {
    fn new(queue: Vec<Job>) -> Board {
        let in_run = queue.iter().map(|j| j.label.clone()).collect();
        Board {
            state: Mutex::new(BoardState {
                queue,
                in_run,
                ended: HashSet::new(),
            }),
            changed: Condvar::new(),
        }
    }

    /// The next job whose builds have ended, waiting for one if need be; `None` when the
    /// queue is empty.
    fn take(&self) -> Option<Job> {
        let mut state = self.state.lock().expect("board lock");
        loop {
            if state.queue.is_empty() {
                return None;
            }
            let ready = hints::next_ready(
                &state.queue,
                &|l: &str| state.ended.contains(l),
                &|l: &str| state.in_run.contains(l),
            );
            if let Some(at) = ready {
                return Some(state.queue.remove(at));
            }
            state = self.changed.wait(state).expect("board lock");
        }
    }

    fn ended(&self, label: String) {
        self.state.lock().expect("board lock").ended.insert(label);
        self.changed.notify_all();
    }
}

/// Builds the suite and prints its jobs in the order the lanes would take them.
pub fn list(picks: &[String]) -> Result<(), SuiteError> {
    let root = suite::workspace_root();
    for job in hints::order(suite::jobs_of(&root, suite::build(&root)?, picks)?) {
        let hint = hints::hint(&job.label);
        let needs = hint.needs.last().copied().unwrap_or("-");
        println!(
            "{:>5} s  after {needs:28}  {}  ({})",
            hint.seconds, job.label, job.rerun
        );
    }
    Ok(())
}

/// Runs `job` with its output to its log file, its tests on `threads` threads.
fn run_one(job: Job, log_dir: &Path, passed_on: &[String], threads: &str) -> Outcome {
    let log = log_dir.join(format!("{}.log", job.label.replace(['/', ' '], "_")));
    let started = Instant::now();
    let status = File::create(&log)
        .and_then(|out| Ok((out.try_clone()?, out)))
        .map_err(|e| format!("creating {}: {e}", log.display()))
        .and_then(|(out, err)| {
            let mut command = Command::new(&job.program);
            command
                .args(&job.args)
                .args(passed_on)
                .current_dir(&job.dir)
                // As `cargo test` runs a test binary.
                .env("CARGO_MANIFEST_DIR", &job.dir)
                .env("RUST_TEST_THREADS", threads)
                .stdin(Stdio::null())
                .stdout(out)
                .stderr(err);
            if !hints::is_build(&job.label) && std::env::var_os("CARGO_BUILD_JOBS").is_none() {
                command.env("CARGO_BUILD_JOBS", threads);
            }
            command
                .status()
                .map_err(|e| format!("starting {}: {e}", job.program.display()))
        });
    let seconds = started.elapsed().as_secs_f64();
    let counts = fs::read(&log)
        .map(|bytes| Counts::of_log(&String::from_utf8_lossy(&bytes)))
        .unwrap_or_default();
    Outcome {
        job,
        seconds,
        status,
        log,
        counts,
    }
}

/// Prints one job's end: a line if it passed, its whole log (up to [`PRINTED_LOG`]) if not.
fn report(outcome: &Outcome, started: Instant) {
    let at = minutes(started.elapsed().as_secs_f64());
    let c = outcome.counts;
    if outcome.passed() {
        say(&format!(
            "{at}: ok     {} in {:.1} s ({} passed, {} ignored)",
            outcome.job.label, outcome.seconds, c.passed, c.ignored
        ));
        return;
    }
    let why = match &outcome.status {
        Ok(status) => status.to_string(),
        Err(e) => e.clone(),
    };
    let text = fs::read(&outcome.log).unwrap_or_default();
    let shown = &text[text.len().saturating_sub(PRINTED_LOG)..];
    let mut out = std::io::stdout().lock();
    // Printing to our own stdout: nothing useful can be done if it fails.
    let _ = writeln!(
        out,
        "[xtask] {at}: FAILED {} in {:.1} s ({why}; {} passed, {} failed)\n\
         ===== {} ({}) =====",
        outcome.job.label,
        outcome.seconds,
        c.passed,
        c.failed,
        outcome.job.label,
        outcome.log.display()
    );
    if shown.len() < text.len() {
        let _ = writeln!(
            out,
            "[... the first {} bytes are in the log]",
            text.len() - shown.len()
        );
    }
    let _ = out.write_all(shown);
    let _ = writeln!(
        out,
        "===== end of {}; rerun: {} =====",
        outcome.job.label, outcome.job.rerun
    );
    let _ = out.flush();
}

/// Prints the run's totals, its slowest jobs and its failures; writes
/// `target/xtask/last-run.tsv`. True if every job passed.
fn summarize(root: &Path, ended: &[Outcome], wall: f64, built: f64) -> Result<bool, SuiteError> {
    let mut counts = Counts::default();
    for o in ended {
        counts.add(o.counts);
    }
    let mut by_time: Vec<&Outcome> = ended.iter().collect();
    by_time.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    let table: String = by_time
        .iter()
        .map(|o| {
            let state = if o.passed() { "ok" } else { "FAILED" };
            format!(
                "{}\t{:.1}\t{state}\t{}\t{}\n",
                o.job.label, o.seconds, o.counts.passed, o.counts.failed
            )
        })
        .collect();
    let tsv = root.join("target/xtask/last-run.tsv");
    fs::write(
        &tsv,
        format!("binary\tseconds\tresult\tpassed\tfailed\n{table}"),
    )
    .map_err(|e| SuiteError::Log(tsv.clone(), e))?;

    say(&format!(
        "slowest: {}",
        by_time
            .iter()
            .take(8)
            .map(|o| format!("{} {:.0} s", o.job.label, o.seconds))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let failed: Vec<&&Outcome> = by_time.iter().filter(|o| !o.passed()).collect();
    say(&format!(
        "{} jobs, {} tests: {} passed, {} failed, {} ignored; {} jobs failed; {} in all \
         ({} building); times in {}",
        ended.len(),
        counts.passed + counts.failed + counts.ignored,
        counts.passed,
        counts.failed,
        counts.ignored,
        failed.len(),
        minutes(wall),
        minutes(built),
        tsv.display()
    ));
    for o in &failed {
        say(&format!(
            "FAILED {}: rerun with {}",
            o.job.label, o.job.rerun
        ));
    }
    Ok(failed.is_empty())
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    // Printing to our own stdout: nothing useful can be done if it fails.
    let _ = writeln!(out, "[xtask] {line}");
    let _ = out.flush();
}

/// `seconds` as `12 min 5 s`.
fn minutes(seconds: f64) -> String {
    let s = seconds.round() as u64;
    if s < 60 {
        format!("{s} s")
    } else {
        format!("{} min {} s", s / 60, s % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_logs_result_lines_are_summed() {
        let log = "running 3 tests\n\
                   test a ... ok\n\
                   test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.1s\n\
                   test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 2s\n";
        assert_eq!(
            Counts::of_log(log),
            Counts {
                passed: 5,
                failed: 1,
                ignored: 1
            }
        );
        assert_eq!(Counts::of_log("no results here"), Counts::default());
    }

    #[test]
    fn durations_read_as_minutes_and_seconds() {
        assert_eq!(minutes(59.4), "59 s");
        assert_eq!(minutes(725.0), "12 min 5 s");
    }

    #[test]
    fn a_job_runs_in_its_folder_with_its_output_in_its_log() {
        let dir = std::env::temp_dir().join(format!("xtask-lanes-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let job = |code: &str| Job {
            label: format!("tests/{code}.rs"),
            program: "/bin/sh".into(),
            args: vec![
                "-c".into(),
                format!(
                    "pwd; echo \"$CARGO_MANIFEST_DIR\" >&2; echo \"threads $RUST_TEST_THREADS\"; echo \"cargo jobs $CARGO_BUILD_JOBS\"; echo \"test result: ok. 2 passed; 0 failed; 0 ignored\"; exit {code}"
                ),
            ],
            dir: dir.clone(),
            rerun: String::new(),
        };
        let ok = run_one(job("0"), &dir, &[], "1");
        assert!(ok.passed());
        assert_eq!(ok.counts.passed, 2);
        let text = fs::read_to_string(&ok.log).unwrap();
        let here = dir.display().to_string();
        assert_eq!(text.lines().filter(|l| *l == here).count(), 2, "{text}");
        assert!(text.lines().any(|l| l == "threads 1"), "{text}");
        if std::env::var_os("CARGO_BUILD_JOBS").is_none() {
            assert!(text.lines().any(|l| l == "cargo jobs 1"), "{text}");
            // A build job keeps cargo's default (every CPU).
            let build = run_one(
                Job {
                    label: hints::GUEST.into(),
                    ..job("0")
                },
                &dir,
                &[],
                "1",
            );
            let text = fs::read_to_string(&build.log).unwrap();
            assert!(text.lines().any(|l| l == "cargo jobs "), "{text}");
        }
        let failed = run_one(job("3"), &dir, &[], "1");
        assert!(!failed.passed());
        assert_eq!(failed.status.as_ref().unwrap().code(), Some(3));
        let missing = run_one(
            Job {
                program: dir.join("no-such-binary"),
                ..job("0")
            },
            &dir,
            &[],
            "1",
        );
        assert!(matches!(&missing.status, Err(e) if e.contains("no-such-binary")));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_lane_waits_on_the_board_until_the_build_it_needs_has_ended() {
        let job = Job::named;
        let board = Arc::new(Board::new(hints::order(vec![
            job("tests/jobs.rs"),
            job(hints::GUEST),
            job(hints::PYTHON),
        ])));
        assert_eq!(board.take().unwrap().label, hints::GUEST);
        let waiting = {
            let board = board.clone();
            thread::spawn(move || board.take().map(|j| j.label))
        };
        thread::sleep(Duration::from_millis(50));
        assert!(
            !waiting.is_finished(),
            "the python build waits for the guest"
        );
        board.ended(hints::GUEST.to_owned());
        assert_eq!(waiting.join().unwrap().as_deref(), Some(hints::PYTHON));
        board.ended(hints::PYTHON.to_owned());
        assert_eq!(board.take().unwrap().label, "tests/jobs.rs");
        assert!(board.take().is_none());
    }
}
