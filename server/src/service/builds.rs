//! User templates built over HTTP (`POST /v1/templates`, docs/templates.md): a definition
//! checked here (every fault a 400 naming its field), its build started on the server's
//! builder (`crate::core::builds`: another process), the template served as `building`
//! meanwhile (its jobs get 503 `not_ready`), then loaded once built, or dropped with the
//! build's error if it failed: a failed build leaves nothing served or stored.
//!
//! With API keys on, a template and its build belong to the key that asked for it, and
//! another key's are answered as if they did not exist ([`crate::service::templates::may_see`]).

use std::sync::Arc;

use bud_guest::definition::{Definition, Limits};
use tracing::{info, warn};

use crate::core::builds::{Build, BuildState};
use crate::core::state::{AppState, Moment, TemplateStatus};
use crate::service::error::Error;
use crate::service::templates::{self, prepare};

/// The limits a definition must keep on this server.
fn limits(state: &AppState) -> Limits {
    Limits {
        packages: state.config().builds.template_max_packages,
        ..Limits::default()
    }
}

/// Checks `body` (a definition, parsed as JSON) and starts its build; the template is
/// served as `building` from now on, the current request's key's (with keys on). Refused
/// (409) when the name is built in, served or building (another key's: taken, naming no
/// key); with keys on, a `from` that is neither built in nor a served template the request
/// may see is 400 `unknown_template` on `from`.
pub fn create(
    state: &AppState,
    body: serde_json::Value,
) -> Result<(TemplateStatus, Arc<Build>), Error> {
    let builder = state
        .builder()
        .cloned()
        .ok_or_else(|| Error::NoBuilds("this server builds no templates".into()))?;
    let allowed = state.config().builds.template_builds;
    if allowed == 0 {
        return Err(Error::NoBuilds(
            "template builds over HTTP are off on this server (--template-builds 0)".into(),
        ));
    }
    // A built-in name is taken whatever the rest says.
    if let Some(name) = body["name"].as_str()
        && builder.built_in().iter().any(|b| b == name)
    {
        return Err(Error::TemplateExists(format!(
            "template {name} is built into bud; give yours another name"
        )));
    }
    let definition = Definition::from_value(body, &limits(state)).map_err(|e| Error::Invalid {
        field: Some(e.field().to_owned()),
        message: e.to_string(),
    })?;
    let name = definition.name.clone();
    if templates::taken_by_another(state, &name) {
        return Err(templates::taken(&name));
    }
    if state.template_state(&name).is_some() {
        return Err(Error::TemplateExists(format!(
            "template {name} is served already (DELETE /v1/templates/{name} first)"
        )));
    }
    // Under keys the builder must not be asked for another key's template (nor be the one to
    // say which stored templates there are).
    if state.config().api_keys.is_some()
        && !builder.built_in().contains(&definition.from)
        && !templates::visible(state, &definition.from)
    {
        return Err(templates::unknown(state, &definition.from, "from"));
    }
    if state.builds().building() >= allowed {
        return Err(Error::TooManyBuilds { limit: allowed });
    }
    let owner = templates::owner_now(state);
    let build = state
        .builds()
        .begin(&name, owner.as_deref())
        .ok_or_else(|| Error::TemplateExists(format!("template {name} is being built already")))?;
    if !state.add_template(&name, owner.as_deref()) {
        build.finish(BuildState::Failed("served meanwhile".into()));
        return Err(Error::TemplateExists(format!(
            "template {name} is served already"
        )));
    }
    info!(template = %name, "user template build started");
    let runtime = tokio::runtime::Handle::current();
    let (on_line, on_done) = (build.clone(), build.clone());
    let st = state.clone();
    builder.start(
        serde_json::to_value(&definition).map_err(Error::internal)?,
        Box::new(move |line| on_line.line(line)),
        Box::new(move |result| {
            runtime.spawn(finish(st, on_done, result));
        }),
    );
    let status = state
        .templates()
        .into_iter()
        .find(|t| t.name == name)
        .ok_or_else(|| Error::NoTemplate(format!("template {name} was removed meanwhile")))?;
    Ok((status, build))
}

/// After the builder's end: loads the built template and serves it, or drops it.
async fn finish(state: AppState, build: Arc<Build>, built: Result<(), String>) {
    let name = build.name.clone();
    let loaded = match built {
        Err(why) => Err(why),
        Ok(()) => load(&state, &name).await,
    };
    match loaded {
        Ok(()) => {
            if let Some(dir) = state.state_dir()
                && let Err(e) =
                    crate::core::builds::record(dir.root(), &name, build.owner.as_deref())
            {
                warn!(template = %name, "cannot record the template for the next start: {e}");
                build.line(&format!(
                    "warning: not recorded in the state directory ({e}): a restart will not serve it"
                ));
            }
            info!(template = %name, seconds = build.seconds(), "user template built and served");
            build.line("ready: the template is served");
            build.finish(BuildState::Ready);
        }
        Err(why) => {
            warn!(template = %name, "user template build failed: {why}");
            state.remove_template(&name);
            build.finish(BuildState::Failed(why));
        }
    }
}

/// Loads built template `name` into its served entry.
async fn load(state: &AppState, name: &str) -> Result<(), String> {
    let source = state
        .template_source()
        .cloned()
        .ok_or("this server has no source of templates")?;
    let (st, owned) = (state.clone(), name.to_owned());
    // Loaded only, never booted (the builder booted it): the jail allows that
    // (`crate::core::jail`), so a jailed server serves what it built.
    let prepared =
        tokio::task::spawn_blocking(move || prepare(&source, &owned, Moment::Built, st.config()))
            .await
            .map_err(|e| e.to_string())?;
    match prepared {
        Err(e) => Err(crate::core::error_chain(&e)),
        Ok((executor, info)) => {
            if state.set_template(name, Arc::new(executor), info) {
                Ok(())
            } else {
                Err(format!("template {name} was removed while it was built"))
            }
        }
    }
}

/// The latest build of `name`, if the current request may see it.
fn visible_build(state: &AppState, name: &str) -> Option<Arc<Build>> {
    let build = state.builds().get(name)?;
    templates::may_see(state, build.owner.as_deref()).then_some(build)
}

/// The latest build of `name`: 404 if there was none on this server (or it is another
/// key's).
pub fn build_of(state: &AppState, name: &str) -> Result<Arc<Build>, Error> {
    visible_build(state, name)
        .ok_or_else(|| Error::NoTemplate(format!("no build of template {name} on this server")))
}

/// What `GET /v1/templates/{name}` finds.
#[derive(Debug)]
pub enum Found {
    /// Served, with its latest build on this server if it has one.
    Served(Box<TemplateStatus>, Option<Arc<Build>>),
    /// Not served: a build that failed (or one whose template was removed since).
    Built(Arc<Build>),
}

/// Template `name` as `GET /v1/templates/{name}` finds it: its served entry and its latest
/// build on this server, each if the current request may see it; 404 with neither.
pub fn find(state: &AppState, name: &str) -> Result<Found, Error> {
    let served = templates::visible_templates(state)
        .into_iter()
        .find(|t| t.name == name);
    match (served, visible_build(state, name)) {
        (Some(t), build) => Ok(Found::Served(Box::new(t), build)),
        (None, Some(build)) => Ok(Found::Built(build)),
        (None, None) => Err(Error::NoTemplate(format!(
            "template {name} is not served and was not built here; this server serves: {}",
            templates::visible_names(state).join(", ")
        ))),
    }
}
