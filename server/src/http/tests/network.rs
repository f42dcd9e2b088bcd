//! A sandbox's network as a client sees it, on a template with a card (the test engine's:
//! no VM, so no guest connects; the gate a session gets is asked directly, as the VMM's
//! stack asks it): E2B's `network` object refusing keys it does not have, a huge bad
//! policy entry answered by its prefix, and the server's own address, which no policy
//! and no `--egress-allow-private` opens.

use std::net::{Ipv4Addr, SocketAddr};

use serde_json::{Value, json};
use vmm::{ConnectRequest, Egress, Verdict};

use super::{Served, answer, test_config};
use crate::core::config::Config;
use crate::core::egress::Private;
use crate::core::engine::fake::FakeEngine;

/// A server on loopback whose template has a card, configured as `change` says.
async fn carded(change: impl FnOnce(&mut Config)) -> Served {
    let mut config = test_config();
    change(&mut config);
    Served::with_engine(config, FakeEngine::with_card()).await
}

impl Served {
    async fn put(&self, path: &str, body: &Value) -> (u16, Value) {
        let req = self.client.put(self.url(path)).json(body);
        answer(req.send().await.expect("request failed")).await
    }

    /// A new E2B sandbox of `body` (201), its id.
    async fn e2b_sandbox(&self, body: Value) -> String {
        let (status, r) = self.post("/v2/sandboxes", &body).await;
        assert_eq!(status, 201, "{r}");
        r["sandboxID"].as_str().expect("an id").to_owned()
    }
}

/// What serde says of a key E2B's `network` object does not have, at `column`.
fn unknown_key(key: &str, column: usize) -> String {
    format!(
        "unknown field `{key}`, expected one of `allowOut`, `denyOut`, `rules`, `dnsServers`, \
         `egressProxy`, `allowPublicTraffic`, `maskRequestHost`, `httpsPorts`, \
         `allowInternetAccess`, `allow_internet_access` at line 1 column {column}"
    )
}

#[tokio::test]
async fn e2bs_network_object_refuses_a_key_it_does_not_have_naming_it() {
    let s = carded(|_| {}).await;

    let (created, at_create) = s
        .post(
            "/v2/sandboxes",
            &json!({"templateID": "python", "network": {"deny_out": ["0.0.0.0/0"]}}),
        )
        .await;
    let started = s.engine.counts().started;
    let id = s
        .e2b_sandbox(json!({"templateID": "python", "network": {"allowOut": ["pypi.test"], "denyOut": ["0.0.0.0/0"]}}))
        .await;
    let (updated, at_update) = s
        .put(
            &format!("/sandboxes/{id}/network"),
            &json!({"deny_out": ["0.0.0.0/0"]}),
        )
        .await;
    let (_, info) = s.get(&format!("/sandboxes/{id}")).await;

    assert_eq!(created, 400);
    assert_eq!(
        at_create,
        json!({"code": 400, "message": format!("bad JSON body: network.deny_out: {}", unknown_key("deny_out", 22))})
    );
    assert_eq!(started, 0, "nothing started for the refused create");
    assert_eq!(updated, 400);
    assert_eq!(
        at_update,
        json!({"code": 400, "message": format!("bad JSON body: deny_out: {}", unknown_key("deny_out", 11))})
    );
    assert_eq!(
        info["network"],
        json!({"allowOut": ["pypi.test"], "denyOut": ["0.0.0.0/0"]}),
        "the policy the refused update would have replaced"
    );
}

#[tokio::test]
async fn every_key_e2bs_sdks_send_is_taken() {
    let s = carded(|_| {}).await;
    // `spec/openapi.yml`'s SandboxNetworkConfig, as the SDKs send it (the ingress settings
    // and empty lists of what bud does not do yet have no effect), and `httpsPorts` of the
    // newer SDKs.
    let network = json!({
        "allowOut": ["pypi.test"],
        "denyOut": ["0.0.0.0/0"],
        "allowPublicTraffic": false,
        "maskRequestHost": "${PORT}-sandbox.test",
        "httpsPorts": [8443],
        "rules": {},
        "egressProxy": null,
        "dnsServers": []
    });
    // SandboxNetworkUpdateConfig.
    let update = json!({
        "allowOut": ["files.pypi.test"],
        "denyOut": ["0.0.0.0/0"],
        "rules": {},
        "egressProxy": null,
        "allow_internet_access": true
    });

    let id = s
        .e2b_sandbox(
            json!({"templateID": "python", "allow_internet_access": true, "network": network}),
        )
        .await;
    let (_, created) = s.get(&format!("/sandboxes/{id}")).await;
    let (updated, _) = s.put(&format!("/sandboxes/{id}/network"), &update).await;
    let (_, after) = s.get(&format!("/sandboxes/{id}")).await;
    let (misplaced, refused) = s
        .post(
            "/v2/sandboxes",
            &json!({"templateID": "python", "network": {"allow_internet_access": false}}),
        )
        .await;

    assert_eq!(
        created["network"],
        json!({"allowOut": ["pypi.test"], "denyOut": ["0.0.0.0/0"]})
    );
    assert_eq!(updated, 204);
    assert_eq!(
        after["network"],
        json!({"allowOut": ["files.pypi.test"], "denyOut": ["0.0.0.0/0"]})
    );
    assert_eq!(misplaced, 400);
    assert_eq!(
        refused,
        json!({"code": 400, "message": "allow_internet_access goes beside network at create, not in it"})
    );
}

#[tokio::test]
async fn a_huge_bad_entry_is_answered_by_its_prefix_and_length() {
    let s = carded(|_| {}).await;
    let huge = format!("{}!", "a".repeat(1 << 20));
    let id = s.e2b_sandbox(json!({"templateID": "python"})).await;
    let quoted = format!("\"{}\"… (1048577 bytes)", "a".repeat(64));

    let (native, n) = s
        .post("/v1/sessions", &json!({"network": {"allow_out": [huge]}}))
        .await;
    let (e2b, e) = s
        .put(
            &format!("/sandboxes/{id}/network"),
            &json!({"allowOut": [huge]}),
        )
        .await;

    let why =
        format!("allow_out: {quoted} is not an IPv4 address, a CIDR, a domain or `*` (bad domain)");
    assert_eq!(native, 400);
    assert_eq!(
        n,
        json!({"error": {"code": "invalid_request", "message": why, "field": "network"}})
    );
    assert_eq!(e2b, 400);
    assert_eq!(e, json!({"code": 400, "message": why}));
}

#[tokio::test]
async fn the_servers_own_address_is_never_dialed_whatever_the_policy_and_private_ranges_say() {
    // Everything opened: every always-denied range, and every address and name allowed.
    let s = carded(|c| c.egress_allow_private = Private::parse("0.0.0.0/0").unwrap()).await;
    let id = s
        .session(json!({"network": {"allow_out": ["*"], "deny_out": []}}))
        .await;
    let gate = s
        .state
        .sessions()
        .get(&id)
        .expect("the session")
        .network
        .clone()
        .expect("its gate");
    let port = s.addr.port();
    let connect = |addr: Ipv4Addr, port: u16| {
        gate.connect(&ConnectRequest {
            name: None,
            addr,
            port,
            id: 1,
        })
    };

    let api = connect(Ipv4Addr::LOCALHOST, port);
    let this_host = connect(Ipv4Addr::UNSPECIFIED, port);
    let next_port = connect(Ipv4Addr::LOCALHOST, port.wrapping_add(1));
    let (_, view) = s.get(&format!("/v1/sessions/{id}/network")).await;

    assert_eq!(s.state.egress_site().listeners.all(), [s.addr]);
    assert_eq!(api, Verdict::Refuse);
    assert_eq!(this_host, Verdict::Refuse);
    assert_eq!(
        next_port,
        Verdict::Dial(SocketAddr::from((
            Ipv4Addr::LOCALHOST,
            port.wrapping_add(1)
        )))
    );
    let seen: Vec<_> = view["attempts"]
        .as_array()
        .expect("attempts")
        .iter()
        .map(|a| {
            (
                a["allowed"].clone(),
                a["reason"].clone(),
                a["dialed"].clone(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            (json!(false), json!("bud-listener"), Value::Null),
            (json!(false), json!("bud-listener"), Value::Null),
            (
                json!(true),
                json!("allowed"),
                json!(format!("127.0.0.1:{}", port.wrapping_add(1)))
            ),
        ]
    );
}
