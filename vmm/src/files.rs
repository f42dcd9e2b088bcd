//! A session's files, typed: put, get, list, stat, glob, remove, make a directory,
//! rename, each with typed errors and entries.
//!
//! Every operation is a file request to the session's worker ([`crate::protocol::file_op`],
//! run by `guest/python/bud_jobs.py`), which resolves the path inside the work directory
//! (symlinks included) and answers with an exit code of [`crate::protocol::file_status`] and
//! its data on stdout. This module is the one place that knows that wire form: callers
//! (the server, tests) see [`FileEntry`] and [`FileError`], never exit codes or the guest's
//! JSON and NUL-separated listings.
//!
//! Every operation runs as root in the guest; [`Owner`] says whom what a write, a new
//! directory or a move's new parents belong to (root, or the guest's user `user`), and
//! entries name their owner and group.
//!
//! A request past its deadline or over its output cap is interrupted like a cell, so a
//! file larger than the caller's limit leaves the session usable.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use crate::executor::Executor;
use crate::job::{JobResult, Status};
use crate::protocol::{file_op, file_status};
use crate::session::{FILE_CHUNK, Requests, SessionError};

/// What a path is, as `lstat` sees it (a final symlink is not followed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

/// One file, directory or link.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
pub struct FileEntry {
    /// Its name (the last component of its path).
    pub name: String,
    #[serde(rename = "type")]
    pub kind: FileKind,
    /// Bytes (of the link itself for a symlink).
    pub size: u64,
    /// `st_mode`: type and permission bits.
    pub mode: u32,
    /// Last modification, nanoseconds since the epoch.
    pub mtime_ns: i64,
    /// A symlink's target, as stored in the link.
    #[serde(default)]
    pub target: Option<String>,
    /// Its owner's user id, and that user's name in the guest's `/etc/passwd` (the id as
    /// text when no entry names it).
    #[serde(default)]
    pub uid: u32,
    #[serde(default)]
    pub owner: String,
    /// Its group's id and name (`/etc/group`; the id as text when no entry names it).
    #[serde(default)]
    pub gid: u32,
    #[serde(default)]
    pub group: String,
    /// Its E2B metadata, `user.e2b.<key>` extended attributes as `{key: value}`: only in
    /// entries asked for with it ([`Files::stat_with_metadata`],
    /// [`Files::list_dir_with_metadata`], a watcher's entries).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
}

/// Whom what a file operation writes or makes belongs to. Every operation runs as root in
/// the guest; this only sets the owner of the file written and of the directories made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Owner {
    /// root, as for everything bud's own API does.
    #[default]
    Root,
    /// The guest's non-root user `user` (uid and gid 1000): E2B's user.
    User,
}

impl Owner {
    /// The flag of [`file_op`] that asks for this owner.
    fn flag(self) -> u32 {
        match self {
            Owner::Root => 0,
            Owner::User => file_op::AS_USER,
        }
    }
}

/// Why a file operation did not do what it was asked.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The path is malformed or leaves the work directory (after resolving symlinks).
    #[error("{0}")]
    BadPath(String),
    #[error("{0}")]
    NotFound(String),
    /// A directory where a file was needed, or the other way round.
    #[error("{0}")]
    WrongKind(String),
    /// The answer is larger than the caller's limit.
    #[error("{path} is larger than {limit} bytes")]
    TooLarge { path: String, limit: usize },
    /// The guest failed it (an OS error, its deadline): why.
    #[error("file operation on {path} failed ({status:?}): {message}")]
    Failed {
        path: String,
        status: Status,
        message: String,
    },
    /// The guest's answer is not what the protocol says (a bug, or a hostile guest).
    #[error("the guest's answer to a file request on {path} is malformed: {why}")]
    Malformed { path: String, why: String },
    #[error(transparent)]
    Session(#[from] SessionError),
}

/// Most bytes of a listing, a stat or a glob's names the host takes.
pub(crate) const LISTING_LIMIT: usize = 8 << 20;

/// The data of `r`, a file request on `path` that asked for at most `limit` bytes, or why
/// there is none.
fn answer(path: &str, r: JobResult, limit: usize) -> Result<Vec<u8>, FileError> {
    let message = || String::from_utf8_lossy(&r.stderr).trim().to_owned();
    match (r.status, r.exit_code) {
        (Status::Ok, _) => Ok(r.stdout),
        (Status::OutputLimit, _) => Err(FileError::TooLarge {
            path: path.to_owned(),
            limit,
        }),
        (_, Some(file_status::BAD_PATH)) => Err(FileError::BadPath(message())),
        (_, Some(file_status::NOT_FOUND)) => Err(FileError::NotFound(message())),
        (_, Some(file_status::WRONG_KIND)) => Err(FileError::WrongKind(message())),
        (status, _) => Err(FileError::Failed {
            path: path.to_owned(),
            status,
            message: message(),
        }),
    }
}

fn json<T: for<'de> Deserialize<'de>>(path: &str, bytes: &[u8]) -> Result<T, FileError> {
    serde_json::from_slice(bytes).map_err(|e| FileError::Malformed {
        path: path.to_owned(),
        why: e.to_string(),
    })
}

/// The typed file operations, on a [`crate::session::Session`] or beside its running request
/// ([`crate::beside::Beside`]).
pub trait Files: Requests {
    /// Runs file request `op` on `path` with `data`, and returns its data (at most `limit`
    /// bytes).
    fn file_request(
        &mut self,
        ex: &Executor,
        op: u32,
        path: &str,
        data: Vec<u8>,
        timeout: Duration,
        limit: usize,
    ) -> Result<Vec<u8>, FileError> {
        let r = self.file_op(ex, op, path, data, timeout, limit)?;
        answer(path, r, limit)
    }

    /// Creates or truncates `path` (and its parent directories) and writes `data`, in
    /// requests of at most [`FILE_CHUNK`] bytes.
    fn put_file(
        &mut self,
        ex: &Executor,
        path: &str,
        data: &[u8],
        timeout: Duration,
    ) -> Result<(), FileError> {
        self.put_file_as(ex, path, data, Owner::Root, timeout)
    }

    /// [`Files::put_file`], the file and the directories made for it belonging to `owner`
    /// (an existing file becomes `owner`'s too).
    fn put_file_as(
        &mut self,
        ex: &Executor,
        path: &str,
        data: &[u8],
        owner: Owner,
        timeout: Duration,
    ) -> Result<(), FileError> {
        put_chunks(self, ex, path, file_op::WRITE, data, owner, timeout)
    }

    /// [`Files::put_file_as`], the file's E2B metadata then exactly `metadata`
    /// (`user.e2b.<key>` extended attributes; the others removed, so `{}` clears them).
    fn put_file_with_metadata(
        &mut self,
        ex: &Executor,
        path: &str,
        data: &[u8],
        owner: Owner,
        metadata: &BTreeMap<String, String>,
        timeout: Duration,
    ) -> Result<(), FileError> {
        let meta = serde_json::to_string(metadata).expect("a map of strings is JSON");
        let first = format!("{path}\0{meta}");
        let op = file_op::WRITE | file_op::METADATA;
        put_chunks(self, ex, &first, op, data, owner, timeout)
    }

    /// Appends `data` to `path`.
    fn append_file(
        &mut self,
        ex: &Executor,
        path: &str,
        data: Vec<u8>,
        timeout: Duration,
    ) -> Result<(), FileError> {
        self.file_request(ex, file_op::APPEND, path, data, timeout, 64 << 10)
            .map(drop)
    }

    /// The bytes of file `path`; [`FileError::TooLarge`] past `limit`.
    fn get_file(
        &mut self,
        ex: &Executor,
        path: &str,
        limit: usize,
        timeout: Duration,
    ) -> Result<Vec<u8>, FileError> {
        self.file_request(ex, file_op::READ, path, Vec::new(), timeout, limit)
    }

    /// The entries of directory `path` (`.`: the work directory).
    fn list_dir(
        &mut self,
        ex: &Executor,
        path: &str,
        timeout: Duration,
    ) -> Result<Vec<FileEntry>, FileError> {
        entries(self, ex, file_op::LIST, path, timeout)
    }

    /// [`Files::list_dir`], each entry with its metadata.
    fn list_dir_with_metadata(
        &mut self,
        ex: &Executor,
        path: &str,
        timeout: Duration,
    ) -> Result<Vec<FileEntry>, FileError> {
        entries(self, ex, file_op::LIST | file_op::METADATA, path, timeout)
    }

    /// [`Files::stat`] with the entry's metadata.
    fn stat_with_metadata(
        &mut self,
        ex: &Executor,
        path: &str,
        timeout: Duration,
    ) -> Result<FileEntry, FileError> {
        entries(self, ex, file_op::STAT | file_op::METADATA, path, timeout)
    }

    /// What `path` is, without following a final symlink.
    fn stat(
        &mut self,
        ex: &Executor,
        path: &str,
        timeout: Duration,
    ) -> Result<FileEntry, FileError> {
        entries(self, ex, file_op::STAT, path, timeout)
    }

    /// The regular files matching glob `pattern` (relative to the work directory, `**`
    /// allowed), as paths relative to it.
    fn glob(
        &mut self,
        ex: &Executor,
        pattern: &str,
        timeout: Duration,
    ) -> Result<Vec<String>, FileError> {
        let out = self.file_request(
            ex,
            file_op::GLOB,
            pattern,
            Vec::new(),
            timeout,
            LISTING_LIMIT,
        )?;
        Ok(out
            .split(|b| *b == 0)
            .filter(|n| !n.is_empty())
            .map(|n| String::from_utf8_lossy(n).into_owned())
            .collect())
    }

    /// Removes a file, or a directory with everything in it.
    fn remove(&mut self, ex: &Executor, path: &str, timeout: Duration) -> Result<(), FileError> {
        self.file_request(ex, file_op::DELETE, path, Vec::new(), timeout, 64 << 10)
            .map(drop)
    }

    /// Creates directory `path` and its parents (an existing directory is no error; an
    /// existing file is [`FileError::WrongKind`]).
    fn make_dir(&mut self, ex: &Executor, path: &str, timeout: Duration) -> Result<(), FileError> {
        self.make_dir_as(ex, path, Owner::Root, timeout)
    }

    /// [`Files::make_dir`], the directories it makes belonging to `owner`.
    fn make_dir_as(
        &mut self,
        ex: &Executor,
        path: &str,
        owner: Owner,
        timeout: Duration,
    ) -> Result<(), FileError> {
        let op = file_op::MKDIR | owner.flag();
        self.file_request(ex, op, path, Vec::new(), timeout, 64 << 10)
            .map(drop)
    }

    /// Renames `from` to `to` (the destination's parents are created).
    fn rename(
        &mut self,
        ex: &Executor,
        from: &str,
        to: &str,
        timeout: Duration,
    ) -> Result<(), FileError> {
        self.rename_as(ex, from, to, Owner::Root, timeout)
    }

    /// [`Files::rename`], the destination's parents it makes belonging to `owner` (what
    /// is moved keeps its own owner).
    fn rename_as(
        &mut self,
        ex: &Executor,
        from: &str,
        to: &str,
        owner: Owner,
        timeout: Duration,
    ) -> Result<(), FileError> {
        let to = to.as_bytes().to_vec();
        let op = file_op::MOVE | owner.flag();
        self.file_request(ex, op, from, to, timeout, 64 << 10)
            .map(drop)
    }
}

impl<T: Requests + ?Sized> Files for T {}

/// A LIST or STAT request (`op`, with its flags) on `path`, its JSON answer parsed.
fn entries<S: Files + ?Sized, T: for<'de> Deserialize<'de>>(
    s: &mut S,
    ex: &Executor,
    op: u32,
    path: &str,
    timeout: Duration,
) -> Result<T, FileError> {
    let out = s.file_request(ex, op, path, Vec::new(), timeout, LISTING_LIMIT)?;
    json(path, &out)
}

/// Writes `data` in requests of at most [`FILE_CHUNK`] bytes: the first is `first_op` on
/// `first` (the path, or the path, a NUL and what that request carries with it), the rest
/// appends to the path; each belongs to `owner`.
fn put_chunks<S: Files + ?Sized>(
    s: &mut S,
    ex: &Executor,
    first: &str,
    first_op: u32,
    data: &[u8],
    owner: Owner,
    timeout: Duration,
) -> Result<(), FileError> {
    let path = first.split('\0').next().unwrap_or(first);
    let (mut op, mut at) = (first_op | owner.flag(), first);
    for chunk in data
        .chunks(FILE_CHUNK)
        .chain(data.is_empty().then_some(&[][..]))
    {
        s.file_request(ex, op, at, chunk.to_vec(), timeout, 64 << 10)?;
        (op, at) = (file_op::APPEND | owner.flag(), path);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(status: Status, exit: Option<i32>, stdout: &[u8], stderr: &[u8]) -> JobResult {
        JobResult {
            status,
            exit_code: exit,
            stdout: stdout.to_vec(),
            stderr: stderr.to_vec(),
            ..JobResult::never_ran(status)
        }
    }

    #[test]
    fn exit_codes_become_typed_errors_with_the_guests_message() {
        let bad = answer("x", result(Status::Error, Some(2), b"", b"leaves\n"), 9);
        let missing = answer("x", result(Status::Error, Some(3), b"", b"no x"), 9);
        let kind = answer("x", result(Status::Error, Some(4), b"", b"a dir"), 9);
        let os = answer("x", result(Status::Error, Some(5), b"", b"EIO"), 9);
        let big = answer("x", result(Status::OutputLimit, None, b"", b""), 9);
        let ok = answer("x", result(Status::Ok, Some(0), b"data", b""), 9);

        assert!(matches!(bad, Err(FileError::BadPath(m)) if m == "leaves"));
        assert!(matches!(missing, Err(FileError::NotFound(m)) if m == "no x"));
        assert!(matches!(kind, Err(FileError::WrongKind(m)) if m == "a dir"));
        assert!(matches!(
            os,
            Err(FileError::Failed {
                status: Status::Error,
                ..
            })
        ));
        assert!(matches!(big, Err(FileError::TooLarge { limit: 9, .. })));
        assert_eq!(ok.unwrap(), b"data");
    }

    #[test]
    fn entries_parse_from_the_guests_json() {
        let listed: Vec<FileEntry> = json(
            "d",
            br#"[{"name": "a", "type": "file", "size": 3, "mode": 33188, "mtime_ns": 5},
                 {"name": "l", "type": "symlink", "size": 1, "mode": 41471, "mtime_ns": 6,
                  "target": "a"}]"#,
        )
        .unwrap();
        let broken = json::<FileEntry>("d", b"{\"name\": 1}");

        assert_eq!(listed[0].kind, FileKind::File);
        assert_eq!((listed[0].size, listed[0].mode), (3, 0o100644));
        assert_eq!(listed[1].target.as_deref(), Some("a"));
        assert_eq!((listed[0].uid, listed[0].owner.as_str()), (0, ""));
        let owned: FileEntry = json(
            "f",
            br#"{"name": "f", "type": "file", "size": 0, "mode": 33188, "mtime_ns": 0,
                 "uid": 1000, "owner": "user", "gid": 1000, "group": "user"}"#,
        )
        .unwrap();
        assert_eq!((owned.uid, owned.owner.as_str()), (1000, "user"));
        assert_eq!((owned.gid, owned.group.as_str()), (1000, "user"));
        assert!(matches!(broken, Err(FileError::Malformed { .. })));
    }
}
