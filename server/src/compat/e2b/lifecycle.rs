//! E2B's sandbox lifecycle over bud's durable sessions (`service::durable`):
//!
//! - `POST /sandboxes/{id}/pause` `{}`: 204; 409 if it is paused already; 404 if unknown.
//! - `POST /v2/sandboxes/{id}/connect`, `POST /sandboxes/{id}/connect` and the older `POST
//!   /sandboxes/{id}/resume` `{"timeout"}`: a running sandbox answers 200 (its lifetime is
//!   then `timeout` from now, if that is later), a paused one is resumed and answers 201
//!   with its token, as E2B does.
//! - `POST /sandboxes/{id}/snapshots` `{"name"?}`: 201 `{"snapshotID", "names"}`; the sandbox
//!   goes on. `GET /snapshots` lists them (`sandboxID` filters); a sandbox starts from one
//!   with `templateID` = its id; `DELETE /templates/{id}` deletes one (204, 404).
//! - `autoPause: true` at create: the sandbox pauses at its timeout instead of ending.
//! - A paused sandbox is listed (`state=paused`) and shown with `"state": "paused"`; its
//!   in-sandbox routes answer 502 (E2B's proxy says the same) until a connect resumes it,
//!   unless it was made with `autoResume: {"enabled": true}`: then any in-sandbox request
//!   (with its access token, where the server has keys) resumes it first ([`auto_resume`]).
//! - A sandbox parked by the server for idling (`--park-idle-s`) is shown and listed
//!   running, any in-sandbox request resumes it, a connect answers 200 as for a running
//!   one, and a pause resumes and pauses it.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{Sandbox, Timeout, body_of, e2b_error, live, paused, sandbox, set_lifetime};
use crate::compat::Compat;
use crate::core::clock::{epoch_s, rfc3339};
use crate::core::durable::{Paused, from_epoch_ms};
use crate::http::error::{ApiError, Error};
use crate::service::durable;

/// Whether paused sandbox `p` is parked for idling now (`--park-idle-s`): E2B's clients
/// see it running.
pub fn is_parked(p: &Paused) -> bool {
    p.record
        .parked_at(crate::core::durable::epoch_ms(SystemTime::now()))
}

/// What `GET /sandboxes/{id}` (and a listing) shows of a paused sandbox (of a parked one:
/// running).
pub fn paused_info(c: &Compat, s: &Sandbox, p: &Paused) -> Value {
    let r = &p.record;
    let now = SystemTime::now();
    let parked = is_parked(p);
    let stamp = |t: SystemTime| rfc3339(epoch_s(t));
    json!({
        "templateID": s.template_id,
        "sandboxID": s.id,
        "clientID": "bud",
        "envdVersion": super::ENVD_VERSION,
        "alias": r.template,
        "startedAt": stamp(from_epoch_ms(r.created_at_ms)),
        "endAt": stamp(now + r.lifetime_left_at(crate::core::durable::epoch_ms(now))),
        "cpuCount": 1,
        "memoryMB": super::template_ram_bytes(c, &r.template) >> 20,
        "diskSizeMB": 0,
        "state": if parked { "running" } else { "paused" },
        "metadata": s.metadata,
        "pauseMode": "full",
    })
}

/// Every paused sandbox, for a listing (which filters them by the asker's key).
pub fn paused_sandboxes(c: &Compat) -> Vec<(Arc<Sandbox>, Paused)> {
    let Some(dir) = c.app.state_dir() else {
        return Vec::new();
    };
    dir.paused()
        .list()
        .into_iter()
        .filter_map(|p| Some((sandbox(c, &p.record.id, None)?, p)))
        .collect()
}

/// `POST /sandboxes/{id}/pause`.
pub async fn pause(State(c): State<Compat>, Path(id): Path<String>) -> Response {
    match paused(&c, &id) {
        Some(p) if !is_parked(&p) => return e2b_error(Error::Paused(id)),
        // Parked: running for its client; the pause resumes it and pauses it.
        Some(_) => {}
        None => {
            if let Err(e) = live(&c, &id) {
                return e2b_error(e);
            }
        }
    }
    match durable::pause(&c.app, &id).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e2b_error(e),
    }
}

/// `POST /v2/sandboxes/{id}/connect`, `/sandboxes/{id}/connect`, `/sandboxes/{id}/resume`.
pub async fn connect(State(c): State<Compat>, Path(id): Path<String>, body: Bytes) -> Response {
    connect_sandbox(&c, &id, &body)
        .await
        .unwrap_or_else(e2b_error)
}

async fn connect_sandbox(c: &Compat, id: &str, body: &[u8]) -> Result<Response, ApiError> {
    let timeout = serde_json::from_slice::<Timeout>(body)
        .ok()
        .map(|t| t.timeout);
    let on_disk = paused(c, id);
    // A parked sandbox was running as far as its client knew: resumed, it answers as one.
    let was_paused = on_disk.as_ref().is_some_and(|p| !is_parked(p));
    if on_disk.is_some() {
        if sandbox(c, id, None).is_none() {
            return Err(ApiError::NotFound(format!("paused sandbox {id} not found")));
        }
        durable::resume(&c.app, id).await?;
    }
    let (s, e) = live(c, id)?;
    if let Some(t) = timeout {
        // Connect only extends (E2B's rule); a resume sets it.
        if was_paused || e.lifetime_left() < Duration::from_secs(t) {
            set_lifetime(&c.app, &e, t)?;
        }
    }
    let status = if was_paused {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(body_of(&s, &e, true))).into_response())
}

/// `POST /sandboxes/{id}/snapshots`'s body.
#[derive(Debug, Default, Deserialize)]
pub struct SnapshotBody {
    pub name: Option<String>,
}

/// `POST /sandboxes/{id}/snapshots`: 201 `{"snapshotID", "names"}`.
pub async fn snapshot(State(c): State<Compat>, Path(id): Path<String>, body: Bytes) -> Response {
    let run = async {
        let req: SnapshotBody = if body.is_empty() {
            SnapshotBody::default()
        } else {
            super::json_body(&body, "body")?
        };
        live(&c, &id)?;
        let snap = durable::snapshot(&c.app, &id).await?;
        let names: Vec<String> = req.name.into_iter().collect();
        Ok::<_, ApiError>(
            (
                StatusCode::CREATED,
                Json(json!({"snapshotID": snap.record.id, "names": names})),
            )
                .into_response(),
        )
    };
    run.await.unwrap_or_else(e2b_error)
}

/// `GET /snapshots`'s query.
#[derive(Debug, Default, Deserialize)]
pub struct SnapshotQuery {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: Option<String>,
}

/// `GET /snapshots`: a JSON array, oldest first (one page).
pub async fn list_snapshots(State(c): State<Compat>, Query(q): Query<SnapshotQuery>) -> Response {
    let Some(dir) = c.app.state_dir() else {
        return e2b_error(Error::NoStateDir);
    };
    let all: Vec<Value> = dir
        .snapshots()
        .list()
        .into_iter()
        .filter(|s| {
            crate::core::sessions::listed_for(s.record.owner.as_deref())
                && q.sandbox_id
                    .as_deref()
                    .is_none_or(|id| id == s.record.source)
        })
        .map(|s| json!({"snapshotID": s.record.id, "names": []}))
        .collect();
    Json(all).into_response()
}

/// `DELETE /templates/{id}`: a snapshot's (E2B deletes snapshots as templates).
pub async fn delete_snapshot(State(c): State<Compat>, Path(id): Path<String>) -> Response {
    match durable::delete_snapshot(&c.app, &id) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e2b_error(e),
    }
}

/// Resumes a paused sandbox made with `autoResume` before an in-sandbox request for it
/// (E2B's client proxy does the same); the request then goes on as for a running one.
pub async fn auto_resume(
    State(c): State<Compat>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let wanted = super::is_sandbox_route(req.uri().path())
        .then(|| req.headers().get(super::SANDBOX_ID_HEADER))
        .flatten()
        .and_then(|v| v.to_str().ok())
        .and_then(|id| Some((id.to_owned(), is_parked(&paused(&c, id)?))));
    if let Some((id, parked)) = wanted
        && let Some(s) = sandbox(&c, &id, None)
        && (s.auto_resume || parked)
    {
        let allowed = c.app.config().api_keys.is_none() || super::token_of(req.headers(), &s);
        if allowed && let Err(e) = durable::resume(&c.app, &id).await {
            return e2b_error(e);
        }
    }
    next.run(req).await
}
