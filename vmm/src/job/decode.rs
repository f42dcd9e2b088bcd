//! Reading what the guest left in the mailbox during and at the end of a request: output
//! areas (taken as they fill, with the cap applied), the outcome or the worker's wait
//! status, the phase marks, the display JSON. All of it is hostile input: lengths are
//! clamped to their areas, values out of range are a crash, anything unparsable is dropped.

use super::{CellError, Display, GuestPhases, JobError, Status, Stream};
use crate::mailbox::{Mailbox, MailboxError};
use crate::memory::GuestRam;
use crate::protocol::{guest_flags, job, outcome, result};

/// Who sees output chunks as they are taken (for streaming).
pub(crate) type OnOutput<'a> = &'a mut dyn FnMut(Stream, &[u8]);

/// Output gathered so far, with the cap applied.
pub(crate) struct Collected<'a> {
    pub(crate) stdout: Vec<u8>,
    pub(crate) stderr: Vec<u8>,
    pub(crate) limit: usize,
    pub(crate) over_limit: bool,
    /// Sees each chunk as it is taken (for streaming), if anyone does.
    pub(crate) on_output: Option<OnOutput<'a>>,
    /// Bytes of each area already taken since the guest's counters were last zeroed.
    pub(crate) taken: [usize; 2],
}

impl<'a> Collected<'a> {
    /// Nothing taken yet, at most `limit` bytes to keep.
    pub(crate) fn new(limit: usize, on_output: Option<OnOutput<'a>>) -> Self {
        Self {
            stdout: Vec::new(),
            stderr: Vec::new(),
            limit,
            over_limit: false,
            on_output,
            taken: [0, 0],
        }
    }

    /// Takes what each area holds past what was already taken. `reset` zeroes the guest's
    /// fill counters (after a FLUSH, the guest waiting at the doorbell). Without it the
    /// guest may be stopped anywhere, even mid-write: the guest counts bytes only after
    /// copying them, so the areas up to their counters are always whole, and the counters
    /// only grow until a FLUSH; so this may run at any stop, and takes each byte once.
    pub(crate) fn drain(
        &mut self,
        ram: &GuestRam,
        mb: &Mailbox,
        reset: bool,
    ) -> Result<(), MailboxError> {
        for (stream, len_at, area, end) in [
            (
                Stream::Stdout,
                result::STDOUT_LEN,
                result::STDOUT_AREA,
                result::STDOUT_AREA_END,
            ),
            (
                Stream::Stderr,
                result::STDERR_LEN,
                result::STDERR_AREA,
                result::STDERR_AREA_END,
            ),
        ] {
            // Hostile: clamp the guest's length to its area (and never below what was taken).
            let len = (mb.read_u32(ram, len_at as u64)? as usize).min(end - area);
            let from = self.taken[stream as usize].min(len);
            let room = self
                .limit
                .saturating_sub(self.stdout.len() + self.stderr.len());
            let take = (len - from).min(room);
            if len - from > room {
                self.over_limit = true;
            }
            let mut chunk = vec![0u8; take];
            mb.read(ram, (area + from) as u64, &mut chunk)?;
            self.taken[stream as usize] = if reset { 0 } else { from + take };
            if let Some(f) = self.on_output.as_mut().filter(|_| !chunk.is_empty()) {
                f(stream, &chunk);
            }
            match stream {
                Stream::Stdout => self.stdout.extend_from_slice(&chunk),
                Stream::Stderr => self.stderr.extend_from_slice(&chunk),
            }
            if reset {
                mb.write(ram, len_at as u64, &0u32.to_le_bytes())?;
            }
        }
        Ok(())
    }
}

/// The result fields of a job that ended, before output and timings are attached.
pub(crate) struct End {
    pub(crate) status: Status,
    pub(crate) exit_code: Option<i32>,
    pub(crate) signal: Option<i32>,
    pub(crate) crash: Option<String>,
}

impl End {
    pub(super) fn exited(code: i32) -> Self {
        let status = if code == 0 { Status::Ok } else { Status::Error };
        Self {
            status,
            exit_code: Some(code),
            signal: None,
            crash: None,
        }
    }
    pub(super) fn crashed(why: String) -> Self {
        Self {
            status: Status::Crashed,
            exit_code: None,
            signal: None,
            crash: Some(why),
        }
    }
    pub(super) fn with(status: Status) -> Self {
        Self {
            status,
            exit_code: None,
            signal: None,
            crash: None,
        }
    }
}

const SIGKILL: i32 = 9;

/// Maps a wait status of the worker process (from a FAILED / WORKER_EXITED doorbell).
/// The end of a job from the outcome and value the guest reported at DONE. Hostile input:
/// an exit status outside 0..=255, a signal outside 1..=64 or an unknown outcome is a
/// crash (the guest broke the protocol), never a status a job could not have had.
pub(crate) fn end_from_outcome(outcome: u32, value: i32) -> End {
    match outcome {
        outcome::EXITED if (0..=255).contains(&value) => End::exited(value),
        outcome::SIGNALED if (1..=64).contains(&value) => End {
            status: Status::Error,
            exit_code: None,
            signal: Some(value),
            crash: None,
        },
        outcome::OUT_OF_MEMORY if (0..=255).contains(&value) => End {
            status: Status::MemoryLimit,
            exit_code: Some(value),
            signal: None,
            crash: None,
        },
        outcome::EXITED | outcome::SIGNALED | outcome::OUT_OF_MEMORY => End::crashed(format!(
            "guest reported outcome {outcome} with value {value}, out of range"
        )),
        other => End::crashed(format!("guest reported unknown outcome {other}")),
    }
}

pub(super) fn end_from_wait_status(status: u64, console_says_oom: bool) -> End {
    let status = status as i32;
    let signal = status & 0x7f;
    if signal == 0 {
        return End::exited((status >> 8) & 0xff);
    }
    if signal == SIGKILL && console_says_oom {
        return End {
            status: Status::MemoryLimit,
            exit_code: None,
            signal: Some(signal),
            crash: None,
        };
    }
    End {
        status: Status::Error,
        exit_code: None,
        signal: Some(signal),
        crash: None,
    }
}

/// The guest's phase marks of a request that ended at DONE (None when they make no sense).
pub(super) fn read_phases(
    ram: &GuestRam,
    mb: &Mailbox,
) -> Result<Option<GuestPhases>, MailboxError> {
    let mark = |at: usize| -> Result<u64, MailboxError> {
        let mut b = [0u8; 8];
        mb.read(ram, at as u64, &mut b)?;
        Ok(u64::from_le_bytes(b))
    };
    let flags = mb.read_u32(ram, result::GUEST_FLAGS as u64)?;
    Ok(GuestPhases::from_marks(
        mark(result::PHASE_READ_NS)?,
        mark(result::PHASE_IDENTITY_NS)?,
        mark(result::PHASE_COMPILED_NS)?,
        mark(result::PHASE_FINISHED_NS)?,
    )
    .map(|p| GuestPhases {
        clock_set: flags & guest_flags::CLOCK_SET != 0,
        ..p
    }))
}

/// What a request displayed (`result::DISPLAY_LEN`): `{"value": [...], "figures": [...]}`,
/// each a list of `{type, data}`.
#[derive(Debug, Default, serde::Deserialize)]
pub(super) struct Shown {
    #[serde(default)]
    pub(super) value: Vec<Display>,
    #[serde(default)]
    pub(super) figures: Vec<Display>,
    #[serde(default)]
    pub(super) error: Option<CellError>,
}

/// The display data of a request. Hostile: the length is clamped to the area, and anything
/// but the JSON of [`Shown`] is dropped whole.
pub(super) fn read_display(ram: &GuestRam, mb: &Mailbox) -> Result<Shown, JobError> {
    let len =
        (mb.read_u32(ram, result::DISPLAY_LEN as u64)? as usize).min(job::DATA_END - job::DATA);
    if len == 0 {
        return Ok(Shown::default());
    }
    let mut bytes = vec![0u8; len];
    mb.read(ram, job::DATA as u64, &mut bytes)?;
    Ok(serde_json::from_slice(&bytes).unwrap_or_default())
}

/// Everything the host decodes of what the guest wrote into the mailbox by the end of a
/// request, run over `mb` as it is: both output areas with their counters (as at a FLUSH
/// and at DONE), the outcome, the phase marks and the display JSON. For the fuzz target
/// `result` (`fuzz/`): whatever the guest wrote, this returns, never panics.
#[doc(hidden)]
pub fn decode_result(ram: &GuestRam, mb: &Mailbox, limit: usize) -> Result<usize, JobError> {
    let mut seen = 0usize;
    let mut count = |_: Stream, b: &[u8]| seen += b.len();
    let mut out = Collected::new(limit, Some(&mut count));
    out.drain(ram, mb, false)?;
    out.drain(ram, mb, true)?;
    out.drain(ram, mb, false)?;
    let kept = out.stdout.len() + out.stderr.len();
    let oc = mb.read_u32(ram, result::OUTCOME as u64)?;
    let value = mb.read_u32(ram, result::EXIT_CODE as u64)? as i32;
    let _ = end_from_outcome(oc, value);
    let _ = read_phases(ram, mb)?;
    let _ = read_display(ram, mb)?;
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_outcomes_out_of_range_are_crashes() {
        assert_eq!(end_from_outcome(outcome::EXITED, 3).exit_code, Some(3));
        assert_eq!(end_from_outcome(outcome::SIGNALED, 9).signal, Some(9));
        assert_eq!(end_from_outcome(outcome::SIGNALED, 64).signal, Some(64));
        for (oc, v) in [
            (outcome::EXITED, 256),
            (outcome::EXITED, -1),
            (outcome::SIGNALED, 0),
            (outcome::SIGNALED, 65),
            (outcome::SIGNALED, i32::MIN),
            (outcome::OUT_OF_MEMORY, 1000),
            (77, 0),
        ] {
            assert_eq!(end_from_outcome(oc, v).status, Status::Crashed, "{oc} {v}");
        }
    }

    #[test]
    fn wait_status_exit_code_and_signals_map_to_statuses() {
        assert_eq!(end_from_wait_status(0, false).status, Status::Ok);
        assert_eq!(end_from_wait_status(3 << 8, false).exit_code, Some(3));
        assert_eq!(end_from_wait_status(3 << 8, false).status, Status::Error);
        assert_eq!(end_from_wait_status(9, true).status, Status::MemoryLimit);
        assert_eq!(end_from_wait_status(9, false).status, Status::Error);
        assert_eq!(end_from_wait_status(11, false).signal, Some(11));
    }
}
