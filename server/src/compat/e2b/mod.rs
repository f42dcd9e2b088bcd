//! E2B's control plane over bud sessions: an E2B sandbox *is* a bud session.
//!
//! - `POST /v2/sandboxes` (and the older `POST /sandboxes`): 201 with `templateID`,
//!   `sandboxID` (the session id), `clientID`, `envdVersion` and `envdAccessToken`. Template
//!   `code-interpreter-v1` (the SDK's default) is bud's `datascience` template, `base` is
//!   `tools` (bash, curl, git) when the server serves it and `python` otherwise, and any
//!   template bud serves can be named directly. `timeout` (seconds, default 300) is the
//!   session's lifetime, and also its idle timeout up to the server's
//!   `max_idle_timeout_s` (E2B has no idle timeout of its own); `envVars` are the env of
//!   every cell and command; `metadata` is kept and shown.
//! - `DELETE /sandboxes/{id}` 204 / 404; `GET /sandboxes/{id}`; `POST
//!   /sandboxes/{id}/timeout` (204: the lifetime is now `timeout` from now).
//! - Listing, metrics and fork: [`control`]; pause, connect (and resume), snapshots:
//!   [`lifecycle`]; `allow_internet_access`, `network` and `PUT /sandboxes/{id}/network`:
//!   [`network`]. A sandbox's record (token, contexts, ...) is its session's attachment,
//!   saved with it when it pauses, so a paused sandbox is found again after a restart.
//! - Errors are `{"code": HTTP status, "message"}`.
//!
//! The registry here keeps only what E2B clients know that a session does not: the
//! template name they asked for, the access token, and the code contexts. A sandbox whose
//! session ended by itself (lifetime, crash) is dropped from it on its next use.
//!
//! `envdVersion` is `0.6.4`: the SDK then uses what bud implements, up to file metadata
//! (0.6.2), entries on watch events (0.6.3) and watchers allowed on network mounts (0.6.4;
//! the guest has none, so that flag changes nothing).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

pub mod cluster;
pub mod control;
pub mod lifecycle;
pub mod network;

use super::Compat;
use crate::core::clock::{epoch_s, rfc3339};
use crate::core::keys::constant_time_eq;
use crate::core::sessions::Entry;
use crate::core::state::AppState;
use crate::http::error::{ApiError, Error};
use crate::service::sessions;
use crate::service::sessions::CreateSession;

/// The header E2B's SDK names the sandbox with on in-sandbox routes.
pub const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";
/// Where E2B's requests name a sandbox, for the node's routing
/// ([`crate::http::node::SandboxPlaces`]): its paths, its header, its per-port host names.
pub const SANDBOX_PLACES: crate::http::node::SandboxPlaces = crate::http::node::SandboxPlaces {
    prefixes: &["/sandboxes/", "/v2/sandboxes/", "/templates/"],
    not_ids: &[],
    header: Some(SANDBOX_ID_HEADER),
    host_form: true,
    creates: &[
        ("/sandboxes", "templateID"),
        ("/v2/sandboxes", "templateID"),
    ],
    error: |e| e2b_error(e),
};
/// The header carrying the sandbox's access token.
pub const ACCESS_TOKEN_HEADER: &str = "x-access-token";
/// The header the code interpreter's context calls carry the traffic access token in.
pub const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";
/// The envd version bud's compat layer speaks (module docs).
pub const ENVD_VERSION: &str = "0.6.4";
/// E2B's default sandbox timeout, seconds.
pub const DEFAULT_TIMEOUT_S: u64 = 300;

/// What E2B clients know of a sandbox besides its session.
#[derive(Debug)]
pub struct Sandbox {
    pub id: String,
    pub template_id: String,
    pub token: String,
    /// The name of the API key that made it (its routes carry none; for the audit trail).
    pub key: Option<String>,
    pub metadata: BTreeMap<String, String>,
    /// Paused rather than killed at its timeout (E2B's `autoPause`).
    pub auto_pause: bool,
    /// Resumed by any in-sandbox request while paused (E2B's `autoResume`).
    pub auto_resume: bool,
}

/// What a paused sandbox keeps of itself (in its session's record, under `e2b`).
#[derive(Debug, serde::Serialize, Deserialize)]
struct SandboxRecord {
    id: String,
    template_id: String,
    token: String,
    key: Option<String>,
    metadata: BTreeMap<String, String>,
    /// Its code contexts, in records older than contexts of the session's own
    /// (`crate::core::contexts`): taken over by the session when read.
    #[serde(default, skip_serializing)]
    contexts: Option<crate::core::contexts::Contexts>,
    auto_pause: bool,
    #[serde(default)]
    auto_resume: bool,
}

impl crate::core::sessions::Attachment for Sandbox {
    fn record(&self) -> serde_json::Value {
        let r = SandboxRecord {
            id: self.id.clone(),
            template_id: self.template_id.clone(),
            token: self.token.clone(),
            key: self.key.clone(),
            metadata: self.metadata.clone(),
            contexts: None,
            auto_pause: self.auto_pause,
            auto_resume: self.auto_resume,
        };
        json!({ "e2b": r })
    }
}

/// The most bytes of JSON a sandbox's metadata may hold: what its session's may
/// (`POST /sandboxes` gives both the same metadata, which the session's create bounds).
const MAX_METADATA_BYTES: usize = 4096;
/// The longest template id a record may name (bud's names are at most 64; a snapshot's id
/// is a session id).
const MAX_TEMPLATE_ID: usize = 256;

/// E2B's rules for a sandbox record that comes from outside (an imported paused session):
/// what a create makes of one. Its id and API key are its session's, its metadata within
/// a create's bound, its token one bud makes.
#[derive(Debug)]
pub struct RecordRules;

impl crate::core::sessions::AttachmentRules for RecordRules {
    fn check(
        &self,
        id: &str,
        owner: Option<&str>,
        attachment: &serde_json::Value,
    ) -> Result<(), String> {
        let Some(e2b) = attachment.get("e2b") else {
            return Ok(());
        };
        let r: SandboxRecord = serde_json::from_value(e2b.clone())
            .map_err(|e| format!("its E2B sandbox record is not one: {e}"))?;
        if r.id != id {
            return Err("its E2B sandbox record is another sandbox's".to_owned());
        }
        if r.key.as_deref() != owner {
            return Err(
                "its E2B sandbox's API key is not the key its session belongs to".to_owned(),
            );
        }
        let meta = serde_json::to_vec(&r.metadata).map_or(usize::MAX, |v| v.len());
        if meta > MAX_METADATA_BYTES {
            return Err(format!(
                "its E2B metadata is {meta} bytes of JSON, more than {MAX_METADATA_BYTES}"
            ));
        }
        if r.template_id.is_empty() || r.template_id.len() > MAX_TEMPLATE_ID {
            return Err(format!(
                "its E2B template id is empty or longer than {MAX_TEMPLATE_ID}"
            ));
        }
        if r.token.len() != 32 || !r.token.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err("its E2B access token is not one bud makes".to_owned());
        }
        Ok(())
    }
}

impl Sandbox {
    /// The sandbox `record` (a session's saved attachment) keeps, if it is sandbox `id`'s,
    /// and the contexts an older record kept.
    fn from_record(
        id: &str,
        record: &serde_json::Value,
    ) -> Option<(Self, Option<crate::core::contexts::Contexts>)> {
        let r: SandboxRecord = serde_json::from_value(record.get("e2b")?.clone()).ok()?;
        (r.id == id).then(|| {
            let s = Self {
                id: r.id,
                template_id: r.template_id,
                token: r.token,
                key: r.key,
                metadata: r.metadata,
                auto_pause: r.auto_pause,
                auto_resume: r.auto_resume,
            };
            (s, r.contexts)
        })
    }
}

/// The E2B sandboxes by id.
#[derive(Debug, Default)]
pub struct Registry {
    sandboxes: Mutex<HashMap<String, Arc<Sandbox>>>,
}

impl Registry {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Sandbox>>> {
        self.sandboxes.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn count(&self) -> usize {
        self.map().len()
    }
}

fn random_hex(bytes: usize) -> Result<String, Error> {
    crate::core::node::random_hex(bytes).map_err(Error::internal)
}

/// E2B's error shape over a native error's status.
pub fn e2b_error(e: impl Into<ApiError>) -> Response {
    let e = e.into();
    let code = e.status().as_u16();
    e.respond_with(json!({ "code": code, "message": e.to_string() }))
}

/// What E2B's `base` template has on its `PATH` (a Debian with bash, curl and git).
const BASE_TOOLS: [&str; 3] = ["bash", "curl", "git"];

/// The bud template of an E2B template name. E2B's `base` is the first served template
/// whose manifest has bash, curl and git (bud's `tools`), else `tools` while it is still
/// building, else `python`; only among the templates the caller may see (with API keys,
/// another key's user template is not there: `crate::service::templates::may_see`).
fn bud_template(state: &AppState, asked: &str) -> Result<String, Error> {
    let names = crate::service::templates::visible_names(state);
    let served = |name: &str| names.iter().any(|t| t == name);
    let with_tools = names.iter().find(|name| {
        state
            .template_manifest(name)
            .is_some_and(|m| BASE_TOOLS.iter().all(|t| m.has_tool(t)))
    });
    let name = match asked {
        "code-interpreter-v1" | "code-interpreter" => "datascience",
        "base" => match with_tools {
            Some(name) => name.as_str(),
            None if served("tools") => "tools",
            None => "python",
        },
        other => other,
    };
    if served(name) {
        return Ok(name.to_owned());
    }
    Err(Error::invalid(
        "templateID",
        format!(
            "template {asked} is bud's {name}, which this server does not serve (bud serve --templates {name},...)"
        ),
    ))
}

/// `POST /v2/sandboxes`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub timeout: Option<u64>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub env_vars: BTreeMap<String, String>,
    /// Pause instead of kill at the timeout.
    pub auto_pause: Option<bool>,
    /// `{"enabled": bool}`: resume at any in-sandbox request while paused.
    pub auto_resume: Option<AutoResume>,
    /// E2B's switch for the whole internet (its SDK sends `true` unless told otherwise;
    /// the camelCase some clients write is read too, rather than ignored: its `false`
    /// ignored would leave the server's default in force).
    #[serde(rename = "allow_internet_access", alias = "allowInternetAccess")]
    pub allow_internet_access: Option<bool>,
    /// E2B's egress lists ([`network`]).
    pub network: Option<network::NetworkConfig>,
}

/// E2B's `autoResume` at create.
#[derive(Debug, Deserialize)]
pub struct AutoResume {
    #[serde(default)]
    pub enabled: bool,
}

fn body_of(s: &Sandbox, e: &Entry, with_token: bool) -> serde_json::Value {
    let mut v = json!({
        "templateID": s.template_id,
        "sandboxID": s.id,
        "clientID": "bud",
        "envdVersion": ENVD_VERSION,
        "alias": e.template,
    });
    if with_token {
        // The same secret under both names: the code interpreter's context calls send only
        // the traffic token (`E2B-Traffic-Access-Token`), `run_code` and envd's the access
        // token; `sandbox_of` takes either.
        v["envdAccessToken"] = json!(s.token);
        v["trafficAccessToken"] = json!(s.token);
    }
    v
}

async fn create_sandbox(c: &Compat, req: NewSandbox) -> Result<Response, Error> {
    let state = &c.app;
    // A snapshot's id names it as a template does (E2B starts sandboxes from snapshots so).
    let snapshot = state
        .state_dir()
        .and_then(|d| d.snapshots().get(&req.template_id))
        .map(|s| (s.record.id, s.record.template));
    let template = match snapshot {
        Some(_) => None,
        None => match Error::wrong_node(state.node(), &req.template_id) {
            Some(e) if req.template_id.starts_with("snap_") => return Err(e),
            _ => Some(bud_template(state, &req.template_id)?),
        },
    };
    let timeout = req.timeout.unwrap_or(DEFAULT_TIMEOUT_S);
    let lim = &state.config().sessions;
    // The bud template the sandbox runs on: the one named, or the snapshot's.
    let (snapshot, of_snapshot) = snapshot.unzip();
    let runs_on = template.as_ref().or(of_snapshot.as_ref());
    let policy = network::at_create(
        state,
        runs_on.map_or("", String::as_str),
        req.allow_internet_access,
        req.network.as_ref(),
    )?;
    let native = CreateSession {
        env: req.env_vars,
        idle_timeout_s: Some(timeout.clamp(1, lim.max_idle_timeout_s)),
        max_lifetime_s: Some(timeout),
        metadata: serde_json::to_value(&req.metadata).unwrap_or_default(),
        template,
        snapshot,
        auto_pause: req.auto_pause,
        network: policy,
        ..CreateSession::default()
    };
    let e = crate::service::lifecycle::start(state, native)
        .await
        .map_err(|e| match e {
            Error::Invalid { field, message } => Error::Invalid {
                field: field.map(|f| {
                    if f == "max_lifetime_s" {
                        "timeout".into()
                    } else {
                        f
                    }
                }),
                message: message.replace("max_lifetime_s", "timeout"),
            },
            other => other,
        })?;
    let s = Arc::new(Sandbox {
        id: e.id.clone(),
        template_id: req.template_id,
        token: random_hex(16)?,
        key: crate::core::audit::current_key(),
        metadata: req.metadata,
        auto_pause: req.auto_pause.unwrap_or(false),
        auto_resume: req.auto_resume.as_ref().is_some_and(|a| a.enabled),
    });
    e.attach(s.clone());
    let mut map = c.own.e2b.map();
    // Sandboxes whose sessions ended by themselves (expired, crashed) go here, so the
    // registry never holds more than the live and paused sessions and those that ended
    // since.
    map.retain(|id, _| state.sessions().get(id).is_ok() || paused(c, id).is_some());
    map.insert(s.id.clone(), s.clone());
    drop(map);
    Ok((StatusCode::CREATED, Json(body_of(&s, &e, true))).into_response())
}

/// `POST /v2/sandboxes`.
pub async fn create(State(c): State<Compat>, body: axum::body::Bytes) -> Response {
    let req = match json_body::<NewSandbox>(&body, "body") {
        Ok(r) => r,
        Err(e) => return e2b_error(e),
    };
    create_sandbox(&c, req).await.unwrap_or_else(e2b_error)
}

/// `POST /sandboxes`: the older route, same body.
pub async fn create_v1(c: State<Compat>, body: axum::body::Bytes) -> Response {
    create(c, body).await
}

/// Paused sandbox `id`'s session record, if it is paused.
pub fn paused(c: &Compat, id: &str) -> Option<crate::core::durable::Paused> {
    c.app.state_dir()?.paused().get(id)
}

/// Sandbox `id` as E2B clients know it: from the registry, or made again from its
/// session's saved record (a sandbox resumed or paused before this server started).
fn sandbox(c: &Compat, id: &str, e: Option<&Entry>) -> Option<Arc<Sandbox>> {
    if let Some(s) = c.own.e2b.map().get(id) {
        return Some(s.clone());
    }
    let record = match e {
        Some(e) => e.attachment_record(),
        None => paused(c, id)?.record.attachment,
    };
    let (s, contexts) = Sandbox::from_record(id, &record)?;
    let s = Arc::new(s);
    if let Some(e) = e {
        e.attach(s.clone());
        if let Some(old) = contexts {
            let mut now = e.contexts();
            if now.made.is_empty() {
                *now = old;
            }
        }
    }
    c.own.e2b.map().insert(id.to_owned(), s.clone());
    Some(s)
}

/// The live sandbox `id` and its session; a sandbox whose session is gone is forgotten, a
/// paused one is 404 `paused` here (E2B's in-sandbox routes answer it 502, its control
/// plane resumes it on connect).
pub fn live(c: &Compat, id: &str) -> Result<(Arc<Sandbox>, Arc<Entry>), ApiError> {
    let not_found = || ApiError::NotFound(format!("sandbox {id} not found"));
    match c.app.sessions().get(id) {
        Ok(e) => {
            let s = sandbox(c, id, Some(&e)).ok_or_else(not_found)?;
            Ok((s, e))
        }
        Err(_) if paused(c, id).is_some() => {
            Err(ApiError::NotFound(format!("sandbox {id} is paused")))
        }
        Err(_) => {
            c.own.e2b.map().remove(id);
            Err(ApiError::NotFound(format!("sandbox {id} is not running")))
        }
    }
}

/// Whether `path` is one of the in-sandbox routes (envd's, the code interpreter's), which
/// find their sandbox by header and check its token rather than an API key.
pub fn is_sandbox_route(path: &str) -> bool {
    matches!(path, "/execute" | "/contexts" | "/health" | "/files")
        || path.starts_with("/contexts/")
        || path.starts_with("/process.Process/")
        || path.starts_with("/filesystem.Filesystem/")
}

/// The sandbox an in-sandbox request is for (`E2b-Sandbox-Id`), with its token checked
/// when the server has keys. A sandbox that is not running is 502, as E2B's proxy answers.
pub fn sandbox_of(c: &Compat, headers: &HeaderMap) -> Result<(Arc<Sandbox>, Arc<Entry>), ApiError> {
    let id = headers
        .get(SANDBOX_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| {
            ApiError::NotFound(
                "this route needs an E2b-Sandbox-Id header (E2B's SDK sends it)".into(),
            )
        })?;
    let (s, e) = live(c, id).map_err(|_| ApiError::SandboxGone(id.to_owned()))?;
    if c.app.config().api_keys.is_some() && !token_of(headers, &s) {
        return Err(ApiError::Unauthorized);
    }
    Ok((s, e))
}

/// Whether `headers` carry sandbox `s`'s token, as its access token or its traffic access
/// token (the same secret, see `body_of`), compared in constant time.
pub fn token_of(headers: &HeaderMap, s: &Sandbox) -> bool {
    [ACCESS_TOKEN_HEADER, TRAFFIC_TOKEN_HEADER].iter().any(|h| {
        headers
            .get(*h)
            .is_some_and(|v| constant_time_eq(v.as_bytes(), s.token.as_bytes()))
    })
}

/// What a signed file URL says (E2B's v1 signatures, `download_url` / `upload_url`).
#[derive(Debug)]
pub struct SignedRequest<'a> {
    pub path: &'a str,
    /// `read` or `write`.
    pub operation: &'a str,
    /// The user in the URL (`""`: the default one).
    pub user: &'a str,
    pub signature: &'a str,
    /// Seconds since the epoch after which the URL no longer works.
    pub expiration: Option<u64>,
}

/// E2B's v1 signature of `r` made with a sandbox's `token`: `v1_` and the unpadded base64
/// of the sha256 of `path:operation:user:token[:expiration]`.
pub fn signature(r: &SignedRequest<'_>, token: &str) -> String {
    use base64::Engine;
    use sha2::Digest;
    let raw = match r.expiration {
        None => format!("{}:{}:{}:{token}", r.path, r.operation, r.user),
        Some(e) => format!("{}:{}:{}:{token}:{e}", r.path, r.operation, r.user),
    };
    let digest = sha2::Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// The live sandbox whose token makes `r`'s signature (401 if none does, or if it has
/// expired). Every live sandbox is tried, each in constant time.
pub fn signed(c: &Compat, r: &SignedRequest<'_>) -> Result<(Arc<Sandbox>, Arc<Entry>), ApiError> {
    if let Some(e) = r.expiration {
        let now = epoch_s(SystemTime::now());
        if (e as f64) < now {
            return Err(ApiError::BadSignature("has expired"));
        }
    }
    let all: Vec<Arc<Sandbox>> = c.own.e2b.map().values().cloned().collect();
    let mut found = None;
    for s in all {
        if constant_time_eq(signature(r, &s.token).as_bytes(), r.signature.as_bytes()) {
            found = Some(s);
        }
    }
    let s = found.ok_or(ApiError::BadSignature("matches no sandbox's token"))?;
    let (s, e) = live(c, &s.id.clone()).map_err(|_| ApiError::SandboxGone(s.id.clone()))?;
    Ok((s, e))
}

/// `DELETE /sandboxes/{id}`: 204, or 404 if unknown.
pub async fn kill(State(c): State<Compat>, Path(id): Path<String>) -> Response {
    let known = c.own.e2b.map().remove(&id).is_some() || paused(&c, &id).is_some();
    if !known {
        return e2b_error(ApiError::NotFound(format!("sandbox {id} not found")));
    }
    match sessions::end(&c.app, &id).await {
        Ok(()) | Err(Error::NoSession(_)) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e2b_error(e),
    }
}

/// `GET /sandboxes/{id}`.
pub async fn info(State(c): State<Compat>, Path(id): Path<String>) -> Response {
    if let Some(p) = paused(&c, &id)
        && let Some(s) = sandbox(&c, &id, None)
    {
        return Json(lifecycle::paused_info(&c, &s, &p)).into_response();
    }
    match live(&c, &id) {
        Ok((s, e)) => Json(info_body(&c, &s, &e)).into_response(),
        Err(err) => e2b_error(err),
    }
}

/// Guest RAM of the VMs of `e`'s template, bytes.
fn ram_bytes(c: &Compat, e: &Entry) -> u64 {
    template_ram_bytes(c, &e.template)
}

/// Guest RAM of the VMs of template `name`, bytes.
fn template_ram_bytes(c: &Compat, name: &str) -> u64 {
    c.app
        .templates()
        .into_iter()
        .find(|t| t.name == name)
        .and_then(|t| t.ram_bytes)
        .unwrap_or(0)
}

/// What `GET /sandboxes/{id}` (and a listing) shows of a running sandbox.
fn info_body(c: &Compat, s: &Sandbox, e: &Entry) -> serde_json::Value {
    let stamp = |t: SystemTime| rfc3339(epoch_s(t));
    let mut v = body_of(s, e, false);
    let extra = json!({
        "startedAt": stamp(e.created_at),
        "endAt": stamp(e.expires_at()),
        "cpuCount": 1,
        "memoryMB": ram_bytes(c, e) >> 20,
        "diskSizeMB": 0,
        "state": "running",
        "metadata": s.metadata,
    });
    if let (Some(v), Some(extra)) = (v.as_object_mut(), extra.as_object()) {
        v.extend(extra.clone());
    }
    if let Some(gate) = &e.network {
        v["network"] = network::detail(gate);
    }
    v
}

/// `{"timeout": seconds}` of connect and set_timeout.
#[derive(Debug, Deserialize)]
pub struct Timeout {
    pub timeout: u64,
}

fn set_lifetime(state: &AppState, e: &Entry, seconds: u64) -> Result<(), Error> {
    let max = state.config().sessions.max_lifetime_s;
    if !(1..=max).contains(&seconds) {
        return Err(Error::invalid(
            "timeout",
            format!("timeout must be 1..={max} seconds (got {seconds})"),
        ));
    }
    e.set_lifetime(Duration::from_secs(seconds));
    Ok(())
}

/// A request's JSON body as `T`, or a 400 naming the field at fault (`network.deny_out`;
/// `what` where the body is not JSON at all) and repeating at most a short prefix of what
/// the client sent ([`crate::core::echo`]).
pub fn json_body<T: serde::de::DeserializeOwned>(body: &[u8], what: &str) -> Result<T, ApiError> {
    crate::http::body::parse(body).map_err(|e| match e {
        ApiError::Service(Error::Invalid { field, message })
        | ApiError::Json { field, message } => match field {
            Some(f) => ApiError::invalid(f.clone(), format!("bad JSON body: {f}: {message}")),
            None => ApiError::invalid(what, format!("bad JSON body: {message}")),
        },
        other => other,
    })
}

/// `POST /sandboxes/{id}/timeout`: 204.
pub async fn set_timeout(
    State(c): State<Compat>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let run = || -> Result<Response, ApiError> {
        let (_, e) = live(&c, &id)?;
        let t: Timeout = json_body(&body, "timeout")?;
        set_lifetime(&c.app, &e, t.timeout)?;
        Ok(StatusCode::NO_CONTENT.into_response())
    };
    run().unwrap_or_else(e2b_error)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::sessions::{Attachment, AttachmentRules};

    fn sandbox(key: Option<&str>, metadata: BTreeMap<String, String>) -> Sandbox {
        Sandbox {
            id: "ses_a".into(),
            template_id: "python".into(),
            token: "ab".repeat(16),
            key: key.map(str::to_owned),
            metadata,
            auto_pause: false,
            auto_resume: true,
        }
    }

    #[test]
    fn a_record_bud_saved_passes_and_an_altered_one_is_refused_saying_why() {
        let meta = BTreeMap::from([("user".to_owned(), "a".to_owned())]);
        let saved = sandbox(Some("alice"), meta).record();
        assert_eq!(RecordRules.check("ses_a", Some("alice"), &saved), Ok(()));
        assert_eq!(RecordRules.check("ses_a", None, &json!(null)), Ok(()));

        let refused = |id: &str, owner: Option<&str>, record: &serde_json::Value| {
            RecordRules.check(id, owner, record).unwrap_err()
        };
        assert_eq!(
            refused("ses_a", Some("bob"), &saved),
            "its E2B sandbox's API key is not the key its session belongs to"
        );
        assert_eq!(
            refused("ses_b", Some("alice"), &saved),
            "its E2B sandbox record is another sandbox's"
        );
        let big: BTreeMap<String, String> =
            (0..600).map(|i| (format!("k{i}"), "v".into())).collect();
        let too_big = sandbox(None, big).record();
        assert!(
            refused("ses_a", None, &too_big).starts_with("its E2B metadata is "),
            "{too_big}"
        );
        let mut token = saved.clone();
        token["e2b"]["token"] = json!("guessable");
        assert_eq!(
            refused("ses_a", Some("alice"), &token),
            "its E2B access token is not one bud makes"
        );
        assert!(
            refused("ses_a", Some("alice"), &json!({"e2b": 1}))
                .starts_with("its E2B sandbox record is not one")
        );
    }
}
