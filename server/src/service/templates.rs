//! Templates: which engine (and, for the operations not behind the engine's seam yet,
//! which VMM executor) a request runs on, which runtime of its template a job names, and
//! the served templates changed while the server runs.
//!
//! What a template can run is its manifest ([`vmm::Manifest`], written by the image
//! builder): a job's `language` is one of its runtimes (by name or alias), checked here,
//! and the worker runs it as the runtime's [`Language`] says (one-shot jobs, session cells
//! and, for a kernel runtime ([`Language::Kernel`], JavaScript), code contexts alike).
//! Templates are prepared ([`prepare`]) at start and by [`add`] later, from the server's
//! [`TemplateSource`]; [`remove`] stops serving one that no live session runs on.
//!
//! **Whose a template is.** With API keys on, a user template built over HTTP belongs to
//! the key that built it (its name, kept with the template and in the state directory's
//! record): another key's is invisible, answered as a template that does not exist (not
//! listed, 404 for its entry, its build and its `DELETE`, `unknown_template` for a job,
//! batch, session or definition's `from` that names it; the templates an error lists are
//! the caller's to see). The built-in ones (`--templates`), those added with `PUT` and
//! those built without keys are nobody's: every key sees them. Names stay one namespace:
//! a name another key holds is taken (409, naming no key). Without keys every template is
//! every request's. [`may_see`] alone decides; every lookup by a name a request gives
//! goes through [`visible`] ([`engine_for`], [`remove`], [`add`], the builds'), while what
//! exists already (a session's, a paused session's or a snapshot's template) is found with
//! [`served_engine`] (a session's id is what gives it).

use std::sync::Arc;
use std::time::Instant;

use tracing::info;
use vmm::manifest::Runtime;
use vmm::template::Origin;
use vmm::{Executor, Language, Manifest};

use crate::core::config::{Config, valid_template_name};
use crate::core::engine::Engine;
use crate::core::metrics::Rejection;
use crate::core::state::{
    AppState, Moment, SourceError, TemplateInfo, TemplateSource, TemplateState, TemplateStatus,
};
use crate::service::error::Error;

/// Why a template could not be made ready.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error("preparing the template")]
    Template(#[from] SourceError),
    #[error("starting the executor")]
    Executor(#[from] vmm::ExecError),
    #[error("closing the jail")]
    Jail(#[from] crate::core::jail::JailError),
    #[error("after closing the jail")]
    StateDir(#[from] crate::core::durable::DurableError),
}

/// Whether the current request may see a template that belongs to `owner` (an API key's
/// name; None: nobody's): the one place that decides (module docs). Without API keys,
/// always; with them, a template of nobody's or of the request's own key.
pub fn may_see(state: &AppState, owner: Option<&str>) -> bool {
    if state.config().api_keys.is_none() {
        return true;
    }
    owner.is_none_or(|o| crate::core::audit::current_key().as_deref() == Some(o))
}

/// The owner a template made for the current request gets: its API key's name, with keys
/// on; nobody without.
pub fn owner_now(state: &AppState) -> Option<String> {
    state.config().api_keys.as_ref()?;
    crate::core::audit::current_key()
}

/// Whether template `name` is served and the current request may see it.
pub fn visible(state: &AppState, name: &str) -> bool {
    state
        .template_owner(name)
        .is_some_and(|owner| may_see(state, owner.as_deref()))
}

/// Whether template `name` is served for another key than the current request's: its
/// name is taken, and nothing more is said.
pub fn taken_by_another(state: &AppState, name: &str) -> bool {
    state
        .template_owner(name)
        .is_some_and(|owner| !may_see(state, owner.as_deref()))
}

/// The served templates the current request may see, their states, in order.
pub fn visible_templates(state: &AppState) -> Vec<TemplateStatus> {
    let mut all = state.templates();
    all.retain(|t| may_see(state, t.owner.as_deref()));
    all
}

/// The names of the served templates the current request may see, in order: what an
/// error about an unknown template lists.
pub fn visible_names(state: &AppState) -> Vec<String> {
    let mut all = state.template_owners();
    all.retain(|(_, owner)| may_see(state, owner.as_deref()));
    all.into_iter().map(|(name, _)| name).collect()
}

/// 400 `unknown_template` on `field`: `name` is not a template the current request may
/// use, naming those it may.
pub fn unknown(state: &AppState, name: &str, field: &str) -> Error {
    Error::UnknownTemplate {
        name: name.to_owned(),
        served: visible_names(state),
        field: field.into(),
    }
}

/// The engine of template `asked` (`None`: the default one), a name a request gives:
/// unknown if it is not served or not the request's to see ([`may_see`]); not ready (retry
/// later) while it is built or loaded; failed if it could not be.
pub fn engine_for(state: &AppState, asked: Option<&str>) -> Result<Arc<dyn Engine>, Error> {
    let name = state.template_name(asked);
    if !visible(state, name) {
        return Err(unknown(state, name, "template"));
    }
    served_engine(state, name)
}

/// The engine of served template `name` whoever it belongs to: for what exists already (a
/// session's, a paused session's or a snapshot's template), never for a name a request
/// gives ([`engine_for`]). Errors as [`engine_for`]'s.
pub fn served_engine(state: &AppState, name: &str) -> Result<Arc<dyn Engine>, Error> {
    match state.template_state(name) {
        None => Err(unknown(state, name, "template")),
        Some(TemplateState::Ready(e)) => Ok(e),
        Some(TemplateState::Failed(why)) => {
            state.metrics().rejected(Rejection::NotReady);
            Err(Error::TemplateFailed {
                name: name.to_owned(),
                why,
            })
        }
        Some(TemplateState::Building) => {
            state.metrics().rejected(Rejection::NotReady);
            Err(Error::NotReady {
                template: name.to_owned(),
                retry_after: state.config().retry_after(),
            })
        }
    }
}

/// The VMM executor of template `asked`, as [`engine_for`] finds it; a template on a test
/// engine has none.
pub fn executor_for(state: &AppState, asked: Option<&str>) -> Result<Arc<Executor>, Error> {
    executor_of_engine(engine_for(state, asked)?)
}

/// The VMM executor of served template `name`, as [`served_engine`] finds it (whoever it
/// belongs to: for what exists already).
pub fn served_executor(state: &AppState, name: &str) -> Result<Arc<Executor>, Error> {
    executor_of_engine(served_engine(state, name)?)
}

fn executor_of_engine(engine: Arc<dyn Engine>) -> Result<Arc<Executor>, Error> {
    engine
        .executor()
        .cloned()
        .ok_or_else(|| Error::internal("this template's engine has no VMM"))
}

/// The default template's executor.
pub fn default_executor(state: &AppState) -> Result<Arc<Executor>, Error> {
    executor_for(state, None)
}

/// The runtime `asked` of the template `engine` serves (how the worker runs it), by its name or an
/// alias (`None`: its default runtime, the manifest's first): 400 on `field` naming the
/// template's runtimes when it has no such runtime. One-shot jobs, a session's cells (its
/// default and a cell's own `language`) and sessions resolve their runtime here alike.
pub fn runtime<'e>(
    engine: &'e dyn Engine,
    asked: Option<&str>,
    field: &str,
) -> Result<&'e Runtime, Error> {
    let manifest = engine.manifest();
    let found = match asked {
        Some(name) => manifest.runtime(name),
        None => manifest.default_runtime(),
    };
    found.ok_or_else(|| no_runtime(manifest, asked, field))
}

/// 400 on `field`: the template of `manifest` has no runtime `asked` (`None`: none at all),
/// naming the runtimes it has.
pub fn no_runtime(manifest: &Manifest, asked: Option<&str>, field: &str) -> Error {
    Error::invalid(
        field,
        format!(
            "template {} has no runtime {}; its runtimes: {}",
            manifest.name,
            asked.map_or_else(|| "at all".to_owned(), |a| format!("{a:?}")),
            runtime_list(manifest),
        ),
    )
}

/// The runtimes of `manifest` as a message names them, each with its aliases:
/// `javascript (js, node), python, shell` (`none` for none).
pub fn runtime_list(manifest: &Manifest) -> String {
    if manifest.runtimes.is_empty() {
        return "none".to_owned();
    }
    let each = manifest
        .runtimes
        .iter()
        .map(|r| match r.aliases.as_slice() {
            [] => r.name.clone(),
            aliases => format!("{} ({})", r.name, aliases.join(", ")),
        });
    each.collect::<Vec<_>>().join(", ")
}

/// The name of the runtime a session's cells run in by default, as its API shows it: the
/// first runtime of `manifest` the worker runs as `language` in `dialect` (`python`,
/// `shell`, `javascript`, `typescript`), or the mode's own name without one (a template no
/// longer served).
pub fn runtime_name(manifest: Option<&Manifest>, language: Language, dialect: u32) -> String {
    let runs = |r: &&Runtime| r.run == language && r.dialect == dialect;
    manifest
        .and_then(|m| m.runtimes.iter().find(runs))
        .map_or_else(|| language.name().to_owned(), |r| r.name.clone())
}

/// Gets template `name` from `source` at `moment`, then starts its executor.
pub fn prepare(
    source: &TemplateSource,
    name: &str,
    moment: Moment,
    config: &Config,
) -> Result<(Executor, TemplateInfo), PrepareError> {
    let started = Instant::now();
    info!(
        template = name,
        "loading the template (a first build boots the guest: minutes)"
    );
    let (template, template_info) = source(name, moment)?;
    match template.origin() {
        Origin::Built {
            boot,
            capture,
            write,
        } => info!(
            template = name,
            dir = %template.dir().display(),
            ready_s = boot.to_ready.as_secs_f64(),
            capture_ms = capture.as_secs_f64() * 1e3,
            write_ms = write.as_secs_f64() * 1e3,
            "template built"
        ),
        Origin::Derived {
            layer,
            capture,
            write,
        } => info!(
            template = name,
            dir = %template.dir().display(),
            layer_s = layer.as_secs_f64(),
            capture_ms = capture.as_secs_f64() * 1e3,
            write_ms = write.as_secs_f64() * 1e3,
            "template made from its parent's snapshot"
        ),
        Origin::Loaded { load } => info!(
            template = name,
            dir = %template.dir().display(),
            load_ms = load.as_secs_f64() * 1e3,
            "template loaded"
        ),
    }
    let executor = Executor::new(
        template,
        vmm::ExecutorOptions {
            pool_size: config.pool_size,
            reuse: config.reuse,
            verify: config.verify_resets,
            // Warm VMs for every job thread and the pool; a session's VM past that is
            // closed at its end.
            max_idle: config.pool_size + config.workers,
            ..vmm::ExecutorOptions::default()
        },
    )?;
    info!(
        template = name,
        pool = config.pool_size,
        runtimes = executor.template().manifest().runtime_names().join(","),
        total_s = started.elapsed().as_secs_f64(),
        "ready for jobs"
    );
    Ok((executor, template_info))
}

/// Whether a template was added now or was served already.
#[derive(Debug)]
pub enum Added {
    Now(TemplateStatus),
    Already(TemplateStatus),
}

/// Serves template `name` from now on: loads it from the server's source (its guest must be
/// built; its template is loaded, or booted on first use) and waits until it is ready;
/// nobody's (every key's to see). A template served already is left as it is; one served
/// for another key is taken (409, naming no key); with API keys, a user template is refused
/// (400: its key POSTs its definition). Refused once the jail's filters are on
/// (the jail never closes while one is loaded: [`AppState::fix_templates_if`]).
pub async fn add(state: &AppState, name: &str) -> Result<Added, Error> {
    if !valid_template_name(name) {
        return Err(Error::invalid(
            "name",
            "a template name is lowercase letters, digits, '-' and '_'",
        ));
    }
    if taken_by_another(state, name) {
        return Err(taken(name));
    }
    let status = |state: &AppState| state.templates().into_iter().find(|t| t.name == name);
    let source = state
        .template_source()
        .cloned()
        .ok_or_else(|| Error::NoTemplate("this server has no source of templates".into()))?;
    if !state.add_template(name, None) {
        return Ok(Added::Already(status(state).ok_or_else(|| gone(name))?));
    }
    let (st, owned) = (state.clone(), name.to_owned());
    let prepared = tokio::task::spawn_blocking(move || {
        st.while_adding(|| prepare(&source, &owned, Moment::Added, st.config()))
    })
    .await
    .map_err(Error::internal)?;
    match prepared {
        None => {
            state.remove_template(name);
            Err(Error::Jailed)
        }
        Some(Ok((_, info))) if let Some(refused) = added_by_name(state, name, &info) => {
            state.remove_template(name);
            Err(refused)
        }
        Some(Ok((executor, info))) => {
            state.set_template(name, Arc::new(executor), info);
            Ok(Added::Now(status(state).ok_or_else(|| gone(name))?))
        }
        // Not served after all: a later PUT tries again.
        Some(Err(PrepareError::Template(SourceError::NotFound(why)))) => {
            state.remove_template(name);
            Err(Error::NoTemplate(why))
        }
        Some(Err(e)) => {
            let why = crate::core::error_chain(&e);
            tracing::error!(template = %name, "{why}");
            state.remove_template(name);
            Err(Error::TemplateFailed {
                name: name.to_owned(),
                why,
            })
        }
    }
}

/// Why template `name`, loaded as `info` says, may not be served by name (`PUT`): with API
/// keys, a user template is its key's, and one added by name would be every key's (whoever
/// asks could serve another key's deleted template to all); its key POSTs its definition
/// instead. None: it may.
fn added_by_name(state: &AppState, name: &str, info: &TemplateInfo) -> Option<Error> {
    (info.user && state.config().api_keys.is_some()).then(|| {
        Error::invalid(
            "name",
            format!(
                "{name} is a user template: with API keys, POST its definition to \
                 /v1/templates to serve it as your key's (a definition built before is served \
                 from the cache)"
            ),
        )
    })
}

fn gone(name: &str) -> Error {
    Error::NoTemplate(format!("template {name} was removed meanwhile"))
}

/// 409: template `name` is another key's (and which is not said).
pub fn taken(name: &str) -> Error {
    Error::TemplateExists(format!(
        "the name {name} is taken on this server; give yours another name"
    ))
}

/// Ids named in a refusal, at most.
const NAMED: usize = 10;

/// `what` and its ids (the first [`NAMED`], then how many more), or None if there are none.
fn naming(what: &str, mut ids: Vec<String>) -> Option<String> {
    if ids.is_empty() {
        return None;
    }
    ids.sort();
    let more = ids.len().saturating_sub(NAMED);
    ids.truncate(NAMED);
    let tail = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    Some(format!("{what} {}{tail}", ids.join(", ")))
}

/// Stops serving template `name`: refused for the default template, and while a session
/// runs on it or a paused session or a snapshot was made on it (sessions are not drained:
/// they are the client's to end; a paused file would no longer resume): the 409 names them.
/// Jobs already admitted on it finish; its executor goes with the last of them.
pub fn remove(state: &AppState, name: &str) -> Result<(), Error> {
    if !visible(state, name) {
        return Err(Error::NoTemplate(format!(
            "template {name} is not served; this server serves: {}",
            visible_names(state).join(", ")
        )));
    }
    if name == state.config().default_template() {
        return Err(Error::TemplateInUse(format!(
            "template {name} is the server's default"
        )));
    }
    let live: Vec<String> = state
        .sessions()
        .list()
        .iter()
        .filter(|s| s.template == name)
        .map(|s| s.id.clone())
        .collect();
    let (paused, snapshots) = match state.state_dir() {
        Some(dir) => (
            dir.paused()
                .list()
                .into_iter()
                .filter(|p| p.record.template == name)
                .map(|p| p.record.id)
                .collect(),
            dir.snapshots()
                .list()
                .into_iter()
                .filter(|s| s.record.template == name)
                .map(|s| s.record.id)
                .collect(),
        ),
        None => (Vec::new(), Vec::new()),
    };
    let needs: Vec<String> = [
        naming("live session(s)", live),
        naming("paused session(s)", paused),
        naming("snapshot(s)", snapshots),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !needs.is_empty() {
        return Err(Error::TemplateInUse(format!(
            "template {name} is needed by {}: end the sessions and delete the paused ones and the snapshots first",
            needs.join("; ")
        )));
    }
    state.remove_template(name);
    // A user template this server built is no longer served after a restart either.
    if let Some(dir) = state.state_dir()
        && crate::core::builds::recorded(dir.root())
            .iter()
            .any(|n| n == name)
        && let Err(e) = crate::core::builds::forget(dir.root(), name)
    {
        tracing::warn!(
            template = name,
            "cannot update the record of user templates: {e}"
        );
    }
    info!(template = name, "template removed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{added_by_name, naming};
    use crate::core::config::Config;
    use crate::core::keys::ApiKeys;
    use crate::core::state::{AppState, TemplateInfo};

    #[test]
    fn with_keys_a_user_template_is_not_served_by_name_and_a_built_in_one_is() {
        let keys = ApiKeys::parse("alice 0123456789abcdef0123456789abcdef").unwrap();
        let keyed = AppState::new(
            Config {
                api_keys: Some(Arc::new(keys)),
                ..Config::default()
            },
            None,
        )
        .unwrap();
        let open = AppState::new(Config::default(), None).unwrap();
        let (user, built_in) = (
            TemplateInfo {
                user: true,
                ..TemplateInfo::default()
            },
            TemplateInfo::default(),
        );

        let refused = added_by_name(&keyed, "report", &user).expect("refused");

        assert_eq!(refused.field(), Some("name"));
        assert_eq!(
            refused.to_string(),
            "report is a user template: with API keys, POST its definition to /v1/templates to \
             serve it as your key's (a definition built before is served from the cache)"
        );
        assert!(added_by_name(&keyed, "tools", &built_in).is_none());
        assert!(added_by_name(&open, "report", &user).is_none());
    }

    #[test]
    fn a_refusal_names_the_first_ids_in_order_and_counts_the_rest() {
        let ids = |n: usize| (0..n).map(|i| format!("ses_{i:02}")).collect::<Vec<_>>();

        assert_eq!(naming("snapshot(s)", vec![]), None);
        assert_eq!(
            naming("paused session(s)", vec!["ses_b".into(), "ses_a".into()]).unwrap(),
            "paused session(s) ses_a, ses_b"
        );
        assert_eq!(
            naming("live session(s)", ids(13)).unwrap(),
            "live session(s) ses_00, ses_01, ses_02, ses_03, ses_04, ses_05, ses_06, ses_07, ses_08, ses_09 and 3 more"
        );
    }
}
