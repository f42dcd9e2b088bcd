//! Recording a finished job or cell, once, on its job thread (so it counts even if the
//! caller left): metrics, the log, the audit trail, and a session's cell in its trace.

use std::time::Duration;

use vmm::{Job, JobResult};

use crate::core::audit::Origin;
use crate::core::state::AppState;

/// Records a finished job (on its job thread): metrics, log, and the audit trail.
pub fn finished(
    state: &AppState,
    origin: &Origin,
    kind: &str,
    job: &Job,
    result: Result<&JobResult, &dyn std::fmt::Display>,
    waited: Duration,
) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    match result {
        Ok(r) => {
            state.metrics().job(r.status, waited, &r.timings);
            state.audit_job(origin, kind, job, r, waited);
            if let Some(id) = &origin.session {
                state.trace(id, kind, |budget| {
                    crate::core::trace::event::cell(origin, job, r, waited, budget)
                });
            }
            tracing::debug!(
                kind,
                status = ?r.status,
                exit_code = r.exit_code,
                queue_ms = ms(waited),
                clone_ms = ms(r.timings.clone),
                run_ms = ms(r.timings.run),
                total_ms = ms(r.timings.total),
                "job finished"
            );
            if let Some(why) = &r.crash {
                tracing::warn!(kind, crash = %why, "job crashed its VM");
            }
        }
        Err(e) => {
            state.metrics().failure();
            tracing::error!(kind, error = %e, "job could not run");
        }
    }
}
