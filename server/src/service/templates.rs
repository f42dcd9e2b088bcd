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

/// The engine of template `asked` (`None`: the default one): unknown if it is not
/// served; not ready (retry later) while it is built or loaded; failed if it could not be.
pub fn engine_for(state: &AppState, asked: Option<&str>) -> Result<Arc<dyn Engine>, Error> {
    let name = state.template_name(asked);
    match state.template_state(name) {
        None => Err(Error::UnknownTemplate {
            name: name.to_owned(),
            served: state.template_names(),
            field: "template".into(),
        }),
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
    engine_for(state, asked)?
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
/// built; its template is loaded, or booted on first use) and waits until it is ready. A
/// template served already is left as it is. Refused once the jail's filters are on (the
/// jail never closes while one is loaded: [`AppState::fix_templates_if`]).
pub async fn add(state: &AppState, name: &str) -> Result<Added, Error> {
    if !valid_template_name(name) {
        return Err(Error::invalid(
            "name",
            "a template name is lowercase letters, digits, '-' and '_'",
        ));
    }
    let status = |state: &AppState| state.templates().into_iter().find(|t| t.name == name);
    let source = state
        .template_source()
        .cloned()
        .ok_or_else(|| Error::NoTemplate("this server has no source of templates".into()))?;
    if !state.add_template(name) {
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

fn gone(name: &str) -> Error {
    Error::NoTemplate(format!("template {name} was removed meanwhile"))
}

/// Stops serving template `name`: refused for the default template and while a live
/// session runs on it (sessions are not drained: they are the client's to end or pause).
/// Jobs already admitted on it finish; its executor goes with the last of them.
pub fn remove(state: &AppState, name: &str) -> Result<(), Error> {
    if state.template_state(name).is_none() {
        return Err(Error::NoTemplate(format!(
            "template {name} is not served; this server serves: {}",
            state.template_names().join(", ")
        )));
    }
    if name == state.config().default_template() {
        return Err(Error::TemplateInUse(format!(
            "template {name} is the server's default"
        )));
    }
    let live = state
        .sessions()
        .list()
        .iter()
        .filter(|s| s.template == name)
        .count();
    if live > 0 {
        return Err(Error::TemplateInUse(format!(
            "{live} live session(s) run on template {name}: end or pause them first"
        )));
    }
    state.remove_template(name);
    // A user template this server built is no longer served after a restart either.
    if let Some(dir) = state.state_dir()
        && crate::core::builds::recorded(dir.root())
            .iter()
            .any(|n| n == name)
        && let Err(e) = crate::core::builds::record(dir.root(), name, false)
    {
        tracing::warn!(
            template = name,
            "cannot update the record of user templates: {e}"
        );
    }
    info!(template = name, "template removed");
    Ok(())
}
