//! `GET /metrics`: counters and histograms kept in atomics, written in the Prometheus text
//! exposition format (version 0.0.4) by hand: the set is small and fixed.
//!
//! - `bud_jobs_total{status}`: jobs that ran, by status.
//! - `bud_job_failures_total`: jobs bud could not run (answered 500).
//! - `bud_rejected_total{reason}`: job requests refused for want of room or readiness
//!   (`overloaded`, `not_ready`, `shutting_down`).
//! - `bud_http_responses_total{code}`: responses by HTTP status code.
//! - `bud_job_{queue,clone,run,total}_seconds`: histograms.
//! - `bud_job_exits_total`: exits from guests to the VMM during jobs;
//!   `bud_kvm_{exits,emulated_instructions,page_faults}_total`: KVM's own counters of the
//!   jobs' vCPUs (where KVM keeps them);
//!   `bud_job_guest_seconds_total{phase}`: the guests' own account of jobs that ended
//!   normally (`read`, `identity`, `compile`, `run`).
//! - gauges: workers, queue capacity, jobs running and queued, pool size and ready clones,
//!   idle warm VMs, live clones, and the process's resident memory.
//! - VM reuse: `bud_resets_total`, `bud_reset_seconds_total`, `bud_reset_restored_pages_total`,
//!   `bud_reset_mapping_drops_total`
//!   and `bud_vms_replaced_total{reason}` (`abnormal`: the job did not end at DONE;
//!   `too_dirty`: too many private pages; `reset_failed`: the reset or its verification
//!   failed).
//! - sessions: `bud_sessions` (live), `bud_sessions_memory_bytes` (their private pages plus
//!   fork layers, what the memory cap counts), `bud_sessions_created_total`,
//!   `bud_sessions_forked_total` (children made) and `bud_sessions_ended_total{reason}`;
//!   with a state directory, `bud_sessions_paused`, `bud_snapshots`, `bud_state_bytes`,
//!   `bud_sessions_paused_total`, `bud_sessions_resumed_total`, `bud_snapshots_taken_total`.
//!
//! (Over 500 lines with its unit tests, which stay beside the code they test; the code
//! itself is under 500.)

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use vmm::Status;

/// Bucket upper bounds, in seconds.
const BUCKETS: [f64; 16] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
];

const STATUSES: [(Status, &str); 7] = [
    (Status::Ok, "ok"),
    (Status::Error, "error"),
    (Status::Timeout, "timeout"),
    (Status::OutputLimit, "output_limit"),
    (Status::MemoryLimit, "memory_limit"),
    (Status::Crashed, "crashed"),
    (Status::Cancelled, "cancelled"),
];

/// Why a request was refused before it ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    Overloaded,
    KeyQuota,
    MemoryBudget,
    NotReady,
    ShuttingDown,
}

const REJECTIONS: [(Rejection, &str); 5] = [
    (Rejection::Overloaded, "overloaded"),
    (Rejection::KeyQuota, "key_quota"),
    (Rejection::MemoryBudget, "memory_budget"),
    (Rejection::NotReady, "not_ready"),
    (Rejection::ShuttingDown, "shutting_down"),
];

#[derive(Debug, Default)]
struct Histogram {
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|b| s <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (b, n) in BUCKETS.iter().zip(&self.buckets) {
            cumulative += n.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
    }
}

/// The server's counters.
#[derive(Debug, Default)]
pub struct Metrics {
    jobs: [AtomicU64; STATUSES.len()],
    failures: AtomicU64,
    rejected: [AtomicU64; REJECTIONS.len()],
    responses: Mutex<BTreeMap<u16, u64>>,
    queue: Histogram,
    clone: Histogram,
    run: Histogram,
    total: Histogram,
    exits: AtomicU64,
    /// KVM's counters: exits, emulated instructions, page faults.
    kvm: [AtomicU64; 3],
    /// Nanoseconds of guest phases: read, identity, compile, run.
    guest_ns: [AtomicU64; 4],
}

const GUEST_PHASES: [&str; 4] = ["read", "identity", "compile", "run"];

/// Point-in-time values written as gauges.
#[derive(Debug, Clone, Default)]
pub struct Gauges {
    pub workers: usize,
    pub queue_capacity: usize,
    pub jobs_running: usize,
    pub jobs_queued: usize,
    pub pool_size: usize,
    pub pool_ready: usize,
    pub live_clones: usize,
    pub warm_vms: usize,
    pub template_ready: bool,
    /// The executor's counters (all zero before the template is ready).
    pub executor: vmm::executor::ExecutorStats,
    pub sessions: SessionGauges,
    /// The audit log's records written and lost, and whether it is failing (None: no log).
    pub audit: Option<(u64, u64, bool)>,
}

/// What the sessions hold and have done.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionGauges {
    pub live: usize,
    pub memory_bytes: u64,
    pub created: u64,
    pub forked: u64,
    pub ended: BTreeMap<String, u64>,
    /// The state directory's, if the server has one.
    pub state: Option<crate::core::durable::StateGauges>,
}

impl Metrics {
    /// A job that ran.
    pub fn job(&self, status: Status, queued: Duration, t: &vmm::job::JobTimings) {
        if let Some(i) = STATUSES.iter().position(|(s, _)| *s == status) {
            self.jobs[i].fetch_add(1, Ordering::Relaxed);
        }
        self.queue.observe(queued);
        self.clone.observe(t.clone);
        self.run.observe(t.run);
        self.total.observe(t.total);
        self.exits.fetch_add(t.exits, Ordering::Relaxed);
        let k = t.kvm;
        for (slot, v) in self
            .kvm
            .iter()
            .zip([k.exits, k.emulated_instructions, k.page_faults])
        {
            slot.fetch_add(v.unwrap_or(0), Ordering::Relaxed);
        }
        if let Some(g) = t.guest {
            for (slot, d) in self
                .guest_ns
                .iter()
                .zip([g.read, g.identity, g.compile, g.run])
            {
                slot.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
            }
        }
    }

    /// A job bud could not run.
    pub fn failure(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
    }

    pub fn rejected(&self, why: Rejection) {
        if let Some(i) = REJECTIONS.iter().position(|(r, _)| *r == why) {
            self.rejected[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A response went out with HTTP status `code`.
    pub fn response(&self, code: u16) {
        let mut r = self.responses.lock().unwrap_or_else(|e| e.into_inner());
        *r.entry(code).or_insert(0) += 1;
    }

    /// The exposition text.
    pub fn render(&self, g: &Gauges) -> String {
        let mut out = String::with_capacity(8 << 10);
        out.push_str("# HELP bud_jobs_total Jobs that ran, by final status.\n");
        out.push_str("# TYPE bud_jobs_total counter\n");
        for ((_, name), n) in STATUSES.iter().zip(&self.jobs) {
            let _ = writeln!(
                out,
                "bud_jobs_total{{status=\"{name}\"}} {}",
                n.load(Ordering::Relaxed)
            );
        }
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        sample(
            &mut out,
            "bud_job_failures_total",
            "counter",
            "Jobs bud could not run (HTTP 500).",
            load(&self.failures),
        );
        sample(
            &mut out,
            "bud_job_exits_total",
            "counter",
            "Exits from guests to the VMM during jobs.",
            load(&self.exits),
        );
        for ((name, help), v) in [
            (
                "bud_kvm_exits_total",
                "Exits to KVM during jobs (KVM's count).",
            ),
            (
                "bud_kvm_emulated_instructions_total",
                "Guest instructions KVM emulated during jobs.",
            ),
            (
                "bud_kvm_page_faults_total",
                "Page faults KVM took for guests during jobs.",
            ),
        ]
        .iter()
        .zip(&self.kvm)
        {
            sample(&mut out, name, "counter", help, load(v));
        }
        out.push_str(
            "# HELP bud_job_guest_seconds_total The guests' own account of jobs, by phase.\n",
        );
        out.push_str("# TYPE bud_job_guest_seconds_total counter\n");
        for (phase, ns) in GUEST_PHASES.iter().zip(&self.guest_ns) {
            let secs = ns.load(Ordering::Relaxed) as f64 / 1e9;
            let _ = writeln!(
                out,
                "bud_job_guest_seconds_total{{phase=\"{phase}\"}} {secs}"
            );
        }
        if let Some((written, dropped, failing)) = g.audit {
            let _ = writeln!(
                out,
                "# HELP bud_audit_records_total Audit records written, and lost.\n\
                 # TYPE bud_audit_records_total counter\n\
                 bud_audit_records_total{{result=\"written\"}} {written}\n\
                 bud_audit_records_total{{result=\"dropped\"}} {dropped}\n\
                 # HELP bud_audit_failing 1 while the audit log cannot be written.\n\
                 # TYPE bud_audit_failing gauge\n\
                 bud_audit_failing {}",
                u8::from(failing)
            );
        }
        out.push_str("# HELP bud_rejected_total Requests refused before running, by reason.\n");
        out.push_str("# TYPE bud_rejected_total counter\n");
        for ((_, name), n) in REJECTIONS.iter().zip(&self.rejected) {
            let _ = writeln!(
                out,
                "bud_rejected_total{{reason=\"{name}\"}} {}",
                n.load(Ordering::Relaxed)
            );
        }
        out.push_str("# HELP bud_http_responses_total HTTP responses, by status code.\n");
        out.push_str("# TYPE bud_http_responses_total counter\n");
        for (code, n) in self
            .responses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let _ = writeln!(out, "bud_http_responses_total{{code=\"{code}\"}} {n}");
        }
        self.queue.render(
            &mut out,
            "bud_job_queue_seconds",
            "Time jobs waited for a job thread.",
        );
        self.clone.render(
            &mut out,
            "bud_job_clone_seconds",
            "Time to get a clone (0 from the pool).",
        );
        self.run.render(
            &mut out,
            "bud_job_run_seconds",
            "Time from resuming the clone to the job's end.",
        );
        self.total.render(
            &mut out,
            "bud_job_total_seconds",
            "Clone + run + collecting the result.",
        );
        let gauges = [
            ("bud_workers", "Job threads.", g.workers as u64),
            (
                "bud_queue_capacity",
                "Jobs admitted at once (running + waiting).",
                g.queue_capacity as u64,
            ),
            (
                "bud_jobs_running",
                "Jobs running now.",
                g.jobs_running as u64,
            ),
            (
                "bud_jobs_queued",
                "Jobs admitted and waiting for a job thread.",
                g.jobs_queued as u64,
            ),
            (
                "bud_pool_size",
                "Clones the pool keeps ready.",
                g.pool_size as u64,
            ),
            (
                "bud_pool_ready",
                "Clones ready in the pool now.",
                g.pool_ready as u64,
            ),
            (
                "bud_live_clones",
                "Clones that exist (pooled, running, or being closed).",
                g.live_clones as u64,
            ),
            (
                "bud_warm_vms",
                "Reset VMs waiting for a job.",
                g.warm_vms as u64,
            ),
            (
                "bud_template_ready",
                "1 once the template is loaded.",
                g.template_ready as u64,
            ),
            (
                "process_resident_memory_bytes",
                "Resident memory of the server process.",
                resident_bytes(),
            ),
        ];
        for (name, help, v) in gauges {
            sample(&mut out, name, "gauge", help, v);
        }
        let e = &g.executor;
        sample(
            &mut out,
            "bud_resets_total",
            "counter",
            "VMs reset in place after a job.",
            e.resets,
        );
        sample(
            &mut out,
            "bud_reset_seconds_total",
            "counter",
            "Time spent resetting VMs.",
            e.reset_time.as_secs_f64(),
        );
        sample(
            &mut out,
            "bud_reset_restored_pages_total",
            "counter",
            "Guest pages copied back from the template by resets.",
            e.restored_pages,
        );
        sample(
            &mut out,
            "bud_reset_mapping_drops_total",
            "counter",
            "Resets that made KVM drop its shadow page tables (a job changed a page table).",
            e.mapping_drops,
        );
        let _ = writeln!(
            out,
            "# HELP bud_vms_replaced_total VMs thrown away after a job instead of reused, by reason.\n\
             # TYPE bud_vms_replaced_total counter"
        );
        for (reason, v) in [
            ("abnormal", g.executor.replaced_abnormal),
            ("too_dirty", g.executor.replaced_too_dirty),
            ("reset_failed", g.executor.replaced_reset_failed),
        ] {
            let _ = writeln!(out, "bud_vms_replaced_total{{reason=\"{reason}\"}} {v}");
        }
        let ss = &g.sessions;
        sample(&mut out, "bud_sessions", "gauge", "Live sessions.", ss.live);
        sample(
            &mut out,
            "bud_sessions_memory_bytes",
            "gauge",
            "Host memory sessions hold: their private pages plus fork layers.",
            ss.memory_bytes,
        );
        sample(
            &mut out,
            "bud_sessions_created_total",
            "counter",
            "Sessions created (forks included).",
            ss.created,
        );
        sample(
            &mut out,
            "bud_sessions_forked_total",
            "counter",
            "Sessions made by forking.",
            ss.forked,
        );
        let _ = writeln!(
            out,
            "# HELP bud_sessions_ended_total Sessions ended, by reason.\n\
             # TYPE bud_sessions_ended_total counter"
        );
        for (reason, v) in &ss.ended {
            let _ = writeln!(out, "bud_sessions_ended_total{{reason=\"{reason}\"}} {v}");
        }
        if let Some(st) = &ss.state {
            sample(
                &mut out,
                "bud_sessions_paused",
                "gauge",
                "Paused sessions on disk.",
                st.paused,
            );
            sample(
                &mut out,
                "bud_snapshots",
                "gauge",
                "Snapshots on disk.",
                st.snapshots,
            );
            sample(
                &mut out,
                "bud_state_bytes",
                "gauge",
                "Bytes of the state directory's session files (what its quota counts).",
                st.bytes,
            );
            sample(
                &mut out,
                "bud_sessions_paused_total",
                "counter",
                "Pauses.",
                st.pauses,
            );
            sample(
                &mut out,
                "bud_sessions_resumed_total",
                "counter",
                "Resumes.",
                st.resumes,
            );
            sample(
                &mut out,
                "bud_snapshots_taken_total",
                "counter",
                "Snapshots taken.",
                st.snapshots_taken,
            );
        }
        out
    }
}

/// One metric with a single sample: its HELP and TYPE lines, then `name value`.
fn sample(out: &mut String, name: &str, kind: &str, help: &str, value: impl std::fmt::Display) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
    );
}

/// VmRSS of this process, from /proc/self/status.
pub fn resident_bytes() -> u64 {
    status_bytes("VmRSS:")
}

/// RssAnon of this process: its private memory, which is what its VMs' private pages, its
/// sessions and its own buffers take from the host (the templates' memory files are
/// shared page cache and not in it).
pub fn private_bytes() -> u64 {
    status_bytes("RssAnon:")
}

fn status_bytes(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map(|kib| kib * 1024)
        .unwrap_or(0)
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
        let text = m.render(&Gauges::default());

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
        let text = Metrics::default().render(&Gauges::default());

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
}
