//! The session API's files: `PUT/GET/DELETE /v1/sessions/{id}/files/{*path}`, the listing,
//! one-shot jobs with files (`POST /v1/exec` with `files` / `return_files`), and
//! [`file_request`], the one way a route runs a file operation in a session (the compat
//! layers use it too). Error model as the session API's.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use vmm::protocol::{file_op, file_status};
use vmm::session::{Session, SessionError};
use vmm::{Executor, JobResult, Status};

use crate::api::{ExecResponse, JobFiles};
use crate::error::ApiError;
use crate::session_routes::{end_if_unusable, internal, on_job_thread, unavailable};
use crate::state::AppState;

/// `GET /v1/sessions/{id}/files?dir=`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ListQuery {
    pub dir: Option<String>,
}

/// A file path from the URL, checked before the guest sees it (the guest checks again after
/// resolving symlinks).
fn file_path(path: &str) -> Result<String, ApiError> {
    crate::api::check_relative("path", path)?;
    Ok(path.to_owned())
}

/// Runs file operation `op` in session `id`; maps its status to the API's.
pub async fn file_request(
    state: &AppState,
    id: &str,
    op: u32,
    path: String,
    data: Vec<u8>,
) -> Result<Vec<u8>, ApiError> {
    let busy = state
        .sessions()
        .acquire(id)
        .map_err(|u| unavailable(id, u))?;
    let limit = state.config().sessions.max_file_bytes;
    let timeout = Duration::from_millis(state.config().limits.max_timeout_ms);
    let st = state.clone();
    let shown = path.clone();
    let exec = busy.entry().executor.clone();
    let r = on_job_thread(state, exec, move |ex| {
        let ran = busy
            .entry()
            .with_vm(|s| {
                if op == file_op::WRITE {
                    s.write_file(ex, &path, &data, timeout)
                } else {
                    s.file_op(ex, op, &path, data, timeout, limit)
                }
            })
            .unwrap_or(Err(SessionError::Gone));
        busy.entry().account();
        end_if_unusable(&st, &busy);
        ran
    })
    .await?
    .map_err(internal)?;
    let message = || String::from_utf8_lossy(&r.stderr).trim().to_owned();
    match (r.status, r.exit_code) {
        (Status::Ok, _) => Ok(r.stdout),
        (Status::OutputLimit, _) => Err(ApiError::TooLarge {
            field: "path".into(),
            bytes: limit + 1,
            limit,
        }),
        (_, Some(file_status::BAD_PATH)) | (_, Some(file_status::WRONG_KIND)) => {
            Err(ApiError::invalid("path", message()))
        }
        (_, Some(file_status::NOT_FOUND)) => {
            Err(ApiError::NoFile(format!("{shown}: {}", message())))
        }
        _ => Err(internal(format!(
            "file operation on {shown} failed: {} {:?}",
            message(),
            r.status
        ))),
    }
}

/// `PUT /v1/sessions/{id}/files/{*path}`: the raw body becomes the file.
pub async fn put_file(
    State(state): State<AppState>,
    Path((id, path)): Path<(String, String)>,
    req: Request,
) -> Result<StatusCode, ApiError> {
    let path = file_path(&path)?;
    let limit = state.config().sessions.max_file_bytes;
    let timeout = state.config().limits.body_timeout();
    let data = crate::body::read_limited(req.into_body(), limit, timeout)
        .await
        .map_err(|e| match e {
            ApiError::BodyTooLarge { limit } => ApiError::TooLarge {
                field: "body".into(),
                bytes: limit + 1,
                limit,
            },
            other => other,
        })?;
    file_request(&state, &id, file_op::WRITE, path, data).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /v1/sessions/{id}/files/{*path}`: the file's bytes.
pub async fn get_file(
    State(state): State<AppState>,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let path = file_path(&path)?;
    let bytes = file_request(&state, &id, file_op::READ, path, Vec::new()).await?;
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Bytes::from(bytes),
    )
        .into_response())
}

/// `DELETE /v1/sessions/{id}/files/{*path}`.
pub async fn delete_file(
    State(state): State<AppState>,
    Path((id, path)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let path = file_path(&path)?;
    file_request(&state, &id, file_op::DELETE, path, Vec::new()).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /v1/sessions/{id}/files?dir=`: `{"files": [{name, type, size}]}`.
pub async fn list_files(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<ListQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let dir = match q.dir.as_deref() {
        None | Some("") | Some(".") => ".".to_owned(),
        Some(d) => file_path(d)?,
    };
    let bytes = file_request(&state, &id, file_op::LIST, dir, Vec::new()).await?;
    let listed: Vec<serde_json::Value> = serde_json::from_slice(&bytes)
        .map_err(|e| internal(format!("the guest's listing is not JSON: {e}")))?;
    let files: Vec<serde_json::Value> = listed
        .into_iter()
        .map(|f| serde_json::json!({"name": f["name"], "type": f["type"], "size": f["size"]}))
        .collect();
    Ok(Json(serde_json::json!({ "files": files })))
}

/// `POST /v1/exec` with `files` / `return_files`: the job runs in a VM that first gets the
/// files (file requests), then runs the job as a one-shot job, then returns the files the
/// patterns match (only if the job ended at DONE; up to the job's output limit in all), and
/// goes back to the executor like any job's VM.
pub async fn exec_with_files(
    state: &AppState,
    exec: Arc<Executor>,
    mut job: vmm::Job,
    files: JobFiles,
    output_b64: bool,
    origin: crate::audit::Origin,
) -> Result<ExecResponse, ApiError> {
    // Held by this future: a client that goes away cancels the job.
    let mut cancel = crate::jobs::CancelOnDrop::for_job(state.jobs(), &mut job);
    let st = state.clone();
    let metrics = state.metrics_handle();
    let queued = Instant::now();
    let ran = on_job_thread(state, exec, move |ex| {
        let waited = queued.elapsed();
        let mut s = Session::start(ex).map_err(internal)?;
        let outcome = files_job(ex, &mut s, &job, &files);
        s.end(ex);
        let (r, back) = outcome?;
        metrics.job(r.status, waited, &r.timings);
        st.audit_job(&origin, "job", &job, &r, waited);
        Ok::<_, ApiError>((r, back, waited))
    })
    .await??;
    cancel.disarm();
    let (r, back, waited) = ran;
    let mut resp = ExecResponse::new(r, waited, output_b64);
    resp.files = back;
    Ok(resp)
}

fn files_job(
    ex: &Executor,
    s: &mut Session,
    job: &vmm::Job,
    files: &JobFiles,
) -> Result<(JobResult, Option<BTreeMap<String, String>>), ApiError> {
    use base64::Engine;
    let t = job.timeout;
    for (name, data) in &files.put {
        let w = s.write_file(ex, name, data, t).map_err(internal)?;
        if w.status != Status::Ok {
            let why = String::from_utf8_lossy(&w.stderr).trim().to_owned();
            return Err(ApiError::invalid(format!("files[{name:?}]"), why));
        }
    }
    let r = s.run_job(ex, job, &mut |_, _| {}).map_err(internal)?;
    if files.return_globs.is_empty() || !s.usable() {
        return Ok((r, (!files.return_globs.is_empty()).then(BTreeMap::new)));
    }
    let mut back = BTreeMap::new();
    let mut room = job.output_limit;
    let mut names = Vec::new();
    for g in &files.return_globs {
        let found = s
            .file_op(ex, file_op::GLOB, g, Vec::new(), t, 1 << 20)
            .map_err(internal)?;
        names.extend(
            found
                .stdout
                .split(|b| *b == 0)
                .filter(|n| !n.is_empty())
                .map(|n| String::from_utf8_lossy(n).into_owned()),
        );
    }
    names.sort();
    names.dedup();
    for name in names {
        let got = s
            .file_op(ex, file_op::READ, &name, Vec::new(), t, room.max(1))
            .map_err(internal)?;
        if got.status != Status::Ok {
            continue; // over the output limit, or gone: left out
        }
        room = room.saturating_sub(got.stdout.len());
        back.insert(
            name,
            base64::engine::general_purpose::STANDARD.encode(&got.stdout),
        );
    }
    Ok((r, Some(back)))
}
