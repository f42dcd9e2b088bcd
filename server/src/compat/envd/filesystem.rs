//! envd's `filesystem.Filesystem` RPCs (Connect JSON) over the session's file
//! operations: `Stat`, `ListDir`, `MakeDir`, `Remove`, `Move` (see the parent module;
//! entries name their true owner, group and permissions, and what `MakeDir` and `Move` make
//! belongs to the request's user), and
//! its directory watchers over the session's ([`crate::service::processes::watch`]):
//! `CreateWatcher` / `GetWatcherEvents` / `RemoveWatcher` (what the sync SDK polls) and
//! `WatchDir` (a server stream: `start`, then a `filesystem` event per change and
//! keepalives, what the async SDK reads).

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde_json::{Value, json};
use vmm::files::{FileEntry, FileKind};

use super::connect::{Next, Timing, envelope, next, stream_response, unwrap_envelope};
use super::{EnvdUser, MAX_ENTRIES, connect_error, e2b_path, from_api, guest_path};
use crate::compat::Compat;
use crate::compat::e2b::sandbox_of;
use crate::core::clock::rfc3339;
use crate::core::state::AppState;
use crate::http::error::{ApiError, Error};
use crate::service::{files, processes};
use vmm::process::{Change, Changed};

/// E2B's `EventType` name of a change.
pub(super) fn event_name(c: Change) -> &'static str {
    match c {
        Change::Create => "EVENT_TYPE_CREATE",
        Change::Write => "EVENT_TYPE_WRITE",
        Change::Remove => "EVENT_TYPE_REMOVE",
        Change::Rename => "EVENT_TYPE_RENAME",
        Change::Chmod => "EVENT_TYPE_CHMOD",
    }
}

/// Watcher number of a `watcherId`.
fn watcher_id(body: &Value) -> Result<u32, Error> {
    field(body, "watcherId")?
        .parse()
        .map_err(|_| Error::invalid("watcherId", "no such watcher"))
}

/// A user's or group's name, or its id when the guest named none.
fn name_or_id(name: &str, id: u32) -> String {
    if name.is_empty() {
        id.to_string()
    } else {
        name.to_owned()
    }
}

/// An EntryInfo of entry `st` at guest path `rel`.
fn entry_info(rel: &str, st: &FileEntry) -> Value {
    let mode = st.mode;
    let (kind, t) = match st.kind {
        FileKind::Dir => ("FILE_TYPE_DIRECTORY", 'd'),
        FileKind::File => ("FILE_TYPE_FILE", '-'),
        FileKind::Symlink => ("FILE_TYPE_SYMLINK", 'l'),
        FileKind::Other => ("FILE_TYPE_UNSPECIFIED", '-'),
    };
    let perms: String = std::iter::once(t)
        .chain(
            "rwxrwxrwx"
                .chars()
                .enumerate()
                .map(|(i, c)| if mode & (1 << (8 - i)) != 0 { c } else { '-' }),
        )
        .collect();
    let mut v = json!({
        "name": st.name,
        "type": kind,
        "path": e2b_path(rel),
        "size": st.size.to_string(),
        "mode": mode & 0o7777,
        "permissions": perms,
        "owner": name_or_id(&st.owner, st.uid),
        "group": name_or_id(&st.group, st.gid),
        "modifiedTime": rfc3339(st.mtime_ns as f64 / 1e9),
    });
    if let Some(t) = &st.target {
        v["symlinkTarget"] = json!(t);
    }
    if let Some(m) = st.metadata.as_ref().filter(|m| !m.is_empty()) {
        v["metadata"] = json!(m);
    }
    v
}

/// A watcher's change as E2B's `FilesystemEvent`: the name relative to the watched
/// directory `dir` (guest-relative), and the entry when the watcher asked for entries.
fn event_json(dir: &str, c: &Changed) -> Value {
    let mut v = json!({"name": c.path, "type": event_name(c.change)});
    if let Some(entry) = &c.entry {
        v["entry"] = entry_info(&child(dir, &c.path), entry);
    }
    v
}

/// The guest-relative path of `name` in directory `dir` (`.`: the work directory).
fn child(dir: &str, name: &str) -> String {
    if dir == "." {
        name.to_owned()
    } else {
        format!("{dir}/{name}")
    }
}

/// `recursive` and `includeEntry` of a watcher request. `allowNetworkMounts` needs
/// nothing: the guest mounts no network file system.
fn watch_options(body: &Value) -> (bool, bool) {
    (
        body["recursive"].as_bool() == Some(true),
        body["includeEntry"].as_bool() == Some(true),
    )
}

async fn stat(state: &AppState, id: &str, rel: &str) -> Result<Value, Error> {
    Ok(entry_info(rel, &files::stat(state, id, rel).await?))
}

fn field(body: &Value, name: &str) -> Result<String, Error> {
    body[name]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| Error::invalid(name, format!("{name} is required")))
}

/// `POST /filesystem.Filesystem/{method}`.
pub async fn filesystem(
    State(c): State<Compat>,
    headers: HeaderMap,
    Path(method): Path<String>,
    body: Bytes,
) -> Response {
    let state = &c.app;
    let run = async {
        let (_, e) = sandbox_of(&c, &headers)?;
        let owner = EnvdUser::of(&headers)?.owner();
        if method == "WatchDir" {
            return watch_dir(&c, &e.id, &headers, &body).await;
        }
        let body: Value = serde_json::from_slice(&body)
            .map_err(|err| ApiError::invalid("body", format!("bad JSON body: {err}")))?;
        let id = e.id.as_str();
        let answer = match method.as_str() {
            "Stat" => {
                let rel = guest_path(&field(&body, "path")?)?;
                json!({"entry": stat(state, id, &rel).await?})
            }
            "ListDir" => {
                let rel = guest_path(&field(&body, "path")?)?;
                let depth = body["depth"].as_u64().unwrap_or(1).max(1);
                json!({"entries": list(state, id, &rel, depth).await?})
            }
            "MakeDir" => {
                let rel = guest_path(&field(&body, "path")?)?;
                if stat(state, id, &rel).await.is_ok() {
                    return Ok(connect_error(
                        "already_exists",
                        format!("{} already exists", e2b_path(&rel)),
                    ));
                }
                files::make_dir_as(state, id, &rel, owner).await?;
                json!({"entry": stat(state, id, &rel).await?})
            }
            "Remove" => {
                let rel = guest_path(&field(&body, "path")?)?;
                files::remove(state, id, &rel).await?;
                json!({})
            }
            "Move" => {
                let from = guest_path(&field(&body, "source")?)?;
                let to = guest_path(&field(&body, "destination")?)?;
                files::rename_as(state, id, &from, &to, owner).await?;
                json!({"entry": stat(state, id, &to).await?})
            }
            "CreateWatcher" => {
                let rel = guest_path(&field(&body, "path")?)?;
                let (recursive, entries) = watch_options(&body);
                let wid = processes::watch(state, id, &rel, recursive, entries).await?;
                json!({"watcherId": wid.to_string()})
            }
            "GetWatcherEvents" => {
                let wid = watcher_id(&body)?;
                let dir = processes::watched(state, id, wid)?;
                let (changes, _) = processes::changes(state, id, wid)?;
                let events: Vec<Value> = changes.iter().map(|c| event_json(&dir, c)).collect();
                json!({ "events": events })
            }
            "RemoveWatcher" => {
                processes::unwatch(state, id, watcher_id(&body)?).await?;
                json!({})
            }
            other => {
                return Ok(connect_error(
                    "unimplemented",
                    format!("filesystem.Filesystem/{other} is not implemented by bud"),
                ));
            }
        };
        Ok::<_, ApiError>(Json(answer).into_response())
    };
    run.await.unwrap_or_else(from_api)
}

/// Entries under `rel` down to `depth` levels, breadth first, at most [`MAX_ENTRIES`].
async fn list(state: &AppState, id: &str, rel: &str, depth: u64) -> Result<Vec<Value>, Error> {
    let mut entries = Vec::new();
    let mut level = vec![rel.to_owned()];
    for _ in 0..depth {
        let mut next = Vec::new();
        for dir in level {
            for item in files::list_with_metadata(state, id, &dir).await? {
                let path = child(&dir, &item.name);
                if item.kind == FileKind::Dir {
                    next.push(path.clone());
                }
                entries.push(entry_info(&path, &item));
                if entries.len() >= MAX_ENTRIES {
                    return Ok(entries);
                }
            }
        }
        level = next;
    }
    Ok(entries)
}

/// `filesystem.Filesystem/WatchDir` (server streaming): a watcher of `path` for as long as
/// the client reads (removed when it goes away or the stream's deadline passes).
async fn watch_dir(
    c: &Compat,
    id: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let req = unwrap_envelope(body)?;
    let path = req["path"]
        .as_str()
        .ok_or_else(|| ApiError::invalid("path", "path is required"))?;
    let rel = guest_path(path)?;
    let (recursive, entries) = watch_options(&req);
    let limit = crate::core::processes::MAX_STREAMS;
    if crate::service::sessions::get(&c.app, id)?
        .processes
        .streams()
        >= limit
    {
        return Err(Error::TooManyStreams { limit }.into());
    }
    let wid = processes::watch(&c.app, id, &rel, recursive, entries).await?;
    let e = crate::service::sessions::get(&c.app, id)?;
    let rx = e
        .processes
        .subscribe_watch(wid)
        .ok_or_else(|| ApiError::from(Error::internal("the watcher vanished")))?;
    // Removes the watcher when the stream is dropped (the client left).
    struct Unwatch(Compat, String, u32);
    impl Drop for Unwatch {
        fn drop(&mut self) {
            let (state, id, wid) = (self.0.app.clone(), self.1.clone(), self.2);
            tokio::spawn(async move {
                let _ = processes::unwatch(&state, &id, wid).await;
            });
        }
    }
    let guard = Unwatch(c.clone(), id.to_owned(), wid);
    let timing = Timing::of(headers);
    // WatchDirResponse's oneof is flat in proto JSON: {"start": {}}, {"filesystem": ...}.
    let started = envelope(0, &json!({"start": {}}));
    let rest = stream::unfold(Some((rx, guard)), move |st| {
        let rel = rel.clone();
        async move {
            let (mut rx, guard) = st?;
            Some(match next(&mut rx, timing).await {
                Next::Event(changed) => {
                    let ev = json!({"filesystem": event_json(&rel, &changed)});
                    (envelope(0, &ev), Some((rx, guard)))
                }
                Next::Keepalive => (envelope(0, &json!({"keepalive": {}})), Some((rx, guard))),
                Next::Deadline | Next::Closed => (envelope(2, &json!({})), None),
            })
        }
    });
    Ok(stream_response(started, rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_info_has_proto_json_fields() {
        let st = FileEntry {
            name: "a.txt".into(),
            kind: FileKind::File,
            size: 5,
            mode: 0o100644,
            mtime_ns: 0,
            target: None,
            uid: 1000,
            owner: "user".into(),
            gid: 1234,
            group: String::new(),
            metadata: None,
        };
        let v = entry_info("d/a.txt", &st);
        assert_eq!(v["type"], "FILE_TYPE_FILE");
        assert_eq!(v["path"], "/home/user/d/a.txt");
        assert_eq!(v["size"], "5");
        assert_eq!(v["permissions"], "-rw-r--r--");
        assert_eq!(v["mode"], 0o644);
        assert_eq!(v["modifiedTime"], "1970-01-01T00:00:00.000Z");
        assert_eq!((&v["owner"], &v["group"]), (&json!("user"), &json!("1234")));
    }
}
