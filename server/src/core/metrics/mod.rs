//! `GET /metrics`: the server's counters and histograms, kept in `prometheus-client`'s
//! types, and the figures other parts own (job queue, executors, sessions, state directory,
//! audit log), read when a scrape asks ([`Gauges`]). The module counts and writes text; it
//! never decides anything, and the server never reads its counters back.
//!
//! - `bud_jobs_total{status}`: jobs that ran, by status.
//! - `bud_job_failures_total`: jobs bud could not run (answered 500).
//! - `bud_rejected_total{reason}`: job requests refused for want of room or readiness
//!   (`overloaded`, `key_quota`, `memory_budget`, `not_ready`, `shutting_down`).
//! - `bud_http_responses_total{code}`: responses by HTTP status code.
//! - `bud_job_{queue,clone,run,total}_seconds`: histograms.
//! - `bud_job_exits_total`: exits from guests to the VMM during jobs;
//!   `bud_kvm_{exits,emulated_instructions,page_faults}_total`: KVM's own counters of the
//!   jobs' vCPUs (where KVM keeps them);
//!   `bud_job_guest_seconds_total{phase}`: the guests' own account of jobs that ended
//!   normally (`read`, `identity`, `compile`, `run`).
//! - with an audit log, `bud_audit_records_total{result}` (`written`, `dropped`) and
//!   `bud_audit_failing`.
//! - sandboxes' networks: `bud_egress_attempts_total{kind,result}` (`dns`, `connect`;
//!   `allowed`, `refused`), `bud_egress_bytes_total{direction}` (`sent`, `received`: bytes
//!   of connections that are over), `bud_egress_queued` (lookups and dials waiting for a
//!   dial thread) and `bud_egress_dialing` (dials under way: connects not yet completed).
//! - gauges: workers, queue capacity, jobs running and queued, pool size and ready clones,
//!   idle warm VMs, live clones, and the process's resident memory.
//! - VM reuse: `bud_resets_total`, `bud_reset_seconds_total`, `bud_reset_restored_pages_total`,
//!   `bud_reset_mapping_drops_total`
//!   and `bud_vms_replaced_total{reason}` (`abnormal`: the job did not end at DONE;
//!   `too_dirty`: too many private pages; `reset_failed`: the reset or its verification
//!   failed); `bud_vms_closed_total` and `bud_vm_close_seconds_total` (VMs closed and the
//!   host's time tearing them down).
//! - sessions: `bud_sessions` (live), `bud_sessions_memory_bytes` (their private pages plus
//!   fork layers, what the memory cap counts), `bud_sessions_created_total`,
//!   `bud_sessions_forked_total` (children made) and `bud_sessions_ended_total{reason}`;
//!   with a state directory, `bud_sessions_paused`, `bud_snapshots`, `bud_state_bytes`,
//!   `bud_sessions_paused_total`, `bud_sessions_parked` and `bud_sessions_parked_total` (parked for
//!   idling), `bud_sessions_resumed_total`, `bud_snapshots_taken_total`.
//!
//! Written by `prometheus-client`'s Prometheus text encoder (format 0.0.4,
//! [`CONTENT_TYPE`]), not its OpenMetrics one, so names, types, labels, help and content
//! type are those bud wrote by hand before. What that takes:
//! - a counter is registered without its `_total` and a help without its closing period:
//!   the crate adds both (a counter registered as `..._total` panics in debug builds);
//! - every known value of a counter's label (each status, each reason of a refusal, each
//!   guest phase) is made at zero with the metrics, so its series is there before its
//!   first event, as before;
//! - what this module counts lives in one registry made at start ([`Metrics`]); what other
//!   parts own is handed in by the handler and registered in a registry made for that
//!   scrape (`gauges.rs`). A `Collector` registered once could not do it: it would have to
//!   hold the server's state, which holds the metrics.
//!
//! Not quite as before, and read the same by Prometheus: a whole float is written `0.0`
//! where it was `0` (bucket bounds keep `le="1"`: the crate writes them as Go's client
//! does); the series of a labelled family come in no fixed order (the crate keeps them in
//! a hash map); a family with no series yet (responses before the first, sessions ended
//! before the first) writes nothing, where it wrote its HELP and TYPE lines alone. Sums of
//! seconds are added as `f64` (they were nanoseconds in a `u64`).

use std::borrow::Cow;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, prometheus_text};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Metric, Registry};
use vmm::Status;

mod gauges;
pub use gauges::{EgressGauges, Gauges, SessionGauges, private_bytes, resident_bytes};

/// The `Content-Type` of `GET /metrics`: the Prometheus text format, version 0.0.4.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// Why the metrics could not be written.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The encoder failed (it writes to a `String`, so only a bug of an encoding would).
    #[error("cannot encode the metrics")]
    Encode(#[from] std::fmt::Error),
}

/// Bucket upper bounds, in seconds.
const BUCKETS: [f64; 16] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
];

const STATUSES: [Status; 7] = [
    Status::Ok,
    Status::Error,
    Status::Timeout,
    Status::OutputLimit,
    Status::MemoryLimit,
    Status::Crashed,
    Status::Cancelled,
];

/// A status's label value (its name in the API).
fn status_name(s: Status) -> &'static str {
    match s {
        Status::Ok => "ok",
        Status::Error => "error",
        Status::Timeout => "timeout",
        Status::OutputLimit => "output_limit",
        Status::MemoryLimit => "memory_limit",
        Status::Crashed => "crashed",
        Status::Cancelled => "cancelled",
    }
}

/// Why a request was refused before it ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    Overloaded,
    KeyQuota,
    MemoryBudget,
    NotReady,
    ShuttingDown,
}

impl Rejection {
    const ALL: [Rejection; 5] = [
        Rejection::Overloaded,
        Rejection::KeyQuota,
        Rejection::MemoryBudget,
        Rejection::NotReady,
        Rejection::ShuttingDown,
    ];

    /// Its `reason` label.
    fn name(self) -> &'static str {
        match self {
            Rejection::Overloaded => "overloaded",
            Rejection::KeyQuota => "key_quota",
            Rejection::MemoryBudget => "memory_budget",
            Rejection::NotReady => "not_ready",
            Rejection::ShuttingDown => "shutting_down",
        }
    }
}

const GUEST_PHASES: [&str; 4] = ["read", "identity", "compile", "run"];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabel {
    status: &'static str,
}

/// `reason`: a refusal's, a replaced VM's, an ended session's.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: Cow<'static, str>,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabel {
    code: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

/// The server's counters and histograms, registered once; they count from here on.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    jobs: Family<StatusLabel, Counter>,
    failures: Counter,
    rejected: Family<ReasonLabel, Counter>,
    responses: Family<CodeLabel, Counter>,
    queue: Histogram,
    clone: Histogram,
    run: Histogram,
    total: Histogram,
    exits: Counter,
    /// KVM's counters: exits, emulated instructions, page faults.
    kvm: [Counter; 3],
    /// Seconds of guest phases, by [`GUEST_PHASES`].
    guest: Family<PhaseLabel, Counter<f64, AtomicU64>>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut r = Registry::default();
        let jobs = labelled(STATUSES.map(|s| StatusLabel {
            status: status_name(s),
        }));
        let rejected = labelled(Rejection::ALL.map(|r| ReasonLabel {
            reason: r.name().into(),
        }));
        let guest = labelled(GUEST_PHASES.map(|phase| PhaseLabel { phase }));
        let histogram = || Histogram::new(BUCKETS);
        Metrics {
            jobs: add(&mut r, "bud_jobs", "Jobs that ran, by final status", jobs),
            failures: add(
                &mut r,
                "bud_job_failures",
                "Jobs bud could not run (HTTP 500)",
                Counter::default(),
            ),
            exits: add(
                &mut r,
                "bud_job_exits",
                "Exits from guests to the VMM during jobs",
                Counter::default(),
            ),
            kvm: [
                ("bud_kvm_exits", "Exits to KVM during jobs (KVM's count)"),
                (
                    "bud_kvm_emulated_instructions",
                    "Guest instructions KVM emulated during jobs",
                ),
                (
                    "bud_kvm_page_faults",
                    "Page faults KVM took for guests during jobs",
                ),
            ]
            .map(|(name, help)| add(&mut r, name, help, Counter::default())),
            guest: add(
                &mut r,
                "bud_job_guest_seconds",
                "The guests' own account of jobs, by phase",
                guest,
            ),
            rejected: add(
                &mut r,
                "bud_rejected",
                "Requests refused before running, by reason",
                rejected,
            ),
            responses: add(
                &mut r,
                "bud_http_responses",
                "HTTP responses, by status code",
                Family::default(),
            ),
            queue: add(
                &mut r,
                "bud_job_queue_seconds",
                "Time jobs waited for a job thread",
                histogram(),
            ),
            clone: add(
                &mut r,
                "bud_job_clone_seconds",
                "Time to get a clone (0 from the pool)",
                histogram(),
            ),
            run: add(
                &mut r,
                "bud_job_run_seconds",
                "Time from resuming the clone to the job's end",
                histogram(),
            ),
            total: add(
                &mut r,
                "bud_job_total_seconds",
                "Clone + run + collecting the result",
                histogram(),
            ),
            registry: r,
        }
    }
}

impl Metrics {
    /// A job that ran.
    pub fn job(&self, status: Status, queued: Duration, t: &vmm::job::JobTimings) {
        let status = status_name(status);
        self.jobs.get_or_create(&StatusLabel { status }).inc();
        self.queue.observe(queued.as_secs_f64());
        self.clone.observe(t.clone.as_secs_f64());
        self.run.observe(t.run.as_secs_f64());
        self.total.observe(t.total.as_secs_f64());
        self.exits.inc_by(t.exits);
        let k = t.kvm;
        for (counter, v) in self
            .kvm
            .iter()
            .zip([k.exits, k.emulated_instructions, k.page_faults])
        {
            counter.inc_by(v.unwrap_or(0));
        }
        if let Some(g) = t.guest {
            for (phase, d) in GUEST_PHASES
                .into_iter()
                .zip([g.read, g.identity, g.compile, g.run])
            {
                self.guest
                    .get_or_create(&PhaseLabel { phase })
                    .inc_by(d.as_secs_f64());
            }
        }
    }

    /// A job bud could not run.
    pub fn failure(&self) {
        self.failures.inc();
    }

    pub fn rejected(&self, why: Rejection) {
        let reason = why.name().into();
        self.rejected.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// A response went out with HTTP status `code`.
    pub fn response(&self, code: u16) {
        self.responses.get_or_create(&CodeLabel { code }).inc();
    }

    /// The exposition text: the counters kept here, then the figures of `g`.
    pub fn render(&self, g: &Gauges) -> Result<String, MetricsError> {
        let mut out = String::with_capacity(8 << 10);
        prometheus_text::encode(&mut out, &self.registry)?;
        prometheus_text::encode(&mut out, &gauges::registry(g))?;
        Ok(out)
    }
}

/// Registers `m` (a handle: the registry keeps a clone) and gives it back.
fn add<M: Metric + Clone>(r: &mut Registry, name: &str, help: &str, m: M) -> M {
    r.register(name, help, m.clone());
    m
}

/// A family with a series for each of `labels`, all at zero.
fn labelled<L, M, const N: usize>(labels: [L; N]) -> Family<L, M>
where
    L: Clone + std::hash::Hash + Eq,
    M: Default,
{
    let family = Family::default();
    for l in &labels {
        drop(family.get_or_create(l));
    }
    family
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm::job::JobTimings;

    #[test]
    fn histograms_are_cumulative_and_counted() {
        let m = Metrics::default();
        let t = JobTimings {
            clone: Duration::ZERO,
            run: Duration::from_millis(3),
            total: Duration::from_millis(4),
            guest: Some(vmm::job::GuestPhases {
                run: Duration::from_millis(2),
                ..Default::default()
            }),
            exits: 5,
            kvm: vmm::kvm_stats::VcpuCounters {
                emulated_instructions: Some(600),
                ..Default::default()
            },
        };

        m.job(Status::Ok, Duration::ZERO, &t);
        m.job(Status::Timeout, Duration::ZERO, &t);
        let text = m.render(&Gauges::default()).unwrap();

        assert!(text.contains("bud_jobs_total{status=\"ok\"} 1\n"));
        assert!(text.contains("bud_jobs_total{status=\"timeout\"} 1\n"));
        assert!(text.contains("bud_job_run_seconds_bucket{le=\"0.002\"} 0\n"));
        assert!(text.contains("bud_job_run_seconds_bucket{le=\"0.005\"} 2\n"));
        assert!(text.contains("bud_job_run_seconds_bucket{le=\"+Inf\"} 2\n"));
        assert!(text.contains("bud_job_run_seconds_count 2\n"));
        assert!(text.contains("bud_job_exits_total 10\n"));
        assert!(text.contains("bud_kvm_emulated_instructions_total 1200\n"));
        assert!(text.contains("bud_kvm_page_faults_total 0\n"));
        assert!(text.contains("bud_job_guest_seconds_total{phase=\"run\"} 0.004\n"));
    }

    #[test]
    fn every_sample_line_is_name_value() {
        let text = Metrics::default().render(&Gauges::default()).unwrap();

        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (name, value) = line.rsplit_once(' ').unwrap();
            assert!(
                name.starts_with("bud_") || name.starts_with("process_"),
                "{line}"
            );
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
        assert!(resident_bytes() > 0);
    }

    /// Every figure there is: an audit log, a state directory, a session ended.
    fn everything() -> Gauges {
        Gauges {
            template_ready: true,
            sessions: SessionGauges {
                ended: [("deleted".to_owned(), 1)].into(),
                state: Some(Default::default()),
                ..Default::default()
            },
            audit: Some((3, 1, false)),
            egress: Some(EgressGauges {
                dns_allowed: 2,
                connect_refused: 1,
                bytes_received: 4096,
                queued: 3,
                dialing: 5,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn every_metric_keeps_its_name_and_type() {
        let m = Metrics::default();
        m.response(200);
        let text = m.render(&everything()).unwrap();

        let mut types: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .collect();
        types.sort_unstable();
        assert_eq!(
            types,
            [
                "bud_audit_failing gauge",
                "bud_audit_records_total counter",
                "bud_egress_attempts_total counter",
                "bud_egress_bytes_total counter",
                "bud_egress_dialing gauge",
                "bud_egress_queued gauge",
                "bud_http_responses_total counter",
                "bud_job_clone_seconds histogram",
                "bud_job_exits_total counter",
                "bud_job_failures_total counter",
                "bud_job_guest_seconds_total counter",
                "bud_job_queue_seconds histogram",
                "bud_job_run_seconds histogram",
                "bud_job_total_seconds histogram",
                "bud_jobs_queued gauge",
                "bud_jobs_running gauge",
                "bud_jobs_total counter",
                "bud_kvm_emulated_instructions_total counter",
                "bud_kvm_exits_total counter",
                "bud_kvm_page_faults_total counter",
                "bud_live_clones gauge",
                "bud_pool_ready gauge",
                "bud_pool_size gauge",
                "bud_queue_capacity gauge",
                "bud_rejected_total counter",
                "bud_reset_mapping_drops_total counter",
                "bud_reset_restored_pages_total counter",
                "bud_reset_seconds_total counter",
                "bud_resets_total counter",
                "bud_sessions gauge",
                "bud_sessions_created_total counter",
                "bud_sessions_ended_total counter",
                "bud_sessions_forked_total counter",
                "bud_sessions_memory_bytes gauge",
                "bud_sessions_parked gauge",
                "bud_sessions_parked_total counter",
                "bud_sessions_paused gauge",
                "bud_sessions_paused_total counter",
                "bud_sessions_resumed_total counter",
                "bud_snapshots gauge",
                "bud_snapshots_taken_total counter",
                "bud_state_bytes gauge",
                "bud_template_ready gauge",
                "bud_vm_close_seconds_total counter",
                "bud_vms_closed_total counter",
                "bud_vms_replaced_total counter",
                "bud_warm_vms gauge",
                "bud_workers gauge",
                "process_resident_memory_bytes gauge",
            ]
        );
    }

    #[test]
    fn labelled_metrics_keep_their_label() {
        let m = Metrics::default();
        m.response(200);
        let text = m.render(&everything()).unwrap();

        let mut labelled: Vec<String> = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.contains("_bucket{"))
            .filter_map(|l| {
                let (name, rest) = l.split_once('{')?;
                Some(format!("{name}{{{}}}", rest.split_once('=')?.0))
            })
            .collect();
        labelled.sort_unstable();
        labelled.dedup();
        assert_eq!(
            labelled,
            [
                "bud_audit_records_total{result}",
                "bud_egress_attempts_total{kind}",
                "bud_egress_bytes_total{direction}",
                "bud_http_responses_total{code}",
                "bud_job_guest_seconds_total{phase}",
                "bud_jobs_total{status}",
                "bud_rejected_total{reason}",
                "bud_sessions_ended_total{reason}",
                "bud_vms_replaced_total{reason}",
            ]
        );
    }

    #[test]
    fn a_network_servers_egress_figures_are_written_with_their_labels() {
        let text = Metrics::default().render(&everything()).unwrap();

        for series in [
            "bud_egress_attempts_total{kind=\"dns\",result=\"allowed\"} 2\n",
            "bud_egress_attempts_total{kind=\"connect\",result=\"refused\"} 1\n",
            "bud_egress_attempts_total{kind=\"connect\",result=\"allowed\"} 0\n",
            "bud_egress_bytes_total{direction=\"received\"} 4096\n",
            "bud_egress_bytes_total{direction=\"sent\"} 0\n",
            "bud_egress_queued 3\n",
            "bud_egress_dialing 5\n",
        ] {
            assert!(text.contains(series), "{series}: {text}");
        }
        let none = Metrics::default().render(&Gauges::default()).unwrap();
        assert!(!none.contains("bud_egress"), "{none}");
    }

    #[test]
    fn help_lines_end_with_one_period() {
        let text = Metrics::default().render(&everything()).unwrap();

        for line in text.lines().filter(|l| l.starts_with("# HELP ")) {
            assert!(line.ends_with('.') && !line.ends_with(".."), "{line}");
        }
    }

    #[test]
    fn known_labels_are_counted_from_zero_before_their_first_event() {
        let text = Metrics::default().render(&Gauges::default()).unwrap();

        for series in [
            "bud_jobs_total{status=\"cancelled\"} 0\n",
            "bud_rejected_total{reason=\"memory_budget\"} 0\n",
            "bud_job_guest_seconds_total{phase=\"compile\"} 0.0\n",
            "bud_vms_replaced_total{reason=\"reset_failed\"} 0\n",
        ] {
            assert!(text.contains(series), "{series}: {text}");
        }
    }
}
