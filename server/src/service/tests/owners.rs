//! Whose a template is ([`crate::service::templates::may_see`]): under API keys a user
//! template is its owner's alone, and every lookup by a name a request gives answers
//! another key's as a template that does not exist; the built-in ones and those of nobody
//! are every key's; without keys, every template is every request's.

use std::sync::Arc;

use crate::core::audit::KEY;
use crate::core::config::Config;
use crate::core::engine::fake::FakeEngine;
use crate::core::keys::ApiKeys;
use crate::core::state::{AppState, TemplateInfo};
use crate::service::error::Error;
use crate::service::templates::{engine_for, may_see, remove, served_engine, visible_names};

/// A server serving `python` (nobody's) and `mine` (alice's), with keys or without.
fn served(keys: bool) -> AppState {
    let config = Config {
        api_keys: keys.then(|| {
            Arc::new(ApiKeys::parse("alice 0123456789abcdef\nbob fedcba9876543210\n").unwrap())
        }),
        ..Config::default()
    };
    let state = AppState::new(config, None).expect("a state");
    assert!(state.add_template("mine", Some("alice")));
    for name in ["python", "mine"] {
        let engine = Arc::new(FakeEngine::new());
        assert!(state.set_engine(name, engine, TemplateInfo::default()));
    }
    state
}

/// `f` as a request with API key `key` (None: no key, as outside a request).
fn as_key<R>(key: Option<&str>, f: impl FnOnce() -> R) -> R {
    KEY.sync_scope(key.map(str::to_owned), f)
}

#[test]
fn under_keys_a_template_is_its_owners_and_nobodys_is_everyones() {
    let state = served(true);
    let sees = |key, owner| as_key(key, || may_see(&state, owner));

    assert!(sees(Some("alice"), Some("alice")));
    assert!(!sees(Some("bob"), Some("alice")));
    assert!(!sees(None, Some("alice")));
    assert!(sees(Some("bob"), None));
    assert!(sees(None, None));
    assert_eq!(
        as_key(Some("alice"), || visible_names(&state)),
        ["python", "mine"]
    );
    assert_eq!(as_key(Some("bob"), || visible_names(&state)), ["python"]);
}

#[test]
fn without_keys_every_template_is_every_requests() {
    let state = served(false);

    assert!(as_key(None, || may_see(&state, Some("alice"))));
    assert_eq!(as_key(None, || visible_names(&state)), ["python", "mine"]);
    assert!(as_key(None, || engine_for(&state, Some("mine"))).is_ok());
}

#[test]
fn another_keys_template_is_unknown_to_a_request_but_found_for_what_exists() {
    let state = served(true);

    let bob = as_key(Some("bob"), || engine_for(&state, Some("mine"))).err();
    let alice = as_key(Some("alice"), || engine_for(&state, Some("mine")));
    let removed = as_key(Some("bob"), || remove(&state, "mine")).unwrap_err();

    assert!(
        matches!(&bob, Some(Error::UnknownTemplate { name, served, field })
            if name == "mine" && served == &["python"] && field == "template"),
        "{bob:?}"
    );
    assert!(alice.is_ok());
    assert_eq!(
        removed.to_string(),
        "template mine is not served; this server serves: python"
    );
    // A session or snapshot on it (its id is what gives it) still finds its engine.
    assert!(as_key(Some("bob"), || served_engine(&state, "mine")).is_ok());
    assert!(state.template_state("mine").is_some(), "still served");
}
