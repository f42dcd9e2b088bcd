//! The server's knobs: how many job threads, how deep the admission queue, how many ready
//! clones, and the limits every request is checked against. Defaults are documented here,
//! in docs/api.md (limits) and docs/sessions.md (session caps); `bud serve --help` shows the
//! same numbers.
//!
//! The limits every request and session is checked against are [`limits`]; this module is
//! the server's whole configuration and its checks.

mod limits;

use std::time::Duration;

use clap::builder::TypedValueParser;

use limits::mib_to_bytes;
pub use limits::{Limits, SessionLimits};

/// What a sandbox given no `network` policy may reach (`--egress-default`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum EgressDefault {
    /// No route out.
    #[default]
    None,
    /// Everything but the always-denied ranges.
    All,
}

fn parse_private(text: &str) -> Result<crate::core::egress::Private, String> {
    crate::core::egress::Private::parse(text)
}

/// The whole server configuration. `bud serve` takes it as its options (flattened: every
/// field's `long` names its option, and [`Config::default`]'s value is its default) but for
/// the API keys and the audit trail, which it reads from files and options of its own.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct Config {
    /// Job threads: jobs running at once (default: one per core).
    #[arg(long, default_value_t = default_workers())]
    pub workers: usize,
    /// Jobs that may wait for a job thread; past workers + queue, requests get 429.
    #[arg(long, default_value_t = Config::default().queue)]
    pub queue: usize,
    /// VMs kept ready (fresh clones and idle warm VMs).
    #[arg(long = "pool", value_name = "POOL", default_value_t = Config::default().pool_size)]
    pub pool_size: usize,
    /// A fresh clone for every job instead of resetting and reusing warm VMs.
    #[arg(
        long = "fresh-clones",
        action = clap::ArgAction::SetTrue,
        value_parser = clap::builder::BoolValueParser::new()
            .map(|fresh| if fresh { vmm::Reuse::Fresh } else { vmm::Reuse::Warm })
    )]
    pub reuse: vmm::Reuse,
    /// Verify every reset by value against the template (reads all of guest RAM per job).
    #[arg(long)]
    pub verify_resets: bool,
    /// The templates to serve, comma-separated, prepared in this order at start (`python`,
    /// `datascience`, `tools`: guest/image/templates/). Jobs and sessions choose one with
    /// `template`; without it they get `python` if served, else the first.
    #[arg(long, value_delimiter = ',', default_value = DEFAULT_TEMPLATE)]
    pub templates: Vec<String>,
    /// Give every template a network card (part of its identity): sandboxes then reach
    /// what their `network` policy allows, and nothing without one (docs/network.md).
    #[arg(long)]
    pub network: bool,
    /// What a sandbox given no `network` policy may reach on a template with a card:
    /// `none` (no route out) or `all` (everything but the always-denied ranges).
    #[arg(long, value_enum, default_value_t = EgressDefault::None, requires = "network")]
    pub egress_default: EgressDefault,
    /// Private ranges sandboxes' policies may reach after all (comma-separated IPv4
    /// addresses and CIDRs): loopback, RFC 1918, link-local and the like are never dialed
    /// otherwise, whatever a policy says. bud's own listening addresses and ports are never
    /// dialed, whatever this opens.
    #[arg(
        long,
        value_name = "CIDRS",
        value_parser = parse_private,
        default_value = "",
        requires = "network"
    )]
    pub egress_allow_private: crate::core::egress::Private,
    /// Names pinned to addresses, `NAME ADDRESS` a line: a sandbox's connection to such a
    /// name is dialed there, without asking the host's resolver.
    #[arg(long, value_name = "FILE", requires = "network")]
    pub egress_hosts: Option<std::path::PathBuf>,
    /// Secrets for network rules' header values (`{{secret:NAME}}`), `NAME=VALUE` a line:
    /// held in the server's memory, never shown, read again on SIGHUP.
    #[arg(long, value_name = "FILE", requires = "network")]
    pub egress_secrets: Option<std::path::PathBuf>,
    /// bud's egress CA (`cert.pem` and `key.pem`, made there if missing): HTTPS to a host
    /// whose rules set headers is terminated with certificates it signs, which the images
    /// trust (they are built with the build directory's CA: `bud serve` uses that one,
    /// `build/egress-ca`). Without it, TLS to such a host is refused.
    #[arg(long, value_name = "DIR", requires = "network")]
    pub egress_ca_dir: Option<std::path::PathBuf>,
    /// Certificates (PEM) bud trusts besides the host's store when it opens TLS of its own
    /// to a host with rules (a private upstream's CA).
    #[arg(long, value_name = "FILE", requires = "network")]
    pub egress_upstream_ca: Option<std::path::PathBuf>,
    /// Bytes each sandbox's connections may move in all, both ways (none past it: its open
    /// connections are reset and new ones refused). Default: no cap.
    #[arg(long, value_name = "BYTES", requires = "network")]
    pub egress_max_bytes: Option<u64>,
    /// Most jobs one API key may have running or queued at once (429 key_quota past it).
    /// Default: half of workers + queue with several keys (at least --max-batch-jobs),
    /// no limit but the server's own with one key or none.
    #[arg(long)]
    pub key_max_jobs: Option<usize>,
    /// On SIGINT/SIGTERM: seconds running and queued jobs get to finish before they are
    /// cancelled (their clients get `cancelled`).
    #[arg(long, default_value_t = Config::default().shutdown_grace_s)]
    pub shutdown_grace_s: u64,
    /// Refuse jobs, cells and new sessions (503 memory_budget, Retry-After) while the
    /// server's private memory (its VMs' private pages, sessions, buffers) is over this.
    #[arg(
        long = "memory-budget-mib",
        value_name = "MEMORY_BUDGET_MIB",
        value_parser = mib_to_bytes
    )]
    pub memory_budget_bytes: Option<u64>,
    /// The jail closed once the templates are prepared (on by default; `--no-jail`, `--jail`,
    /// `--user`).
    #[command(flatten)]
    pub jail: crate::core::jail::JailConfig,
    /// What a 429 or 503 tells the client to wait, in seconds (`Retry-After`).
    #[arg(skip = RETRY_AFTER_S)]
    pub retry_after_s: u64,
    /// API keys (`bud serve --api-keys-file`); None: the server is open (loopback only).
    #[arg(skip)]
    pub api_keys: Option<std::sync::Arc<crate::core::keys::ApiKeys>>,
    /// The audit trail (`bud serve --audit-log`); None: no audit log.
    #[arg(skip)]
    pub audit: Option<crate::core::audit::AuditConfig>,
    /// Where paused sessions and snapshots are kept, and running sessions marked, so that
    /// a server started again on it serves them (docs/durable.md). `bud serve`'s default:
    /// `state/PORT/` in the build folder (none with `--port 0`); none: no pause, resume or
    /// snapshots.
    #[arg(long)]
    pub state_dir: Option<std::path::PathBuf>,
    /// Bytes the state directory's files may take, in MiB; past it, a pause or snapshot
    /// is 507.
    #[arg(
        long = "state-quota-mib",
        value_name = "STATE_QUOTA_MIB",
        value_parser = mib_to_bytes,
        default_value_t = Config::default().state_quota_bytes >> 20
    )]
    pub state_quota_bytes: u64,
    /// The keys that sign and check session files (pauses, snapshots, exports and
    /// imports): one hex key per line (at least 16 bytes), the first signs, every one
    /// verifies. Nodes that move sessions between them share it. None: the state
    /// directory's own `session.key`, made at its first start (docs/durable.md).
    #[arg(long, alias = "import-key-file", env = "BUD_SESSION_KEY_FILE")]
    pub session_key_file: Option<std::path::PathBuf>,
    /// Hours a file set aside in the state directory's `damaged/` is kept (it counts in
    /// the quota meanwhile); 0: removed at once.
    #[arg(
        long = "damaged-keep-hours",
        value_name = "HOURS",
        value_parser = hours,
        default_value = "24"
    )]
    pub damaged_keep: std::time::Duration,
    /// Session traces in the state directory (docs/evidence.md).
    #[command(flatten)]
    pub trace: crate::core::trace::TraceConfig,
    /// At shutdown, pause the running sessions (to the state directory) instead of ending
    /// them.
    #[arg(long)]
    pub pause_on_shutdown: bool,
    /// This server as one node of many: its id, HAProxy's agent check, Redis.
    #[command(flatten)]
    pub cluster: crate::core::node::ClusterConfig,
    /// User templates built over HTTP: how many at once, how long, how big.
    #[command(flatten)]
    pub builds: crate::core::builds::BuildConfig,
    /// Limits on one session.
    #[command(flatten)]
    pub sessions: SessionLimits,
    /// Limits on one request.
    #[command(flatten)]
    pub limits: Limits,
}

/// The template of a request that names none (when served).
pub const DEFAULT_TEMPLATE: &str = "python";

/// [`Config::retry_after_s`]'s value.
const RETRY_AFTER_S: u64 = 1;

impl Default for Config {
    fn default() -> Self {
        Self {
            workers: default_workers(),
            queue: 64,
            pool_size: 2,
            reuse: vmm::Reuse::Warm,
            verify_resets: false,
            retry_after_s: RETRY_AFTER_S,
            shutdown_grace_s: 10,
            memory_budget_bytes: None,
            jail: crate::core::jail::JailConfig::default(),
            limits: Limits::default(),
            sessions: SessionLimits::default(),
            templates: vec![DEFAULT_TEMPLATE.to_owned()],
            network: false,
            egress_default: EgressDefault::None,
            egress_allow_private: crate::core::egress::Private::default(),
            egress_hosts: None,
            egress_secrets: None,
            egress_ca_dir: None,
            egress_upstream_ca: None,
            egress_max_bytes: None,
            key_max_jobs: None,
            api_keys: None,
            audit: None,
            state_dir: None,
            state_quota_bytes: 20 << 30,
            session_key_file: None,
            damaged_keep: std::time::Duration::from_secs(24 * 3600),
            pause_on_shutdown: false,
            trace: Default::default(),
            cluster: Default::default(),
            builds: Default::default(),
        }
    }
}

/// A duration given in hours (`--damaged-keep-hours`).
fn hours(h: &str) -> Result<std::time::Duration, String> {
    let h: u64 = h
        .parse()
        .map_err(|e: std::num::ParseIntError| e.to_string())?;
    h.checked_mul(3600)
        .map(std::time::Duration::from_secs)
        .ok_or_else(|| format!("{h} hours is too long"))
}

/// One job thread per core.
pub fn default_workers() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
}

/// A configuration that cannot work.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("workers must be at least 1")]
    NoWorkers,
    #[error(
        "code ({code}) + stdin ({stdin}) + args/env ({args_env}) limits exceed the {area} bytes a job can carry"
    )]
    RequestArea {
        code: usize,
        stdin: usize,
        args_env: usize,
        area: usize,
    },
    #[error("the default timeout {default} ms is not within 1..={max} ms")]
    Timeout { default: u64, max: u64 },
    #[error("max_batch_jobs ({batch}) must be 1..={capacity} (workers + queue)")]
    Batch { batch: usize, capacity: usize },
    #[error(
        "key_max_jobs ({quota}) must be at least max_batch_jobs ({batch}) and at most {capacity} (workers + queue)"
    )]
    KeyQuota {
        quota: usize,
        batch: usize,
        capacity: usize,
    },
    #[error("the header and body timeouts must be at least 1 ms")]
    RequestTimes,
    #[error(
        "max_output_bytes must be at least 1, and max_batch_output_bytes at least max_batch_jobs (one byte per job)"
    )]
    Output,
    #[error("at least one template must be served")]
    NoTemplates,
    #[error("template name `{0}` is repeated or not made of a-z, 0-9, - and _")]
    TemplateName(String),
    #[error(
        "session idle timeout and lifetime defaults must be at least 1 s and at most their maximums"
    )]
    SessionTimes,
    #[error("the jail cannot be both off and required (--no-jail with --jail or --user)")]
    Jail,
    #[error("--park-idle-s parks sessions in the state directory: this server has none")]
    ParkWithoutStateDir,
}

/// Whether `name` may name a template: lowercase letters, digits, `-` and `_`, not empty.
pub fn valid_template_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

impl Config {
    /// The template of a request that names none.
    pub fn default_template(&self) -> &str {
        if self.templates.iter().any(|t| t == DEFAULT_TEMPLATE) {
            DEFAULT_TEMPLATE
        } else {
            self.templates
                .first()
                .map_or(DEFAULT_TEMPLATE, String::as_str)
        }
    }

    /// Jobs admitted at once: running plus waiting.
    pub fn capacity(&self) -> usize {
        self.workers + self.queue
    }

    /// Most jobs one API key may have admitted at once: `--key-max-jobs`, or by default
    /// half the capacity when several keys are configured (so one client leaves the other
    /// half to the rest), at least a whole batch; the whole capacity with one key or none.
    pub fn key_quota(&self) -> usize {
        let keys = self.api_keys.as_ref().map_or(0, |k| k.len());
        self.key_max_jobs.unwrap_or(if keys > 1 {
            self.capacity()
                .div_ceil(2)
                .max(self.limits.max_batch_jobs)
                .min(self.capacity())
        } else {
            self.capacity()
        })
    }

    pub fn retry_after(&self) -> Duration {
        Duration::from_secs(self.retry_after_s)
    }

    /// Checks the limits agree with each other and with the guest protocol.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let l = &self.limits;
        if self.workers == 0 {
            return Err(ConfigError::NoWorkers);
        }
        let area = vmm::job::MAX_REQUEST_DATA;
        if l.max_code_bytes + l.max_stdin_bytes + l.max_args_env_bytes > area {
            return Err(ConfigError::RequestArea {
                code: l.max_code_bytes,
                stdin: l.max_stdin_bytes,
                args_env: l.max_args_env_bytes,
                area,
            });
        }
        if l.default_timeout_ms == 0 || l.default_timeout_ms > l.max_timeout_ms {
            return Err(ConfigError::Timeout {
                default: l.default_timeout_ms,
                max: l.max_timeout_ms,
            });
        }
        if l.max_batch_jobs == 0 || l.max_batch_jobs > self.capacity() {
            return Err(ConfigError::Batch {
                batch: l.max_batch_jobs,
                capacity: self.capacity(),
            });
        }
        if let Some(q) = self.key_max_jobs
            && (q < l.max_batch_jobs || q > self.capacity())
        {
            return Err(ConfigError::KeyQuota {
                quota: q,
                batch: l.max_batch_jobs,
                capacity: self.capacity(),
            });
        }
        if l.max_output_bytes == 0 || l.max_batch_output_bytes < l.max_batch_jobs {
            return Err(ConfigError::Output);
        }
        if l.header_timeout_ms == 0 || l.body_timeout_ms == 0 {
            return Err(ConfigError::RequestTimes);
        }
        let s = &self.sessions;
        let ordered = |default: u64, max: u64| default >= 1 && default <= max;
        if !ordered(s.default_idle_timeout_s, s.max_idle_timeout_s)
            || !ordered(s.default_lifetime_s, s.max_lifetime_s)
        {
            return Err(ConfigError::SessionTimes);
        }
        if s.park_idle_s > 0 && self.state_dir.is_none() {
            return Err(ConfigError::ParkWithoutStateDir);
        }
        if !self.jail.is_consistent() {
            return Err(ConfigError::Jail);
        }
        if self.templates.is_empty() {
            return Err(ConfigError::NoTemplates);
        }
        for (i, name) in self.templates.iter().enumerate() {
            if !valid_template_name(name) || self.templates[..i].contains(name) {
                return Err(ConfigError::TemplateName(name.clone()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    /// `bud serve`'s options as the `bud` binary flattens them.
    #[derive(Debug, clap::Parser)]
    struct Serve {
        #[command(flatten)]
        config: Config,
    }

    fn parse(args: &[&str]) -> Result<Config, clap::Error> {
        Serve::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
            .map(|s| s.config)
    }

    #[test]
    fn no_options_give_the_default_config() {
        let parsed = parse(&[]).unwrap();

        assert_eq!(parsed, Config::default());
    }

    #[test]
    fn options_fill_their_fields_with_sizes_in_mib_as_bytes() {
        let parsed = parse(&[
            "--pool",
            "3",
            "--fresh-clones",
            "--templates",
            "python,datascience",
            "--memory-budget-mib",
            "512",
            "--sessions-memory-mib",
            "1024",
            "--session-idle-timeout-s",
            "5",
            "--max-session-lifetime-s",
            "7",
            "--max-code-bytes",
            "9",
        ])
        .unwrap();

        assert_eq!(parsed.pool_size, 3);
        assert_eq!(parsed.reuse, vmm::Reuse::Fresh);
        assert_eq!(parsed.templates, ["python", "datascience"]);
        assert_eq!(parsed.memory_budget_bytes, Some(512 << 20));
        assert_eq!(parsed.sessions.max_memory_bytes, 1 << 30);
        assert_eq!(parsed.sessions.default_idle_timeout_s, 5);
        assert_eq!(parsed.sessions.max_lifetime_s, 7);
        assert_eq!(parsed.limits.max_code_bytes, 9);
    }

    #[test]
    fn no_jail_turns_the_filters_off_and_jail_or_user_require_them() {
        let off = parse(&["--no-jail"]).unwrap();
        let required = parse(&["--jail"]).unwrap();
        let as_user = parse(&["--user", "nobody"]).unwrap();

        assert!(!off.jail.seccomp);
        assert!(required.jail.seccomp && required.jail.requires_seccomp());
        assert!(as_user.jail.seccomp && as_user.jail.requires_seccomp());
    }

    #[test]
    fn no_jail_with_jail_or_user_is_refused() {
        for args in [
            &["--no-jail", "--jail"][..],
            &["--no-jail", "--user", "nobody"],
        ] {
            let e = parse(args).unwrap_err();
            assert_eq!(
                e.kind(),
                clap::error::ErrorKind::ArgumentConflict,
                "{args:?}"
            );
        }
    }

    #[test]
    fn a_jail_both_off_and_required_is_refused() {
        let mut c = Config::default();
        c.jail.seccomp = false;
        c.jail.required = true;

        assert_eq!(c.validate(), Err(ConfigError::Jail));
    }

    #[test]
    fn parking_needs_a_state_directory() {
        let without = parse(&["--park-idle-s", "60"]).unwrap();
        let mut with = without.clone();
        with.state_dir = Some("/tmp/bud-state".into());

        assert_eq!(without.sessions.park_idle_s, 60);
        assert_eq!(without.validate(), Err(ConfigError::ParkWithoutStateDir));
        assert_eq!(with.validate(), Ok(()));
    }

    #[test]
    fn a_size_in_mib_past_what_bytes_can_hold_is_refused() {
        let e = parse(&["--sessions-memory-mib", "99999999999999999"]).unwrap_err();

        assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation);
    }

    #[test]
    fn defaults_are_valid() {
        assert_eq!(Config::default().validate(), Ok(()));
    }

    #[test]
    fn limits_larger_than_the_request_area_are_refused() {
        let mut c = Config::default();
        c.limits.max_stdin_bytes = 2 << 20;

        assert!(matches!(c.validate(), Err(ConfigError::RequestArea { .. })));
    }

    #[test]
    fn a_batch_larger_than_the_admission_capacity_is_refused() {
        let c = Config {
            workers: 1,
            queue: 2,
            ..Config::default()
        };

        assert_eq!(
            c.validate(),
            Err(ConfigError::Batch {
                batch: 16,
                capacity: 3
            })
        );
    }

    #[test]
    fn a_default_timeout_over_the_maximum_is_refused() {
        let mut c = Config::default();
        c.limits.default_timeout_ms = c.limits.max_timeout_ms + 1;

        assert!(matches!(c.validate(), Err(ConfigError::Timeout { .. })));
    }
}
