//! The figures `/metrics` shows that other parts own: the job queue's, the executors',
//! the sessions', the state directory's, the audit log's and the sandboxes' networks'
//! (`bud_egress_attempts_total{kind,result}`, `bud_egress_bytes_total{direction}`,
//! `bud_egress_queued`, zero on a server whose templates have no network card), handed in as [`Gauges`] by
//! the handler and registered in a registry made for that scrape (prometheus-client's
//! constant gauges and counters); and the process's memory, read from `/proc`. Nothing
//! here is kept between scrapes.

use std::collections::BTreeMap;

use prometheus_client::encoding::{EncodeCounterValue, EncodeGaugeValue, EncodeLabelSet};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use super::{ReasonLabel, ResultLabel, add};

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
    /// Every sandbox's network attempts and bytes (the server always has them).
    pub egress: Option<EgressGauges>,
}

/// The sandboxes' names resolved and connections opened, allowed and refused, and the bytes
/// of their closed connections.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressGauges {
    pub dns_allowed: u64,
    pub dns_refused: u64,
    pub connect_allowed: u64,
    pub connect_refused: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Lookups and dials waiting for a dial thread (`vmm::net::dialer_queued`).
    pub queued: u64,
    /// Dials under way: connects started and not yet completed, failed or timed out
    /// (`vmm::net::dials_in_flight`).
    pub dialing: u64,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AttemptLabel {
    kind: &'static str,
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabel {
    direction: &'static str,
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

/// A registry of the figures other parts own, made for one scrape.
pub(super) fn registry(g: &Gauges) -> Registry {
    let mut r = Registry::default();
    if let Some((written, dropped, failing)) = g.audit {
        let records = Family::<ResultLabel, Counter>::default();
        for (result, n) in [("written", written), ("dropped", dropped)] {
            records.get_or_create(&ResultLabel { result }).inc_by(n);
        }
        add(
            &mut r,
            "bud_audit_records",
            "Audit records written, and lost",
            records,
        );
        gauge(
            &mut r,
            "bud_audit_failing",
            "1 while the audit log cannot be written",
            u64::from(failing),
        );
    }
    for (name, help, v) in [
        ("bud_workers", "Job threads", g.workers),
        (
            "bud_queue_capacity",
            "Jobs admitted at once (running + waiting)",
            g.queue_capacity,
        ),
        ("bud_jobs_running", "Jobs running now", g.jobs_running),
        (
            "bud_jobs_queued",
            "Jobs admitted and waiting for a job thread",
            g.jobs_queued,
        ),
        ("bud_pool_size", "Clones the pool keeps ready", g.pool_size),
        (
            "bud_pool_ready",
            "Clones ready in the pool now",
            g.pool_ready,
        ),
        (
            "bud_live_clones",
            "Clones that exist (pooled, running, or being closed)",
            g.live_clones,
        ),
        ("bud_warm_vms", "Reset VMs waiting for a job", g.warm_vms),
        (
            "bud_template_ready",
            "1 once the template is loaded",
            usize::from(g.template_ready),
        ),
    ] {
        gauge(&mut r, name, help, v as u64);
    }
    gauge(
        &mut r,
        "process_resident_memory_bytes",
        "Resident memory of the server process",
        resident_bytes(),
    );
    executor(&mut r, &g.executor);
    sessions(&mut r, &g.sessions);
    if let Some(e) = &g.egress {
        egress(&mut r, e);
    }
    r
}

/// The sandboxes' networks.
fn egress(r: &mut Registry, e: &EgressGauges) {
    let attempts = Family::<AttemptLabel, Counter>::default();
    for (kind, result, n) in [
        ("dns", "allowed", e.dns_allowed),
        ("dns", "refused", e.dns_refused),
        ("connect", "allowed", e.connect_allowed),
        ("connect", "refused", e.connect_refused),
    ] {
        attempts
            .get_or_create(&AttemptLabel { kind, result })
            .inc_by(n);
    }
    add(
        r,
        "bud_egress_attempts",
        "Names sandboxes resolved (dns) and connections they opened (connect), allowed and refused",
        attempts,
    );
    let bytes = Family::<DirectionLabel, Counter>::default();
    for (direction, n) in [("sent", e.bytes_sent), ("received", e.bytes_received)] {
        bytes.get_or_create(&DirectionLabel { direction }).inc_by(n);
    }
    add(
        r,
        "bud_egress_bytes",
        "Bytes of sandboxes' closed connections, sent by the guests and received by them",
        bytes,
    );
    gauge(
        r,
        "bud_egress_queued",
        "Sandboxes' lookups and dials waiting for a dial thread",
        e.queued,
    );
    gauge(
        r,
        "bud_egress_dialing",
        "Sandboxes' dials under way: connects started, not yet completed, failed or timed out",
        e.dialing,
    );
}

/// VM reuse: resets, and VMs replaced instead of reused.
fn executor(r: &mut Registry, e: &vmm::executor::ExecutorStats) {
    counter(r, "bud_resets", "VMs reset in place after a job", e.resets);
    counter(
        r,
        "bud_reset_seconds",
        "Time spent resetting VMs",
        e.reset_time.as_secs_f64(),
    );
    counter(
        r,
        "bud_reset_restored_pages",
        "Guest pages copied back from the template by resets",
        e.restored_pages,
    );
    counter(
        r,
        "bud_reset_mapping_drops",
        "Resets that made KVM drop its shadow page tables (a job changed a page table)",
        e.mapping_drops,
    );
    counter(
        r,
        "bud_vms_closed",
        "VMs closed (a session's at its end, a replaced one)",
        e.closed,
    );
    counter(
        r,
        "bud_vm_close_seconds",
        "Time spent closing VMs (the host's teardown of each)",
        e.close_time.as_secs_f64(),
    );
    let replaced = Family::<ReasonLabel, Counter>::default();
    for (reason, n) in [
        ("abnormal", e.replaced_abnormal),
        ("too_dirty", e.replaced_too_dirty),
        ("reset_failed", e.replaced_reset_failed),
    ] {
        let reason = reason.into();
        replaced.get_or_create(&ReasonLabel { reason }).inc_by(n);
    }
    add(
        r,
        "bud_vms_replaced",
        "VMs thrown away after a job instead of reused, by reason",
        replaced,
    );
}

/// Sessions, and the state directory's paused sessions and snapshots.
fn sessions(r: &mut Registry, s: &SessionGauges) {
    gauge(r, "bud_sessions", "Live sessions", s.live as u64);
    gauge(
        r,
        "bud_sessions_memory_bytes",
        "Host memory sessions hold: their private pages plus fork layers",
        s.memory_bytes,
    );
    counter(
        r,
        "bud_sessions_created",
        "Sessions created (forks included)",
        s.created,
    );
    counter(
        r,
        "bud_sessions_forked",
        "Sessions made by forking",
        s.forked,
    );
    let ended = Family::<ReasonLabel, Counter>::default();
    for (reason, n) in &s.ended {
        let reason = reason.clone().into();
        ended.get_or_create(&ReasonLabel { reason }).inc_by(*n);
    }
    add(r, "bud_sessions_ended", "Sessions ended, by reason", ended);
    let Some(st) = &s.state else { return };
    gauge(
        r,
        "bud_sessions_paused",
        "Paused sessions on disk",
        st.paused as u64,
    );
    gauge(
        r,
        "bud_sessions_parked",
        "Of the paused sessions, those parked for idling (shown running)",
        st.parked as u64,
    );
    gauge(r, "bud_snapshots", "Snapshots on disk", st.snapshots as u64);
    gauge(
        r,
        "bud_state_bytes",
        "Bytes of the state directory's session files (what its quota counts)",
        st.bytes,
    );
    counter(r, "bud_sessions_paused", "Pauses", st.pauses);
    counter(
        r,
        "bud_sessions_parked",
        "Sessions parked for idling",
        st.parks,
    );
    counter(r, "bud_sessions_resumed", "Resumes", st.resumes);
    counter(
        r,
        "bud_snapshots_taken",
        "Snapshots taken",
        st.snapshots_taken,
    );
}

/// A counter whose value another part keeps.
fn counter<N>(r: &mut Registry, name: &str, help: &str, v: N)
where
    N: EncodeCounterValue + std::fmt::Debug + Send + Sync + 'static,
{
    r.register(name, help, ConstCounter::new(v));
}

fn gauge<N>(r: &mut Registry, name: &str, help: &str, v: N)
where
    N: EncodeGaugeValue + std::fmt::Debug + Send + Sync + 'static,
{
    r.register(name, help, ConstGauge::new(v));
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
