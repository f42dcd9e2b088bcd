//! One sandbox's gate: its policy applied to each name its guest resolves and each
//! connection it opens ([`vmm::Egress`]), with a record of every attempt.
//!
//! For a connection by name (the guest resolved it through bud's DNS, so the stack knows
//! which name a synthetic address stands for), the gate resolves the *name* on the host
//! (`--egress-hosts` first, then the host's resolver) and dials the first address that is
//! dialable ([`super::ranges`]), is not the server's own listener on that port
//! ([`super::listeners`]: checked before the policy, which cannot open it) and that the
//! policy allows for that name: the address the guest used is never dialed, so an
//! `/etc/hosts` line or a rebinding in the guest changes nothing. A connection to an
//! address the guest used directly is decided on that address alone (no name: domain
//! entries do not match it).
//!
//! Every attempt is kept in the gate's log (`GET /v1/sessions/{id}/network`), counted in the
//! site's [`Totals`] (`/metrics`) and, with an audit log, written to it as a `dns` or
//! `connect` record: a refused one at once, an allowed connection when it closes, with the
//! bytes it moved each way (the VMM's relay counts them and reports the end,
//! [`vmm::Egress::closed`]).
//!
//! With `--egress-max-bytes`, a sandbox's connections may move that many bytes in all (both
//! ways, counted from its gate's start: a resumed session or a fork starts again); the
//! stack moves none past it, resets what is open and refuses the rest (`bytes`).
//!
//! Not yet here (stage 2 of `docs/network-design.md` continues): the Host and SNI of a
//! connection by address.

use std::collections::VecDeque;
use std::net::{Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use vmm::{ConnectRequest, Egress, Headers, Limit, Refusal, Traffic, Verdict};

use super::listeners::Listeners;
use super::policy::{Decision, Policy, PolicySpec};
use super::ranges::{Hosts, Private};
use super::secrets::Secrets;
use crate::core::audit::{AuditLog, Origin};

/// Attempts one gate keeps (the oldest are dropped first, and counted).
pub const LOG_KEPT: usize = 10_000;

/// What every gate of the server shares: what the operator decided (pinned names, private
/// ranges opened), the server's own listening sockets (never dialed), the totals the
/// metrics read, and the audit log attempts are written to.
#[derive(Debug, Clone, Default)]
pub struct Site {
    pub hosts: Hosts,
    pub private: Private,
    /// Where the server listens, registered as it binds ([`crate::http::serve`]).
    pub listeners: Arc<Listeners>,
    /// Bytes each sandbox's connections may move in all (`--egress-max-bytes`).
    pub max_bytes: Option<u64>,
    pub totals: Arc<Totals>,
    pub audit: Option<AuditLog>,
    /// The session traces attempts are written to, beside the audit log.
    pub traces: Option<Arc<crate::core::trace::Traces>>,
    /// The operator's secrets, for rules' header values (`--egress-secrets`).
    pub secrets: Arc<Secrets>,
    /// bud's side of the TLS it terminates to hosts with rules (`--egress-ca-dir`); None:
    /// TLS to them is refused.
    pub intercept: Option<Arc<super::Interceptor>>,
}

/// Every gate's attempts and bytes added up (`bud_egress_*` in `/metrics`).
#[derive(Debug, Default)]
pub struct Totals {
    pub dns_allowed: AtomicU64,
    pub dns_refused: AtomicU64,
    pub connect_allowed: AtomicU64,
    pub connect_refused: AtomicU64,
    /// Bytes of closed connections, from the guests and to them.
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
}

impl Totals {
    fn count(&self, a: &Attempt) {
        let counter = match (a.kind, a.allowed) {
            ("dns", true) => &self.dns_allowed,
            ("dns", false) => &self.dns_refused,
            (_, true) => &self.connect_allowed,
            (_, false) => &self.connect_refused,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The figures now, for `/metrics`.
    pub fn gauges(&self) -> crate::core::metrics::EgressGauges {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        crate::core::metrics::EgressGauges {
            dns_allowed: n(&self.dns_allowed),
            dns_refused: n(&self.dns_refused),
            connect_allowed: n(&self.connect_allowed),
            connect_refused: n(&self.connect_refused),
            bytes_sent: n(&self.bytes_sent),
            bytes_received: n(&self.bytes_received),
            queued: vmm::net::dialer_queued() as u64,
            dialing: vmm::net::dials_in_flight() as u64,
        }
    }
}

/// One name resolved or one connection opened by the guest, and what became of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Attempt {
    /// Unix time, milliseconds.
    pub at_ms: u64,
    /// `dns` or `connect`.
    pub kind: &'static str,
    /// The name asked for, if any.
    pub name: Option<String>,
    /// The address the guest used (a synthetic one for a name) and its port.
    pub addr: Option<Ipv4Addr>,
    pub port: Option<u16>,
    pub allowed: bool,
    /// Why: `allowed` (an allow entry), `unlisted` (no entry: allowed), `denied` (a deny
    /// entry), `no-policy`, `always-denied` (every address the name had is in a range no
    /// policy opens), `unresolved`, `nxdomain` (a name no entry allows where every address
    /// is denied), `bud-listener` (the address and port are one the server itself listens
    /// on: never dialed, whatever the policy or `--egress-allow-private` says), `limit` (the
    /// sandbox had as many connections open or being dialed as one may: refused by the stack
    /// without asking the policy), `dials` (it had as many connections being dialed, not
    /// yet connected, as one may: refused the same way), `bytes` (its connections had moved
    /// all the bytes `--egress-max-bytes` allows); for a connection allowed for a name and
    /// reset once its bytes named another host (an HTTP `Host` or target, a TLS SNI),
    /// `host-mismatch`, or whose bytes started as HTTP or TLS and could not be read so,
    /// `unreadable` (`vmm::net::names`); for one to a host with rules, `rules-need-http`
    /// (it started TLS and the server has no egress CA to terminate it with),
    /// `secret-missing` (a secret its headers name is no longer held) or `tls` (bud's TLS
    /// with the guest or the host failed: `detail` has rustls's error).
    pub reason: &'static str,
    /// The entry that decided, as the client wrote it.
    pub rule: Option<String>,
    /// Where bud connected.
    pub dialed: Option<SocketAddr>,
    /// For a connection bud opened, once it is over: when (Unix time, milliseconds) and the
    /// bytes it moved from the guest and to it. None while it is open, and for every other
    /// attempt.
    pub closed_at_ms: Option<u64>,
    pub bytes_sent: Option<u64>,
    pub bytes_received: Option<u64>,
    /// For `host-mismatch`, the host the connection's bytes named; for `unreadable`, what
    /// could not be read; for `secret-missing`, the secret's name.
    pub detail: Option<String>,
    /// For a connection to a host with rules: the rule (its host key) whose headers were
    /// set on its HTTP requests, the secrets their values named (names only), and, once it
    /// is over, how many requests got them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headers_from: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requests_rewritten: Option<u64>,
    /// The VMM's number of the connection ([`ConnectRequest::id`]), to find it at its end.
    #[serde(skip)]
    conn: Option<u64>,
}

/// The attempts kept and how many were dropped.
#[derive(Debug, Default)]
struct Log {
    kept: VecDeque<Attempt>,
    dropped: u64,
}

/// One sandbox's gate (see the module docs).
#[derive(Debug)]
pub struct Gate {
    /// None: no route out.
    policy: Mutex<Option<Arc<Policy>>>,
    site: Arc<Site>,
    log: Mutex<Log>,
    /// Whose sandbox this is, for its audit records.
    origin: Mutex<Origin>,
    /// Bytes its connections that are over moved, both ways.
    bytes_closed: AtomicU64,
}

impl Gate {
    pub fn new(policy: Option<Policy>, site: Arc<Site>) -> Self {
        Self {
            policy: Mutex::new(policy.map(Arc::new)),
            site,
            log: Mutex::default(),
            origin: Mutex::default(),
            bytes_closed: AtomicU64::new(0),
        }
    }

    /// Names the sandbox in the audit records of its attempts from now on.
    pub fn set_origin(&self, origin: Origin) {
        *lock(&self.origin) = origin;
    }

    /// Replaces the policy: connections opened from now on see it.
    pub fn set_policy(&self, policy: Option<Policy>) {
        *lock(&self.policy) = policy.map(Arc::new);
    }

    /// The policy in force, as the client wrote it, rules' values and all (None: no route
    /// out): for the sandbox's own records, never to be shown.
    pub fn policy(&self) -> Option<PolicySpec> {
        self.current().map(|p| p.spec().clone())
    }

    /// The policy in force as it may be shown: rules' values redacted.
    pub fn shown_policy(&self) -> Option<PolicySpec> {
        self.current().map(|p| p.spec().shown())
    }

    /// The policy in force in words ([`Policy::describe`]; None: no route out).
    pub fn describe(&self) -> String {
        match self.current() {
            Some(p) => p.describe(),
            None => "no route out: no name resolves, no connection opens".to_owned(),
        }
    }

    /// A gate for a copy of this sandbox (a fork): the same policy and site, a log of its
    /// own.
    pub fn child(&self) -> Self {
        Self {
            policy: Mutex::new(self.current()),
            site: self.site.clone(),
            log: Mutex::default(),
            origin: Mutex::new(lock(&self.origin).clone()),
            bytes_closed: AtomicU64::new(0),
        }
    }

    /// The attempts kept, oldest first, and how many older ones were dropped.
    pub fn attempts(&self) -> (Vec<Attempt>, u64) {
        let log = lock(&self.log);
        (log.kept.iter().cloned().collect(), log.dropped)
    }

    fn current(&self) -> Option<Arc<Policy>> {
        lock(&self.policy).clone()
    }

    /// Keeps `a`, counts it, and audits it unless it is an allowed connection (audited
    /// when it closes, with its bytes).
    fn record(&self, a: Attempt) {
        self.site.totals.count(&a);
        if a.conn.is_none() {
            self.audit(&a);
        }
        let mut log = lock(&self.log);
        if log.kept.len() >= LOG_KEPT {
            log.kept.pop_front();
            log.dropped += 1;
        }
        log.kept.push_back(a);
    }

    /// An attempt decided (a refused one) or over (a connection's, with its bytes): to the
    /// audit log and the sandbox's trace.
    fn audit(&self, a: &Attempt) {
        let origin = lock(&self.origin);
        if let Some(audit) = &self.site.audit {
            audit.egress(&origin, a);
        }
        if let (Some(traces), Some(session)) = (&self.site.traces, &origin.session) {
            traces.record(session, a.kind, |_| {
                serde_json::to_value(a).unwrap_or_default()
            });
        }
    }

    /// Records that connection `id`, allowed for `name`, was refused after it opened, for
    /// `reason` (`detail` says more).
    fn name_refused_as(&self, id: u64, name: &str, reason: &'static str, detail: String) {
        // The connection's own attempt (allowed, still open) gives where it went.
        let opened = lock(&self.log)
            .kept
            .iter()
            .rev()
            .find(|a| a.conn == Some(id))
            .map(|a| (a.addr, a.port, a.dialed));
        let (addr, port, dialed) = opened.unwrap_or_default();
        self.record(Attempt {
            at_ms: now_ms(),
            kind: "connect",
            name: Some(name.to_owned()),
            addr,
            port,
            allowed: false,
            reason,
            rule: None,
            dialed,
            closed_at_ms: None,
            bytes_sent: None,
            bytes_received: None,
            detail: Some(detail),
            headers_from: None,
            secrets: Vec::new(),
            requests_rewritten: None,
            conn: None,
        });
    }

    /// Records a connection attempt.
    fn record_connect(
        &self,
        req: &ConnectRequest<'_>,
        reason: &'static str,
        rule: Option<String>,
        dial: Option<SocketAddr>,
    ) {
        self.record(Attempt {
            at_ms: now_ms(),
            kind: "connect",
            name: req.name.map(str::to_owned),
            addr: Some(req.addr),
            port: Some(req.port),
            allowed: dial.is_some(),
            reason,
            rule,
            dialed: dial,
            closed_at_ms: None,
            bytes_sent: None,
            bytes_received: None,
            detail: None,
            headers_from: None,
            secrets: Vec::new(),
            requests_rewritten: None,
            conn: dial.map(|_| req.id),
        });
    }

    /// The IPv4 addresses of `name`: pinned, else the host resolver's.
    fn resolve(&self, name: &str) -> Vec<Ipv4Addr> {
        if let Some(pinned) = self.site.hosts.get(name) {
            return pinned.to_vec();
        }
        (name, 0)
            .to_socket_addrs()
            .map(|addrs| {
                addrs
                    .filter_map(|a| match a {
                        SocketAddr::V4(v4) => Some(*v4.ip()),
                        SocketAddr::V6(_) => None,
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The decision for `req`, and where to dial if allowed.
    fn decide(
        &self,
        req: &ConnectRequest<'_>,
    ) -> (Option<SocketAddr>, &'static str, Option<String>) {
        let Some(policy) = self.current() else {
            return (None, "no-policy", None);
        };
        let candidates = match req.name {
            Some(name) => self.resolve(name),
            None => vec![req.addr],
        };
        if candidates.is_empty() {
            return (None, "unresolved", None);
        }
        let mut refusal = ("always-denied", None);
        for addr in candidates {
            if self.site.listeners.reached_by(addr, req.port).is_some() {
                refusal = ("bud-listener", None);
                continue;
            }
            let decision = policy.decide(req.name, Some(addr), req.port);
            let (reason, rule) = match decision {
                Decision::Allowed(rule) => ("allowed", Some(rule)),
                Decision::Unlisted => ("unlisted", None),
                Decision::Denied(rule) => {
                    refusal = ("denied", Some(rule));
                    continue;
                }
            };
            if self.site.private.dialable(addr) {
                return (Some(SocketAddr::from((addr, req.port))), reason, rule);
            }
        }
        (None, refusal.0, refusal.1)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Egress for Gate {
    fn knows(&self, name: &str) -> bool {
        let (known, reason) = match self.current() {
            None => (false, "no-policy"),
            Some(p) if p.allows_name(name) => (true, "allowed"),
            Some(p) if p.denies_every_address() => (false, "nxdomain"),
            Some(_) if self.resolve(name).is_empty() => (false, "unresolved"),
            Some(_) => (true, "unlisted"),
        };
        self.record(Attempt {
            at_ms: now_ms(),
            kind: "dns",
            name: Some(name.to_owned()),
            addr: None,
            port: None,
            allowed: known,
            reason,
            rule: None,
            dialed: None,
            closed_at_ms: None,
            bytes_sent: None,
            bytes_received: None,
            detail: None,
            headers_from: None,
            secrets: Vec::new(),
            requests_rewritten: None,
            conn: None,
        });
        known
    }

    fn connect(&self, req: &ConnectRequest<'_>) -> Verdict {
        let (dial, reason, rule) = self.decide(req);
        self.record_connect(req, reason, rule, dial);
        // A name with rules may start TLS: its certificate is made here, on a dialer
        // thread, so the relay finds it made ([`Egress::interception`]).
        if let (Some(_), Some(name), Some(intercept), Some(policy)) =
            (dial, req.name, &self.site.intercept, self.current())
            && policy.rules().covers(name)
        {
            intercept.prepare(name);
        }
        dial.map_or(Verdict::Refuse, Verdict::Dial)
    }

    fn over_limit(&self, req: &ConnectRequest<'_>, limit: Limit) {
        let reason = match limit {
            Limit::Connections => "limit",
            Limit::Dials => "dials",
            Limit::Bytes => "bytes",
        };
        self.record_connect(req, reason, None, None);
    }

    fn name_refused(&self, id: u64, name: &str, refusal: &Refusal) {
        let (reason, detail) = match refusal {
            Refusal::Mismatch(claimed) => ("host-mismatch", claimed.clone()),
            Refusal::Unreadable(why) => ("unreadable", (*why).to_owned()),
            Refusal::Encrypted => (
                "rules-need-http",
                "headers are set on HTTP requests only here: TLS to this host is refused (the server has no --egress-ca-dir to terminate it with)".to_owned(),
            ),
            Refusal::Tls(why) => ("tls", why.clone()),
        };
        self.name_refused_as(id, name, reason, detail);
    }

    fn headers(&self, id: u64, name: &str) -> Headers {
        let Some(policy) = self.current() else {
            return Headers::None;
        };
        match policy.rules().for_name(name, &self.site.secrets) {
            None => Headers::None,
            Some(Ok(applied)) => {
                if let Some(a) = lock(&self.log)
                    .kept
                    .iter_mut()
                    .rev()
                    .find(|a| a.conn == Some(id))
                {
                    a.headers_from = Some(applied.rule);
                    a.secrets = applied.secrets;
                }
                Headers::Set(applied.headers)
            }
            Some(Err(missing)) => {
                self.name_refused_as(id, name, "secret-missing", missing.secret);
                Headers::Refuse
            }
        }
    }

    fn interception(&self, name: &str) -> Option<vmm::Interception> {
        self.site.intercept.as_ref()?.for_name(name)
    }

    fn byte_budget(&self) -> Option<u64> {
        let spent = self.bytes_closed.load(Ordering::Relaxed);
        self.site.max_bytes.map(|max| max.saturating_sub(spent))
    }

    fn closed(&self, id: u64, traffic: Traffic) {
        self.bytes_closed
            .fetch_add(traffic.sent + traffic.received, Ordering::Relaxed);
        let totals = &self.site.totals;
        totals.bytes_sent.fetch_add(traffic.sent, Ordering::Relaxed);
        totals
            .bytes_received
            .fetch_add(traffic.received, Ordering::Relaxed);
        let closed = {
            let mut log = lock(&self.log);
            // Recent connections end first: look from the newest. One dropped from the log
            // meanwhile is counted in the totals only.
            let Some(a) = log.kept.iter_mut().rev().find(|a| a.conn == Some(id)) else {
                return;
            };
            a.closed_at_ms = Some(now_ms());
            a.bytes_sent = Some(traffic.sent);
            a.bytes_received = Some(traffic.received);
            if a.headers_from.is_some() {
                a.requests_rewritten = Some(traffic.rewritten);
            }
            a.conn = None;
            a.clone()
        };
        self.audit(&closed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(allow: &[&str], deny: &[&str], hosts: &str, private: &str) -> Gate {
        let spec = PolicySpec {
            allow_out: allow.iter().map(|s| s.to_string()).collect(),
            deny_out: deny.iter().map(|s| s.to_string()).collect(),
            rules: Default::default(),
        };
        let site = Site {
            hosts: Hosts::parse(hosts).unwrap(),
            private: Private::parse(private).unwrap(),
            ..Site::default()
        };
        Gate::new(
            Some(Policy::parse(&spec, &Secrets::default()).unwrap()),
            Arc::new(site),
        )
    }

    /// A gate allowing `api.test` (pinned to 127.0.0.1, opened), whose requests get a
    /// header; with an interceptor whose CA is in `ca_dir`, if given.
    fn ruled_gate(ca_dir: Option<&std::path::Path>) -> Gate {
        let spec = PolicySpec {
            allow_out: vec!["api.test".into()],
            deny_out: Vec::new(),
            rules: serde_json::from_str(
                r#"{"api.test": [{"transform": {"headers": {"X-Team": "blue"}}}]}"#,
            )
            .unwrap(),
        };
        let site = Site {
            hosts: Hosts::parse("api.test 127.0.0.1\nplain.test 127.0.0.1\n").unwrap(),
            private: Private::parse("127.0.0.1").unwrap(),
            intercept: ca_dir.map(|d| Arc::new(super::super::Interceptor::new(d, None).unwrap())),
            ..Site::default()
        };
        Gate::new(
            Some(Policy::parse(&spec, &Secrets::default()).unwrap()),
            Arc::new(site),
        )
    }

    #[test]
    fn tls_to_a_host_with_rules_is_terminated_only_where_the_server_has_an_egress_ca() {
        let dir = std::env::temp_dir().join(format!("bud-gate-ca-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let with_ca = ruled_gate(Some(&dir));
        let without = ruled_gate(None);

        let dialed = with_ca.connect(&by_name("api.test", 443));
        let terminated = with_ca.interception("api.test").is_some();
        let refused_without = without.interception("api.test").is_none();
        with_ca.name_refused(
            9,
            "api.test",
            &Refusal::Tls("host: invalid peer certificate: UnknownIssuer".into()),
        );
        let (log, _) = with_ca.attempts();

        assert_eq!(dialed, Verdict::Dial("127.0.0.1:443".parse().unwrap()));
        assert!(terminated && refused_without);
        let last = log.last().unwrap();
        assert_eq!(
            (last.reason, last.allowed, last.detail.as_deref()),
            (
                "tls",
                false,
                Some("host: invalid peer certificate: UnknownIssuer")
            )
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn by_name(name: &str, port: u16) -> ConnectRequest<'_> {
        ConnectRequest {
            name: Some(name),
            addr: Ipv4Addr::new(198, 18, 0, 1),
            port,
            id: 7,
        }
    }

    fn by_addr(addr: Ipv4Addr, port: u16) -> ConnectRequest<'static> {
        ConnectRequest {
            name: None,
            addr,
            port,
            id: 8,
        }
    }

    #[test]
    fn a_pinned_allowed_name_is_dialed_at_its_pinned_address_and_logged() {
        let g = gate(
            &["pypi.test"],
            &["0.0.0.0/0"],
            "pypi.test 127.0.0.1\n",
            "127.0.0.1",
        );
        assert!(g.knows("pypi.test"));
        assert_eq!(
            g.connect(&by_name("pypi.test", 8080)),
            Verdict::Dial("127.0.0.1:8080".parse().unwrap())
        );
        let (log, dropped) = g.attempts();
        assert_eq!(dropped, 0);
        assert_eq!(
            log.iter()
                .map(|a| (a.kind, a.allowed, a.reason))
                .collect::<Vec<_>>(),
            [("dns", true, "allowed"), ("connect", true, "allowed")]
        );
        assert_eq!(log[1].rule.as_deref(), Some("pypi.test"));
    }

    #[test]
    fn an_allowed_name_that_resolves_to_loopback_is_refused_unless_the_operator_opened_it() {
        let g = gate(&["pypi.test"], &["0.0.0.0/0"], "pypi.test 127.0.0.1\n", "");
        assert_eq!(g.connect(&by_name("pypi.test", 80)), Verdict::Refuse);
        assert_eq!(g.attempts().0[0].reason, "always-denied");
    }

    #[test]
    fn names_no_entry_allows_get_nxdomain_under_deny_all_and_addresses_are_refused() {
        let g = gate(
            &["pypi.test"],
            &["0.0.0.0/0"],
            "evil.test 203.0.113.7\n",
            "127.0.0.1",
        );
        assert!(!g.knows("evil.test"));
        let literal = by_addr(Ipv4Addr::new(203, 0, 113, 7), 443);
        assert_eq!(g.connect(&literal), Verdict::Refuse);
        let (log, _) = g.attempts();
        assert_eq!((log[0].reason, log[1].reason), ("nxdomain", "denied"));
        assert_eq!(log[1].rule.as_deref(), Some("0.0.0.0/0"));
    }

    #[test]
    fn without_a_policy_nothing_resolves_and_nothing_is_dialed() {
        let g = Gate::new(None, Arc::default());
        assert!(!g.knows("pypi.test"));
        let literal = by_addr(Ipv4Addr::new(203, 0, 113, 7), 443);
        assert_eq!(g.connect(&literal), Verdict::Refuse);
        assert!(
            g.attempts()
                .0
                .iter()
                .all(|a| a.reason == "no-policy" && !a.allowed)
        );
        g.set_policy(Some(Policy::allow_all()));
        assert_eq!(
            g.connect(&literal),
            Verdict::Dial("203.0.113.7:443".parse().unwrap())
        );
        assert_eq!(g.policy(), Some(PolicySpec::default()));
        let child = g.child();
        assert_eq!(child.policy(), g.policy());
        assert!(child.attempts().0.is_empty(), "a child's log is its own");
    }

    #[test]
    fn the_servers_own_listener_is_refused_whatever_the_policy_and_the_private_ranges_say() {
        let g = gate(&["*"], &[], "api.test 127.0.0.1\n", "0.0.0.0/0");
        g.site.listeners.add("127.0.0.1:8080".parse().unwrap());

        let named = g.connect(&by_name("api.test", 8080));
        let literal = g.connect(&by_addr(Ipv4Addr::LOCALHOST, 8080));
        let other_port = g.connect(&by_name("api.test", 8081));

        assert_eq!((named, literal), (Verdict::Refuse, Verdict::Refuse));
        assert_eq!(other_port, Verdict::Dial("127.0.0.1:8081".parse().unwrap()));
        let (log, _) = g.attempts();
        assert_eq!(
            log.iter()
                .map(|a| (a.allowed, a.reason, a.rule.as_deref()))
                .collect::<Vec<_>>(),
            [
                (false, "bud-listener", None),
                (false, "bud-listener", None),
                (true, "allowed", Some("*")),
            ]
        );
    }

    #[test]
    fn a_synthetic_address_the_guest_used_without_its_name_is_never_dialed() {
        let g = gate(&[], &[], "", "");
        let stray = by_addr(Ipv4Addr::new(198, 18, 0, 9), 80);
        assert_eq!(g.connect(&stray), Verdict::Refuse);
        assert_eq!(g.attempts().0[0].reason, "always-denied");
    }

    #[test]
    fn a_connection_that_closes_gets_its_bytes_in_the_log_and_the_totals() {
        let g = gate(&["pypi.test"], &[], "pypi.test 127.0.0.1\n", "127.0.0.1");
        assert!(g.knows("pypi.test"));
        assert!(matches!(
            g.connect(&by_name("pypi.test", 80)),
            Verdict::Dial(_)
        ));
        let refused = by_addr(Ipv4Addr::new(127, 0, 0, 2), 80);
        assert_eq!(g.connect(&refused), Verdict::Refuse);
        let open = g.attempts().0[1].clone();
        assert_eq!(
            (open.closed_at_ms, open.bytes_sent, open.bytes_received),
            (None, None, None)
        );

        g.closed(
            8,
            Traffic {
                sent: 1,
                received: 1,
                rewritten: 0,
            },
        ); // not a connection it opened
        g.closed(
            7,
            Traffic {
                sent: 120,
                received: 4096,
                rewritten: 0,
            },
        );

        let (log, _) = g.attempts();
        assert!(log[1].closed_at_ms.is_some_and(|t| t >= open.at_ms));
        assert_eq!(
            (log[1].bytes_sent, log[1].bytes_received),
            (Some(120), Some(4096))
        );
        assert_eq!((log[2].bytes_sent, log[2].closed_at_ms), (None, None));
        assert_eq!(
            g.site.totals.gauges(),
            crate::core::metrics::EgressGauges {
                dns_allowed: 1,
                dns_refused: 0,
                connect_allowed: 1,
                connect_refused: 1,
                bytes_sent: 121,
                bytes_received: 4097,
                queued: 0,
                dialing: 0,
            }
        );
        // Once closed, the same number finds nothing more to close.
        g.closed(
            7,
            Traffic {
                sent: 5,
                received: 5,
                rewritten: 0,
            },
        );
        assert_eq!(g.attempts().0[1].bytes_sent, Some(120));
    }

    #[test]
    fn the_byte_budget_is_the_cap_less_what_closed_connections_moved() {
        let site = Site {
            max_bytes: Some(1000),
            ..Site::default()
        };
        let g = Gate::new(Some(Policy::allow_all()), Arc::new(site));
        assert_eq!(g.byte_budget(), Some(1000));

        g.closed(
            1,
            Traffic {
                sent: 300,
                received: 400,
                rewritten: 0,
            },
        );
        assert_eq!(g.byte_budget(), Some(300));
        g.closed(
            2,
            Traffic {
                sent: 500,
                received: 0,
                rewritten: 0,
            },
        );
        assert_eq!(g.byte_budget(), Some(0), "spent, never negative");
        g.over_limit(&by_addr(Ipv4Addr::new(203, 0, 113, 7), 443), Limit::Bytes);
        let refused = g.attempts().0.pop().unwrap();
        assert_eq!((refused.allowed, refused.reason), (false, "bytes"));
        assert_eq!(g.child().byte_budget(), Some(1000), "a fork counts its own");
        assert_eq!(
            Gate::new(None, Arc::default()).byte_budget(),
            None,
            "no cap"
        );
    }

    #[test]
    fn each_limit_the_stack_refuses_at_is_logged_as_a_refusal_with_its_reason() {
        let g = Gate::new(Some(Policy::allow_all()), Arc::default());

        for limit in [Limit::Connections, Limit::Dials, Limit::Bytes] {
            g.over_limit(&by_addr(Ipv4Addr::new(203, 0, 113, 7), 443), limit);
        }

        let seen: Vec<_> = g
            .attempts()
            .0
            .iter()
            .map(|a| (a.kind, a.allowed, a.reason, a.dialed))
            .collect();
        assert_eq!(
            seen,
            [
                ("connect", false, "limit", None),
                ("connect", false, "dials", None),
                ("connect", false, "bytes", None),
            ]
        );
    }

    #[test]
    fn the_log_keeps_the_newest_attempts_and_counts_the_dropped() {
        let g = Gate::new(None, Arc::default());
        for _ in 0..LOG_KEPT + 3 {
            g.knows("a.test");
        }
        let (log, dropped) = g.attempts();
        assert_eq!((log.len(), dropped), (LOG_KEPT, 3));
    }
}
