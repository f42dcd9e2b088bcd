//! Rules at the egress (issue 59): request headers bud sets on a sandbox's HTTP requests to
//! a host, outside the sandbox, so that a credential a request needs never enters it. E2B's
//! `network.rules` shape, in both APIs:
//! `{"api.test": [{"transform": {"headers": {"Authorization": "Bearer ..."}}}]}`.
//!
//! - A key is a domain or `*.domain` (its subdomains), as in a policy; the name a connection
//!   was allowed for is matched against the keys, an exact key before a wildcard one.
//! - A rule sets its headers in place of any the guest sent under those names; the rules of
//!   a key apply in order (a later one's header replaces an earlier one's).
//! - A value may name secrets the operator gave the server (`{{secret:NAME}}`,
//!   [`super::secrets`]): the value then never passes through any API either.
//! - Registering a host does not allow it (E2B's rule): the policy's lists decide.
//! - Values are never shown: a sandbox's policy is shown with each value replaced by
//!   [`REDACTED`] ([`redacted`]), and errors name the host and the header, never the value.
//!
//! The VMM's relay sets the headers on each HTTP/1 request of the connection
//! (`vmm::net::names`), inside TLS too: where the server has an egress CA, the relay
//! terminates a guest's TLS to a host with rules ([`super::intercept`]); where it has none,
//! such TLS is refused rather than sent without the headers.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::secrets::Secrets;

/// Hosts a policy may give rules for, headers a rule may set, and a value's bytes, at most.
pub const MAX_HOSTS: usize = 64;
pub const MAX_HEADERS: usize = 32;
pub const MAX_VALUE: usize = 8 << 10;

/// What a shown policy has in place of each header value.
pub const REDACTED: &str = "<redacted>";

/// One rule as a client writes it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleSpec {
    pub transform: TransformSpec,
}

/// What a rule does to a request.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransformSpec {
    /// Headers set (name -> value).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

/// Rules by host, as a client writes them.
pub type RulesSpec = BTreeMap<String, Vec<RuleSpec>>;

/// A malformed rule: the host and header it is in, never the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    #[error("rules: {} is not a domain or *.domain", bud_guest::echo::quote(.0))]
    BadHost(String),
    #[error("rules: {count} hosts, more than {MAX_HOSTS}")]
    TooManyHosts { count: usize },
    #[error("rules: {host}: more than {MAX_HEADERS} headers")]
    TooManyHeaders { host: String },
    #[error("rules: {host}: {} is not a header name", bud_guest::echo::quote(.header))]
    BadHeaderName { host: String, header: String },
    #[error("rules: {host}: {header} frames the request or names its host; bud sets it itself")]
    Reserved { host: String, header: String },
    #[error("rules: {host}: the value of {header} {why}")]
    BadValue {
        host: String,
        header: String,
        why: &'static str,
    },
    #[error(
        "rules: {host}: the value of {header} names secret {} that this server does not hold",
        bud_guest::echo::quote(.secret)
    )]
    UnknownSecret {
        host: String,
        header: String,
        secret: String,
    },
}

/// Header names a rule may not set: they frame the request, name its host or change its
/// protocol, which the relay checks.
const RESERVED: [&str; 8] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "upgrade",
    "te",
    "trailer",
    "expect",
];

/// A part of a header's value.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    /// `{{secret:NAME}}`: the secret's value, read when a connection opens.
    Secret(String),
}

/// One header a rule sets.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Header {
    name: String,
    value: Vec<Part>,
}

/// The rules of one key.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HostRules {
    /// As the client wrote it (named in the connection log).
    key: String,
    domain: String,
    wildcard: bool,
    headers: Vec<Header>,
}

/// Parsed rules.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rules {
    hosts: Vec<HostRules>,
}

/// What the rules give one connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// The key that matched.
    pub rule: String,
    /// The headers, their secrets filled in.
    pub headers: Vec<(String, String)>,
    /// The secrets their values name.
    pub secrets: Vec<String>,
}

/// Why the rules of a connection could not be applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Missing {
    pub rule: String,
    /// A secret a value names that the server no longer holds (it was reloaded without it).
    pub secret: String,
}

impl Rules {
    /// Parses `spec`; every secret a value names must be in `secrets`.
    pub fn parse(spec: &RulesSpec, secrets: &Secrets) -> Result<Self, RuleError> {
        if spec.len() > MAX_HOSTS {
            return Err(RuleError::TooManyHosts { count: spec.len() });
        }
        let mut hosts = Vec::new();
        for (key, rules) in spec {
            let (domain, wildcard) = match key.trim().strip_prefix("*.") {
                Some(rest) => (rest, true),
                None => (key.trim(), false),
            };
            let domain = domain.trim_end_matches('.').to_ascii_lowercase();
            if !super::names::valid_domain(&domain)
                || domain.bytes().all(|b| b.is_ascii_digit() || b == b'.')
            {
                return Err(RuleError::BadHost(key.clone()));
            }
            let mut headers: Vec<Header> = Vec::new();
            for (name, value) in rules.iter().flat_map(|r| &r.transform.headers) {
                let header = parse_header(key, name, value, secrets)?;
                headers.retain(|h| !h.name.eq_ignore_ascii_case(&header.name));
                headers.push(header);
                if headers.len() > MAX_HEADERS {
                    return Err(RuleError::TooManyHeaders { host: key.clone() });
                }
            }
            hosts.push(HostRules {
                key: key.clone(),
                domain,
                wildcard,
                headers,
            });
        }
        Ok(Self { hosts })
    }

    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// The key that matches `name` (lower case), if it sets headers: the exact name's, else
    /// the first `*.domain` over it.
    fn host_for(&self, name: &str) -> Option<&HostRules> {
        let exact = self.hosts.iter().find(|h| !h.wildcard && h.domain == name);
        exact
            .or_else(|| {
                self.hosts.iter().find(|h| {
                    h.wildcard
                        && name.len() > h.domain.len() + 1
                        && name.ends_with(&h.domain)
                        && name.as_bytes()[name.len() - h.domain.len() - 1] == b'.'
                })
            })
            .filter(|h| !h.headers.is_empty())
    }

    /// Whether connections to `name` (lower case) get headers set.
    pub fn covers(&self, name: &str) -> bool {
        self.host_for(name).is_some()
    }

    /// The headers for a connection allowed for `name` (lower case), if a key matches it and
    /// sets any; `Err` if a secret a value names is no longer held.
    pub fn for_name(&self, name: &str, secrets: &Secrets) -> Option<Result<Applied, Missing>> {
        let host = self.host_for(name)?;
        let mut applied = Applied {
            rule: host.key.clone(),
            headers: Vec::new(),
            secrets: Vec::new(),
        };
        for h in &host.headers {
            let mut value = String::new();
            for part in &h.value {
                match part {
                    Part::Text(t) => value.push_str(t),
                    Part::Secret(s) => {
                        let Some(v) = secrets.get(s) else {
                            return Some(Err(Missing {
                                rule: host.key.clone(),
                                secret: s.clone(),
                            }));
                        };
                        value.push_str(&v);
                        if !applied.secrets.contains(s) {
                            applied.secrets.push(s.clone());
                        }
                    }
                }
            }
            applied.headers.push((h.name.clone(), value));
        }
        Some(Ok(applied))
    }
}

/// `spec` with every header value replaced by [`REDACTED`]: what a sandbox's policy shows.
pub fn redacted(spec: &RulesSpec) -> RulesSpec {
    spec.iter()
        .map(|(host, rules)| {
            let rules = rules
                .iter()
                .map(|r| RuleSpec {
                    transform: TransformSpec {
                        headers: r
                            .transform
                            .headers
                            .keys()
                            .map(|k| (k.clone(), REDACTED.to_owned()))
                            .collect(),
                    },
                })
                .collect();
            (host.clone(), rules)
        })
        .collect()
}

/// One header of a rule for `host`, its value's secret references resolved against
/// `secrets`' names.
fn parse_header(
    host: &str,
    name: &str,
    value: &str,
    secrets: &Secrets,
) -> Result<Header, RuleError> {
    let tchar = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if name.is_empty() || name.len() > 256 || !name.bytes().all(tchar) {
        return Err(RuleError::BadHeaderName {
            host: host.to_owned(),
            header: name.to_owned(),
        });
    }
    if RESERVED.iter().any(|r| r.eq_ignore_ascii_case(name)) {
        return Err(RuleError::Reserved {
            host: host.to_owned(),
            header: name.to_owned(),
        });
    }
    let bad = |why| RuleError::BadValue {
        host: host.to_owned(),
        header: name.to_owned(),
        why,
    };
    if value.len() > MAX_VALUE {
        return Err(bad("is longer than 8 KiB"));
    }
    if value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
        return Err(bad("holds a line break or a NUL"));
    }
    let mut parts = Vec::new();
    let mut rest = value;
    while let Some(at) = rest.find("{{secret:") {
        if at > 0 {
            parts.push(Part::Text(rest[..at].to_owned()));
        }
        let after = &rest[at + "{{secret:".len()..];
        let end = after
            .find("}}")
            .ok_or_else(|| bad("opens a {{secret:...}} it does not close"))?;
        let secret = &after[..end];
        if !secrets.holds(secret) {
            return Err(RuleError::UnknownSecret {
                host: host.to_owned(),
                header: name.to_owned(),
                secret: secret.to_owned(),
            });
        }
        parts.push(Part::Secret(secret.to_owned()));
        rest = &after[end + 2..];
    }
    if !rest.is_empty() {
        parts.push(Part::Text(rest.to_owned()));
    }
    Ok(Header {
        name: name.to_owned(),
        value: parts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: &str) -> RulesSpec {
        serde_json::from_str(json).unwrap()
    }

    fn secrets() -> Secrets {
        Secrets::from_text("OPENAI=sk-live-1\nGH=ghp_2\n").unwrap()
    }

    #[test]
    fn a_name_gets_its_keys_headers_with_secrets_filled_in_exact_before_wildcard() {
        let rules = Rules::parse(
            &spec(
                r#"{"api.test": [{"transform": {"headers": {"Authorization": "Bearer {{secret:OPENAI}}", "X-A": "1"}}},
                                 {"transform": {"headers": {"x-a": "2"}}}],
                    "*.gh.test": [{"transform": {"headers": {"Authorization": "token {{secret:GH}}"}}}],
                    "raw.gh.test": [{"transform": {"headers": {"X-Raw": "yes"}}}]}"#,
            ),
            &secrets(),
        )
        .unwrap();
        let s = secrets();

        assert_eq!(
            rules.for_name("api.test", &s),
            Some(Ok(Applied {
                rule: "api.test".into(),
                headers: vec![
                    ("Authorization".into(), "Bearer sk-live-1".into()),
                    ("x-a".into(), "2".into()),
                ],
                secrets: vec!["OPENAI".into()],
            }))
        );
        assert_eq!(
            rules.for_name("api.gh.test", &s).unwrap().unwrap().headers,
            [("Authorization".to_owned(), "token ghp_2".to_owned())]
        );
        assert_eq!(
            rules.for_name("raw.gh.test", &s).unwrap().unwrap().rule,
            "raw.gh.test"
        );
        assert_eq!(rules.for_name("gh.test", &s), None);
        assert_eq!(rules.for_name("other.test", &s), None);
        let reloaded = Secrets::from_text("GH=ghp_3\n").unwrap();
        assert_eq!(
            rules.for_name("api.test", &reloaded),
            Some(Err(Missing {
                rule: "api.test".into(),
                secret: "OPENAI".into()
            }))
        );
    }

    #[test]
    fn bad_rules_are_refused_naming_host_and_header_never_the_value() {
        let s = secrets();
        let err = |json: &str| Rules::parse(&spec(json), &s).unwrap_err().to_string();

        assert_eq!(
            err(r#"{"10.0.0.1": []}"#),
            "rules: \"10.0.0.1\" is not a domain or *.domain"
        );
        assert_eq!(
            err(r#"{"api.test": [{"transform": {"headers": {"Host": "x"}}}]}"#),
            "rules: api.test: Host frames the request or names its host; bud sets it itself"
        );
        assert_eq!(
            err(r#"{"api.test": [{"transform": {"headers": {"X-Key": "abc\r\nEvil: 1"}}}]}"#),
            "rules: api.test: the value of X-Key holds a line break or a NUL"
        );
        assert_eq!(
            err(r#"{"api.test": [{"transform": {"headers": {"X Key": "v"}}}]}"#),
            "rules: api.test: \"X Key\" is not a header name"
        );
        assert_eq!(
            err(r#"{"api.test": [{"transform": {"headers": {"X-Key": "{{secret:NOPE}}"}}}]}"#),
            "rules: api.test: the value of X-Key names secret \"NOPE\" that this server does not hold"
        );
        assert_eq!(
            err(r#"{"api.test": [{"transform": {"headers": {"X-Key": "{{secret:GH"}}}]}"#),
            "rules: api.test: the value of X-Key opens a {{secret:...}} it does not close"
        );
        let unknown = serde_json::from_str::<RulesSpec>(r#"{"a.test": [{"transfrom": {}}]}"#);
        assert!(
            unknown
                .unwrap_err()
                .to_string()
                .contains("unknown field `transfrom`")
        );
    }

    #[test]
    fn a_shown_policy_has_the_header_names_and_no_value() {
        let shown = redacted(&spec(
            r#"{"api.test": [{"transform": {"headers": {"Authorization": "Bearer sk-live-1"}}}]}"#,
        ));
        let text = serde_json::to_string(&shown).unwrap();

        assert_eq!(
            text,
            r#"{"api.test":[{"transform":{"headers":{"Authorization":"<redacted>"}}}]}"#
        );
    }
}
