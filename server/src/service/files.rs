//! A session's files, and the files of a one-shot job: the server's side of
//! [`vmm::files`]. Each operation runs beside the request its session runs if one runs
//! ([`vmm::beside`]: a file read while a cell computes), else takes its session (busy
//! meanwhile) and runs on a job thread; it maps the typed file errors to the service's.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use vmm::Executor;
use vmm::beside::Beside;
use vmm::files::{FileEntry, FileError, Files, Owner};
use vmm::job::Stream;
use vmm::session::{Requests, Session, SessionError};
use vmm::{Job, JobResult};

use crate::core::state::AppState;
use crate::service::access::{Taken, beside_or_acquire, end_if_unusable};
use crate::service::admission;
use crate::service::error::Error;

/// The service's error for `e`, a failed operation on `path` (named `field` in requests).
fn file_error(field: &str, path: &str, e: FileError) -> Error {
    match e {
        FileError::BadPath(why) | FileError::WrongKind(why) => Error::invalid(field, why),
        FileError::NotFound(why) => Error::NoFile(format!("{path}: {why}")),
        FileError::TooLarge { limit, .. } => Error::TooLarge {
            field: field.to_owned(),
            bytes: limit + 1,
            limit,
        },
        e @ (FileError::Failed { .. } | FileError::Malformed { .. } | FileError::Session(_)) => {
            Error::internal(e)
        }
    }
}

/// Runs `op` in session `id` with the server's file timeout: beside the request it runs, if
/// one runs, else on its VM on a job thread. An operation of several requests (a large
/// write) that the running request's end cuts short runs again whole on the VM (a write
/// starts by truncating).
async fn in_session<T: Send + 'static>(
    state: &AppState,
    id: &str,
    path: &str,
    op: impl Fn(&mut dyn Requests, &Executor, Duration) -> Result<T, FileError> + Send + Sync + 'static,
) -> Result<T, Error> {
    let timeout = Duration::from_millis(state.config().limits.max_timeout_ms);
    let op = Arc::new(op);
    let o = op.clone();
    let lane_op = Arc::new(
        move |lane: &mut Beside, ex: &Executor| match o(lane, ex, timeout) {
            Err(FileError::Session(s)) if s.not_beside() => None,
            done => Some(done),
        },
    );
    let busy = match beside_or_acquire(state, id, false, lane_op).await? {
        Taken::Beside(done) => return done.map_err(|e| file_error("path", path, e)),
        Taken::Held(busy) => busy,
    };
    let st = state.clone();
    let done = admission::call(state, move || {
        let done = busy
            .entry()
            .with_vmm(|s, exec| op(s, exec, timeout))
            .unwrap_or(Err(FileError::Session(SessionError::Gone)));
        busy.entry().account();
        end_if_unusable(&st, &busy);
        done
    })
    .await?;
    done.map_err(|e| file_error("path", path, e))
}

/// The bytes of file `path` (at most the server's `max_file_bytes`).
pub async fn read(state: &AppState, id: &str, path: &str) -> Result<Vec<u8>, Error> {
    let limit = state.config().sessions.max_file_bytes;
    let p = path.to_owned();
    in_session(state, id, path, move |s, ex, t| {
        s.get_file(ex, &p, limit, t)
    })
    .await
}

/// Writes `data` to `path` (created or truncated, parents made).
pub async fn write(state: &AppState, id: &str, path: &str, data: Vec<u8>) -> Result<(), Error> {
    write_as(state, id, path, data, Owner::Root).await
}

/// [`write`], the file and the directories made for it belonging to `owner`.
pub async fn write_as(
    state: &AppState,
    id: &str,
    path: &str,
    data: Vec<u8>,
    owner: Owner,
) -> Result<(), Error> {
    let p = path.to_owned();
    let traced = traced_write(state, path, &data);
    in_session(state, id, path, move |s, ex, t| {
        s.put_file_as(ex, &p, &data, owner, t)
    })
    .await?;
    trace(state, id, "file_written", traced);
    Ok(())
}

/// The trace event of writing `data` to `path` (None without traces: no hash taken).
fn traced_write(state: &AppState, path: &str, data: &[u8]) -> Option<serde_json::Value> {
    state
        .traces()
        .map(|_| crate::core::trace::event::file_written(path, data))
}

/// Traces a file operation that succeeded.
fn trace(state: &AppState, id: &str, kind: &str, data: Option<serde_json::Value>) {
    if let Some(data) = data {
        state.trace(id, kind, |_| data);
    }
}

/// [`write_as`], the file's E2B metadata then exactly `metadata` (`{}` clears it).
pub async fn write_with_metadata(
    state: &AppState,
    id: &str,
    path: &str,
    data: Vec<u8>,
    owner: Owner,
    metadata: BTreeMap<String, String>,
) -> Result<(), Error> {
    let p = path.to_owned();
    let traced = traced_write(state, path, &data);
    in_session(state, id, path, move |s, ex, t| {
        s.put_file_with_metadata(ex, &p, &data, owner, &metadata, t)
    })
    .await?;
    trace(state, id, "file_written", traced);
    Ok(())
}

/// Removes a file, or a directory with everything in it.
pub async fn remove(state: &AppState, id: &str, path: &str) -> Result<(), Error> {
    let p = path.to_owned();
    in_session(state, id, path, move |s, ex, t| s.remove(ex, &p, t)).await?;
    trace(
        state,
        id,
        "file_removed",
        Some(serde_json::json!({"path": path})),
    );
    Ok(())
}

/// The entries of directory `dir`.
pub async fn list(state: &AppState, id: &str, dir: &str) -> Result<Vec<FileEntry>, Error> {
    let p = dir.to_owned();
    in_session(state, id, dir, move |s, ex, t| s.list_dir(ex, &p, t)).await
}

/// [`list`], each entry with its E2B metadata.
pub async fn list_with_metadata(
    state: &AppState,
    id: &str,
    dir: &str,
) -> Result<Vec<FileEntry>, Error> {
    let p = dir.to_owned();
    in_session(state, id, dir, move |s, ex, t| {
        s.list_dir_with_metadata(ex, &p, t)
    })
    .await
}

/// What `path` is (a final symlink not followed), with its E2B metadata.
pub async fn stat(state: &AppState, id: &str, path: &str) -> Result<FileEntry, Error> {
    let p = path.to_owned();
    in_session(state, id, path, move |s, ex, t| {
        s.stat_with_metadata(ex, &p, t)
    })
    .await
}

/// Makes directory `path` and its parents, the ones it makes belonging to `owner`.
pub async fn make_dir_as(
    state: &AppState,
    id: &str,
    path: &str,
    owner: Owner,
) -> Result<(), Error> {
    let p = path.to_owned();
    in_session(state, id, path, move |s, ex, t| {
        s.make_dir_as(ex, &p, owner, t)
    })
    .await?;
    trace(
        state,
        id,
        "dir_made",
        Some(serde_json::json!({"path": path})),
    );
    Ok(())
}

/// Renames `from` to `to`, the parents it makes for `to` belonging to `owner`.
pub async fn rename_as(
    state: &AppState,
    id: &str,
    from: &str,
    to: &str,
    owner: Owner,
) -> Result<(), Error> {
    let (f, t2) = (from.to_owned(), to.to_owned());
    in_session(state, id, from, move |s, ex, t| {
        s.rename_as(ex, &f, &t2, owner, t)
    })
    .await?;
    let moved = serde_json::json!({"from": from, "to": to});
    trace(state, id, "file_renamed", Some(moved));
    Ok(())
}

/// The files a job's `return_files` patterns matched (path -> bytes); None without patterns.
pub type Returned = Option<BTreeMap<String, Vec<u8>>>;

/// A one-shot job with files, on its job thread: a VM that first gets the files, then runs
/// the job as a one-shot job, then gives back the files the patterns match (only if the
/// job ended at DONE; up to the job's output limit in all), and goes back to the executor
/// like any job's VM.
pub fn run_with_files(
    ex: &Executor,
    job: &Job,
    files: &JobFiles,
    sink: &mut dyn FnMut(Stream, &[u8]),
) -> Result<(JobResult, Returned), Error> {
    let mut s = Session::start(ex).map_err(Error::internal)?;
    if let Some(egress) = &job.egress {
        // Its own network, as a one-shot job without files has (the session's end puts
        // the executor's back).
        s.set_egress(egress.0.clone());
    }
    let outcome = files_job(ex, &mut s, job, files, sink);
    s.end(ex);
    outcome
}

fn files_job(
    ex: &Executor,
    s: &mut Session,
    job: &Job,
    files: &JobFiles,
    sink: &mut dyn FnMut(Stream, &[u8]),
) -> Result<(JobResult, Returned), Error> {
    let t = job.timeout;
    for (name, data) in &files.put {
        let field = format!("files[{name:?}]");
        s.put_file(ex, name, data, t).map_err(|e| match e {
            // The guest could not write it (no room, a name it refuses): the request's.
            FileError::Failed { message, .. } => Error::invalid(&field, message),
            e => file_error(&field, name, e),
        })?;
    }
    let r = s.run_job(ex, job, sink).map_err(Error::internal)?;
    if files.return_globs.is_empty() {
        return Ok((r, None));
    }
    let mut back = BTreeMap::new();
    if !s.usable() {
        return Ok((r, Some(back)));
    }
    let mut names = Vec::new();
    for (i, g) in files.return_globs.iter().enumerate() {
        let found = s
            .glob(ex, g, t)
            .map_err(|e| file_error(&format!("return_files[{i}]"), g, e))?;
        names.extend(found);
    }
    names.sort();
    names.dedup();
    let mut room = job.output_limit;
    for name in names {
        match s.get_file(ex, &name, room.max(1), t) {
            Ok(bytes) => {
                room = room.saturating_sub(bytes.len());
                back.insert(name, bytes);
            }
            Err(e @ FileError::Session(_)) => return Err(Error::internal(e)),
            // Over the output limit, gone meanwhile, unreadable: left out.
            Err(_) => {}
        }
    }
    Ok((r, Some(back)))
}

/// The files of a job: what goes in, and the patterns of what comes back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobFiles {
    pub put: Vec<(String, Vec<u8>)>,
    pub return_globs: Vec<String>,
}

impl JobFiles {
    pub fn is_empty(&self) -> bool {
        self.put.is_empty() && self.return_globs.is_empty()
    }
}

/// A relative path (or pattern) inside the work directory: not empty, not absolute, no
/// `..` component, no NUL.
pub fn check_relative(field: &str, path: &str) -> Result<(), Error> {
    let bad = path.is_empty()
        || path.starts_with('/')
        || path.contains('\0')
        || path.split('/').any(|c| c == "..");
    if bad {
        return Err(Error::invalid(
            field,
            format!("{path:?} must be a relative path without '..'"),
        ));
    }
    Ok(())
}
