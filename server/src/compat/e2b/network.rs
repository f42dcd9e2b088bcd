//! E2B's network settings over bud's ([`crate::service::network`]): `allow_internet_access`
//! and `network` (`allowOut`, `denyOut`) at create, and `PUT /sandboxes/{id}/network`.
//!
//! How E2B's words map:
//! - `network.allowOut` / `denyOut` are bud's `allow_out` / `deny_out` (the same grammar and
//!   order: an allow entry wins, then a deny entry refuses, else allowed);
//! - `allow_internet_access: false` adds `0.0.0.0/0` to `deny_out` (E2B: "works the same as
//!   setting deny_out to [0.0.0.0/0]"); on a template without a network card it asks for
//!   nothing the sandbox does not already have, so it is accepted there;
//! - `allow_internet_access: true` without `network` (what E2B's SDK sends by default) is
//!   the server's own default (`--egress-default`): an operator who opens nothing is not
//!   overruled by a client library's default;
//! - `network.rules` (headers set on a host's requests, outside the sandbox) are bud's
//!   `rules` (`crate::core::egress::rules`: HTTP only so far; a value may also name a secret
//!   the operator gave the server), shown with their values redacted;
//! - what bud does not do yet is refused, never ignored: `dnsServers`, `egressProxy`; the
//!   ingress settings
//!   (`allowPublicTraffic`, `maskRequestHost`, `httpsPorts`) are accepted and have no effect,
//!   as bud serves no public URL;
//! - a key the object does not have is refused with a 400 naming it (as bud's own API
//!   refuses one): `{"deny_out": [...]}`, the spelling E2B's Python SDK takes before it
//!   sends `denyOut`, would otherwise leave the server's default in force. The keys are those
//!   E2B's OpenAPI spec and SDKs send (`spec/openapi.yml`'s `SandboxNetworkConfig` and
//!   `SandboxNetworkUpdateConfig`, and `httpsPorts` of its newer SDKs);
//!   `allow_internet_access` is a key of the update's body, and beside `network` at create
//!   (refused inside it there: E2B would not read it).

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::{Compat, e2b_error, json_body, live};
use crate::core::egress::PolicySpec;
use crate::http::error::ApiError;
use crate::service::error::Error;

/// E2B's `network` object at create, and the body of `PUT /sandboxes/{id}/network`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NetworkConfig {
    #[serde(default)]
    pub allow_out: Option<Vec<String>>,
    #[serde(default)]
    pub deny_out: Option<Vec<String>>,
    /// Headers set on requests to hosts (`crate::core::egress::rules`).
    #[serde(default)]
    pub rules: Option<crate::core::egress::RulesSpec>,
    #[serde(default)]
    pub dns_servers: Option<Vec<String>>,
    #[serde(default)]
    pub egress_proxy: Option<serde_json::Value>,
    /// Ingress: no effect in bud.
    #[serde(default)]
    pub allow_public_traffic: Option<bool>,
    #[serde(default)]
    pub mask_request_host: Option<String>,
    #[serde(default)]
    pub https_ports: Option<Vec<u16>>,
    /// The update's switch for the whole internet (snake_case in E2B's JSON); at create it
    /// goes beside `network`, and is refused in it.
    #[serde(
        default,
        rename = "allow_internet_access",
        alias = "allowInternetAccess"
    )]
    pub allow_internet_access: Option<bool>,
}

/// bud's policy for E2B's settings (module docs); None: the server's default.
pub fn policy(
    allow_internet_access: Option<bool>,
    network: Option<&NetworkConfig>,
) -> Result<Option<PolicySpec>, Error> {
    if let Some(n) = network {
        let unsupported = [
            (
                "network.dnsServers",
                n.dns_servers.as_ref().is_some_and(|d| !d.is_empty()),
            ),
            (
                "network.egressProxy",
                n.egress_proxy.as_ref().is_some_and(|p| !p.is_null()),
            ),
        ];
        if let Some((field, _)) = unsupported.iter().find(|(_, given)| *given) {
            return Err(Error::invalid(
                *field,
                format!("{field} is not supported by bud yet: leave it out"),
            ));
        }
    }
    let denied_all = allow_internet_access == Some(false);
    let listed = network.is_some_and(|n| n.allow_out.is_some() || n.deny_out.is_some());
    let ruled = network.is_some_and(|n| n.rules.as_ref().is_some_and(|r| !r.is_empty()));
    if !listed && !denied_all && !ruled {
        return Ok(None);
    }
    let mut spec = PolicySpec::lists(
        network
            .and_then(|n| n.allow_out.clone())
            .unwrap_or_default(),
        network.and_then(|n| n.deny_out.clone()).unwrap_or_default(),
    );
    spec.rules = network.and_then(|n| n.rules.clone()).unwrap_or_default();
    let everything = "0.0.0.0/0";
    if denied_all && !spec.deny_out.iter().any(|d| d == everything) {
        spec.deny_out.push(everything.to_owned());
    }
    Ok(Some(spec))
}

/// The policy of a sandbox created on bud's template `template` (a snapshot's, for one
/// started from a snapshot) with E2B's settings: `allow_internet_access: false` alone on a
/// template without a card asks for what the sandbox has anyway, so it asks for nothing.
pub fn at_create(
    state: &crate::core::state::AppState,
    template: &str,
    allow_internet_access: Option<bool>,
    network: Option<&NetworkConfig>,
) -> Result<Option<PolicySpec>, Error> {
    if network.is_some_and(|n| n.allow_internet_access.is_some()) {
        return Err(Error::invalid(
            "network.allow_internet_access",
            "allow_internet_access goes beside network at create, not in it",
        ));
    }
    let spec = policy(allow_internet_access, network)?;
    let listed = network.is_some_and(|n| {
        n.allow_out.is_some()
            || n.deny_out.is_some()
            || n.rules.as_ref().is_some_and(|r| !r.is_empty())
    });
    // The template named was found for the caller already (or is a snapshot's).
    let card = crate::service::templates::served_engine(state, template)
        .is_ok_and(|e| crate::service::network::has_card(e.as_ref()));
    Ok(spec.filter(|_| listed || card))
}

/// What `GET /sandboxes/{id}` shows of a sandbox's network (E2B's `network` of a
/// `SandboxDetail`): the policy in force, no policy as the deny-all it is.
pub fn detail(gate: &crate::core::egress::Gate) -> serde_json::Value {
    let spec = gate
        .shown_policy()
        .unwrap_or_else(|| PolicySpec::lists(Vec::new(), vec!["0.0.0.0/0".to_owned()]));
    let mut shown = serde_json::json!({"allowOut": spec.allow_out, "denyOut": spec.deny_out});
    if !spec.rules.is_empty() {
        shown["rules"] = serde_json::to_value(&spec.rules).unwrap_or_default();
    }
    shown
}

/// `PUT /sandboxes/{id}/network`: 204. Replaces the sandbox's policy (omitting both lists
/// clears it: everything allowed, as in E2B).
pub async fn update(
    State(c): State<Compat>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let run = || -> Result<Response, ApiError> {
        let (_, e) = live(&c, &id)?;
        let u: NetworkConfig = json_body(&body, "network")?;
        let spec = policy(u.allow_internet_access, Some(&u))?.unwrap_or_default();
        crate::service::network::put(&c.app, &e.id, &spec)?;
        Ok(StatusCode::NO_CONTENT.into_response())
    };
    run().unwrap_or_else(e2b_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(allow: Option<&[&str]>, deny: Option<&[&str]>) -> NetworkConfig {
        let list = |l: &[&str]| l.iter().map(|s| s.to_string()).collect();
        NetworkConfig {
            allow_out: allow.map(list),
            deny_out: deny.map(list),
            ..NetworkConfig::default()
        }
    }

    #[test]
    fn e2bs_settings_become_bud_policies() {
        let sdk_default = policy(Some(true), None).unwrap();
        let cut_off = policy(Some(false), None).unwrap();
        let listed = policy(
            Some(true),
            Some(&config(Some(&["pypi.org"]), Some(&["0.0.0.0/0"]))),
        )
        .unwrap();
        let both = policy(Some(false), Some(&config(Some(&["pypi.org"]), None))).unwrap();

        assert_eq!(sdk_default, None, "the server's default");
        assert_eq!(
            cut_off,
            Some(PolicySpec {
                allow_out: vec![],
                deny_out: vec!["0.0.0.0/0".into()],
                rules: Default::default(),
            })
        );
        assert_eq!(
            listed,
            Some(PolicySpec {
                allow_out: vec!["pypi.org".into()],
                deny_out: vec!["0.0.0.0/0".into()],
                rules: Default::default(),
            })
        );
        assert_eq!(both, listed, "deny-all added once");
    }

    #[test]
    fn what_bud_cannot_do_is_refused_rules_are_kept_and_ingress_is_accepted() {
        let mut dns = config(Some(&["api.test"]), None);
        dns.dns_servers = Some(vec!["9.9.9.9".into()]);
        let mut rules = config(None, None);
        rules.rules = serde_json::from_str(
            r#"{"api.test": [{"transform": {"headers": {"Authorization": "Bearer x"}}}]}"#,
        )
        .unwrap();
        let mut ingress = config(None, None);
        ingress.allow_public_traffic = Some(false);

        let e = policy(None, Some(&dns)).unwrap_err();
        let kept = policy(None, Some(&rules)).unwrap().unwrap();

        assert_eq!(e.field(), Some("network.dnsServers"));
        assert_eq!(kept.rules, rules.rules.unwrap());
        assert_eq!((kept.allow_out.len(), kept.deny_out.len()), (0, 0));
        assert_eq!(policy(None, Some(&ingress)).unwrap(), None);
    }
}
