//! The per-connection decision: which names the guest may resolve and where each of its TCP
//! connections goes. The network stack ([`super::stack`]) asks; whoever owns the VM's policy
//! answers (the server in stage 2 of `docs/network-design.md`, a test's map in stage 1).
//!
//! The stack never dials anything an [`Egress`] did not name: a refused connection is
//! answered with a TCP RST to the guest's SYN (`ECONNREFUSED` in the guest), a name the
//! egress does not know with NXDOMAIN (`socket.gaierror`), and nothing leaves the host.

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub use super::names::Refusal;

/// One TCP connection the guest opens, as the stack sees its first segment (SYN).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectRequest<'a> {
    /// The name the guest resolved to `addr` through bud's DNS, if `addr` is one of bud's
    /// synthetic addresses; `None` for an address the guest used directly.
    pub name: Option<&'a str>,
    /// The destination address the guest used.
    pub addr: Ipv4Addr,
    /// The destination port.
    pub port: u16,
    /// This connection's number, unique in the process ([`next_connection_id`]): an
    /// allowed connection that opens is reported to [`Egress::closed`] under it.
    pub id: u64,
}

/// Bytes one connection moved, counted by the stack's relay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// From the guest to the host it dialed.
    pub sent: u64,
    /// From that host to the guest.
    pub received: u64,
    /// HTTP requests that had headers set ([`Egress::headers`]).
    pub rewritten: u64,
}

/// Why the stack refused a connection itself, without asking the egress's policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// The VM already had as many connections open or being dialed as one may.
    Connections,
    /// The VM already had as many connections being dialed (not yet connected or failed)
    /// as one may.
    Dials,
    /// The VM's connections had moved all the bytes its egress allows
    /// ([`Egress::byte_budget`]).
    Bytes,
}

/// A number no other connection of this process has had.
pub(crate) fn next_connection_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// What becomes of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Dial this host address and relay the connection to it.
    Dial(SocketAddr),
    /// Refuse: the guest's SYN gets a RST, nothing is dialed.
    Refuse,
}

/// Decides names and connections for one VM. Called on the vCPU thread: keep it fast and
/// never block (a policy lookup, not a network call).
pub trait Egress: Send + Sync + fmt::Debug {
    /// Whether bud answers a DNS query for `name` (lower case, no trailing dot) with an
    /// address. `false` is NXDOMAIN: nothing is resolved upstream, nothing forwarded.
    fn knows(&self, name: &str) -> bool;

    /// Where the connection `req` goes, if anywhere.
    fn connect(&self, req: &ConnectRequest<'_>) -> Verdict;

    /// The stack refused `req` itself, without asking, for `limit` (for the egress's
    /// record; called on the vCPU thread, so it must not block).
    fn over_limit(&self, _req: &ConnectRequest<'_>, _limit: Limit) {}

    /// What connection `id`, which the egress allowed for `name` (the name the guest
    /// resolved) and the stack just opened, carries besides the guest's bytes: headers the
    /// relay sets on each of its HTTP requests ([`super::names::NameCheck::with_headers`]),
    /// or a refusal (it cannot be given what it must carry). Called once per named
    /// connection, on the vCPU thread: it must not block.
    fn headers(&self, _id: u64, _name: &str) -> Headers {
        Headers::None
    }

    /// How bud terminates TLS to `name` for a connection whose requests get headers set
    /// ([`Headers::Set`]): a certificate for the name that the guest trusts, and a client
    /// that verifies the host. `None` (the default): such TLS is refused
    /// ([`Refusal::Encrypted`]). Called on the vCPU thread when such a connection starts
    /// TLS: it must not block (make the certificate earlier, in [`Self::connect`]).
    fn interception(&self, _name: &str) -> Option<super::Interception> {
        None
    }

    /// Connection `id`, which the egress allowed for `name` (the name the guest resolved),
    /// then named another host in its bytes, or bytes whose name could not be read
    /// ([`super::names`]): the stack reset it (it is still reported to [`Self::closed`]).
    /// Called on the vCPU thread: it must not block.
    fn name_refused(&self, _id: u64, _name: &str, _refusal: &Refusal) {}

    /// Bytes, both ways together, that the VM's connections open now and later may still
    /// move (the cap less what its connections already over moved); None: no cap. The stack
    /// moves no byte past it, then resets every open connection and refuses new ones. Asked
    /// on the vCPU thread each time the stack relays: it must not block.
    fn byte_budget(&self) -> Option<u64> {
        None
    }

    /// Connection `id`, which the egress allowed and the stack opened, is over: both sides
    /// closed, reset, or the VM's stack went (a reset, a pause, the end of a one-shot job).
    /// `traffic` is what it moved. Called once per opened connection, on the vCPU thread:
    /// it must not block.
    fn closed(&self, _id: u64, _traffic: Traffic) {}
}

/// The default: no name resolves, every connection is refused (a VM with a network card but
/// no policy has no route out).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoEgress;

impl Egress for NoEgress {
    fn knows(&self, _name: &str) -> bool {
        false
    }

    fn connect(&self, _req: &ConnectRequest<'_>) -> Verdict {
        Verdict::Refuse
    }
}

/// What a connection carries besides the guest's bytes ([`Egress::headers`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Headers {
    /// Nothing: the guest's bytes as they are (its names checked).
    None,
    /// These headers (name, value), set on each HTTP request in place of the guest's of
    /// the same names; TLS is terminated by bud where the egress gives an
    /// [`Egress::interception`], else refused ([`Refusal::Encrypted`]).
    Set(Vec<(String, String)>),
    /// Nothing may go: the connection is reset at once.
    Refuse,
}

/// One job's egress ([`crate::Job::egress`]): a handle that compares by identity, as a
/// [`crate::Cancel`] does.
#[derive(Debug, Clone)]
pub struct JobEgress(pub Arc<dyn Egress>);

impl PartialEq for JobEgress {
    /// The same egress.
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for JobEgress {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_egress_knows_no_name_and_refuses_every_connection() {
        let req = ConnectRequest {
            name: Some("example.test"),
            addr: Ipv4Addr::new(198, 18, 0, 1),
            port: 80,
            id: next_connection_id(),
        };

        assert!(!NoEgress.knows("example.test"));
        assert_eq!(NoEgress.connect(&req), Verdict::Refuse);
        assert!(
            next_connection_id() > req.id,
            "numbers are never handed out twice"
        );
    }
}
