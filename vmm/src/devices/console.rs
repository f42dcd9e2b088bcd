//! Where the guest's serial console output goes: a bounded, timestamped line log kept for
//! diagnostics (a failed boot or a crashed clone reports its tail), optionally echoed live.
//!
//! The console is never a job channel: jobs use the mailbox (see [`crate::protocol`]). It must
//! never grow without bound, whatever the guest prints.

use std::collections::VecDeque;
use std::io::Write;
use std::time::{Duration, Instant};

/// Lines kept by default.
pub(crate) const DEFAULT_MAX_LINES: usize = 512;
/// A line longer than this is split (so a guest printing without newlines stays bounded).
pub(crate) const MAX_LINE_BYTES: usize = 4096;

/// One console line and when it was completed, relative to the log's start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsoleLine {
    pub at: Duration,
    pub text: String,
}

/// Callback that sees every completed line (for `bud boot`'s live console).
pub type EchoFn = Box<dyn FnMut(&ConsoleLine) + Send>;

/// The console sink: implements [`Write`] for the UART model.
pub struct ConsoleLog {
    start: Instant,
    partial: Vec<u8>,
    lines: VecDeque<ConsoleLine>,
    max_lines: usize,
    total_bytes: u64,
    echo: Option<EchoFn>,
}

impl std::fmt::Debug for ConsoleLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleLog")
            .field("lines", &self.lines.len())
            .field("total_bytes", &self.total_bytes)
            .finish()
    }
}

impl Default for ConsoleLog {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_LINES)
    }
}

impl ConsoleLog {
    /// A log keeping the last `max_lines` lines.
    pub fn new(max_lines: usize) -> Self {
        Self {
            start: Instant::now(),
            partial: Vec::new(),
            lines: VecDeque::new(),
            max_lines: max_lines.max(1),
            total_bytes: 0,
            echo: None,
        }
    }

    /// Calls `echo` for every completed line from now on.
    pub(crate) fn set_echo(&mut self, echo: Option<EchoFn>) {
        self.echo = echo;
    }

    /// Restarts the clock that line timestamps are relative to.
    pub(crate) fn reset_clock(&mut self, start: Instant) {
        self.start = start;
    }

    /// The last `n` lines, the unfinished one included, as text.
    pub fn tail(&self, n: usize) -> Vec<String> {
        let mut out: Vec<String> = self.lines.iter().map(|l| l.text.clone()).collect();
        if !self.partial.is_empty() {
            out.push(String::from_utf8_lossy(&self.partial).into_owned());
        }
        let skip = out.len().saturating_sub(n);
        out.split_off(skip)
    }

    fn finish_line(&mut self) {
        let text = String::from_utf8_lossy(&self.partial)
            .trim_end_matches('\r')
            .to_string();
        self.partial.clear();
        let line = ConsoleLine {
            at: self.start.elapsed(),
            text,
        };
        if let Some(echo) = self.echo.as_mut() {
            echo(&line);
        }
        if self.lines.len() == self.max_lines {
            self.lines.pop_front();
        }
        self.lines.push_back(line);
    }
}

impl Write for ConsoleLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.total_bytes += buf.len() as u64;
        for &b in buf {
            if b == b'\n' {
                self.finish_line();
            } else {
                self.partial.push(b);
                if self.partial.len() >= MAX_LINE_BYTES {
                    self.finish_line();
                }
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_split_on_newline_and_carriage_returns_dropped() {
        let mut log = ConsoleLog::new(10);

        log.write_all(b"hello\r\nwor").unwrap();
        log.write_all(b"ld\npartial").unwrap();

        assert_eq!(log.tail(10), vec!["hello", "world", "partial"]);
        assert_eq!(log.total_bytes, 20);
    }

    #[test]
    fn only_the_last_lines_are_kept() {
        let mut log = ConsoleLog::new(3);

        for i in 0..10 {
            writeln!(log, "line {i}").unwrap();
        }

        assert_eq!(log.tail(100), vec!["line 7", "line 8", "line 9"]);
        assert_eq!(log.tail(1), vec!["line 9"]);
    }

    #[test]
    fn a_line_without_newline_is_split_at_the_limit() {
        let mut log = ConsoleLog::new(4);

        log.write_all(&vec![b'x'; MAX_LINE_BYTES * 2 + 1]).unwrap();

        let tail = log.tail(4);
        assert_eq!(tail.len(), 3);
        assert_eq!(tail[0].len(), MAX_LINE_BYTES);
        assert_eq!(tail[2], "x");
    }

    #[test]
    fn echo_sees_every_completed_line() {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = seen.clone();
        let mut log = ConsoleLog::new(1);
        log.set_echo(Some(Box::new(move |l: &ConsoleLine| {
            sink.lock().unwrap().push(l.text.clone())
        })));

        log.write_all(b"a\nb\nc").unwrap();

        assert_eq!(*seen.lock().unwrap(), vec!["a", "b"]);
    }
}
