//! bud's project tasks, run as `cargo xtask <task>` (the alias in `.cargo/config.toml`).
//!
//! One task: `test`, the whole test suite, which is the README's test command and what CI's
//! `.ci/run` runs. It builds every test binary of the workspace with cargo, then runs them
//! in lanes ([`lanes`]) after the first-use builds they wait for ([`hints`]), and reports
//! each job as it ends.
//!
//! ```text
//! cargo xtask test [--lanes N] [--list] [BINARY...] [-- ARGS...]
//! ```
//!
//! `BINARY` picks binaries by a part of their source path (`compat`, `server/tests/http.rs`);
//! `ARGS` go to every binary (a test name filter, `--nocapture`). `--lanes` defaults to
//! `BUD_TEST_LANES`, else 2. `--list` builds the binaries and lists the jobs in
//! the order the lanes would take them, with their hints, and runs nothing.

mod hints;
mod lanes;
mod suite;

use std::process::ExitCode;

/// What `cargo xtask` was asked to do.
#[derive(Debug, PartialEq)]
struct TestArgs {
    lanes: Option<usize>,
    /// Only list the jobs in the order the lanes would take them.
    list: bool,
    picks: Vec<String>,
    passed_on: Vec<String>,
}

/// Why the command line was not understood.
#[derive(Debug, thiserror::Error, PartialEq)]
enum UsageError {
    #[error("no task given")]
    NoTask,
    #[error("unknown task {0:?}")]
    UnknownTask(String),
    #[error("--lanes needs a whole number from 1 to 64, not {0:?}")]
    Lanes(String),
    #[error("unknown option {0:?}")]
    UnknownOption(String),
}

const USAGE: &str = "usage: cargo xtask test [--lanes N] [--list] [BINARY...] [-- ARGS...]";

fn parse(args: &[String]) -> Result<TestArgs, UsageError> {
    let (task, rest) = args.split_first().ok_or(UsageError::NoTask)?;
    if task != "test" {
        return Err(UsageError::UnknownTask(task.clone()));
    }
    let mut parsed = TestArgs {
        lanes: None,
        list: false,
        picks: Vec::new(),
        passed_on: Vec::new(),
    };
    let mut it = rest.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--" => {
                parsed.passed_on = it.cloned().collect();
                break;
            }
            "--list" => parsed.list = true,
            "--lanes" => {
                let value = it.next().map(String::as_str).unwrap_or("");
                parsed.lanes = Some(lanes_of(value)?);
            }
            option if option.starts_with('-') => {
                return Err(UsageError::UnknownOption(option.to_owned()));
            }
            pick => parsed.picks.push(pick.to_owned()),
        }
    }
    Ok(parsed)
}

fn lanes_of(value: &str) -> Result<usize, UsageError> {
    match value.parse::<usize>() {
        Ok(n) if (1..=64).contains(&n) => Ok(n),
        _ => Err(UsageError::Lanes(value.to_owned())),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parsed = match parse(&args) {
        Ok(parsed) => parsed,
        Err(e) => {
            eprintln!("xtask: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let lanes = match parsed.lanes {
        Some(n) => n,
        None => match std::env::var("BUD_TEST_LANES") {
            Ok(v) => match lanes_of(&v) {
                Ok(n) => n,
                Err(e) => {
                    eprintln!("xtask: BUD_TEST_LANES: {e}");
                    return ExitCode::from(2);
                }
            },
            // Two lanes unless asked: see `lanes`' module doc for the measured reason.
            Err(_) => 2,
        },
    };
    if parsed.list {
        return match lanes::list(&parsed.picks) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("xtask: {}", suite::error_chain(&e));
                ExitCode::from(101)
            }
        };
    }
    match lanes::run_suite(lanes, &parsed.picks, &parsed.passed_on) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(101),
        Err(e) => {
            eprintln!("xtask: {}", suite::error_chain(&e));
            ExitCode::from(101)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_test_task_takes_lanes_picks_and_arguments_for_the_binaries() {
        let parsed = parse(&strings(&[
            "test",
            "--lanes",
            "3",
            "compat",
            "http",
            "--",
            "--nocapture",
            "x",
        ]))
        .unwrap();
        assert_eq!(
            parsed,
            TestArgs {
                lanes: Some(3),
                list: false,
                picks: strings(&["compat", "http"]),
                passed_on: strings(&["--nocapture", "x"]),
            }
        );
    }

    #[test]
    fn bad_command_lines_say_what_is_wrong() {
        assert_eq!(parse(&[]), Err(UsageError::NoTask));
        assert_eq!(
            parse(&strings(&["build"])),
            Err(UsageError::UnknownTask("build".into()))
        );
        assert_eq!(
            parse(&strings(&["test", "--lanes", "0"])),
            Err(UsageError::Lanes("0".into()))
        );
        assert_eq!(
            parse(&strings(&["test", "--lanes"])),
            Err(UsageError::Lanes("".into()))
        );
        assert_eq!(
            parse(&strings(&["test", "--fast"])),
            Err(UsageError::UnknownOption("--fast".into()))
        );
    }
}
