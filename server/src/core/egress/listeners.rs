//! The server's own listening sockets (its API, its agent-check port), which no sandbox
//! reaches, whatever its policy and whatever `--egress-allow-private` opens: a sandbox
//! allowed `127.0.0.1` for a local package mirror must not reach bud's API on the same
//! address (with the host's own source address, as if it were the operator).
//!
//! A listener on one address is reached by that address and its port (and by `0.0.0.0/8`,
//! which stands for this host: Linux connects `0.0.0.0` to loopback). A listener on
//! `0.0.0.0` (or `::`, which takes IPv4 too) is reached by every address of this host on
//! its port: loopback (`127.0.0.0/8`), `0.0.0.0/8`, and each address of the host's
//! interfaces, asked of the kernel at each decision ([`is_this_host`]), so an address the
//! host gains while the server runs is known at once.
//!
//! The listeners are registered as they are bound ([`crate::http::serve`], the agent port
//! at startup); nothing here dials or binds.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{PoisonError, RwLock};

use super::policy::Cidr;

/// `0.0.0.0/8`: "this host" as a destination.
const THIS_HOST: Cidr = Cidr::new(Ipv4Addr::UNSPECIFIED, 8);
const LOOPBACK: Cidr = Cidr::new(Ipv4Addr::new(127, 0, 0, 0), 8);

/// The addresses the server listens on.
#[derive(Debug, Default)]
pub struct Listeners(RwLock<Vec<SocketAddr>>);

/// Which IPv4 destinations reach a listener, by the address it is bound to.
enum Bound {
    /// Every address of this host.
    Everywhere,
    At(Ipv4Addr),
    /// An IPv6 address no IPv4 connection reaches (the guest has IPv4 only).
    Elsewhere,
}

fn bound(ip: IpAddr) -> Bound {
    let v4 = match ip {
        IpAddr::V4(v4) => v4,
        IpAddr::V6(v6) if v6.is_unspecified() => return Bound::Everywhere,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4,
            None => return Bound::Elsewhere,
        },
    };
    if v4.is_unspecified() {
        Bound::Everywhere
    } else {
        Bound::At(v4)
    }
}

impl Listeners {
    /// Adds a socket the server listens on.
    pub fn add(&self, addr: SocketAddr) {
        let mut all = self.0.write().unwrap_or_else(PoisonError::into_inner);
        if !all.contains(&addr) {
            all.push(addr);
        }
    }

    /// The sockets the server listens on.
    pub fn all(&self) -> Vec<SocketAddr> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The listener a connection to `addr:port` would reach, if any.
    pub fn reached_by(&self, addr: Ipv4Addr, port: u16) -> Option<SocketAddr> {
        let all = self.0.read().unwrap_or_else(PoisonError::into_inner);
        // Asked of the kernel once, and only for a port the server listens on.
        let mut this_host = None;
        all.iter().copied().find(|l| {
            l.port() == port
                && match bound(l.ip()) {
                    Bound::Everywhere => *this_host.get_or_insert_with(|| is_this_host(addr)),
                    Bound::At(ip) => ip == addr || THIS_HOST.contains(addr),
                    Bound::Elsewhere => false,
                }
        })
    }
}

/// Whether `addr` is an address of this host: loopback, `0.0.0.0/8`, or one the kernel
/// routes to itself (a UDP socket connected to it takes it as its own source address;
/// nothing is sent). Where the kernel cannot be asked, yes: a refusal, never a way in.
pub fn is_this_host(addr: Ipv4Addr) -> bool {
    if LOOPBACK.contains(addr) || THIS_HOST.contains(addr) {
        return true;
    }
    match source_for(addr) {
        Ok(source) => source == addr,
        // No route to it: not one of the host's (its own addresses always route), and no
        // dial would reach it either.
        Err(Probe::Connect) => false,
        Err(Probe::Socket | Probe::Name) => true,
    }
}

/// The step of [`source_for`] that failed.
#[derive(Debug)]
enum Probe {
    Socket,
    Connect,
    Name,
}

/// The source address the host would use to reach `addr`: a UDP socket connected to it
/// (which picks the route and sends nothing) and asked its own address. `socket`,
/// `connect`, `getsockname` and `close` only: what the jail lets the dial threads make
/// (`bind`, which `std::net::UdpSocket` would make first, it does not).
fn source_for(addr: Ipv4Addr) -> Result<Ipv4Addr, Probe> {
    // SAFETY: socket takes no pointers; a descriptor it returns is owned just below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(Probe::Socket);
    }
    // SAFETY: `fd` is a socket just made, owned by nothing else; dropping it closes it.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let to = sockaddr(addr);
    let size = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: `to` is a live sockaddr_in and `size` is its size.
    let rc = unsafe {
        libc::connect(
            socket.as_raw_fd(),
            (&raw const to).cast::<libc::sockaddr>(),
            size,
        )
    };
    if rc < 0 {
        return Err(Probe::Connect);
    }
    let mut from = sockaddr(Ipv4Addr::UNSPECIFIED);
    let mut len = size;
    // SAFETY: `from` is a live sockaddr_in of `len` bytes, which getsockname writes at
    // most, and `len` a live socklen_t it updates.
    let rc = unsafe {
        libc::getsockname(
            socket.as_raw_fd(),
            (&raw mut from).cast::<libc::sockaddr>(),
            &mut len,
        )
    };
    if rc < 0 || i32::from(from.sin_family) != libc::AF_INET {
        return Err(Probe::Name);
    }
    Ok(Ipv4Addr::from(u32::from_be(from.sin_addr.s_addr)))
}

/// `addr`, port 9 (discard: a UDP connect needs a port, and sends nothing to it).
fn sockaddr(addr: Ipv4Addr) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 9u16.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listeners(addrs: &[&str]) -> Listeners {
        let l = Listeners::default();
        for a in addrs {
            l.add(a.parse().unwrap());
        }
        l
    }

    /// The host's IPv4 addresses outside loopback, from `getifaddrs` (what `ip addr`
    /// shows): what the probe must find without being told.
    fn interface_addresses() -> Vec<Ipv4Addr> {
        let mut found = Vec::new();
        let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
        // SAFETY: getifaddrs writes a list it allocates to `head`, freed below.
        assert_eq!(unsafe { libc::getifaddrs(&mut head) }, 0);
        let mut at = head;
        while !at.is_null() {
            // SAFETY: `at` is an entry of the list getifaddrs made, alive until freeifaddrs.
            let entry = unsafe { &*at };
            let family = if entry.ifa_addr.is_null() {
                None
            } else {
                // SAFETY: a non-null `ifa_addr` points at the entry's sockaddr.
                Some(i32::from(unsafe { (*entry.ifa_addr).sa_family }))
            };
            if family == Some(libc::AF_INET) {
                // SAFETY: as above: the family says it is a sockaddr_in.
                let sin = unsafe { &*entry.ifa_addr.cast::<libc::sockaddr_in>() };
                found.push(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
            }
            at = entry.ifa_next;
        }
        // SAFETY: `head` is the list getifaddrs made, freed once.
        unsafe { libc::freeifaddrs(head) };
        found.retain(|a| !a.is_loopback());
        found
    }

    const PUBLIC: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 7);

    #[test]
    fn a_listener_on_one_address_is_reached_by_that_address_and_port_only() {
        let l = listeners(&["127.0.0.1:8080", "[::1]:8081"]);
        let at = |a: &str, port| l.reached_by(a.parse().unwrap(), port);

        assert_eq!(
            at("127.0.0.1", 8080),
            Some("127.0.0.1:8080".parse().unwrap())
        );
        assert_eq!(at("0.0.0.0", 8080), Some("127.0.0.1:8080".parse().unwrap()));
        assert_eq!(at("127.0.0.1", 8081), None, "IPv6 loopback only");
        assert_eq!(at("127.0.0.2", 8080), None);
        assert_eq!(at("127.0.0.1", 8079), None);
        assert_eq!(l.reached_by(PUBLIC, 8080), None);
    }

    #[test]
    fn a_listener_on_every_address_is_reached_by_each_of_the_hosts_and_no_other() {
        let v4 = listeners(&["0.0.0.0:8080"]);
        let v6 = listeners(&["[::]:8080"]);
        let mut host = interface_addresses();
        host.extend(["127.0.0.1", "127.1.2.3", "0.0.0.0"].map(|a| a.parse::<Ipv4Addr>().unwrap()));

        for addr in &host {
            assert!(v4.reached_by(*addr, 8080).is_some(), "{addr}");
            assert!(v6.reached_by(*addr, 8080).is_some(), "{addr}");
            assert_eq!(v4.reached_by(*addr, 8081), None, "{addr}");
        }
        assert_eq!(v4.reached_by(PUBLIC, 8080), None);
        assert_eq!(v6.reached_by(PUBLIC, 8080), None);
        assert!(!is_this_host(PUBLIC));
    }

    #[test]
    fn a_listener_added_twice_is_kept_once() {
        let l = listeners(&["127.0.0.1:8080", "127.0.0.1:8080", "127.0.0.1:9000"]);

        assert_eq!(
            l.all(),
            ["127.0.0.1:8080", "127.0.0.1:9000"].map(|a| a.parse::<SocketAddr>().unwrap())
        );
    }
}
