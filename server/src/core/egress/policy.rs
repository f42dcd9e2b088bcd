//! A sandbox's network policy in E2B's shape (`allow_out`, `deny_out`), parsed once and
//! decided per connection.
//!
//! An entry is one of: an IPv4 address (`203.0.113.7`), a CIDR (`203.0.113.0/24`), a
//! domain (`pypi.test`, matched exactly, case-insensitive), a wildcard domain (`*.pypi.test`:
//! the subdomains, not the apex, as E2B's `matchDomain`), or `*` (everything); any of them
//! may end in a port or a port range (`:443`, `:8000-8100`). `deny_out` takes addresses and
//! CIDRs only (E2B's rule: a name can be denied only by not allowing it).
//!
//! The order is E2B's: an allow entry that matches wins; then a deny entry that matches
//! refuses; anything else is allowed. So `allow_out: ["pypi.test"], deny_out: ["0.0.0.0/0"]`
//! reaches one name and nothing else, and an empty policy reaches everything (that the
//! always-denied ranges of [`super::ranges`] leave).
//!
//! **An allow-list means one in bud's own API.** Under E2B's rule `allow_out` alone denies
//! nothing (an allow entry only overrides a deny), which is not what a user who writes an
//! allow-list means. So a [`PolicySpec`] read from JSON (bud's routes and records) that gives
//! `allow_out` without `deny_out` gets `deny_out: ["0.0.0.0/0"]`: those destinations and
//! nothing else. E2B's routes build their spec from E2B's own fields and keep E2B's meaning
//! (`crate::compat::e2b::network`). Either way the spec a sandbox shows is the one in force,
//! with [`Policy::describe`] saying it in words.
//!
//! Why not `ipnet` for the CIDRs: the guest has IPv4 only, and the 40 lines of
//! [`Cidr`] are all the arithmetic needed; a crate would bring its IPv6 forms into every
//! error message and parse path for nothing.

use std::fmt;
use std::net::Ipv4Addr;
use std::ops::RangeInclusive;

use serde::{Deserialize, Serialize};

use super::names::valid_domain;
use super::rules::{RuleError, Rules, RulesSpec};
use super::secrets::Secrets;
use crate::core::echo::quote;

/// Entries one list may hold, at most.
pub const MAX_ENTRIES: usize = 256;

/// A malformed entry of a policy, with the list and the entry it is in (its message quotes
/// a long entry by its prefix: [`quote`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error(
        "{list}: {} is not an IPv4 address, a CIDR, a domain or `*` ({why})",
        quote(.entry)
    )]
    Malformed {
        list: &'static str,
        entry: String,
        why: &'static str,
    },
    #[error(
        "deny_out: {} is a domain; deny_out takes addresses and CIDRs (leave a name out of allow_out to deny it)",
        quote(.entry)
    )]
    DomainDenied { entry: String },
    #[error("{list}: {count} entries, more than {MAX_ENTRIES}")]
    TooMany { list: &'static str, count: usize },
    #[error(transparent)]
    Rule(#[from] RuleError),
}

/// The deny entry of every address: what an allow-list of bud's API denies
/// (module docs).
pub const EVERY_ADDRESS: &str = "0.0.0.0/0";

/// A policy in force, in E2B's terms (both APIs' `network` object). Read from JSON it
/// takes bud's meaning of an allow-list (module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "WrittenSpec")]
pub struct PolicySpec {
    /// What may be reached, whatever `deny_out` says.
    pub allow_out: Vec<String>,
    /// What may not be reached (addresses and CIDRs).
    pub deny_out: Vec<String>,
    /// Headers set on requests to hosts ([`super::rules`]); shown with their values
    /// redacted ([`Self::shown`]).
    #[serde(skip_serializing_if = "RulesSpec::is_empty")]
    pub rules: RulesSpec,
}

/// A `network` object as a client of bud's API writes it: each list given or not.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WrittenSpec {
    #[serde(default)]
    allow_out: Option<Vec<String>>,
    #[serde(default)]
    deny_out: Option<Vec<String>>,
    #[serde(default)]
    rules: RulesSpec,
}

impl From<WrittenSpec> for PolicySpec {
    /// An allow-list without a deny list denies the rest.
    fn from(w: WrittenSpec) -> Self {
        let allow_out = w.allow_out.unwrap_or_default();
        let deny_out = match w.deny_out {
            Some(deny) => deny,
            None if !allow_out.is_empty() => vec![EVERY_ADDRESS.to_owned()],
            None => Vec::new(),
        };
        Self {
            allow_out,
            deny_out,
            rules: w.rules,
        }
    }
}

impl PolicySpec {
    /// The lists alone, E2B's meaning (rules none).
    pub fn lists(allow_out: Vec<String>, deny_out: Vec<String>) -> Self {
        Self {
            allow_out,
            deny_out,
            rules: RulesSpec::new(),
        }
    }

    /// As a sandbox shows it: each rule's header values redacted.
    pub fn shown(&self) -> Self {
        Self {
            rules: super::rules::redacted(&self.rules),
            ..self.clone()
        }
    }
}

/// An IPv4 network: an address and a prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    base: u32,
    prefix: u8,
}

impl Cidr {
    /// `a.b.c.d/prefix`; the host bits are cleared (`10.1.2.3/8` is `10.0.0.0/8`).
    pub const fn new(addr: Ipv4Addr, prefix: u8) -> Self {
        let prefix = if prefix > 32 { 32 } else { prefix };
        Self {
            base: addr.to_bits() & Self::mask(prefix),
            prefix,
        }
    }

    const fn mask(prefix: u8) -> u32 {
        if prefix == 0 {
            0
        } else {
            u32::MAX << (32 - prefix as u32)
        }
    }

    /// Whether `addr` is in this network.
    pub fn contains(&self, addr: Ipv4Addr) -> bool {
        addr.to_bits() & Self::mask(self.prefix) == self.base
    }

    /// `a.b.c.d` or `a.b.c.d/n`; None if it is neither.
    pub fn parse(text: &str) -> Option<Self> {
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (a, p.parse::<u8>().ok().filter(|p| *p <= 32)?),
            None => (text, 32),
        };
        Some(Self::new(addr.parse().ok()?, prefix))
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", Ipv4Addr::from_bits(self.base), self.prefix)
    }
}

/// What an entry matches, ports aside.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    /// `*`: every name and address.
    Any,
    Net(Cidr),
    /// A lower-case domain; `wildcard`: its subdomains only.
    Domain {
        name: String,
        wildcard: bool,
    },
}

/// One entry of a list: what it matches and on which ports.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    target: Target,
    ports: RangeInclusive<u16>,
    /// As the client wrote it, without the whitespace around it (named in the connection
    /// log as the rule that decided, once per attempt: the grammar bounds its length, where
    /// the whitespace a client may pad an entry with is bounded only by the body).
    text: String,
}

impl Entry {
    fn parse(list: &'static str, text: &str) -> Result<Self, PolicyError> {
        let bad = |why| PolicyError::Malformed {
            list,
            entry: text.to_owned(),
            why,
        };
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Err(bad("empty"));
        }
        if trimmed.contains('[') || trimmed.matches(':').count() > 1 {
            return Err(bad("IPv6 is not offered: the sandbox has IPv4 only"));
        }
        let (what, ports) = match trimmed.rsplit_once(':') {
            Some((what, ports)) => (what, parse_ports(ports).ok_or_else(|| bad("bad port"))?),
            None => (trimmed, 0..=u16::MAX),
        };
        let target = if what == "*" {
            Target::Any
        } else if let Some(net) = Cidr::parse(what) {
            Target::Net(net)
        } else if what.contains('/') || what.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
            return Err(bad("bad address or prefix"));
        } else {
            let (name, wildcard) = match what.strip_prefix("*.") {
                Some(rest) => (rest, true),
                None => (what, false),
            };
            let name = name.trim_end_matches('.').to_ascii_lowercase();
            if !valid_domain(&name) {
                return Err(bad("bad domain"));
            }
            Target::Domain { name, wildcard }
        };
        Ok(Self {
            target,
            ports,
            text: trimmed.to_owned(),
        })
    }

    fn matches(&self, name: Option<&str>, addr: Option<Ipv4Addr>, port: u16) -> bool {
        if !self.ports.contains(&port) {
            return false;
        }
        match &self.target {
            Target::Any => true,
            Target::Net(net) => addr.is_some_and(|a| net.contains(a)),
            Target::Domain { name: d, wildcard } => {
                name.is_some_and(|n| domain_matches(d, *wildcard, n))
            }
        }
    }
}

fn parse_ports(text: &str) -> Option<RangeInclusive<u16>> {
    let (lo, hi) = text.split_once('-').unwrap_or((text, text));
    let (lo, hi) = (lo.parse::<u16>().ok()?, hi.parse::<u16>().ok()?);
    (lo >= 1 && lo <= hi).then_some(lo..=hi)
}

/// `name` (lower case) against a domain entry.
fn domain_matches(domain: &str, wildcard: bool, name: &str) -> bool {
    if wildcard {
        name.len() > domain.len() + 1
            && name.ends_with(domain)
            && name.as_bytes()[name.len() - domain.len() - 1] == b'.'
    } else {
        name == domain
    }
}

/// A parsed policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    allow: Vec<Entry>,
    deny: Vec<Entry>,
    rules: Rules,
    /// As the client wrote it.
    spec: PolicySpec,
}

/// What the policy says of one connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// An allow entry matched (its text).
    Allowed(String),
    /// No entry matched: allowed (E2B's default).
    Unlisted,
    /// A deny entry matched (its text).
    Denied(String),
}

impl Decision {
    pub fn allows(&self) -> bool {
        !matches!(self, Decision::Denied(_))
    }
}

impl Policy {
    /// Everything (that the always-denied ranges leave): `--egress-default all`.
    pub fn allow_all() -> Self {
        Self {
            allow: Vec::new(),
            deny: Vec::new(),
            rules: Rules::default(),
            spec: PolicySpec::default(),
        }
    }

    /// Its rules ([`super::rules`]).
    pub fn rules(&self) -> &Rules {
        &self.rules
    }

    /// The policy as the client wrote it (an empty one for [`Self::allow_all`], which it
    /// parses back to).
    pub fn spec(&self) -> &PolicySpec {
        &self.spec
    }

    /// Parses `spec`; the secrets its rules name must be among `secrets`.
    pub fn parse(spec: &PolicySpec, secrets: &Secrets) -> Result<Self, PolicyError> {
        let list = |name: &'static str, entries: &[String]| {
            if entries.len() > MAX_ENTRIES {
                return Err(PolicyError::TooMany {
                    list: name,
                    count: entries.len(),
                });
            }
            entries
                .iter()
                .map(|e| Entry::parse(name, e))
                .collect::<Result<Vec<_>, _>>()
        };
        let allow = list("allow_out", &spec.allow_out)?;
        let deny = list("deny_out", &spec.deny_out)?;
        if let Some(d) = deny
            .iter()
            .find(|e| matches!(e.target, Target::Domain { .. }))
        {
            return Err(PolicyError::DomainDenied {
                entry: d.text.clone(),
            });
        }
        let rules = Rules::parse(&spec.rules, secrets)?;
        Ok(Self {
            allow,
            deny,
            rules,
            spec: spec.clone(),
        })
    }

    /// The decision for a connection to `port` of `name` (if the guest asked by name) at
    /// `addr` (the address that would be dialed, if known).
    pub fn decide(&self, name: Option<&str>, addr: Option<Ipv4Addr>, port: u16) -> Decision {
        if let Some(e) = self.allow.iter().find(|e| e.matches(name, addr, port)) {
            return Decision::Allowed(e.text.clone());
        }
        match self.deny.iter().find(|e| e.matches(name, addr, port)) {
            Some(e) => Decision::Denied(e.text.clone()),
            None => Decision::Unlisted,
        }
    }

    /// The policy in words, as `GET .../network` shows it beside the lists.
    pub fn describe(&self) -> String {
        let join = |entries: &[Entry]| {
            entries
                .iter()
                .map(|e| quote(&e.text))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let rest = if self.denies_every_address() {
            "nothing else".to_owned()
        } else if self.deny.is_empty() {
            "everything else".to_owned()
        } else {
            format!("everything else but {}", join(&self.deny))
        };
        let rules = if self.rules.is_empty() {
            String::new()
        } else {
            let keys: Vec<String> = self.spec.rules.keys().map(|k| quote(k)).collect();
            format!("; headers set on requests to {}", keys.join(", "))
        };
        let reach = if self.allow.is_empty() {
            if self.denies_every_address() {
                "nothing: no name resolves, no connection opens".to_owned()
            } else if self.deny.is_empty() {
                "everything (but the ranges no policy opens)".to_owned()
            } else {
                format!("everything but {}", join(&self.deny))
            }
        } else {
            format!("{}; {rest}", join(&self.allow))
        };
        reach + &rules
    }

    /// Whether a name could be reached without looking at its addresses: an allow entry
    /// names it (on some port). Where this is false and [`Self::denies_every_address`], bud's
    /// DNS answers NXDOMAIN without resolving anything.
    pub fn allows_name(&self, name: &str) -> bool {
        self.allow.iter().any(|e| match &e.target {
            Target::Any => true,
            Target::Domain { name: d, wildcard } => domain_matches(d, *wildcard, name),
            Target::Net(_) => false,
        })
    }

    /// Whether no address is reachable unless an allow entry names it: a deny entry covers
    /// every address on every port (`0.0.0.0/0`).
    pub fn denies_every_address(&self) -> bool {
        let everything = Target::Net(Cidr::new(Ipv4Addr::UNSPECIFIED, 0));
        self.deny
            .iter()
            .any(|e| e.target == everything && e.ports == (0..=u16::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(allow: &[&str], deny: &[&str]) -> Result<Policy, PolicyError> {
        let list = |l: &[&str]| l.iter().map(|s| s.to_string()).collect();
        Policy::parse(
            &PolicySpec::lists(list(allow), list(deny)),
            &Secrets::default(),
        )
    }

    fn policy(allow: &[&str], deny: &[&str]) -> Policy {
        parse(allow, deny).unwrap()
    }

    const ADDR: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 7);

    fn written(json: &str) -> PolicySpec {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn an_allow_list_alone_in_bud_s_json_denies_every_other_destination() {
        let only = written(r#"{"allow_out": ["pypi.test"]}"#);
        let both = written(r#"{"allow_out": ["pypi.test"], "deny_out": ["10.0.0.0/8"]}"#);
        let open = written(r#"{"allow_out": ["pypi.test"], "deny_out": []}"#);
        let deny_only = written(r#"{"deny_out": ["10.0.0.0/8"]}"#);
        let empty = written("{}");

        assert_eq!(only.deny_out, [EVERY_ADDRESS]);
        let p = Policy::parse(&only, &Secrets::default()).unwrap();
        assert_eq!(
            p.decide(Some("other.test"), Some(ADDR), 443),
            Decision::Denied(EVERY_ADDRESS.into())
        );
        assert!(!p.allows_name("other.test"));
        assert!(p.decide(Some("pypi.test"), Some(ADDR), 443).allows());
        assert_eq!(p.describe(), "\"pypi.test\"; nothing else");
        // Lists given both ways keep E2B's order: the rest is allowed.
        assert_eq!(both.deny_out, ["10.0.0.0/8"]);
        assert_eq!(
            Policy::parse(&both, &Secrets::default())
                .unwrap()
                .describe(),
            "\"pypi.test\"; everything else but \"10.0.0.0/8\""
        );
        assert_eq!(
            Policy::parse(&open, &Secrets::default())
                .unwrap()
                .describe(),
            "\"pypi.test\"; everything else"
        );
        assert_eq!(
            Policy::parse(&deny_only, &Secrets::default())
                .unwrap()
                .describe(),
            "everything but \"10.0.0.0/8\""
        );
        assert_eq!(empty, PolicySpec::default());
        assert_eq!(
            Policy::allow_all().describe(),
            "everything (but the ranges no policy opens)"
        );
        assert_eq!(
            policy(&[], &[EVERY_ADDRESS]).describe(),
            "nothing: no name resolves, no connection opens"
        );
        // What a sandbox shows reads back as itself.
        let shown = serde_json::to_string(&only).unwrap();
        assert_eq!(written(&shown), only);
        let err = serde_json::from_str::<PolicySpec>(r#"{"denyOut": []}"#).unwrap_err();
        assert!(
            err.to_string().starts_with(
                "unknown field `denyOut`, expected one of `allow_out`, `deny_out`, `rules`"
            ),
            "{err}"
        );
    }

    #[test]
    fn an_allowed_name_wins_over_a_deny_of_every_address() {
        let p = policy(&["pypi.test"], &["0.0.0.0/0"]);
        assert_eq!(
            p.decide(Some("pypi.test"), Some(ADDR), 443),
            Decision::Allowed("pypi.test".into())
        );
        assert_eq!(
            p.decide(Some("PyPI.test".to_ascii_lowercase().as_str()), None, 80),
            Decision::Allowed("pypi.test".into())
        );
        assert_eq!(
            p.decide(Some("evil.test"), Some(ADDR), 443),
            Decision::Denied("0.0.0.0/0".into())
        );
        assert_eq!(
            p.decide(None, Some(ADDR), 443),
            Decision::Denied("0.0.0.0/0".into())
        );
        assert!(p.allows_name("pypi.test"));
        assert!(!p.allows_name("evil.test"));
        assert!(p.denies_every_address());
    }

    #[test]
    fn a_wildcard_matches_subdomains_but_not_the_apex_or_a_lookalike() {
        let p = policy(&["*.pypi.test"], &["0.0.0.0/0"]);
        assert!(p.allows_name("files.pypi.test"));
        assert!(p.allows_name("a.b.pypi.test"));
        assert!(!p.allows_name("pypi.test"));
        assert!(!p.allows_name("evilpypi.test"));
        assert!(!p.allows_name("pypi.test.evil"));
    }

    #[test]
    fn ports_and_port_ranges_narrow_an_entry() {
        let p = policy(
            &["pypi.test:443", "203.0.113.0/24:8000-8100"],
            &["0.0.0.0/0"],
        );
        assert!(p.decide(Some("pypi.test"), Some(ADDR), 443).allows());
        assert!(!p.decide(Some("pypi.test"), Some(ADDR), 80).allows());
        assert!(p.decide(None, Some(ADDR), 8080).allows());
        assert!(!p.decide(None, Some(ADDR), 8101).allows());
        assert!(
            !p.decide(None, Some(Ipv4Addr::new(203, 0, 114, 1)), 8080)
                .allows()
        );
    }

    #[test]
    fn unlisted_is_allowed_and_a_deny_entry_refuses_its_range() {
        let p = policy(&[], &["203.0.113.0/24"]);
        assert_eq!(
            p.decide(None, Some(Ipv4Addr::new(198, 51, 100, 1)), 80),
            Decision::Unlisted
        );
        assert_eq!(
            p.decide(None, Some(ADDR), 80),
            Decision::Denied("203.0.113.0/24".into())
        );
        assert!(!p.denies_every_address());
        let all = policy(&["*"], &["0.0.0.0/0"]);
        assert!(all.allows_name("anything.test"));
        assert!(all.decide(None, Some(ADDR), 1).allows());
    }

    #[test]
    fn malformed_entries_are_refused_with_the_list_and_the_entry() {
        for bad in [
            "",
            "10.0.0.0/33",
            "300.1.2.3",
            "pypi.test:0",
            "pypi.test:9-8",
            "a..b",
            "-a.test",
            "::1",
            "[::1]:80",
            "x/8",
            "pypi.test:http",
        ] {
            let err = parse(&[bad], &[]).unwrap_err();
            assert!(
                matches!(&err, PolicyError::Malformed { list: "allow_out", entry, .. } if entry == bad),
                "{bad}: {err}"
            );
        }
        assert_eq!(
            parse(&[], &["evil.test"]).unwrap_err(),
            PolicyError::DomainDenied {
                entry: "evil.test".into()
            }
        );
        let many: Vec<String> = (0..=MAX_ENTRIES).map(|i| format!("h{i}.test")).collect();
        let refs: Vec<&str> = many.iter().map(String::as_str).collect();
        assert_eq!(
            parse(&refs, &[]).unwrap_err(),
            PolicyError::TooMany {
                list: "allow_out",
                count: MAX_ENTRIES + 1
            }
        );
    }

    #[test]
    fn a_huge_entry_is_refused_by_its_prefix_and_a_padded_one_is_logged_trimmed() {
        let huge = format!("{}!", "a".repeat(1 << 20));
        let padded = format!("{0}pypi.test{0}", " ".repeat(1 << 20));
        let err = Policy::parse(
            &PolicySpec {
                allow_out: vec![huge],
                deny_out: vec![],
                rules: Default::default(),
            },
            &Secrets::default(),
        )
        .unwrap_err();
        let denied = Policy::parse(
            &PolicySpec {
                allow_out: vec![],
                deny_out: vec![padded.clone()],
                rules: Default::default(),
            },
            &Secrets::default(),
        )
        .unwrap_err();
        let p = policy(&[&padded], &["0.0.0.0/0"]);

        assert_eq!(
            err.to_string(),
            format!(
                "allow_out: \"{}\"… (1048577 bytes) is not an IPv4 address, a CIDR, a domain or `*` (bad domain)",
                "a".repeat(64)
            )
        );
        assert_eq!(
            denied.to_string(),
            "deny_out: \"pypi.test\" is a domain; deny_out takes addresses and CIDRs (leave a name out of allow_out to deny it)"
        );
        assert_eq!(
            p.decide(Some("pypi.test"), None, 443),
            Decision::Allowed("pypi.test".into())
        );
        assert_eq!(p.spec().allow_out, [padded], "the policy as written");
    }

    #[test]
    fn a_cidr_clears_host_bits_and_contains_its_range_only() {
        let net = Cidr::parse("10.1.2.3/8").unwrap();
        assert_eq!(net.to_string(), "10.0.0.0/8");
        assert!(net.contains(Ipv4Addr::new(10, 255, 0, 1)));
        assert!(!net.contains(Ipv4Addr::new(11, 0, 0, 0)));
        assert!(Cidr::parse("0.0.0.0/0").unwrap().contains(ADDR));
        assert_eq!(
            Cidr::parse("203.0.113.7").unwrap().to_string(),
            "203.0.113.7/32"
        );
        assert!(Cidr::parse("1.2.3.4/").is_none());
    }
}
