//! The durable-session API's handlers: pause and resume a session, take a snapshot of one,
//! list, show and delete snapshots (a session starts from one with `POST /v1/sessions`
//! `{"snapshot": ID}`), and move a paused session between servers: `GET
//! /v1/sessions/{id}/export` (its file, as it is on disk) and `POST /v1/sessions/import`
//! (that file; 201 with the paused session). Thin adapters over
//! [`crate::service::durable`]. Without a state directory every one of them is 501
//! `no_state_dir`.

use crate::core::clock::epoch_s;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;

use crate::core::state::AppState;
use crate::http::error::{ApiError, Error};
use crate::http::sessions::SessionInfo;
use crate::service::durable;
use crate::service::durable::PauseResponse;

/// `POST /v1/sessions/{id}/pause`: 200 with what was written; 409 `session_paused` if it
/// is paused already.
pub async fn pause(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<PauseResponse>, ApiError> {
    Ok(Json(durable::pause(&state, &id).await?))
}

/// `POST /v1/sessions/{id}/resume`: 200 with the running session (at once if it runs).
pub async fn resume(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<SessionInfo>, ApiError> {
    let e = durable::resume(&state, &id).await?;
    Ok(Json(SessionInfo::of(&e)))
}

/// `POST /v1/sessions/{id}/snapshots`: 201 with the snapshot; the session goes on.
pub async fn snapshot(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<SnapshotInfo>), ApiError> {
    let s = durable::snapshot(&state, &id).await?;
    Ok((StatusCode::CREATED, Json(SnapshotInfo::of(&s))))
}

/// `GET /v1/snapshots`.
pub async fn list(State(state): State<AppState>) -> Result<Json<serde_json::Value>, ApiError> {
    let dir = state.state_dir().ok_or(Error::NoStateDir)?;
    // A key's own snapshots only (as sessions are listed).
    let all: Vec<SnapshotInfo> = dir
        .snapshots()
        .list()
        .iter()
        .filter(|s| crate::core::sessions::listed_for(s.record.owner.as_deref()))
        .map(SnapshotInfo::of)
        .collect();
    Ok(Json(serde_json::json!({ "snapshots": all })))
}

/// `GET /v1/snapshots/{id}`.
pub async fn show(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<SnapshotInfo>, ApiError> {
    let dir = state.state_dir().ok_or(Error::NoStateDir)?;
    let s = dir.snapshots().get(&id).ok_or(Error::NoSnapshot(id))?;
    Ok(Json(SnapshotInfo::of(&s)))
}

/// `DELETE /v1/snapshots/{id}`: 204; sessions started from it go on.
pub async fn delete(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    durable::delete_snapshot(&state, &id)?;
    Ok(StatusCode::NO_CONTENT)
}

/// Bytes read from a session file per chunk of an export.
const EXPORT_CHUNK: usize = 1 << 20;

/// `GET /v1/sessions/{id}/export`: the paused session's file (`application/octet-stream`);
/// 409 `session_running` for a running one. The session stays paused here: delete it once
/// the other server has imported it.
pub async fn export(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let dir = state.state_dir().ok_or(Error::NoStateDir)?;
    if dir.paused().get(&id).is_none() {
        crate::service::sessions::get(&state, &id)?;
        return Err(Error::NotPaused(id).into());
    }
    let file = std::fs::File::open(dir.paused().path(&id)).map_err(Error::internal)?;
    let len = file.metadata().map_err(Error::internal)?.len();
    let file = std::sync::Arc::new(file);
    let chunks = futures_util::stream::unfold(0u64, move |at| {
        let file = file.clone();
        async move {
            if at >= len {
                return None;
            }
            let n = (len - at).min(EXPORT_CHUNK as u64) as usize;
            let read = tokio::task::spawn_blocking(move || {
                let mut buf = vec![0u8; n];
                std::os::unix::fs::FileExt::read_exact_at(&*file, &mut buf, at).map(|()| buf)
            })
            .await
            .map_err(std::io::Error::other)
            .and_then(|r| r);
            Some((read.map(axum::body::Bytes::from), at + n as u64))
        }
    });
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_owned()),
            (header::CONTENT_LENGTH, len.to_string()),
        ],
        Body::from_stream(chunks),
    )
        .into_response())
}

/// `POST /v1/sessions/import`: a session file another server exported (the body, as it
/// is); 201 with the paused session here. Refused with why (400) if it is not whole, not
/// of a template and host this server serves, or (409) if the id exists here.
pub async fn import(
    State(state): State<AppState>,
    req: Request,
) -> Result<(StatusCode, Json<SessionInfo>), ApiError> {
    static UPLOADS: AtomicU64 = AtomicU64::new(0);
    let dir = state.state_dir().ok_or(Error::NoStateDir)?.clone();
    // The upload holds its bytes of the quota as they arrive: two at once never pass it.
    let mut held = dir.reserve(0).ok_or(Error::StateQuota {
        used: dir.usage().0,
        need: 0,
        quota: dir.usage().1,
    })?;
    let tmp = dir
        .upload_path(u64::from(std::process::id()) << 32 | UPLOADS.fetch_add(1, Ordering::Relaxed));
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(Error::internal)?;
    let mut body = req.into_body();
    let timeout = state.config().limits.body_timeout();
    let received = tokio::time::timeout(timeout, async {
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| ApiError::Body(e.to_string()))?;
            if let Ok(data) = frame.into_data() {
                if !held.grow(data.len() as u64) {
                    let (used, quota) = dir.usage();
                    return Err(Error::StateQuota {
                        used,
                        need: held.bytes() + data.len() as u64,
                        quota,
                    }
                    .into());
                }
                out.write_all(&data).map_err(Error::internal)?;
            }
        }
        out.sync_all().map_err(Error::internal)?;
        Ok::<_, ApiError>(())
    })
    .await
    .unwrap_or(Err(ApiError::RequestTimeout {
        part: "body",
        after: timeout,
    }));
    if let Err(e) = received {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    let p = durable::import(&state, tmp, held).await?;
    Ok((StatusCode::CREATED, Json(SessionInfo::paused(&state, &p))))
}

/// A snapshot as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotInfo {
    pub id: String,
    /// The session it was taken of.
    pub source: String,
    pub created_at: f64,
    pub template: String,
    pub metadata: serde_json::Value,
    /// Size of its file in the state directory.
    pub bytes: u64,
}

impl SnapshotInfo {
    pub fn of(s: &crate::core::durable::Snapshot) -> Self {
        let r = &s.record;
        Self {
            id: r.id.clone(),
            source: r.source.clone(),
            created_at: epoch_s(crate::core::durable::from_epoch_ms(r.created_at_ms)),
            template: r.template.clone(),
            metadata: r.metadata.clone(),
            bytes: s.bytes,
        }
    }
}
