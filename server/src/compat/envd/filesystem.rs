//! envd's `filesystem.Filesystem` RPCs (unary, Connect JSON) over the session's file
//! operations: `Stat`, `ListDir`, `MakeDir`, `Remove`, `Move` (see the parent module).

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use vmm::protocol::file_op;

use super::{MAX_ENTRIES, connect_error, e2b_path, from_api, guest_path};
use crate::compat::e2b::{rfc3339, sandbox_of};
use crate::error::ApiError;
use crate::session_files;
use crate::state::AppState;

/// An EntryInfo of the guest's stat or listing JSON for guest path `rel`.
fn entry_info(rel: &str, st: &Value) -> Value {
    let mode = st["mode"].as_u64().unwrap_or(0) as u32;
    let kind = match mode & 0o170000 {
        0o040000 => "FILE_TYPE_DIRECTORY",
        0o100000 => "FILE_TYPE_FILE",
        0o120000 => "FILE_TYPE_SYMLINK",
        _ => "FILE_TYPE_UNSPECIFIED",
    };
    let perms: String = {
        let t = match kind {
            "FILE_TYPE_DIRECTORY" => 'd',
            "FILE_TYPE_SYMLINK" => 'l',
            _ => '-',
        };
        let bits = "rwxrwxrwx";
        std::iter::once(t)
            .chain(
                bits.chars()
                    .enumerate()
                    .map(|(i, c)| if mode & (1 << (8 - i)) != 0 { c } else { '-' }),
            )
            .collect()
    };
    let mtime = st["mtime_ns"].as_u64().unwrap_or(0) as f64 / 1e9;
    let mut v = json!({
        "name": st["name"],
        "type": kind,
        "path": e2b_path(rel),
        "size": st["size"].as_u64().unwrap_or(0).to_string(),
        "mode": mode & 0o7777,
        "permissions": perms,
        "owner": "root",
        "group": "root",
        "modifiedTime": rfc3339(mtime),
    });
    if let Some(t) = st["target"].as_str() {
        v["symlinkTarget"] = json!(t);
    }
    v
}

async fn stat(state: &AppState, id: &str, rel: &str) -> Result<Value, ApiError> {
    let out =
        session_files::file_request(state, id, file_op::STAT, rel.to_owned(), Vec::new()).await?;
    let st: Value = serde_json::from_slice(&out).map_err(|err| ApiError::Internal {
        field: None,
        message: format!("the guest's stat is not JSON: {err}"),
    })?;
    Ok(entry_info(rel, &st))
}

fn field(body: &Value, name: &str) -> Result<String, ApiError> {
    body[name]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| ApiError::invalid(name, format!("{name} is required")))
}

/// `POST /filesystem.Filesystem/{method}`.
pub async fn filesystem(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(method): Path<String>,
    body: Bytes,
) -> Response {
    let run = async {
        let (_, e) = sandbox_of(&state, &headers)?;
        let body: Value = serde_json::from_slice(&body)
            .map_err(|err| ApiError::invalid("body", format!("bad JSON body: {err}")))?;
        let id = e.id.as_str();
        let answer = match method.as_str() {
            "Stat" => {
                let rel = guest_path(&field(&body, "path")?)?;
                json!({"entry": stat(&state, id, &rel).await?})
            }
            "ListDir" => {
                let rel = guest_path(&field(&body, "path")?)?;
                let depth = body["depth"].as_u64().unwrap_or(1).max(1);
                json!({"entries": list(&state, id, &rel, depth).await?})
            }
            "MakeDir" => {
                let rel = guest_path(&field(&body, "path")?)?;
                if stat(&state, id, &rel).await.is_ok() {
                    return Ok(connect_error(
                        "already_exists",
                        format!("{} already exists", e2b_path(&rel)),
                    ));
                }
                session_files::file_request(&state, id, file_op::MKDIR, rel.clone(), Vec::new())
                    .await?;
                json!({"entry": stat(&state, id, &rel).await?})
            }
            "Remove" => {
                let rel = guest_path(&field(&body, "path")?)?;
                session_files::file_request(&state, id, file_op::DELETE, rel, Vec::new()).await?;
                json!({})
            }
            "Move" => {
                let from = guest_path(&field(&body, "source")?)?;
                let to = guest_path(&field(&body, "destination")?)?;
                session_files::file_request(
                    &state,
                    id,
                    file_op::MOVE,
                    from,
                    to.clone().into_bytes(),
                )
                .await?;
                json!({"entry": stat(&state, id, &to).await?})
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
async fn list(state: &AppState, id: &str, rel: &str, depth: u64) -> Result<Vec<Value>, ApiError> {
    let mut entries = Vec::new();
    let mut level = vec![rel.to_owned()];
    for _ in 0..depth {
        let mut next = Vec::new();
        for dir in level {
            let out =
                session_files::file_request(state, id, file_op::LIST, dir.clone(), Vec::new())
                    .await?;
            let items: Vec<Value> =
                serde_json::from_slice(&out).map_err(|err| ApiError::Internal {
                    field: None,
                    message: format!("the guest's listing is not JSON: {err}"),
                })?;
            for item in items {
                let name = item["name"].as_str().unwrap_or_default();
                let child = if dir == "." {
                    name.to_owned()
                } else {
                    format!("{dir}/{name}")
                };
                if item["type"] == "dir" {
                    next.push(child.clone());
                }
                entries.push(entry_info(&child, &item));
                if entries.len() >= MAX_ENTRIES {
                    return Ok(entries);
                }
            }
        }
        level = next;
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_info_has_proto_json_fields() {
        let st = json!({"name": "a.txt", "size": 5, "mode": 0o100644, "mtime_ns": 0});
        let v = entry_info("d/a.txt", &st);
        assert_eq!(v["type"], "FILE_TYPE_FILE");
        assert_eq!(v["path"], "/home/user/d/a.txt");
        assert_eq!(v["size"], "5");
        assert_eq!(v["permissions"], "-rw-r--r--");
        assert_eq!(v["mode"], 0o644);
        assert_eq!(v["modifiedTime"], "1970-01-01T00:00:00.000Z");
    }
}
