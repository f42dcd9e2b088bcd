//! One job and a batch over HTTP (`POST /v1/exec`, `/v1/exec/batch`), and what their
//! answer shows ([`ExecResponse`]). Streaming lives in [`crate::http::stream`].
//!
//! Order of checks for a job request: content type (415), body size (413), JSON shape (400),
//! field limits (400/413), template ready (503), admission (429). Only then does a job run, on
//! a job thread; the handler awaits its reply.

use axum::Json;
use axum::extract::State;
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;
use vmm::{JobResult, Status};

use crate::core::state::AppState;
use crate::http::body::JsonBody;
use crate::http::error::ApiError;
use crate::service::error::Error;
use crate::service::jobs::{self, OneShot, Ran};
use crate::service::jobs::{BatchRequest, ExecRequest};
use crate::service::task;

/// The service's one-shot job of `req` (checked; its files taken if the route `takes_files`,
/// else refused), asked on `route`; `prefix` names the request in error fields (`""`, or
/// `"jobs[3]."` in a batch).
pub fn one_shot(
    state: &AppState,
    mut req: ExecRequest,
    route: &str,
    prefix: &str,
    takes_files: bool,
) -> Result<OneShot, Error> {
    let files = if takes_files {
        req.take_files(&state.config().limits)?
    } else {
        Default::default()
    };
    let template = req.template.take();
    let runtime = req.language.take();
    let network = req.network.take();
    let trace = std::mem::take(&mut req.trace);
    Ok(OneShot {
        job: req.into_job(&state.config().limits, prefix)?,
        template,
        runtime,
        files,
        route: route.to_owned(),
        network,
        trace,
    })
}

/// The answer for a job that ran.
pub fn response(ran: Ran, output_b64: bool) -> ExecResponse {
    let mut resp = ExecResponse::new(ran.result, ran.waited, output_b64);
    resp.files = ran.files.map(|files| {
        files
            .into_iter()
            .map(|(name, bytes)| (name, crate::http::jobs::b64(&bytes)))
            .collect()
    });
    resp.trace_id = ran.trace;
    resp.network = ran.network.map(|g| {
        serde_json::to_value(crate::service::network::NetworkView::of(Some(&g))).unwrap_or_default()
    });
    resp
}

/// `POST /v1/exec`.
pub async fn exec(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<ExecRequest>,
) -> Result<Json<ExecResponse>, ApiError> {
    let b64 = req.output_b64;
    let one = one_shot(&state, req, "/v1/exec", "", true)?;
    let ran = jobs::run(&state, one, task::no_sink()).await?;
    Ok(Json(response(ran, b64)))
}

/// `POST /v1/exec/batch`: all jobs admitted at once or none, run in parallel on the job
/// threads, results in request order.
pub async fn batch(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<BatchRequest>,
) -> Result<Json<BatchResponse>, ApiError> {
    let mut b64 = Vec::with_capacity(req.jobs.len());
    let mut all = Vec::with_capacity(req.jobs.len());
    for (i, r) in req.jobs.into_iter().enumerate() {
        b64.push(r.output_b64);
        all.push(one_shot(
            &state,
            r,
            "/v1/exec/batch",
            &format!("jobs[{i}]."),
            false,
        )?);
    }
    let ran = jobs::batch(&state, all).await?;
    let results = ran
        .into_iter()
        .zip(b64)
        .map(|(r, b)| response(r, b))
        .collect();
    Ok(Json(BatchResponse { results }))
}

/// Where a job's time went, in milliseconds.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Timings {
    /// Waiting for a job thread.
    pub queue_ms: f64,
    /// Creating the clone (zero when it came ready from the pool).
    pub clone_ms: f64,
    /// From resuming the clone to the job's end.
    pub run_ms: f64,
    /// Clone + run + collecting the result (queueing not included).
    pub total_ms: f64,
    /// Exits from the guest to the VMM during the job.
    #[serde(default)]
    pub exits: u64,
    /// The guest's own account of `run_ms`, when the job ended normally.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest: Option<GuestTimings>,
    /// KVM's counters over the job, where this host's KVM keeps them.
    #[serde(default)]
    pub kvm: KvmCounters,
}

/// KVM's own counters of the job's vCPU during the job (null where KVM has no such count).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct KvmCounters {
    /// Exits from the guest to KVM (most never reach bud).
    pub exits: Option<u64>,
    /// Guest instructions KVM emulated (under kvm_pvm: every guest-kernel instruction).
    pub emulated_instructions: Option<u64>,
    /// Page faults KVM took for the guest.
    pub page_faults: Option<u64>,
    /// Interrupts KVM injected into the guest (absent from older servers' answers).
    #[serde(default)]
    pub interrupts: Option<u64>,
}

/// The guest worker's phases of a job, in milliseconds of its own clock.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct GuestTimings {
    /// Resume to request read.
    pub read_ms: f64,
    /// Seeding `random` and checking the clock.
    pub identity_ms: f64,
    /// Compiling the code (Python), or handing the script to the shell.
    pub compile_ms: f64,
    /// Running the job and flushing its output.
    pub run_ms: f64,
    /// The guest had to set its wall clock itself (the host's setting did not hold).
    #[serde(default)]
    pub clock_set: bool,
}

/// The result of a job that ran (whatever its status).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ExecResponse {
    pub status: Status,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout_b64: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr_b64: Option<String>,
    /// For `crashed`: what went wrong.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crash: Option<String>,
    /// For `crashed`: the last lines of the guest console.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub console_tail: Vec<String>,
    /// The files `return_files` matched (path -> content in base64), when it was given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files: Option<BTreeMap<String, String>>,
    /// On a template with a network card: the policy it ran under and every name it
    /// resolved and connection it opened (as `GET /v1/sessions/{id}/network`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<serde_json::Value>,
    /// Rich results: every matplotlib figure the job showed (`plt.show()`) or left open,
    /// in order, as `image/png`.
    #[serde(default)]
    pub results: Vec<RichResult>,
    pub timings: Timings,
    /// The id of the job's trace (`trace: true`): read as a session's,
    /// `GET /v1/sessions/{trace_id}/trace`, `/review`, ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
}

/// One rich result of a job or cell.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RichResult {
    /// MIME type: `image/png`.
    #[serde(rename = "type")]
    pub mime: String,
    pub data_b64: String,
}

/// `POST /v1/exec/batch`: one result per job, in request order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchResponse {
    pub results: Vec<ExecResponse>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `bytes` in base64.
pub fn b64(bytes: &[u8]) -> String {
    BASE64.encode(bytes)
}

/// Text for `bytes`, and their base64 when the text does not hold them exactly (or `always`).
pub fn text_and_b64(bytes: &[u8], always: bool) -> (String, Option<String>) {
    match std::str::from_utf8(bytes) {
        Ok(s) => (s.to_string(), always.then(|| BASE64.encode(bytes))),
        Err(_) => (
            String::from_utf8_lossy(bytes).into_owned(),
            Some(BASE64.encode(bytes)),
        ),
    }
}

impl ExecResponse {
    pub fn new(r: JobResult, queued: Duration, output_b64: bool) -> Self {
        let (stdout, stdout_b64) = text_and_b64(&r.stdout, output_b64);
        let (stderr, stderr_b64) = text_and_b64(&r.stderr, output_b64);
        Self {
            status: r.status,
            exit_code: r.exit_code,
            signal: r.signal,
            stdout,
            stderr,
            stdout_b64,
            stderr_b64,
            crash: r.crash,
            console_tail: r.console_tail,
            files: None,
            network: None,
            trace_id: None,
            results: r
                .figures
                .into_iter()
                .map(|f| RichResult {
                    mime: f.mime,
                    data_b64: f.data,
                })
                .collect(),
            timings: Timings {
                queue_ms: ms(queued),
                clone_ms: ms(r.timings.clone),
                run_ms: ms(r.timings.run),
                total_ms: ms(r.timings.total),
                exits: r.timings.exits,
                guest: r.timings.guest.map(|g| GuestTimings {
                    read_ms: ms(g.read),
                    identity_ms: ms(g.identity),
                    compile_ms: ms(g.compile),
                    run_ms: ms(g.run),
                    clock_set: g.clock_set,
                }),
                kvm: KvmCounters {
                    exits: r.timings.kvm.exits,
                    emulated_instructions: r.timings.kvm.emulated_instructions,
                    page_faults: r.timings.kvm.page_faults,
                    interrupts: r.timings.kvm.interrupts,
                },
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_that_is_not_utf8_also_comes_as_base64() {
        let (text, b64) = text_and_b64(&[b'a', 0xff], false);
        let (plain, none) = text_and_b64(b"hi", false);
        let (_, forced) = text_and_b64(b"hi", true);

        assert_eq!(text, "a\u{fffd}");
        assert_eq!(b64.as_deref(), Some("Yf8="));
        assert_eq!((plain.as_str(), none), ("hi", None));
        assert_eq!(forced.as_deref(), Some("aGk="));
    }
}
