//! A session's background processes, typed: start one, poll them for output and exits,
//! write to a process's stdin, signal it.
//!
//! Each operation is a process request to the session's worker
//! ([`crate::protocol::process_op`], run by `guest/python/bud_procs.py`), which keeps the
//! processes' pipes between requests. This module is the one place that knows the wire form
//! (pids as decimal text, [`crate::protocol::process_event`] frames, exit codes); callers see
//! [`ProcessEvent`] and [`ProcessError`].
//!
//! Between requests the VM is stopped, and so are its processes: whoever keeps a session
//! with live processes runs [`Processes::poll_processes`] whenever the session has nothing
//! else to do (the server's `service::processes`). A poll waits in the guest until a
//! process writes or ends, or until its `wait` has passed, or until it is cancelled, which
//! interrupts the guest's wait so that another request can have the VM; it never loses an
//! event it has taken (the guest takes the interrupt only while it waits).

use std::time::Duration;

use crate::executor::Executor;
use crate::files::FileEntry;
use crate::job::{Cancel, Job, JobResult, Status, Stream};
use crate::protocol::{file_status, job_flags, process_event, process_op, watch_event};
use crate::session::{Requests, SessionError};

/// What happened to a background process, in the order it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessEvent {
    /// Bytes it wrote (a PTY process's terminal output comes as stdout).
    Output {
        pid: u32,
        stream: Stream,
        data: Vec<u8>,
    },
    /// It ended (after all its output): with an exit status, or killed by a signal.
    Exit {
        pid: u32,
        exit_code: Option<i32>,
        signal: Option<i32>,
    },
    /// A change under a watched directory ([`Processes::watch_dir`]).
    Watch { watcher: u32, changed: Changed },
}

/// One change under a watched directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Changed {
    pub change: Change,
    /// Relative to the watched directory.
    pub path: String,
    /// The entry as the guest saw it when it read the event: only for a watcher made with
    /// `entries`, and only on a create, write or chmod of an entry still there.
    pub entry: Option<Box<FileEntry>>,
}

/// What changed under a watched directory (E2B's kinds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Created, or moved in.
    Create,
    Write,
    Remove,
    /// Moved away.
    Rename,
    /// Permissions or other metadata.
    Chmod,
}

/// A process to start: `/bin/sh -c script`.
#[derive(Debug, Clone, Default)]
pub struct ProcessSpec {
    pub script: String,
    /// Variables added to the worker's environment.
    pub env: Vec<(String, String)>,
    /// Its working directory (absolute, or relative to the work directory); None: the
    /// session's.
    pub cwd: Option<String>,
    /// Give it a stdin pipe (else it reads `/dev/null`).
    pub stdin: bool,
    /// Run it on a terminal of this size (rows, columns) instead of pipes: its stdin,
    /// stdout and stderr, and its controlling terminal.
    pub pty: Option<(u16, u16)>,
    /// Run it as this user of the guest's `/etc/passwd` (its ids and groups, with its
    /// `HOME`, `USER`, `LOGNAME` and `SHELL` unless `env` sets them); None: as the worker,
    /// root, with the worker's environment. A user the guest does not have is
    /// [`ProcessError::Invalid`].
    pub user: Option<String>,
}

/// Why a process operation did not do what it was asked.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// No live process with that pid (it ended, or never was), or its stdin is closed.
    #[error("{0}")]
    NotFound(String),
    /// The request is malformed (a working directory that is not one, a bad signal).
    #[error("{0}")]
    Invalid(String),
    /// The guest failed it: why.
    #[error("process operation failed ({status:?}): {message}")]
    Failed { status: Status, message: String },
    /// The guest's answer is not what the protocol says (a bug, or a hostile guest).
    #[error("the guest's answer to a process request is malformed: {0}")]
    Malformed(String),
    #[error(transparent)]
    Session(#[from] SessionError),
}

/// How long a start, stdin or signal request may take in the guest (a start is an exec:
/// ~0.4 s here).
const OP_TIMEOUT: Duration = Duration::from_secs(30);

/// Output cap of one poll: its byte budget plus the event headers.
const POLL_SLACK: usize = 1 << 20;

fn answer(r: JobResult) -> Result<Vec<u8>, ProcessError> {
    let message = || String::from_utf8_lossy(&r.stderr).trim().to_owned();
    match (r.status, r.exit_code) {
        (Status::Ok, _) => Ok(r.stdout),
        // A request that ran to its end with a refusal (the status says error).
        (Status::Error, Some(file_status::NOT_FOUND)) => Err(ProcessError::NotFound(message())),
        (Status::Error, Some(file_status::BAD_PATH)) => Err(ProcessError::Invalid(message())),
        (status, _) => Err(ProcessError::Failed {
            status,
            message: message(),
        }),
    }
}

fn number<T: std::str::FromStr>(bytes: &[u8]) -> Result<T, ProcessError> {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| ProcessError::Malformed(format!("{:?} is not a number", bytes)))
}

/// The events of a poll's answer.
pub fn decode_events(mut bytes: &[u8]) -> Result<Vec<ProcessEvent>, ProcessError> {
    let mut events = Vec::new();
    let word = |b: &[u8], at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    while !bytes.is_empty() {
        if bytes.len() < process_event::HEADER {
            return Err(ProcessError::Malformed("a truncated event header".into()));
        }
        let pid = word(bytes, 0);
        let kind = word(bytes, 4);
        let value = word(bytes, 8) as i32;
        let len = word(bytes, 12) as usize;
        let data = bytes
            .get(process_event::HEADER..process_event::HEADER + len)
            .ok_or_else(|| ProcessError::Malformed("an event longer than the answer".into()))?;
        let stream = match kind {
            process_event::STDOUT | process_event::PTY => Some(Stream::Stdout),
            process_event::STDERR => Some(Stream::Stderr),
            process_event::EXIT => None,
            process_event::WATCH => {
                let change = match value {
                    watch_event::CREATE => Change::Create,
                    watch_event::WRITE => Change::Write,
                    watch_event::REMOVE => Change::Remove,
                    watch_event::RENAME => Change::Rename,
                    watch_event::CHMOD => Change::Chmod,
                    other => return Err(ProcessError::Malformed(format!("change {other}"))),
                };
                // The path, then for a watcher with entries a NUL and the entry's JSON.
                let (path, entry) = match data.iter().position(|b| *b == 0) {
                    Some(at) => (&data[..at], Some(&data[at + 1..])),
                    None => (data, None),
                };
                let entry = entry
                    .map(serde_json::from_slice::<FileEntry>)
                    .transpose()
                    .map_err(|e| ProcessError::Malformed(format!("a watch entry: {e}")))?
                    .map(Box::new);
                events.push(ProcessEvent::Watch {
                    watcher: pid,
                    changed: Changed {
                        change,
                        path: String::from_utf8_lossy(path).into_owned(),
                        entry,
                    },
                });
                bytes = &bytes[process_event::HEADER + len..];
                continue;
            }
            other => return Err(ProcessError::Malformed(format!("event kind {other}"))),
        };
        events.push(match stream {
            Some(stream) => ProcessEvent::Output {
                pid,
                stream,
                data: data.to_vec(),
            },
            None if value >= 0 => ProcessEvent::Exit {
                pid,
                exit_code: Some(value),
                signal: None,
            },
            None => ProcessEvent::Exit {
                pid,
                exit_code: None,
                signal: Some(value.saturating_neg()),
            },
        });
        bytes = &bytes[process_event::HEADER + len..];
    }
    Ok(events)
}

fn request(code: impl Into<Vec<u8>>, args: Vec<String>, timeout: Duration) -> Job {
    let mut j = Job::shell(code);
    j.args = args;
    j.timeout = timeout;
    j
}

/// The typed process operations, on a [`crate::session::Session`] or beside its running cell
/// ([`crate::beside::Beside`]).
pub trait Processes: Requests {
    /// Starts `spec` and returns its pid in the guest.
    fn start_process(&mut self, ex: &Executor, spec: &ProcessSpec) -> Result<u32, ProcessError> {
        let mut args = vec![spec.cwd.clone().unwrap_or_default()];
        let mut flags = if spec.stdin {
            job_flags::PROCESS_STDIN
        } else {
            0
        };
        let size = spec.pty.map(|(rows, cols)| format!("{rows}x{cols}"));
        if size.is_some() {
            flags |= job_flags::PROCESS_PTY;
        }
        args.push(size.unwrap_or_default());
        args.push(spec.user.clone().unwrap_or_default());
        let mut j = request(spec.script.as_bytes(), args, OP_TIMEOUT);
        j.env = spec.env.clone();
        let r = self.process_op(ex, process_op::START, flags, &j)?;
        number(&answer(r)?)
    }

    /// Watches directory `path` (absolute, or relative to the work directory; and its
    /// subdirectories if `recursive`): its changes come from polls as
    /// [`ProcessEvent::Watch`] of the returned watcher, which keeps polls waiting as a live
    /// process does until [`Processes::unwatch`]. With `entries`, a create, write or chmod
    /// carries the entry with its metadata ([`Changed::entry`]).
    fn watch_dir(
        &mut self,
        ex: &Executor,
        path: &str,
        recursive: bool,
        entries: bool,
    ) -> Result<u32, ProcessError> {
        let mut args = vec![if recursive { "recursive" } else { "" }.into()];
        if entries {
            args.push("entries".into());
        }
        let j = request(path.as_bytes(), args, OP_TIMEOUT);
        let r = self.process_op(ex, process_op::WATCH, 0, &j)?;
        number(&answer(r)?)
    }

    /// Stops watcher `watcher`.
    fn unwatch(&mut self, ex: &Executor, watcher: u32) -> Result<(), ProcessError> {
        let j = request(watcher.to_string(), vec![], OP_TIMEOUT);
        let r = self.process_op(ex, process_op::UNWATCH, 0, &j)?;
        answer(r).map(drop)
    }

    /// Sets the terminal size of PTY process `pid` (it gets SIGWINCH).
    fn resize_process(
        &mut self,
        ex: &Executor,
        pid: u32,
        rows: u16,
        cols: u16,
    ) -> Result<(), ProcessError> {
        let j = request(pid.to_string(), vec![format!("{rows}x{cols}")], OP_TIMEOUT);
        let r = self.process_op(ex, process_op::RESIZE, 0, &j)?;
        answer(r).map(drop)
    }

    /// Waits up to `wait` for output and exits of the live processes (module docs) and
    /// returns them, at most about `budget` bytes of output. `cancel` ends the wait early
    /// with what there is. Nothing live: returns at once, empty.
    fn poll_processes(
        &mut self,
        ex: &Executor,
        wait: Duration,
        budget: usize,
        cancel: Option<Cancel>,
    ) -> Result<Vec<ProcessEvent>, ProcessError> {
        let wait_ms = wait.as_millis().min(u128::from(u32::MAX)) as u64;
        let mut j = request(
            Vec::new(),
            vec![wait_ms.to_string(), budget.to_string()],
            wait + OP_TIMEOUT,
        );
        j.output_limit = budget + POLL_SLACK;
        j.cancel = cancel;
        let r = self.process_op(ex, process_op::POLL, 0, &j)?;
        match (r.status, r.exit_code) {
            (Status::Ok, Some(file_status::OK)) => decode_events(&r.stdout),
            // The guest stopped waiting at the interrupt and answered at DONE with what it
            // had (the host's status replaces its exit code); or it never saw the request.
            (Status::Cancelled, _) => decode_events(&r.stdout),
            _ => answer(r).and_then(|_| {
                Err(ProcessError::Malformed(
                    "a poll that ended otherwise than at DONE".into(),
                ))
            }),
        }
    }

    /// Writes what of `data` process `pid`'s stdin pipe takes now (without blocking) and
    /// returns how many bytes that was; then closes it if `close`.
    fn process_stdin(
        &mut self,
        ex: &Executor,
        pid: u32,
        data: Vec<u8>,
        close: bool,
    ) -> Result<usize, ProcessError> {
        let args = if close { vec!["close".into()] } else { vec![] };
        let mut j = request(pid.to_string(), args, OP_TIMEOUT);
        j.stdin = data;
        let r = self.process_op(ex, process_op::STDIN, 0, &j)?;
        number(&answer(r)?)
    }

    /// Sends `signal` to process `pid` and everything it started (its process group).
    fn signal_process(&mut self, ex: &Executor, pid: u32, signal: i32) -> Result<(), ProcessError> {
        if !(1..=64).contains(&signal) {
            return Err(ProcessError::Invalid(format!("no signal {signal}")));
        }
        let j = request(pid.to_string(), vec![signal.to_string()], OP_TIMEOUT);
        let r = self.process_op(ex, process_op::SIGNAL, 0, &j)?;
        answer(r).map(drop)
    }
}

impl<T: Requests + ?Sized> Processes for T {}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(pid: u32, kind: u32, value: i32, data: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        for w in [pid, kind, value as u32, data.len() as u32] {
            v.extend_from_slice(&w.to_le_bytes());
        }
        v.extend_from_slice(data);
        v
    }

    #[test]
    fn events_decode_in_order_with_exit_codes_and_signals() {
        let mut b = frame(7, process_event::STDOUT, 0, b"hi\n");
        b.extend(frame(7, process_event::STDERR, 0, b"oops"));
        b.extend(frame(7, process_event::EXIT, 3, b""));
        b.extend(frame(9, process_event::EXIT, -9, b""));
        let events = decode_events(&b).unwrap();
        assert_eq!(
            events,
            vec![
                ProcessEvent::Output {
                    pid: 7,
                    stream: Stream::Stdout,
                    data: b"hi\n".to_vec()
                },
                ProcessEvent::Output {
                    pid: 7,
                    stream: Stream::Stderr,
                    data: b"oops".to_vec()
                },
                ProcessEvent::Exit {
                    pid: 7,
                    exit_code: Some(3),
                    signal: None
                },
                ProcessEvent::Exit {
                    pid: 9,
                    exit_code: None,
                    signal: Some(9)
                },
            ]
        );
    }

    #[test]
    fn malformed_answers_are_refused() {
        let whole = frame(1, process_event::STDOUT, 0, b"abc");
        assert!(decode_events(&whole[..whole.len() - 1]).is_err());
        assert!(decode_events(&whole[..10]).is_err());
        assert!(decode_events(&frame(1, 99, 0, b"")).is_err());
        assert_eq!(decode_events(&[]).unwrap(), vec![]);
    }
}
