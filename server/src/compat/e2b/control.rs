//! E2B's control plane beyond one sandbox's lifecycle: listing sandboxes (with filters and
//! pages), a sandbox's metrics, and forking one.
//!
//! - `GET /v2/sandboxes` (and the older `GET /sandboxes`): the live sandboxes made with the
//!   request's API key (all of them on a server without keys), oldest first
//!   (`order=desc`: newest first). Filters: `metadata` (E2B's SDK sends `k=v&...` with each
//!   key and value percent-encoded, the whole once more: every pair must match), `state`
//!   (`running,paused`: paused sandboxes are those in the state directory), `template`
//!   (the name the client asked for, or bud's template), `startedAfter` (RFC 3339). Pages:
//!   `limit` (1..=100, default 100) and `nextToken` from the `x-next-token` header of the
//!   page before (the position after its last sandbox, so sandboxes created or ended between
//!   pages neither repeat nor shift the rest).
//! - `GET /sandboxes/{id}/metrics`: one sample, now (bud keeps no time series):
//!   `memUsed` the host memory the sandbox holds alone (its private pages), `memTotal` its
//!   guest RAM, `cpuUsedPct` the share of the time since it started that its vCPU ran
//!   requests (the VM does not run between requests), `cpuCount` 1, disk 0 (no disk).
//! - `POST /sandboxes/{id}/fork` `{"timeout"?, "count"?}`: bud's fork of the session; each
//!   child is a sandbox of its own (its token, the parent's template, metadata and code
//!   contexts), alive for `timeout` seconds or what was left of the parent's lifetime.
//!   201 with one `{"sandbox": ...}` per child, as E2B answers.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::cluster::{Row, local_rows};
use super::{Sandbox, body_of, e2b_error, live, random_hex, set_lifetime};
use crate::compat::Compat;
use crate::core::clock::{epoch_s, rfc3339};
use crate::http::error::{ApiError, Error};
use crate::service::sessions;

/// Most sandboxes one page lists (E2B's own cap).
pub const MAX_PAGE: usize = 100;

/// `GET /v2/sandboxes`'s query.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListQuery {
    pub metadata: Option<String>,
    pub state: Option<String>,
    pub template: Option<String>,
    pub started_after: Option<String>,
    pub order: Option<String>,
    pub limit: Option<usize>,
    pub next_token: Option<String>,
}

/// One sandbox's place in the listing order: its start (ns since the epoch), then its id.
type Position = (u128, String);

fn token_of(p: &Position) -> String {
    format!("{}_{}", p.0, p.1)
}

fn parse_token(t: &str) -> Result<Position, Error> {
    let bad = || {
        Error::invalid(
            "nextToken",
            format!("{t:?} is not a token this server gave"),
        )
    };
    let (at, id) = t.split_once('_').ok_or_else(bad)?;
    Ok((at.parse().map_err(|_| bad())?, id.to_owned()))
}

/// The metadata pairs of E2B's filter: `k=v&...`, each part percent-encoded once more.
fn metadata_filter(raw: &str) -> Result<Vec<(String, String)>, Error> {
    form_urlencoded::parse(raw.as_bytes())
        .map(|(k, v)| {
            let decode = |s: &str| {
                percent_encoding::percent_decode_str(s)
                    .decode_utf8()
                    .map(|d| d.into_owned())
                    .map_err(|e| Error::invalid("metadata", format!("{s:?}: {e}")))
            };
            Ok((decode(&k)?, decode(&v)?))
        })
        .collect()
}

/// Seconds since the epoch of an RFC 3339 time (`2026-11-26T03:04:05Z`, with an optional
/// fraction and a `Z` or `±hh:mm` offset).
fn parse_rfc3339(s: &str) -> Option<f64> {
    let (date, time) = s.split_once(['T', 't', ' '])?;
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let (clock, offset) = match time.find(['Z', 'z', '+', '-']) {
        Some(i) => time.split_at(i),
        None => return None,
    };
    let offset_s = match offset {
        "Z" | "z" => 0,
        o => {
            let sign = if o.starts_with('-') { -1 } else { 1 };
            let (h, min) = o[1..].split_once(':')?;
            sign * (h.parse::<i64>().ok()? * 3600 + min.parse::<i64>().ok()? * 60)
        }
    };
    let mut c = clock.splitn(3, ':');
    let (h, min, sec) = (c.next()?, c.next()?, c.next()?);
    let (h, min, sec) = (
        h.parse::<i64>().ok()?,
        min.parse::<i64>().ok()?,
        sec.parse::<f64>().ok()?,
    );
    let days = crate::core::clock::days_from_civil(y, m, day);
    Some((days * 86_400 + h * 3600 + min * 60 - offset_s) as f64 + sec)
}

/// `GET /v2/sandboxes` and `GET /sandboxes`.
pub async fn list(State(c): State<Compat>, Query(q): Query<ListQuery>) -> Response {
    list_page(&c, q).await.unwrap_or_else(e2b_error)
}

async fn list_page(c: &Compat, q: ListQuery) -> Result<Response, Error> {
    let limit = q.limit.unwrap_or(MAX_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(Error::invalid(
            "limit",
            format!("limit must be 1..={MAX_PAGE} (got {limit})"),
        ));
    }
    let wanted = q.metadata.as_deref().map(metadata_filter).transpose()?;
    let (running, paused) = match q.state.as_deref() {
        None | Some("") => (true, true),
        Some(states) => {
            let (mut running, mut paused) = (false, false);
            for st in states.split(',') {
                match st {
                    "running" => running = true,
                    "paused" => paused = true,
                    other => {
                        return Err(Error::invalid(
                            "state",
                            format!("state must be running or paused (got {other:?})"),
                        ));
                    }
                }
            }
            (running, paused)
        }
    };
    let after = q
        .started_after
        .as_deref()
        .map(|t| {
            parse_rfc3339(t).ok_or_else(|| {
                Error::invalid("startedAfter", format!("{t:?} is not an RFC 3339 time"))
            })
        })
        .transpose()?;
    let descending = match q.order.as_deref() {
        None | Some("asc") => false,
        Some("desc") => true,
        Some(other) => {
            return Err(Error::invalid(
                "order",
                format!("order must be asc or desc (got {other:?})"),
            ));
        }
    };
    let from = q.next_token.as_deref().map(parse_token).transpose()?;
    let mut found = local_rows(c);
    let others = super::cluster::other_nodes(c, &found).await?;
    found.extend(others);
    let asker = crate::core::audit::current_key();
    found.retain(|r| {
        // A sandbox's id is the key to it: a listing never shows one key another's.
        let key_ok = r.key == asker;
        let state_ok = if r.running { running } else { paused };
        let metadata_ok = wanted.as_ref().is_none_or(|w| {
            w.iter()
                .all(|(k, v)| r.metadata.get(k).is_some_and(|have| have == v))
        });
        let template_ok = q
            .template
            .as_deref()
            .is_none_or(|t| t == r.template_id || t == r.template);
        let after_ok = after.is_none_or(|a| r.at_ns as f64 / 1e9 >= a);
        key_ok && state_ok && metadata_ok && template_ok && after_ok
    });
    found.sort_by_key(Row::position);
    if descending {
        found.reverse();
    }
    if let Some(from) = &from {
        found.retain(|r| {
            let p = r.position();
            if descending { &p < from } else { &p > from }
        });
    }
    let more = found.len() > limit;
    found.truncate(limit);
    let last = found.last().map(Row::position);
    let body: Vec<Value> = found.into_iter().map(|r| r.body).collect();
    let mut response = Json(body).into_response();
    if more && let Some(last) = &last {
        if let Ok(v) = HeaderValue::from_str(&token_of(last)) {
            response.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(response)
}

/// `GET /sandboxes/{id}/metrics`.
pub async fn metrics(State(c): State<Compat>, Path(id): Path<String>) -> Response {
    let (_, e) = match live(&c, &id) {
        Ok(found) => found,
        Err(err) => return e2b_error(err),
    };
    let now = SystemTime::now();
    let alive = now.duration_since(e.created_at).unwrap_or_default();
    let ran = Duration::from_nanos(e.run_ns.load(std::sync::atomic::Ordering::Relaxed));
    let cpu = if alive.is_zero() {
        0.0
    } else {
        (ran.as_secs_f64() / alive.as_secs_f64() * 100.0).min(100.0)
    };
    let ram = super::ram_bytes(&c, &e);
    let at = epoch_s(now);
    Json(json!([{
        "timestamp": rfc3339(at),
        "timestampUnix": at as i64,
        "cpuCount": 1,
        "cpuUsedPct": cpu,
        "memUsed": e.private_bytes.load(std::sync::atomic::Ordering::Relaxed),
        "memTotal": ram,
        "memCache": 0,
        "diskUsed": 0,
        "diskTotal": 0,
    }]))
    .into_response()
}

/// `POST /sandboxes/{id}/fork`'s body.
#[derive(Debug, Default, Deserialize)]
pub struct ForkBody {
    pub timeout: Option<u64>,
    pub count: Option<usize>,
}

/// `POST /sandboxes/{id}/fork`.
pub async fn fork(State(c): State<Compat>, Path(id): Path<String>, body: Bytes) -> Response {
    fork_sandbox(&c, &id, &body).await.unwrap_or_else(e2b_error)
}

async fn fork_sandbox(c: &Compat, id: &str, body: &[u8]) -> Result<Response, ApiError> {
    let (parent, _) = live(c, id)?;
    let req: ForkBody = if body.is_empty() {
        ForkBody::default()
    } else {
        super::json_body(body, "body")?
    };
    let forked = sessions::fork(&c.app, id, req.count.unwrap_or(1)).await?;
    let mut results = Vec::with_capacity(forked.ids.len());
    for child in forked.ids {
        let e = sessions::get(&c.app, &child)?;
        if let Some(t) = req.timeout {
            set_lifetime(&c.app, &e, t)?;
        }
        let s = Arc::new(Sandbox {
            id: child.clone(),
            template_id: parent.template_id.clone(),
            token: random_hex(16)?,
            key: crate::core::audit::current_key(),
            metadata: parent.metadata.clone(),
            auto_pause: parent.auto_pause,
            auto_resume: parent.auto_resume,
        });
        if let Ok(e) = c.app.sessions().get(&child) {
            e.attach(s.clone());
        }
        c.own.e2b.map().insert(child, s.clone());
        results.push(json!({ "sandbox": body_of(&s, &e, true) }));
    }
    Ok((StatusCode::CREATED, Json(results)).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_times_parse_back_to_what_clock_writes() {
        for t in [0.0, 951_782_400.5, 1_795_438_245.25] {
            assert_eq!(parse_rfc3339(&rfc3339(t)), Some(t));
        }
        assert_eq!(
            parse_rfc3339("2026-11-23T13:50:45+01:00"),
            Some(1_795_438_245.0)
        );
        assert_eq!(parse_rfc3339("yesterday"), None);
    }

    #[test]
    fn the_sdks_metadata_filter_is_decoded_twice() {
        // What E2B's SDK sends for {"user": "a b", "k&": "v=1"}, after the query's own
        // decoding: each part quoted, then the whole form-encoded.
        let pairs = metadata_filter("user=a%2520b&k%2526=v%253D1").unwrap();

        assert_eq!(
            pairs,
            vec![
                ("user".to_owned(), "a b".to_owned()),
                ("k&".to_owned(), "v=1".to_owned())
            ]
        );
    }

    #[test]
    fn tokens_round_trip_and_strangers_are_refused() {
        let p = (1_795_438_245_250_000_000u128, "ses_ab12".to_owned());

        assert_eq!(parse_token(&token_of(&p)).unwrap(), p);
        assert!(parse_token("nope").is_err());
    }
}
