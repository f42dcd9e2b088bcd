//! A session's trace read back: its events with filters, its check, and the live stream
//! that a client reconnects to without missing an event (`crate::core::trace` keeps them).
//!
//! The stream subscribes to the session's new events *before* it reads what is on disk,
//! then sends the file's events after the client's last one and the live ones after
//! those, each once, in order: an event written between the read and the subscription
//! cannot fall in the gap. A subscriber that falls more than
//! [`crate::core::trace::LIVE_BACKLOG`] events behind reads the file again from its last
//! one. The stream ends after the trace's seal.

use std::collections::BTreeSet;
use std::sync::Arc;

use tokio::sync::{broadcast, mpsc};

use crate::core::state::AppState;
use crate::core::trace::files::{self as changed, Found};
use crate::core::trace::view::{self, Recorded, Verdict};
use crate::core::trace::{Broken, Line, Traces, Verified, chain, otlp, packet, review};
use crate::service::error::Error;

/// Which events of a trace to read.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only these kinds (empty: all).
    pub kinds: BTreeSet<String>,
    /// Only events at or after this time (RFC 3339 UTC as the trace writes it, or a prefix
    /// of it: `2026-12-02T08:00`).
    pub since: Option<String>,
    /// Only events before this time (the same form).
    pub until: Option<String>,
    /// Only events with a higher seq.
    pub after: u64,
}

impl Filter {
    fn keeps(&self, line: &Line) -> bool {
        let time = time_of(&line.text).unwrap_or_default();
        (self.kinds.is_empty() || self.kinds.contains(&line.kind))
            && self.since.as_deref().is_none_or(|s| time >= s)
            && self.until.as_deref().is_none_or(|u| time < u)
    }
}

/// The `time` of a line (it follows `seq`), without parsing the rest.
fn time_of(line: &str) -> Option<&str> {
    let at = line.find(",\"time\":\"")? + ",\"time\":\"".len();
    let end = line[at..].find('"')?;
    Some(&line[at..at + end])
}

fn traces<'a>(state: &'a AppState, id: &str) -> Result<&'a Arc<Traces>, Error> {
    state
        .traces()
        .filter(|t| t.has(id))
        .ok_or_else(|| Error::NoTrace(id.to_owned()))
}

fn io(id: &str, e: &std::io::Error) -> Error {
    Error::internal(format!("reading the trace of {id}: {e}"))
}

/// Session `id`'s events that `filter` keeps, in order (live or ended sessions alike).
pub async fn events(state: &AppState, id: &str, filter: Filter) -> Result<Vec<Line>, Error> {
    let t = traces(state, id)?.clone();
    let owned = id.to_owned();
    let lines = tokio::task::spawn_blocking(move || t.read(&owned, filter.after))
        .await
        .map_err(Error::internal)?
        .map_err(|e| io(id, &e))?
        .ok_or_else(|| Error::NoTrace(id.to_owned()))?;
    Ok(lines.into_iter().filter(|l| filter.keeps(l)).collect())
}

/// What checking a trace found.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Check {
    /// The chain is whole (and a seal, if any, verifies with this server's keys).
    pub ok: bool,
    pub events: u64,
    pub sealed: bool,
    /// The last event's hash.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head: Option<String>,
    /// A last line cut short by a crash (left out of the chain).
    pub torn_tail: bool,
    /// Where and why the chain breaks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub broken: Option<String>,
}

impl From<Result<Verified, Broken>> for Check {
    fn from(r: Result<Verified, Broken>) -> Self {
        match r {
            Ok(v) => Self {
                ok: true,
                events: v.events,
                sealed: v.sealed,
                head: Some(v.head),
                torn_tail: v.torn_tail,
                broken: None,
            },
            Err(b) => Self {
                ok: false,
                events: 0,
                sealed: false,
                head: None,
                torn_tail: false,
                broken: Some(b.to_string()),
            },
        }
    }
}

/// Checks session `id`'s trace on disk.
pub async fn check(state: &AppState, id: &str) -> Result<Check, Error> {
    let t = traces(state, id)?.clone();
    let owned = id.to_owned();
    tokio::task::spawn_blocking(move || t.verify(&owned))
        .await
        .map_err(Error::internal)?
        .map_err(|e| io(id, &e))?
        .map(Check::from)
        .ok_or_else(|| Error::NoTrace(id.to_owned()))
}

/// Session `id`'s events after seq `after`, then its new ones as they come, until its seal
/// (module docs). The receiver ends when the trace is sealed or the caller drops it.
pub async fn follow(
    state: &AppState,
    id: &str,
    after: u64,
) -> Result<mpsc::Receiver<Arc<Line>>, Error> {
    let t = traces(state, id)?.clone();
    let live = t.subscribe(id);
    let past = read_after(&t, id, after).await?;
    let (tx, rx) = mpsc::channel(64);
    let id = id.to_owned();
    tokio::spawn(async move {
        let mut last = after;
        let mut sealed = false;
        for line in past {
            last = line.seq;
            sealed |= line.kind == chain::SEALED;
            if tx.send(Arc::new(line)).await.is_err() {
                return;
            }
        }
        let Some(mut live) = live else { return };
        while !sealed {
            let more = match live.recv().await {
                Ok(line) => vec![line],
                Err(
                    broadcast::error::RecvError::Lagged(_) | broadcast::error::RecvError::Closed,
                ) => {
                    // Behind, or the trace closed: what the file holds after the last sent.
                    let Ok(lines) = read_after(&t, &id, last).await else {
                        return;
                    };
                    if lines.is_empty() {
                        return;
                    }
                    lines.into_iter().map(Arc::new).collect()
                }
            };
            for line in more {
                if line.seq <= last {
                    continue;
                }
                last = line.seq;
                sealed |= line.kind == chain::SEALED;
                if tx.send(line).await.is_err() {
                    return;
                }
            }
        }
    });
    Ok(rx)
}

/// Session `id`'s trace read whole: its bytes, its events, their verdict and the check
/// as `/trace/verify` shows it.
struct Read {
    bytes: Vec<u8>,
    events: Vec<Recorded>,
    verdict: Verdict,
    check: Check,
}

/// What `make` makes of session `id`'s whole trace, read and made off the async threads
/// (a page of 10 000 events is a few megabytes).
async fn made_of<T: Send + 'static>(
    state: &AppState,
    id: &str,
    make: impl FnOnce(&str, Read) -> std::io::Result<T> + Send + 'static,
) -> Result<T, Error> {
    let t = traces(state, id)?.clone();
    let owned = id.to_owned();
    tokio::task::spawn_blocking(move || {
        let Some(whole) = t.whole(&owned)? else {
            return Ok(None);
        };
        let read = Read {
            events: view::events(&whole.lines),
            verdict: Verdict::from(&whole.check),
            bytes: whole.bytes,
            check: Check::from(whole.check),
        };
        make(&owned, read).map(Some)
    })
    .await
    .map_err(Error::internal)?
    .map_err(|e| io(id, &e))?
    .ok_or_else(|| Error::NoTrace(id.to_owned()))
}

/// Session `id`'s review page (HTML, [`crate::core::trace::review`]).
pub async fn review(state: &AppState, id: &str) -> Result<String, Error> {
    made_of(state, id, |id, r| {
        Ok(review::page(id, &r.events, &r.verdict))
    })
    .await
}

/// Session `id`'s trace as OpenTelemetry spans (OTLP JSON, [`crate::core::trace::otlp`]).
pub async fn spans(state: &AppState, id: &str) -> Result<serde_json::Value, Error> {
    made_of(state, id, |id, r| Ok(otlp::export(id, &r.events))).await
}

/// Session `id`'s review packet (a gzipped tar, [`crate::core::trace::packet`]).
pub async fn packet(state: &AppState, id: &str) -> Result<Vec<u8>, Error> {
    made_of(state, id, |id, r| {
        packet::build(&packet::Contents {
            id,
            trace: &r.bytes,
            events: &r.events,
            verdict: &r.verdict,
            check: serde_json::to_value(&r.check).unwrap_or_default(),
        })
    })
    .await
}

async fn read_after(t: &Arc<Traces>, id: &str, after: u64) -> Result<Vec<Line>, Error> {
    let (t, owned) = (t.clone(), id.to_owned());
    tokio::task::spawn_blocking(move || t.read(&owned, after))
        .await
        .map_err(Error::internal)?
        .map_err(|e| io(id, &e))?
        .ok_or_else(|| Error::NoTrace(id.to_owned()))
}

/// Refuses a new session (or a traced one-shot job) while the traces are at their quota and `--trace-over-quota
/// refuse` keeps them all.
pub fn check_traces(state: &AppState) -> Result<(), Error> {
    match state.traces() {
        Some(t) if t.refuses_sessions() => {
            let (used, quota) = t.usage();
            Err(Error::TraceQuota { used, quota })
        }
        _ => Ok(()),
    }
}

/// Records what session `id`'s own programs changed in its work directory since its last
/// checkpoint (a `files_changed` event, [`crate::core::trace::files`]), `why` it was taken;
/// the event's data. The walk reads the files through the same operations as the files
/// API, within [`changed::MAX_FILES`], [`changed::MAX_FILE_BYTES`] each and
/// [`changed::MAX_READ_BYTES`] in all (past them, `cut` says which).
pub async fn checkpoint(state: &AppState, id: &str, why: &str) -> Result<serde_json::Value, Error> {
    let t = traces(state, id)?.clone();
    let (now, cut) = walk(state, id).await?;
    let (owned, why) = (id.to_owned(), why.to_owned());
    tokio::task::spawn_blocking(move || {
        // Only the earlier checkpoints are needed: the lines, not the chain's check.
        let events = t
            .read(&owned, 0)?
            .map(|lines| view::events(&lines))
            .unwrap_or_default();
        let before = changed::seen(&events);
        let mut data = serde_json::Value::Null;
        t.record(&owned, changed::KIND, |budget| {
            data = changed::event(&why, &before, &now, cut, budget);
            data.clone()
        });
        Ok::<_, std::io::Error>(data)
    })
    .await
    .map_err(Error::internal)?
    .map_err(|e| io(id, &e))
}

/// The work directory of session `id`: path (relative to it) -> what was found, and what
/// the walk left out.
async fn walk(
    state: &AppState,
    id: &str,
) -> Result<
    (
        std::collections::BTreeMap<String, Found>,
        Option<&'static str>,
    ),
    Error,
> {
    use vmm::files::FileKind;
    let mut now = std::collections::BTreeMap::new();
    let (mut cut, mut read) = (None, 0u64);
    let mut dirs = vec![(".".to_owned(), 0usize)];
    while let Some((dir, depth)) = dirs.pop() {
        for e in crate::service::files::list(state, id, &dir).await? {
            let path = if dir == "." {
                e.name.clone()
            } else {
                format!("{dir}/{}", e.name)
            };
            if e.kind == FileKind::Dir {
                if depth + 1 < changed::MAX_DEPTH {
                    dirs.push((path, depth + 1));
                } else {
                    cut = Some("depth");
                }
                continue;
            }
            if now.len() >= changed::MAX_FILES {
                cut = Some("files");
                break;
            }
            let found = match e.kind {
                FileKind::File
                    if e.size <= changed::MAX_FILE_BYTES
                        && read + e.size <= changed::MAX_READ_BYTES =>
                {
                    let bytes = crate::service::files::read(state, id, &path).await?;
                    read += bytes.len() as u64;
                    Found::read(&bytes)
                }
                FileKind::File => {
                    cut = Some("bytes");
                    Found {
                        size: e.size,
                        sha256: None,
                        text: None,
                        kind: "file",
                    }
                }
                FileKind::Symlink => {
                    let target = e.target.clone().unwrap_or_default();
                    Found {
                        kind: "symlink",
                        ..Found::read(target.as_bytes())
                    }
                }
                _ => Found {
                    size: e.size,
                    sha256: None,
                    text: None,
                    kind: "other",
                },
            };
            now.insert(path, found);
        }
    }
    Ok((now, cut))
}
