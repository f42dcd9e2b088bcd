//! Templates: which executor a request runs on.

use std::sync::Arc;

use vmm::Executor;

use crate::core::metrics::Rejection;
use crate::core::state::{AppState, TemplateState};
use crate::service::error::Error;

/// The executor of template `asked` (`None`: the default one): unknown if it is not
/// served; not ready (retry later) while it is built or loaded; failed if it could not be.
pub fn executor_for(state: &AppState, asked: Option<&str>) -> Result<Arc<Executor>, Error> {
    let name = state.template_name(asked);
    match state.template_state(name) {
        None => Err(Error::UnknownTemplate {
            name: name.to_owned(),
            served: state.config().templates.clone(),
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

/// The default template's executor.
pub fn default_executor(state: &AppState) -> Result<Arc<Executor>, Error> {
    executor_for(state, None)
}
