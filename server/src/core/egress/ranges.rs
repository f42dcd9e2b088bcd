//! What no policy opens, and the names an operator pins.
//!
//! **Always denied**: every address a sandbox could use to reach the host, its network or
//! a cloud's metadata service (the ranges of E2B's `DeniedSandboxCIDRs`, plus multicast,
//! the reserved block and bud's own synthetic DNS pool). They are checked on the address
//! actually dialed, after any name is resolved on the host, so neither an IP literal, an
//! `/etc/hosts` line in the guest nor a name that resolves (or rebinds) to one of them gets
//! through. The operator opens some of them with `--egress-allow-private CIDR,...` (an
//! on-premises service; tests' loopback servers), never by a sandbox's own policy.
//!
//! **Pinned names** (`--egress-hosts FILE`, lines `NAME ADDRESS`): looked up before the
//! host's resolver, so a deployment (or a test) decides where a name goes.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::Path;

use super::policy::Cidr;
use crate::core::echo::quote;

/// The ranges no sandbox policy opens.
pub const ALWAYS_DENIED: [Cidr; 11] = [
    Cidr::new(Ipv4Addr::new(0, 0, 0, 0), 8),
    Cidr::new(Ipv4Addr::new(10, 0, 0, 0), 8),
    Cidr::new(Ipv4Addr::new(100, 64, 0, 0), 10),
    Cidr::new(Ipv4Addr::new(127, 0, 0, 0), 8),
    Cidr::new(Ipv4Addr::new(169, 254, 0, 0), 16),
    Cidr::new(Ipv4Addr::new(172, 16, 0, 0), 12),
    Cidr::new(Ipv4Addr::new(192, 168, 0, 0), 16),
    // bud's synthetic DNS answers (vmm::net::dns): never a real destination.
    Cidr::new(Ipv4Addr::new(198, 18, 0, 0), 15),
    Cidr::new(Ipv4Addr::new(224, 0, 0, 0), 4),
    Cidr::new(Ipv4Addr::new(240, 0, 0, 0), 4),
    Cidr::new(Ipv4Addr::new(255, 255, 255, 255), 32),
];

/// The operator's exceptions to [`ALWAYS_DENIED`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Private(Vec<Cidr>);

impl Private {
    /// `CIDR,CIDR,...` (addresses are /32s).
    pub fn parse(text: &str) -> Result<Self, String> {
        text.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                Cidr::parse(s).ok_or_else(|| format!("{} is not an IPv4 address or CIDR", quote(s)))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Self)
    }

    /// Whether `addr` may be dialed at all (not always-denied, or opened by the operator).
    pub fn dialable(&self, addr: Ipv4Addr) -> bool {
        !ALWAYS_DENIED.iter().any(|r| r.contains(addr)) || self.0.iter().any(|r| r.contains(addr))
    }
}

/// Names pinned to addresses (`--egress-hosts`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hosts(HashMap<String, Vec<Ipv4Addr>>);

/// A line of a hosts file that is not `NAME ADDRESS`.
#[derive(Debug, thiserror::Error)]
pub enum HostsError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}, line {line}: {why} (want `NAME IPV4-ADDRESS`)")]
    Line {
        path: String,
        line: usize,
        why: String,
    },
}

impl Hosts {
    pub fn load(path: &Path) -> Result<Self, HostsError> {
        let text = std::fs::read_to_string(path).map_err(|source| HostsError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text).map_err(|(line, why)| HostsError::Line {
            path: path.display().to_string(),
            line,
            why,
        })
    }

    /// `NAME ADDRESS` a line; `#` starts a comment. A name on several lines has every
    /// address, in order.
    pub fn parse(text: &str) -> Result<Self, (usize, String)> {
        let mut map: HashMap<String, Vec<Ipv4Addr>> = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut words = line.split_whitespace();
            let (Some(name), Some(addr), None) = (words.next(), words.next(), words.next()) else {
                return Err((i + 1, quote(line)));
            };
            let addr: Ipv4Addr = addr
                .parse()
                .map_err(|_| (i + 1, format!("{} is not an IPv4 address", quote(addr))))?;
            map.entry(name.trim_end_matches('.').to_ascii_lowercase())
                .or_default()
                .push(addr);
        }
        Ok(Self(map))
    }

    pub fn get(&self, name: &str) -> Option<&[Ipv4Addr]> {
        self.0.get(name).map(Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_private_metadata_and_the_synthetic_pool_are_never_dialable_by_default() {
        let none = Private::default();
        for a in [
            "127.0.0.1",
            "10.0.2.2",
            "169.254.169.254",
            "172.20.0.1",
            "192.168.1.1",
            "198.18.0.5",
            "0.0.0.0",
            "224.0.0.1",
            "100.64.0.1",
        ] {
            assert!(!none.dialable(a.parse().unwrap()), "{a}");
        }
        assert!(none.dialable(Ipv4Addr::new(203, 0, 113, 7)));
        let lo = Private::parse("127.0.0.1, 10.9.0.0/16").unwrap();
        assert!(lo.dialable(Ipv4Addr::LOCALHOST));
        assert!(!lo.dialable(Ipv4Addr::new(127, 0, 0, 2)));
        assert!(lo.dialable(Ipv4Addr::new(10, 9, 3, 4)));
        assert!(!lo.dialable(Ipv4Addr::new(169, 254, 169, 254)));
        assert!(Private::parse("127.0.0.1,nonsense").is_err());
    }

    #[test]
    fn a_hosts_file_pins_names_case_insensitively_and_says_which_line_is_bad() {
        let h =
            Hosts::parse("# pins\nPyPI.test 127.0.0.1\npypi.test. 127.0.0.2 # second\n\n").unwrap();
        assert_eq!(
            h.get("pypi.test"),
            Some(&[Ipv4Addr::LOCALHOST, Ipv4Addr::new(127, 0, 0, 2)][..])
        );
        assert_eq!(h.get("other.test"), None);
        assert_eq!(Hosts::parse("a.test 1.2.3.4\nb.test\n").unwrap_err().0, 2);
        assert_eq!(Hosts::parse("a.test ::1\n").unwrap_err().0, 1);
        assert_eq!(Hosts::parse("a.test 1.2.3.4 extra\n").unwrap_err().0, 1);
    }
}
