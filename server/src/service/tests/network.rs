//! A sandbox's network policy: where it is refused, what a sandbox gets without one, and
//! how it follows a session (live replacement, forks). The gate's own decisions are
//! `core::egress`'s tests; a real guest through them is `server/tests/network.rs`.

use super::{cell, job, server, server_on, server_with};
use crate::core::config::{Config, EgressDefault};
use crate::core::egress::PolicySpec;
use crate::core::engine::fake::FakeEngine;
use crate::core::state::AppState;
use crate::service::error::Error;
use crate::service::network;
use crate::service::sessions::{CreateSession, fork, start_fresh};
use crate::service::task::no_sink;

/// A server whose default template has a network card, configured as `config` says.
fn carded(config: Config) -> (AppState, FakeEngine) {
    server_on(config, FakeEngine::with_card())
}

fn spec(allow: &[&str], deny: &[&str]) -> PolicySpec {
    PolicySpec::lists(
        allow.iter().map(|s| s.to_string()).collect(),
        deny.iter().map(|s| s.to_string()).collect(),
    )
}

async fn session_with(state: &AppState, network: Option<PolicySpec>) -> Result<String, Error> {
    let req = CreateSession {
        network,
        ..CreateSession::default()
    };
    start_fresh(state, req).await.map(|e| e.id.clone())
}

#[tokio::test]
async fn a_policy_for_a_template_without_a_card_is_refused_and_nothing_starts() {
    let (state, engine) = server(1, 1);

    let e = session_with(&state, Some(spec(&["pypi.org"], &[])))
        .await
        .unwrap_err();
    let mut one = job("x");
    one.network = Some(spec(&[], &[]));
    let j = crate::service::jobs::run(&state, one, no_sink())
        .await
        .unwrap_err();
    let plain = session_with(&state, None).await.unwrap();

    assert_eq!(e.field(), Some("network"));
    assert!(e.to_string().contains("no network card"), "{e}");
    assert_eq!(j.field(), Some("network"));
    assert_eq!(
        engine.counts().started,
        1,
        "only the session without a policy"
    );
    assert_eq!(engine.counts().egress_given, 0);
    let view = network::get(&state, &plain).unwrap();
    assert!(!view.card && view.policy.is_none() && view.attempts.is_empty());
}

#[tokio::test]
async fn on_a_card_a_session_without_a_policy_has_no_route_unless_the_server_opens_all() {
    let (closed, closed_engine) = carded(Config::default());
    let (open, _) = carded(Config {
        egress_default: EgressDefault::All,
        ..Config::default()
    });

    let shut = session_with(&closed, None).await.unwrap();
    let wide = session_with(&open, None).await.unwrap();

    let shut = network::get(&closed, &shut).unwrap();
    assert!(shut.card);
    assert_eq!(shut.policy, None, "no route out");
    assert_eq!(
        closed_engine.counts().egress_given,
        1,
        "the gate is on its VM"
    );
    assert_eq!(
        network::get(&open, &wide).unwrap().policy,
        Some(PolicySpec::default())
    );
}

#[tokio::test]
async fn a_sessions_policy_is_checked_replaced_live_and_kept_by_its_forks() {
    let (state, engine) = carded(Config::default());
    let bad = session_with(&state, Some(spec(&["not a name!"], &[])))
        .await
        .unwrap_err();
    let domain_denied = session_with(&state, Some(spec(&[], &["evil.test"])))
        .await
        .unwrap_err();
    let id = session_with(&state, Some(spec(&["pypi.org"], &["0.0.0.0/0"])))
        .await
        .unwrap();

    let replaced = network::put(&state, &id, &spec(&["*.github.com"], &["0.0.0.0/0"])).unwrap();
    let refused = network::put(&state, &id, &spec(&["300.1.1.1"], &[])).unwrap_err();
    let children = fork(&state, &id, 2).await.unwrap();
    let mut per_cell = cell("x");
    per_cell.network = Some(spec(&[], &[]));
    let cell_err = crate::service::sessions::cell(&state, &id, per_cell, "/test", no_sink())
        .await
        .unwrap_err();

    assert_eq!(bad.field(), Some("network"));
    assert!(bad.to_string().contains("not a name!"), "{bad}");
    assert!(
        domain_denied.to_string().contains("deny_out"),
        "{domain_denied}"
    );
    let wanted = Some(spec(&["*.github.com"], &["0.0.0.0/0"]));
    assert_eq!(replaced.policy, wanted);
    assert_eq!(refused.field(), Some("network"));
    assert_eq!(network::get(&state, &id).unwrap().policy, wanted, "kept");
    for child in &children.ids {
        assert_eq!(network::get(&state, child).unwrap().policy, wanted);
    }
    assert_eq!(
        engine.counts().egress_given,
        3,
        "the session and its two forks"
    );
    assert_eq!(cell_err.field(), Some("network"));
}

#[tokio::test]
async fn put_on_a_session_without_a_card_or_an_unknown_one_is_refused() {
    let (state, _) = server_with(Config::default());
    let id = session_with(&state, None).await.unwrap();

    let no_card = network::put(&state, &id, &spec(&[], &[])).unwrap_err();
    let unknown = network::get(&state, "ses_nothing").unwrap_err();

    assert_eq!(no_card.field(), Some("network"));
    assert!(matches!(unknown, Error::NoSession(_)), "{unknown:?}");
}
