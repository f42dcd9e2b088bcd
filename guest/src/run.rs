//! Running the external programs of the build (bash, cargo, apt-get, dpkg-deb, the guest's
//! python) with their output streamed line by line to a progress callback.
//!
//! This module owns the child process: it waits for it on every path (no zombie, no orphan)
//! and keeps the last lines of its output so a failure can say what went wrong.

use std::collections::VecDeque;
use std::io::{self, BufRead, BufReader, Read};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;

/// How many trailing output lines a failure carries.
const TAIL_LINES: usize = 25;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("start `{command}`")]
    Spawn {
        command: String,
        #[source]
        source: io::Error,
    },
    #[error("wait for `{command}`")]
    Wait {
        command: String,
        #[source]
        source: io::Error,
    },
    #[error("`{command}` failed ({status}); last output:\n{tail}")]
    Failed {
        command: String,
        status: ExitStatus,
        tail: String,
    },
}

/// Output of a finished command.
#[derive(Debug)]
pub struct Output {
    /// Everything it printed on stdout, kept only when asked for.
    pub stdout: Vec<u8>,
}

/// A printable form of a command: program and arguments, space separated.
pub fn describe(cmd: &Command) -> String {
    let mut out = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        out.push(' ');
        out.push_str(&arg.to_string_lossy());
    }
    out
}

enum Line {
    Out(String),
    Err(String),
}

fn pump<R: Read + Send + 'static>(
    reader: R,
    tx: mpsc::Sender<Line>,
    wrap: fn(String) -> Line,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let mut reader = BufReader::new(reader);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match reader.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let line = String::from_utf8_lossy(&buf).trim_end().to_owned();
                    if tx.send(wrap(line)).is_err() {
                        break;
                    }
                }
            }
        }
    })
}

/// Runs `cmd` to completion. Every stderr line, and every stdout line unless `capture_stdout`,
/// goes to `progress`; a captured stdout is returned whole instead. Fails with the tail of the
/// output when the command exits non-zero.
pub fn run(
    cmd: &mut Command,
    capture_stdout: bool,
    progress: &mut dyn FnMut(&str),
) -> Result<Output, RunError> {
    let command = describe(cmd);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| RunError::Spawn {
            command: command.clone(),
            source,
        })?;
    let (tx, rx) = mpsc::channel();
    let mut pumps = Vec::new();
    let stdout = child.stdout.take();
    let (streamed, captured) = if capture_stdout {
        (None, stdout)
    } else {
        (stdout, None)
    };
    if let Some(out) = streamed {
        pumps.push(pump(out, tx.clone(), Line::Out));
    }
    if let Some(err) = child.stderr.take() {
        pumps.push(pump(err, tx.clone(), Line::Err));
    }
    drop(tx);
    let stdout_thread = captured.map(|mut out| {
        thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = out.read_to_end(&mut bytes);
            bytes
        })
    });

    let mut tail = VecDeque::with_capacity(TAIL_LINES);
    for line in rx {
        let (Line::Out(text) | Line::Err(text)) = line;
        progress(&text);
        if tail.len() == TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(text);
    }
    for handle in pumps {
        let _ = handle.join();
    }
    let stdout = stdout_thread
        .and_then(|h| h.join().ok())
        .unwrap_or_default();
    let status = child.wait().map_err(|source| RunError::Wait {
        command: command.clone(),
        source,
    })?;
    if !status.success() {
        let tail = Vec::from(tail).join("\n");
        return Err(RunError::Failed {
            command,
            status,
            tail,
        });
    }
    Ok(Output { stdout })
}

/// Runs `cmd` and returns its stdout; stderr lines go to `progress`.
pub fn stdout_of(cmd: &mut Command, progress: &mut dyn FnMut(&str)) -> Result<Vec<u8>, RunError> {
    Ok(run(cmd, true, progress)?.stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_both_streams_and_returns_nothing_captured() {
        let mut lines = Vec::new();

        let out = run(
            Command::new("sh").args(["-c", "echo one; echo two >&2"]),
            false,
            &mut |l| lines.push(l.to_owned()),
        )
        .unwrap();

        lines.sort();
        assert_eq!(lines, ["one", "two"]);
        assert!(out.stdout.is_empty());
    }

    #[test]
    fn captured_stdout_is_not_streamed() {
        let mut lines = Vec::new();

        let out = stdout_of(
            Command::new("sh").args(["-c", "echo data; echo note >&2"]),
            &mut |l| lines.push(l.to_owned()),
        )
        .unwrap();

        assert_eq!(out, b"data\n");
        assert_eq!(lines, ["note"]);
    }

    #[test]
    fn failure_names_command_and_carries_tail() {
        let script = "for i in $(seq 1 40); do echo line$i; done; exit 3";

        let err = run(Command::new("sh").args(["-c", script]), false, &mut |_| {}).unwrap_err();

        let text = err.to_string();
        assert!(text.starts_with("`sh -c for i in"), "{text}");
        assert!(text.contains("exit status: 3"), "{text}");
        assert!(
            text.contains("line40") && !text.contains("line15\n"),
            "{text}"
        );
    }

    #[test]
    fn missing_program_is_a_spawn_error() {
        let err = run(
            &mut Command::new("/nonexistent/bud-tool"),
            false,
            &mut |_| {},
        )
        .unwrap_err();

        assert!(matches!(err, RunError::Spawn { .. }));
    }
}
