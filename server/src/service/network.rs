//! Each sandbox's network (issue 39): the policy a request gives, or the server's default,
//! made into the sandbox's gate ([`crate::core::egress::Gate`], the [`vmm::Egress`] of its
//! network card), read and replaced while the sandbox runs, and the record of every name
//! its guest resolved and every connection it opened.
//!
//! A sandbox has a network only on a template with a card (`bud serve --network`); a policy
//! for a template without one is refused, as a setting it could not honour. On a template
//! with a card every sandbox gets a gate: with no policy (`--egress-default none`, the
//! default) nothing resolves and nothing is dialed, and the attempts are still recorded.
//! A fork's sandboxes get the parent's policy, a paused or snapshotted session keeps its
//! own in its record.

use std::sync::Arc;

use serde::Serialize;

use crate::core::config::EgressDefault;
use crate::core::egress::{Attempt, Gate, Policy, PolicySpec};
use crate::core::engine::Engine;
use crate::core::state::AppState;
use crate::service::error::{Error, unavailable};

/// A sandbox's network as `GET /v1/sessions/{id}/network` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct NetworkView {
    /// Whether its template gives it a network card at all.
    pub card: bool,
    /// The policy in force (None: no route out); an allow-list of bud's API shows the
    /// `deny_out` it implies.
    pub policy: Option<PolicySpec>,
    /// The policy in words: what the sandbox may reach (None: no card).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reaches: Option<String>,
    /// What its guest resolved and connected to, oldest first.
    pub attempts: Vec<Attempt>,
    /// Older attempts no longer kept.
    pub dropped: u64,
}

impl NetworkView {
    /// The view of `gate` (None: a sandbox without a card).
    pub fn of(gate: Option<&Gate>) -> Self {
        match gate {
            None => Self {
                card: false,
                policy: None,
                reaches: None,
                attempts: Vec::new(),
                dropped: 0,
            },
            Some(g) => {
                let (attempts, dropped) = g.attempts();
                Self {
                    card: true,
                    policy: g.shown_policy(),
                    reaches: Some(g.describe()),
                    attempts,
                    dropped,
                }
            }
        }
    }
}

/// Whether `engine`'s template gives its sandboxes a network card.
pub fn has_card(engine: &dyn Engine) -> bool {
    engine.manifest().network == vmm::manifest::Network::Card
}

/// The parsed policy of `spec` (the server's default without one), checked as `field`.
fn policy_of(
    state: &AppState,
    spec: Option<&PolicySpec>,
    field: &str,
) -> Result<Option<Policy>, Error> {
    match spec {
        Some(spec) => Policy::parse(spec, &state.egress_site().secrets)
            .map(Some)
            .map_err(|e| Error::invalid(field, e.to_string())),
        None => Ok(match state.config().egress_default {
            EgressDefault::None => None,
            EgressDefault::All => Some(Policy::allow_all()),
        }),
    }
}

/// The gate of a new sandbox of `engine`'s template (`template` names it in errors), from
/// the request's policy `spec` or the server's default; None for a template without a card
/// (a policy given for one is refused).
pub fn gate_for(
    state: &AppState,
    engine: &dyn Engine,
    template: &str,
    spec: Option<&PolicySpec>,
    field: &str,
) -> Result<Option<Arc<Gate>>, Error> {
    if !has_card(engine) {
        return match spec {
            None => Ok(None),
            Some(_) => Err(Error::invalid(
                field,
                format!(
                    "template {template} has no network card, so no network policy can apply (a server started with --network gives its templates one)"
                ),
            )),
        };
    }
    let policy = policy_of(state, spec, field)?;
    Ok(Some(Arc::new(Gate::new(
        policy,
        state.egress_site().clone(),
    ))))
}

/// The gate of a session made again from its record (a resume): the policy it had, on a
/// template with a card (None in the record: no route out, never the server's default).
pub fn restored(
    state: &AppState,
    engine: &dyn Engine,
    spec: Option<&PolicySpec>,
) -> Option<Arc<Gate>> {
    if !has_card(engine) {
        return None;
    }
    // A record's policy was parsed when it was set; one that no longer parses (a grammar
    // grown stricter) gives no route out rather than a wider one.
    let secrets = &state.egress_site().secrets;
    let policy = spec.and_then(|s| Policy::parse(s, secrets).ok());
    Some(Arc::new(Gate::new(policy, state.egress_site().clone())))
}

/// The network of session `id` (running: a paused one is not resumed for this).
pub fn get(state: &AppState, id: &str) -> Result<NetworkView, Error> {
    let e = state.sessions().get(id).map_err(|u| unavailable(id, u))?;
    Ok(NetworkView::of(e.network.as_deref()))
}

/// Replaces the policy of session `id` while it runs: connections it opens from now on
/// see it (those open stay open).
pub fn put(state: &AppState, id: &str, spec: &PolicySpec) -> Result<NetworkView, Error> {
    let e = state.sessions().get(id).map_err(|u| unavailable(id, u))?;
    let Some(gate) = e.network.as_deref() else {
        return Err(Error::invalid(
            "network",
            format!(
                "session {id} has no network card (its template {} has none)",
                e.template
            ),
        ));
    };
    let policy = Policy::parse(spec, &state.egress_site().secrets)
        .map_err(|e| Error::invalid("network", e.to_string()))?;
    gate.set_policy(Some(policy));
    Ok(NetworkView::of(Some(gate)))
}
