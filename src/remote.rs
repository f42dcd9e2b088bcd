//! `bud run` through a running `bud serve`: its VMs are warm, so a job costs milliseconds
//! instead of a template load and a fresh clone in a new process.
//!
//! Where: `BUD_URL` if set (then it must answer: an unreachable `BUD_URL` is an error, not a
//! silent fallback), else [`DEFAULT_URL`] if something listens there; otherwise the caller runs
//! the job in-process. The request is `POST /v1/exec` with code and stdin in base64 and
//! `output_b64`, so bytes travel exactly; the answer becomes the same [`JobResult`] an
//! in-process run gives, so exit codes and output are the same either way.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use anyhow::{Context, bail};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use bud_server::http::jobs::ExecResponse;
use bud_server::service::jobs::ExecRequest;
use vmm::{Job, JobResult};

/// Where `bud serve` listens by default.
pub const DEFAULT_URL: &str = "http://127.0.0.1:8080";
/// How long a connection attempt to the default address may take before running locally.
const PROBE_TIMEOUT: Duration = Duration::from_millis(100);

/// The server to send jobs to: `BUD_URL`, or the default address if something listens there.
pub fn server_url() -> anyhow::Result<Option<String>> {
    if let Some(url) = std::env::var_os("BUD_URL") {
        let url = url
            .into_string()
            .map_err(|_| anyhow::anyhow!("BUD_URL is not UTF-8"))?;
        return Ok(Some(url.trim_end_matches('/').to_string()));
    }
    let listening =
        default_addr().is_some_and(|a| TcpStream::connect_timeout(&a, PROBE_TIMEOUT).is_ok());
    Ok(listening.then(|| DEFAULT_URL.to_string()))
}

fn default_addr() -> Option<SocketAddr> {
    DEFAULT_URL
        .trim_start_matches("http://")
        .to_socket_addrs()
        .ok()?
        .next()
}

/// Runs `job` on the server at `url`, in runtime `runtime` of `template` (a name or an alias
/// its manifest has; `None`: the template's default), which the server resolves.
pub fn run(
    url: &str,
    job: &Job,
    template: &str,
    runtime: Option<&str>,
) -> anyhow::Result<JobResult> {
    let req = ExecRequest {
        template: Some(template.to_owned()),
        language: runtime.map(str::to_owned),
        code_b64: Some(BASE64.encode(&job.code)),
        stdin_b64: (!job.stdin.is_empty()).then(|| BASE64.encode(&job.stdin)),
        args: job.args.clone(),
        env: job.env.iter().cloned().collect(),
        timeout_ms: Some(job.timeout.as_millis() as u64),
        output_limit: Some(job.output_limit as u64),
        output_b64: true,
        ..ExecRequest::default()
    };
    let endpoint = format!("{url}/v1/exec");
    let response = match ureq::post(&endpoint).send_json(&req) {
        Ok(r) => r,
        Err(ureq::Error::Status(code, r)) => {
            let body = r.into_string().unwrap_or_default();
            bail!("bud serve at {url} refused the job: HTTP {code}: {body}");
        }
        Err(e) => bail!("cannot reach bud serve at {url} (BUD_URL): {e}"),
    };
    let r: ExecResponse = response
        .into_json()
        .with_context(|| format!("{endpoint} did not answer like bud serve"))?;
    let bytes = |b64: Option<String>, text: String| -> anyhow::Result<Vec<u8>> {
        match b64 {
            Some(b) => BASE64
                .decode(b)
                .context("bad base64 in the server's answer"),
            None => Ok(text.into_bytes()),
        }
    };
    Ok(JobResult {
        status: r.status,
        exit_code: r.exit_code,
        signal: r.signal,
        stdout: bytes(r.stdout_b64, r.stdout)?,
        stderr: bytes(r.stderr_b64, r.stderr)?,
        crash: r.crash,
        console_tail: r.console_tail,
        display: Vec::new(),
        figures: r
            .results
            .into_iter()
            .map(|f| vmm::job::Display {
                mime: f.mime,
                data: f.data_b64,
            })
            .collect(),
        error: None,
        timings: vmm::job::JobTimings {
            clone: Duration::from_secs_f64(r.timings.clone_ms / 1e3),
            run: Duration::from_secs_f64(r.timings.run_ms / 1e3),
            total: Duration::from_secs_f64(r.timings.total_ms / 1e3),
            exits: r.timings.exits,
            guest: r.timings.guest.map(|g| vmm::job::GuestPhases {
                read: Duration::from_secs_f64(g.read_ms / 1e3),
                identity: Duration::from_secs_f64(g.identity_ms / 1e3),
                compile: Duration::from_secs_f64(g.compile_ms / 1e3),
                run: Duration::from_secs_f64(g.run_ms / 1e3),
                clock_set: g.clock_set,
            }),
            kvm: vmm::kvm_stats::VcpuCounters {
                exits: r.timings.kvm.exits,
                emulated_instructions: r.timings.kvm.emulated_instructions,
                page_faults: r.timings.kvm.page_faults,
                interrupts: r.timings.kvm.interrupts,
            },
        },
    })
}
