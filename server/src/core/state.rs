//! What every handler shares: the configuration, one executor per served template (once
//! it is ready), the job threads and the metrics.
//!
//! The server answers before its templates exist (health says `starting`, jobs get 503 with
//! `Retry-After`); [`AppState::set_template`] makes one ready, [`AppState::template_failed`]
//! records why one never will be. The served templates are not fixed at start:
//! [`AppState::add_template`] and [`AppState::remove_template`] change them while the
//! server runs (the service decides when, `crate::service::templates`), and
//! [`TemplateSource`] is where a template comes from. What a template can run is its
//! manifest ([`vmm::Manifest`]), read through its executor's template.
//!
//! This is the core's data, read by the service ([`crate::service`]) and the edges; it
//! decides nothing and names no API dialect.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use vmm::Executor;
use vmm::manifest::{Kernel, Manifest, Network, Runtime};

use crate::core::engine::Engine;

use crate::core::config::{Config, ConfigError};
use crate::core::jobs::JobThreads;
use crate::core::metrics::{Gauges, Metrics};

/// What `GET /v1/templates` tells about a template besides its state: from its image.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct TemplateInfo {
    /// Size of the initramfs, bytes.
    pub image_bytes: u64,
    /// The Debian packages of its image, name to version (its manifest's).
    pub packages: BTreeMap<String, String>,
    /// A user template (a stored definition), not one of bud's own.
    pub user: bool,
}

/// When a template is asked of a [`TemplateSource`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moment {
    /// While the server starts (before the jail closes): a missing guest build is built.
    Start,
    /// Added to a running server: only an existing guest build is used, never built.
    Added,
    /// A user template the builder process just built and booted: only loaded, never
    /// booted (the server may be jailed).
    Built,
}

/// Why a [`TemplateSource`] gave no template.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// There is no such template to load (no guest build of it).
    #[error("{0}")]
    NotFound(String),
    #[error(transparent)]
    Failed(Box<dyn std::error::Error + Send + Sync>),
}

/// Produces the named template and what its image holds (the `bud` binary passes
/// `bud_templates::template`). Called on a thread of its own: a first call may boot the
/// template (seconds to minutes), and at [`Moment::Start`] build its guest.
pub type TemplateSource =
    Arc<dyn Fn(&str, Moment) -> Result<(vmm::Template, TemplateInfo), SourceError> + Send + Sync>;

/// Where a served template is.
#[derive(Debug, Clone)]
pub enum TemplateState {
    Building,
    Ready(Arc<dyn Engine>),
    Failed(String),
}

/// The server's [`TemplateSource`] (a closure, shown by name only).
struct Source(TemplateSource);

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TemplateSource")
    }
}

/// One served template.
#[derive(Debug)]
struct Served {
    name: String,
    /// The API key's name of a user template built under keys (None: nobody's, every
    /// key's to see: `crate::service::templates::may_see`).
    owner: Option<String>,
    engine: OnceLock<Arc<dyn Engine>>,
    info: OnceLock<TemplateInfo>,
    failed: OnceLock<String>,
}

impl Served {
    fn new(name: &str, owner: Option<String>) -> Arc<Self> {
        Arc::new(Self {
            name: name.to_owned(),
            owner,
            engine: OnceLock::new(),
            info: OnceLock::new(),
            failed: OnceLock::new(),
        })
    }

    fn state(&self) -> TemplateState {
        match (self.engine.get(), self.failed.get()) {
            (Some(e), _) => TemplateState::Ready(e.clone()),
            (None, Some(why)) => TemplateState::Failed(why.clone()),
            (None, None) => TemplateState::Building,
        }
    }
}

/// A served template's state, as `GET /v1/templates` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TemplateStatus {
    pub name: String,
    /// `ready`, `building` or `failed`.
    pub status: &'static str,
    pub default: bool,
    /// The API key's name of a user template built under keys (only its owner sees it);
    /// absent for nobody's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(flatten)]
    pub info: TemplateInfo,
    /// Guest RAM of its VMs, bytes.
    pub ram_bytes: Option<u64>,
    /// Size of the template's memory file (the snapshot every VM maps), bytes.
    pub memory_file_bytes: Option<u64>,
    /// From its manifest, once it is ready: the runtimes a job may name (the default first).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtimes: Option<Vec<Runtime>>,
    /// Its code-context kernels.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernels: Option<Vec<Kernel>>,
    /// Programs on its guest's `PATH` besides the runtimes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<Network>,
    /// The Python packages a user template's wheels put in, name to version.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub python_packages: Option<std::collections::BTreeMap<String, String>>,
    /// The npm packages of its image (`node` and user templates from it), name to version.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub npm_packages: Option<std::collections::BTreeMap<String, String>>,
}

#[derive(Debug)]
struct Shared {
    config: Config,
    /// The served templates, in the order they were configured or added.
    templates: RwLock<Vec<Arc<Served>>>,
    source: OnceLock<Source>,
    /// Held while a template is added, and while the jail closes; true once the jail's
    /// filters are on, after which no template is added with `PUT` (adding one may boot
    /// it, which the filters do not allow; a user template built by the builder process is
    /// only loaded, which they do).
    fixed: Mutex<bool>,
    jobs: JobThreads,
    metrics: Arc<Metrics>,
    sessions: Arc<crate::core::sessions::Sessions>,
    audit: Option<crate::core::audit::AuditLog>,
    state_dir: Option<Arc<crate::core::durable::StateDir>>,
    /// Session traces (in the state directory, unless `--no-trace`).
    traces: Option<Arc<crate::core::trace::Traces>>,
    node: Arc<crate::core::node::Node>,
    registry: Option<Arc<crate::core::registry::Registry>>,
    /// What the operator decides for every sandbox's network (`--egress-*`).
    egress_site: Arc<crate::core::egress::Site>,
    /// User templates built while the server runs, and who builds them.
    builds: crate::core::builds::Builds,
    builder: OnceLock<Arc<dyn crate::core::builds::Builder>>,
    /// The dialects' rules for their saved attachments, checked on records from outside.
    attachment_rules: RwLock<Vec<Arc<dyn crate::core::sessions::AttachmentRules>>>,
}

/// Cheap to clone: one `Arc`.
#[derive(Debug, Clone)]
pub struct AppState(Arc<Shared>);

/// Why a state could not be made.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("invalid configuration")]
    Config(#[from] ConfigError),
    #[error("cannot start the job threads: {0}")]
    Threads(std::io::Error),
    #[error("cannot start the audit writer: {0}")]
    Audit(std::io::Error),
    #[error(transparent)]
    StateDir(#[from] crate::core::durable::DurableError),
    #[error(transparent)]
    Registry(#[from] crate::core::registry::RegistryError),
    #[error(transparent)]
    EgressHosts(#[from] crate::core::egress::HostsError),
    #[error("--egress-secrets")]
    EgressSecrets(#[from] crate::core::egress::SecretsError),
    #[error(transparent)]
    Intercept(#[from] crate::core::egress::InterceptError),
    #[error(transparent)]
    Traces(#[from] crate::core::trace::TraceError),
}

impl AppState {
    /// How many handles on this server are alive (a test waits for its own to be the last).
    #[cfg(test)]
    pub(crate) fn handles(&self) -> usize {
        Arc::strong_count(&self.0)
    }

    /// A state with its job threads running; ready for jobs once it has an executor.
    pub fn new(config: Config, executor: Option<Arc<Executor>>) -> Result<Self, StateError> {
        config.validate()?;
        let jobs = JobThreads::start(config.workers, config.capacity(), config.key_quota())
            .map_err(StateError::Threads)?;
        // The user templates this server built keep their owners (its state directory's
        // record of them: `crate::core::builds::RECORD_FILE`).
        let owners = config
            .state_dir
            .as_deref()
            .map(crate::core::builds::recorded_owned)
            .unwrap_or_default();
        let owner_of = |name: &str| {
            owners
                .iter()
                .find(|r| r.name == name)
                .and_then(|r| r.owner.clone())
        };
        let templates: Vec<Arc<Served>> = config
            .templates
            .iter()
            .map(|name| Served::new(name, owner_of(name)))
            .collect();
        if let (Some(e), Some(t)) = (
            executor,
            templates
                .iter()
                .find(|t| t.name == config.default_template()),
        ) {
            let _ = t.engine.set(Arc::new(e));
        }
        let audit = match &config.audit {
            Some(a) => {
                Some(crate::core::audit::AuditLog::start(a.clone()).map_err(StateError::Audit)?)
            }
            None => None,
        };
        let sessions: Arc<crate::core::sessions::Sessions> = Arc::default();
        let node = Arc::new(crate::core::node::Node::of(&config.cluster));
        let registry = match &config.cluster.redis {
            Some(url) => Some(Arc::new(crate::core::registry::Registry::new(url)?)),
            None => None,
        };
        sessions.use_node(node.clone());
        let state_dir = match &config.state_dir {
            Some(root) => {
                let opts = crate::core::durable::StateOptions {
                    quota: config.state_quota_bytes,
                    key_file: config.session_key_file.clone(),
                    damaged_keep: config.damaged_keep,
                };
                let (dir, found) = crate::core::durable::StateDir::open(root, &opts)?;
                for (path, why) in &found.damaged {
                    tracing::warn!(path = %path.display(), why, "set aside a damaged state file");
                }
                if !found.lost.is_empty() {
                    tracing::warn!(
                        count = found.lost.len(),
                        "sessions were running when the last server on this state directory stopped: lost"
                    );
                }
                let dir = Arc::new(dir);
                sessions.use_state_dir(dir.clone(), &found.lost);
                Some((dir, found.lost))
            }
            None => None,
        };
        let traces = match &state_dir {
            Some((dir, lost)) if !config.trace.off => {
                let t = Arc::new(crate::core::trace::Traces::open(
                    dir.root(),
                    config.trace.clone(),
                    dir.keys().clone(),
                )?);
                for id in lost {
                    t.end(
                        id,
                        "lost",
                        Some("the server stopped while this session was running"),
                    );
                }
                sessions.use_traces(t.clone());
                Some(t)
            }
            _ => None,
        };
        let state_dir = state_dir.map(|(dir, _)| dir);
        let egress_site = Arc::new(crate::core::egress::Site {
            hosts: match &config.egress_hosts {
                Some(path) => crate::core::egress::Hosts::load(path)?,
                None => crate::core::egress::Hosts::default(),
            },
            private: config.egress_allow_private.clone(),
            listeners: Arc::default(),
            max_bytes: config.egress_max_bytes,
            totals: Arc::default(),
            audit: audit.clone(),
            traces: traces.clone(),
            secrets: Arc::new(match &config.egress_secrets {
                Some(path) => crate::core::egress::Secrets::load(path)?,
                None => crate::core::egress::Secrets::default(),
            }),
            intercept: match &config.egress_ca_dir {
                Some(dir) => Some(Arc::new(crate::core::egress::Interceptor::new(
                    dir,
                    config.egress_upstream_ca.as_deref(),
                )?)),
                None => None,
            },
        });
        Ok(Self(Arc::new(Shared {
            config,
            templates: RwLock::new(templates),
            source: OnceLock::new(),
            fixed: Mutex::new(false),
            jobs,
            metrics: Arc::default(),
            sessions,
            audit,
            state_dir,
            traces,
            node,
            registry,
            egress_site,
            builds: Default::default(),
            builder: OnceLock::new(),
            attachment_rules: RwLock::default(),
        })))
    }

    /// Adds a dialect's rules for its saved attachments (the compat layer's, at start).
    pub fn add_attachment_rules(&self, rules: Arc<dyn crate::core::sessions::AttachmentRules>) {
        self.0
            .attachment_rules
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(rules);
    }

    /// Every dialect's rules for its saved attachments.
    pub fn attachment_rules(&self) -> Vec<Arc<dyn crate::core::sessions::AttachmentRules>> {
        self.0
            .attachment_rules
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The builds of user templates (`POST /v1/templates`).
    pub fn builds(&self) -> &crate::core::builds::Builds {
        &self.0.builds
    }

    /// Who builds user templates, if the server was given a builder (set once, at start).
    pub fn builder(&self) -> Option<&Arc<dyn crate::core::builds::Builder>> {
        self.0.builder.get()
    }

    /// Sets the builder of user templates (once; a second call is ignored).
    pub fn set_builder(&self, builder: Arc<dyn crate::core::builds::Builder>) {
        let _ = self.0.builder.set(builder);
    }

    /// What the operator decides for every sandbox's network.
    pub fn egress_site(&self) -> &Arc<crate::core::egress::Site> {
        &self.0.egress_site
    }

    /// This server as a node of a cluster: its id, drain state, hand-overs.
    pub fn node(&self) -> &Arc<crate::core::node::Node> {
        &self.0.node
    }

    /// The cluster's sandbox registry (`--redis`), if the server has one.
    pub fn registry(&self) -> Option<&Arc<crate::core::registry::Registry>> {
        self.0.registry.as_ref()
    }

    /// The session traces, if the server keeps them.
    pub fn traces(&self) -> Option<&Arc<crate::core::trace::Traces>> {
        self.0.traces.as_ref()
    }

    /// Appends an event to session `id`'s trace (no-op without traces); `data` gets the
    /// session's output budget ([`crate::core::trace::Traces::record`]).
    pub fn trace(&self, id: &str, kind: &str, data: impl FnOnce(&mut u64) -> serde_json::Value) {
        if let Some(t) = self.traces() {
            t.record(id, kind, data);
        }
    }

    /// The state directory, if the server has one.
    pub fn state_dir(&self) -> Option<&Arc<crate::core::durable::StateDir>> {
        self.0.state_dir.as_ref()
    }

    pub fn config(&self) -> &Config {
        &self.0.config
    }

    pub fn metrics(&self) -> &Metrics {
        &self.0.metrics
    }

    /// The metrics, to record from a job thread.
    pub fn metrics_handle(&self) -> Arc<Metrics> {
        self.0.metrics.clone()
    }

    /// The live sessions.
    pub fn sessions(&self) -> &Arc<crate::core::sessions::Sessions> {
        &self.0.sessions
    }

    /// The audit log, when configured.
    pub fn audit(&self) -> Option<&crate::core::audit::AuditLog> {
        self.0.audit.as_ref()
    }

    /// Queues the audit record of a background process's start (no-op without an audit
    /// log).
    pub fn audit_process(&self, origin: &crate::core::audit::Origin, script: &[u8]) {
        if let Some(a) = self.audit() {
            a.process(origin, script);
        }
    }

    /// Queues the audit record of `job` (no-op without an audit log). On a job thread.
    pub fn audit_job(
        &self,
        origin: &crate::core::audit::Origin,
        kind: &str,
        job: &vmm::Job,
        r: &vmm::JobResult,
        waited: std::time::Duration,
    ) {
        if let Some(a) = self.audit() {
            a.job(origin, kind, job, r, waited);
        }
    }

    pub fn jobs(&self) -> &JobThreads {
        &self.0.jobs
    }

    /// Makes template `name` ready. Returns `false` (and drops `e`) if it is not served or
    /// already had one.
    pub fn set_template(&self, name: &str, e: Arc<Executor>, info: TemplateInfo) -> bool {
        self.set_engine(name, Arc::new(e), info)
    }

    /// Makes template `name` ready on `engine` (the VMM's, or a test's). Returns `false`
    /// (and drops it) if it is not served or already had one.
    pub fn set_engine(&self, name: &str, engine: Arc<dyn Engine>, info: TemplateInfo) -> bool {
        let Some(t) = self.served(name) else {
            return false;
        };
        let _ = t.info.set(info);
        t.engine.set(engine).is_ok()
    }

    /// Records that template `name` could not be prepared.
    pub fn template_failed(&self, name: &str, why: String) {
        if let Some(t) = self.served(name) {
            let _ = t.failed.set(why);
        }
    }

    /// Serves template `name` from now on, as `building` until [`AppState::set_template`];
    /// `owner`'s (an API key's name) or nobody's. Returns `false` if it is served already.
    pub fn add_template(&self, name: &str, owner: Option<&str>) -> bool {
        let mut all = self.0.templates.write().unwrap_or_else(|p| p.into_inner());
        if all.iter().any(|t| t.name == name) {
            return false;
        }
        all.push(Served::new(name, owner.map(str::to_owned)));
        true
    }

    /// Whether template `name` is served, and whose it is: `Some(None)` for nobody's (a
    /// template of `--templates`, one added with `PUT`, one built without keys).
    pub fn template_owner(&self, name: &str) -> Option<Option<String>> {
        Some(self.served(name)?.owner.clone())
    }

    /// The served templates' names with their owners, in order.
    pub fn template_owners(&self) -> Vec<(String, Option<String>)> {
        self.all_served()
            .iter()
            .map(|t| (t.name.clone(), t.owner.clone()))
            .collect()
    }

    /// Stops serving template `name`; returns the state it was in (jobs that hold its
    /// executor finish with it), or `None` if it was not served.
    pub fn remove_template(&self, name: &str) -> Option<TemplateState> {
        let mut all = self.0.templates.write().unwrap_or_else(|p| p.into_inner());
        let at = all.iter().position(|t| t.name == name)?;
        Some(all.remove(at).state())
    }

    /// Runs `add` (the loading of an added template) unless the served templates are fixed
    /// (`None`); no jail closes meanwhile.
    pub fn while_adding<R>(&self, add: impl FnOnce() -> R) -> Option<R> {
        let fixed = self.0.fixed.lock().unwrap_or_else(|p| p.into_inner());
        (!*fixed).then(add)
    }

    /// Runs `close` (closing the jail) once no template is being added; the served
    /// templates are fixed from then on if it returns true (the filters are on).
    pub fn fix_templates_if(&self, close: impl FnOnce() -> bool) {
        let mut fixed = self.0.fixed.lock().unwrap_or_else(|p| p.into_inner());
        *fixed = close();
    }

    /// Where templates come from (set once, at start).
    pub fn set_template_source(&self, source: TemplateSource) {
        let _ = self.0.source.set(Source(source));
    }

    /// Where templates come from, if the server was given a source.
    pub fn template_source(&self) -> Option<&TemplateSource> {
        self.0.source.get().map(|s| &s.0)
    }

    /// The manifest of template `name`, once it is ready.
    pub fn template_manifest(&self, name: &str) -> Option<Manifest> {
        let e = self.served(name)?.engine.get()?.clone();
        Some(e.manifest().clone())
    }

    /// Whether template `name` has program `tool` on its guest's `PATH` (known once it is
    /// ready; its manifest's `tools`).
    pub fn template_has_tool(&self, name: &str, tool: &str) -> bool {
        self.served(name)
            .and_then(|t| t.engine.get().cloned())
            .is_some_and(|e| e.manifest().has_tool(tool))
    }

    fn served(&self, name: &str) -> Option<Arc<Served>> {
        let all = self.0.templates.read().unwrap_or_else(|p| p.into_inner());
        all.iter().find(|t| t.name == name).cloned()
    }

    fn all_served(&self) -> Vec<Arc<Served>> {
        self.0
            .templates
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The served templates' names, in order.
    pub fn template_names(&self) -> Vec<String> {
        self.all_served().iter().map(|t| t.name.clone()).collect()
    }

    /// The name a request's `template` resolves to: its own, or the default one.
    pub fn template_name<'a>(&'a self, asked: Option<&'a str>) -> &'a str {
        asked.unwrap_or_else(|| self.config().default_template())
    }

    /// The state of template `name`, or None if it is not served.
    pub fn template_state(&self, name: &str) -> Option<TemplateState> {
        Some(self.served(name)?.state())
    }

    /// The default template's engine if it is ready (no rejection counted).
    pub fn engine_if_ready(&self) -> Option<Arc<dyn Engine>> {
        self.served(self.config().default_template())
            .and_then(|t| t.engine.get().cloned())
    }

    /// The default template's VMM executor if it is ready (none on a test engine).
    pub fn executor_if_ready(&self) -> Option<Arc<Executor>> {
        self.engine_if_ready()?.executor().cloned()
    }

    /// Every ready template's engine, by name.
    pub fn ready_engines(&self) -> Vec<(String, Arc<dyn Engine>)> {
        self.all_served()
            .iter()
            .filter_map(|t| Some((t.name.clone(), t.engine.get()?.clone())))
            .collect()
    }

    /// Every ready template's VMM executor, by name (none on a test engine).
    pub fn ready_executors(&self) -> Vec<(String, Arc<Executor>)> {
        self.ready_engines()
            .into_iter()
            .filter_map(|(n, e)| Some((n, e.executor()?.clone())))
            .collect()
    }

    /// The served templates and their states, in order.
    pub fn templates(&self) -> Vec<TemplateStatus> {
        let default = self.config().default_template();
        self.all_served()
            .iter()
            .map(|t| {
                let e = t.engine.get();
                let manifest = e.map(|e| e.manifest());
                TemplateStatus {
                    name: t.name.clone(),
                    status: match (e, t.failed.get()) {
                        (Some(_), _) => "ready",
                        (None, Some(_)) => "failed",
                        (None, None) => "building",
                    },
                    default: t.name == default,
                    owner: t.owner.clone(),
                    error: t.failed.get().cloned(),
                    info: t.info.get().cloned().unwrap_or_default(),
                    ram_bytes: e.map(|e| e.sizes().0),
                    memory_file_bytes: e.map(|e| e.sizes().1),
                    runtimes: manifest.map(|m| m.runtimes.clone()),
                    kernels: manifest.map(|m| m.kernels.clone()),
                    tools: manifest.map(|m| m.tools.clone()),
                    network: manifest.map(|m| m.network),
                    python_packages: manifest
                        .map(|m| m.python_packages.clone())
                        .filter(|p| !p.is_empty()),
                    npm_packages: manifest
                        .map(|m| m.npm_packages.clone())
                        .filter(|p| !p.is_empty()),
                }
            })
            .collect()
    }

    /// Stops admitting jobs and waits for the job threads to finish what they hold.
    pub fn drain(&self) {
        self.0.jobs.join();
    }

    pub fn gauges(&self) -> Gauges {
        // Every ready template's VMs together; the server is ready with its default one.
        let ready = self.ready_engines();
        let stats = self.engine_if_ready().map(|_| {
            let mut sum = vmm::executor::ExecutorStats::default();
            for (_, e) in &ready {
                sum += e.stats();
            }
            sum
        });
        Gauges {
            workers: self.config().workers,
            queue_capacity: self.0.jobs.capacity(),
            jobs_running: self.0.jobs.running(),
            jobs_queued: self.0.jobs.queued(),
            pool_size: stats.map_or(self.config().pool_size, |s| s.pool_size),
            pool_ready: stats.map_or(0, |s| s.ready),
            live_clones: stats.map_or(0, |s| s.live),
            warm_vms: stats.map_or(0, |s| s.warm),
            template_ready: stats.is_some(),
            executor: stats.unwrap_or_default(),
            sessions: self.0.sessions.gauges(),
            audit: self.audit().map(|a| {
                let s = &a.state;
                (
                    s.written.load(std::sync::atomic::Ordering::Relaxed),
                    s.dropped.load(std::sync::atomic::Ordering::Relaxed),
                    s.failing(),
                )
            }),
            egress: Some(self.0.egress_site.totals.gauges()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> AppState {
        AppState::new(Config::default(), None).unwrap()
    }

    #[test]
    fn templates_are_added_and_removed_by_name_in_order() {
        let s = state();

        let added = s.add_template("tools", None);
        let again = s.add_template("tools", Some("alice"));
        let names = s.template_names();
        let removed = s.remove_template("tools");
        let twice = s.remove_template("tools");

        assert!(added && !again);
        assert_eq!(names, ["python", "tools"]);
        assert!(matches!(removed, Some(TemplateState::Building)));
        assert!(twice.is_none());
        assert_eq!(s.template_names(), ["python"]);
    }

    #[test]
    fn no_template_is_added_once_the_jails_filters_are_on() {
        let open = state();
        let jailed = state();

        open.fix_templates_if(|| false);
        jailed.fix_templates_if(|| true);

        assert_eq!(open.while_adding(|| 1), Some(1));
        assert_eq!(jailed.while_adding(|| 1), None);
    }
}
