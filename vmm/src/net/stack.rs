//! The user-mode network stack behind the card: smoltcp as a socket-level proxy. The guest's
//! TCP connections end in smoltcp sockets here, and each allowed one is relayed to one host
//! socket that the VMM dialed itself; bud's DNS answers on the gateway's UDP port 53. No tap,
//! no raw sockets, nothing that needs privileges: upstream is an ordinary `connect()`.
//!
//! **Transparent accept.** smoltcp accepts packets for any destination routed through the
//! gateway (`any_ip`); before a frame reaches it, a TCP SYN for a connection no socket holds
//! is *held*, and the VM's [`Egress`] is asked about it on a thread of [`super::dialer`],
//! which starts a non-blocking dial of what the egress allows ([`super::connect`]: no thread
//! waits for it). When that comes back: refused (or a dial that failed or timed out) leaves
//! no socket, and the SYN goes to smoltcp, which answers it with a RST
//! (`ECONNREFUSED` in the guest); allowed, a smoltcp socket listens on the SYN's destination
//! and the SYN opens it. The guest's retransmits of a held SYN are dropped. DNS queries are
//! held the same way while the egress is asked about the name (it may resolve it).
//!
//! **Limits per VM**, each refused at once with a RST and reported to the egress
//! ([`Egress::over_limit`], for its log) without asking it: [`MAX_RELAYS`] connections open
//! or being dialed, [`MAX_DIALS_IN_FLIGHT`] of them being dialed (held: their SYN not yet
//! answered), and the egress's byte budget. A refusal past the dials cap is what the guest
//! can see and the log can show (`ECONNREFUSED` at once): a SYN held until another dial
//! ended would be a wait the guest's program could not tell from a slow network, and
//! would need a second queue per VM.
//!
//! Everything else runs on the vCPU thread, between guest exits ([`super::Nic`]), and makes no
//! system call but `read`, `write` and `shutdown` on connected sockets (the dialer and the
//! connect thread connect them, non-blocking, and register them with the VM's [`Waker`],
//! which kicks the vCPU when one is ready, when smoltcp's next timer is due, or when a
//! lookup or a dial is done); and `close` and a lock when the stack goes (its dials under
//! way are cancelled).

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::phy::{self, Checksum, DeviceCapabilities, Medium};
use smoltcp::socket::{tcp, udp};
use smoltcp::wire::{
    EthernetAddress, EthernetFrame, EthernetProtocol, IpAddress, IpCidr, IpEndpoint,
    IpListenEndpoint, IpProtocol, Ipv4Packet, TcpPacket,
};

use super::connect::{self, DIAL_TIMEOUT};
use super::dialer;
use super::dns::{Answer, DnsMap};
use super::egress::{ConnectRequest, Egress, Headers, Limit, Traffic, Verdict, next_connection_id};
use super::inbox::{Conn, Dialed, Done, Inbox, connected, deliver, lock};
use super::names::{NameCheck, Refusal};
use super::terminate::{self, Terminated};
use super::waker::Waker;
use super::{DNS_PORT, GATEWAY_IP, GATEWAY_MAC, GUEST_PREFIX};

/// Connections one VM may have open or being dialed at once; a SYN past it is refused.
const MAX_RELAYS: usize = 64;
/// Connections one VM may have being dialed at once (from its SYN until the dial's outcome
/// comes back): a SYN past it is refused. Dials hold no thread ([`super::connect`]); this
/// bounds what one VM's dials to hosts that never answer keep in flight (sockets, entries
/// in the connect thread's wait), and how fast it can probe such hosts: a dial that hangs
/// frees its place only at its timeout.
pub(crate) const MAX_DIALS_IN_FLIGHT: usize = 32;
/// DNS queries one VM may have waiting for its egress; more are dropped (the guest's
/// resolver asks again).
const MAX_DNS_IN_FLIGHT: usize = 16;
/// Each relay's smoltcp buffer, each way.
const RELAY_BUFFER: usize = 256 << 10;
/// Frames queued towards the guest before smoltcp is told the link is busy.
const MAX_QUEUED_TO_GUEST: usize = 512;
/// A listening socket whose SYN never came (or was reset) is dropped after this long.
const LISTEN_LIFETIME: Duration = Duration::from_secs(10);
/// DNS datagrams buffered each way, and their bytes.
const DNS_PACKETS: usize = 16;
const DNS_BYTES: usize = 16 << 10;

/// The link between the card and smoltcp: frames each way.
#[derive(Debug, Default)]
pub(crate) struct Link {
    /// Frames the guest sent, not yet given to smoltcp.
    pub(crate) to_stack: VecDeque<Vec<u8>>,
    /// Frames smoltcp sent, not yet delivered to the guest.
    pub(crate) to_guest: VecDeque<Vec<u8>>,
    /// The card's MTU (IP packet size).
    mtu: usize,
}

/// One received frame, for smoltcp.
pub(crate) struct RxFrame(Vec<u8>);

/// Room for one frame towards the guest.
pub(crate) struct TxFrame<'a>(&'a mut VecDeque<Vec<u8>>);

impl phy::RxToken for RxFrame {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(&self.0)
    }
}

impl phy::TxToken for TxFrame<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let mut frame = vec![0; len];
        let r = f(&mut frame);
        self.0.push_back(frame);
        r
    }
}

impl phy::Device for Link {
    type RxToken<'a> = RxFrame;
    type TxToken<'a> = TxFrame<'a>;

    fn receive(&mut self, _: smoltcp::time::Instant) -> Option<(RxFrame, TxFrame<'_>)> {
        let frame = self.to_stack.pop_front()?;
        Some((RxFrame(frame), TxFrame(&mut self.to_guest)))
    }

    fn transmit(&mut self, _: smoltcp::time::Instant) -> Option<TxFrame<'_>> {
        (self.to_guest.len() < MAX_QUEUED_TO_GUEST).then_some(TxFrame(&mut self.to_guest))
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ethernet;
        caps.max_transmission_unit = self.mtu + crate::devices::virtio::net::ETH_HDR_LEN;
        // The guest leaves TCP/UDP checksums to the card (VIRTIO_NET_F_CSUM) and the stack
        // terminates every connection: verify nothing it receives, compute what it sends.
        caps.checksum.tcp = Checksum::Tx;
        caps.checksum.udp = Checksum::Tx;
        caps
    }
}

/// One guest connection and the host socket it is relayed to.
#[derive(Debug)]
pub(super) struct Relay {
    pub(super) handle: SocketHandle,
    pub(super) host: File,
    pub(super) created: Instant,
    /// The connection's number ([`ConnectRequest::id`]) and the bytes it moved, reported to
    /// the egress when the relay goes.
    pub(super) id: u64,
    pub(super) traffic: Traffic,
    /// The host closed its side (its FIN was passed on to the guest).
    pub(super) host_done: bool,
    /// The guest closed its side (passed on to the host with `shutdown(Write)`).
    pub(super) guest_done: bool,
    /// The name the connection was allowed for (the guest resolved it), if any.
    pub(super) name: Option<String>,
    /// The check of the names its bytes carry, until it is over (None: nothing to check).
    pub(super) check: Option<NameCheck>,
    /// Bytes the check let through that the host has not taken yet.
    pub(super) to_host: Vec<u8>,
    /// The guest's TLS, terminated by bud (a host whose requests get headers set:
    /// [`super::terminate`]); its check is inside it.
    pub(super) tls: Option<Box<Terminated>>,
}

/// What the stack did, for diagnostics and tests (not part of any state).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StackCounters {
    pub dns_queries: u64,
    pub connections_allowed: u64,
    pub connections_refused: u64,
    pub dials_failed: u64,
    pub bytes_to_host: u64,
    pub bytes_to_guest: u64,
}

/// smoltcp, its sockets and the relays of one VM.
pub(crate) struct Stack {
    iface: Interface,
    sockets: SocketSet<'static>,
    pub(crate) link: Link,
    dns_socket: SocketHandle,
    dns: DnsMap,
    relays: Vec<Relay>,
    /// SYNs held while the dialer works on their connection, with the connection's number
    /// and the name the guest resolved for its address (if it did).
    held: HashMap<Conn, (Vec<u8>, u64, Option<String>)>,
    /// Connections refused or failed whose SYN goes to smoltcp next (for its RST).
    refused: HashSet<Conn>,
    dns_in_flight: usize,
    inbox: Arc<Mutex<Inbox>>,
    /// This VM in the dialer's turns (its work waits in a queue of its own).
    owner: dialer::Owner,
    /// How long each dial may take ([`DIAL_TIMEOUT`]).
    dial_timeout: Duration,
    egress: Arc<dyn Egress>,
    waker: Arc<Waker>,
    origin: Instant,
    counters: StackCounters,
    scratch: Vec<u8>,
}

impl std::fmt::Debug for Stack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stack")
            .field("relays", &self.relays.len())
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

impl Stack {
    /// A fresh stack: the gateway's address and MAC, a default route through itself (so
    /// `any_ip` takes every destination), the DNS socket, no connections.
    pub(crate) fn new(mtu: u16, egress: Arc<dyn Egress>, waker: Arc<Waker>) -> Self {
        let mut link = Link {
            mtu: usize::from(mtu),
            ..Link::default()
        };
        let origin = Instant::now();
        let mut config = Config::new(EthernetAddress(GATEWAY_MAC).into());
        config.random_seed = origin.elapsed().as_nanos() as u64 ^ 0x6275_6400;
        let mut iface = Interface::new(config, &mut link, smoltcp::time::Instant::ZERO);
        iface.update_ip_addrs(|addrs| {
            // Capacity is smoltcp's IFACE_MAX_ADDR_COUNT (at least 2): one address fits.
            let _ = addrs.push(IpCidr::new(IpAddress::Ipv4(GATEWAY_IP), GUEST_PREFIX));
        });
        // A full route table has room for one default route: cannot fail on a new interface.
        let _ = iface.routes_mut().add_default_ipv4_route(GATEWAY_IP);
        iface.set_any_ip(true);
        let mut sockets = SocketSet::new(Vec::new());
        let buffer = || {
            udp::PacketBuffer::new(
                vec![udp::PacketMetadata::EMPTY; DNS_PACKETS],
                vec![0; DNS_BYTES],
            )
        };
        let mut dns = udp::Socket::new(buffer(), buffer());
        // Binding a fresh socket to a non-zero port cannot fail.
        let _ = dns.bind(IpListenEndpoint {
            addr: Some(IpAddress::Ipv4(GATEWAY_IP)),
            port: DNS_PORT,
        });
        let dns_socket = sockets.add(dns);
        Self {
            iface,
            sockets,
            link,
            dns_socket,
            dns: DnsMap::default(),
            relays: Vec::new(),
            held: HashMap::new(),
            refused: HashSet::new(),
            dns_in_flight: 0,
            inbox: Arc::default(),
            owner: dialer::Owner::new(),
            dial_timeout: DIAL_TIMEOUT,
            egress,
            waker,
            origin,
            counters: StackCounters::default(),
            scratch: vec![0; DNS_BYTES],
        }
    }

    /// Decides names and connections from now on.
    pub(crate) fn set_egress(&mut self, egress: Arc<dyn Egress>) {
        self.egress = egress;
    }

    /// The egress in force.
    pub(crate) fn egress(&self) -> Arc<dyn Egress> {
        self.egress.clone()
    }

    /// This VM in the dialer's turns and the connect thread's dials.
    #[cfg(test)]
    pub(crate) fn owner(&self) -> dialer::Owner {
        self.owner
    }

    /// Dials take at most `timeout` from now on (tests use a short one).
    #[cfg(test)]
    pub(crate) fn set_dial_timeout(&mut self, timeout: Duration) {
        self.dial_timeout = timeout;
    }

    pub(crate) fn counters(&self) -> StackCounters {
        self.counters
    }

    /// Whether the stack holds nothing a fresh one would not: no connection, none being
    /// dialed, no query waiting, no name handed out, no frame queued either way.
    pub(crate) fn is_pristine(&self) -> bool {
        self.relays.is_empty()
            && self.held.is_empty()
            && self.refused.is_empty()
            && self.dns_in_flight == 0
            && self.dns.is_empty()
            && self.link.to_stack.is_empty()
            && self.link.to_guest.is_empty()
    }

    /// Whether work of the dialer for this stack is under way.
    #[cfg(test)]
    pub(crate) fn is_waiting(&self) -> bool {
        !self.held.is_empty() || self.dns_in_flight > 0
    }

    fn now(&self) -> smoltcp::time::Instant {
        smoltcp::time::Instant::from_micros(self.origin.elapsed().as_micros() as i64)
    }

    /// Runs the stack over what is queued: the guest's frames (each SYN classified first),
    /// DNS, the relays both ways, then smoltcp's output. Returns when smoltcp next wants to
    /// run (a timer), if ever.
    pub(crate) fn poll(&mut self) -> Option<Duration> {
        let now = self.now();
        self.take_done();
        while let Some(frame) = self.link.to_stack.pop_front() {
            if let Some(conn) = new_syn(&frame)
                && self.hold(conn, &frame)
            {
                continue;
            }
            self.link.to_stack.push_front(frame);
            let _ = self
                .iface
                .poll_ingress_single(now, &mut self.link, &mut self.sockets);
        }
        self.serve_dns();
        self.relay();
        let _ = self
            .iface
            .poll_egress(now, &mut self.link, &mut self.sockets);
        // What the egress queued may let more host bytes in (acks opened the window).
        self.relay();
        let _ = self
            .iface
            .poll_egress(now, &mut self.link, &mut self.sockets);
        self.reap();
        self.iface
            .poll_delay(self.now(), &self.sockets)
            .map(|d| Duration::from_micros(d.total_micros()))
    }

    /// Whether the SYN of `conn` (`frame`) is held: a new connection, whose egress the
    /// dialer is asked about now, or a retransmit of one being dialed (dropped). Not held: a
    /// connection a socket already has, one just refused (smoltcp answers with a RST), or one
    /// past a limit (module docs).
    fn hold(&mut self, conn: Conn, frame: &[u8]) -> bool {
        if self.refused.remove(&conn) {
            return false;
        }
        if self.held.contains_key(&conn) {
            return true;
        }
        let (src, dst) = conn;
        let has_socket = self.relays.iter().any(|r| {
            let s = self.sockets.get::<tcp::Socket>(r.handle);
            s.remote_endpoint() == Some(src)
                || (s.state() == tcp::State::Listen && s.listen_endpoint().port == dst.port && {
                    s.listen_endpoint().addr == Some(dst.addr)
                })
        });
        if has_socket {
            return false;
        }
        let IpAddress::Ipv4(addr) = dst.addr;
        let name = self.dns.name_of(addr).map(str::to_owned);
        let id = next_connection_id();
        let limit = if self.relays.len() + self.held.len() >= MAX_RELAYS {
            Some(Limit::Connections)
        } else if self.held.len() >= MAX_DIALS_IN_FLIGHT {
            Some(Limit::Dials)
        } else if self.bytes_left() == Some(0) {
            Some(Limit::Bytes)
        } else {
            None
        };
        if let Some(limit) = limit {
            self.counters.connections_refused += 1;
            let req = ConnectRequest {
                name: name.as_deref(),
                addr,
                port: dst.port,
                id,
            };
            self.egress.over_limit(&req, limit);
            return false;
        }
        self.held.insert(conn, (frame.to_vec(), id, name.clone()));
        let (egress, inbox, waker) = (self.egress.clone(), self.inbox.clone(), self.waker.clone());
        let (owner, timeout) = (self.owner, self.dial_timeout);
        dialer::submit(
            self.owner,
            dialer::Kind::Dial,
            Box::new(move || {
                let req = ConnectRequest {
                    name: name.as_deref(),
                    addr,
                    port: dst.port,
                    id,
                };
                match egress.connect(&req) {
                    Verdict::Refuse => deliver(&inbox, &waker, Done::Dial(conn, Dialed::Refused)),
                    // The dialer's thread is free once the connect is started.
                    Verdict::Dial(target) => connect::dial(
                        owner,
                        target,
                        timeout,
                        Box::new(move |outcome| {
                            let dialed = connected(outcome, &waker);
                            deliver(&inbox, &waker, Done::Dial(conn, dialed));
                        }),
                    ),
                }
            }),
        );
        true
    }

    /// Takes what the dialer finished: each held SYN goes back to the front of the queue,
    /// to a socket listening for it or to smoltcp's RST; each DNS query is answered.
    fn take_done(&mut self) {
        let done = std::mem::take(&mut lock(&self.inbox).done);
        for d in done {
            match d {
                Done::Dial(conn, dialed) => {
                    let Some((syn, id, name)) = self.held.remove(&conn) else {
                        continue;
                    };
                    let opened = match dialed {
                        Dialed::Connected(host) => {
                            let headers = match &name {
                                Some(name) => self.egress.headers(id, name),
                                None => Headers::None,
                            };
                            if headers == Headers::Refuse {
                                // Allowed and dialed, then refused: over before it opened.
                                self.egress.closed(id, Traffic::default());
                                false
                            } else {
                                self.open_relay(conn.1, host, id, name, headers)
                            }
                        }
                        Dialed::Failed => false,
                        Dialed::Refused => {
                            self.counters.connections_refused += 1;
                            self.refused.insert(conn);
                            self.link.to_stack.push_front(syn);
                            continue;
                        }
                    };
                    if opened {
                        self.counters.connections_allowed += 1;
                    } else {
                        self.counters.dials_failed += 1;
                        self.refused.insert(conn);
                    }
                    self.link.to_stack.push_front(syn);
                }
                Done::Dns { query, meta, known } => {
                    self.dns_in_flight -= 1;
                    if let Answer::Reply(reply) = self.dns.answer(&query, Some(known)) {
                        let socket = self.sockets.get_mut::<udp::Socket>(self.dns_socket);
                        // A full send buffer drops the answer; the guest's resolver asks again.
                        let _ = socket.send_slice(&reply, meta);
                    }
                }
            }
        }
    }

    /// A socket listening on `dst` for the held SYN of connection `id`, relayed to `host`;
    /// one the egress allowed for a `name` has its bytes checked for the names they carry
    /// ([`NameCheck`]). A connection that cannot listen is reported closed at once (the
    /// egress allowed it).
    fn open_relay(
        &mut self,
        dst: IpEndpoint,
        host: File,
        id: u64,
        name: Option<String>,
        headers: Headers,
    ) -> bool {
        let mut socket = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0; RELAY_BUFFER]),
            tcp::SocketBuffer::new(vec![0; RELAY_BUFFER]),
        );
        socket.set_nagle_enabled(false);
        // Acknowledge at once: a delayed ACK would need a timer exit to go out.
        socket.set_ack_delay(None);
        if socket.listen(dst).is_err() {
            self.egress.closed(id, Traffic::default());
            return false;
        }
        let handle = self.sockets.add(socket);
        self.relays.push(Relay {
            handle,
            host,
            created: Instant::now(),
            id,
            traffic: Traffic::default(),
            host_done: false,
            guest_done: false,
            check: name.as_deref().map(|n| match headers {
                Headers::Set(set) => NameCheck::with_headers(n, set),
                Headers::None | Headers::Refuse => NameCheck::new(n),
            }),
            name,
            to_host: Vec::new(),
            tls: None,
        });
        true
    }

    /// Answers the guest's DNS queries: at once if they need no egress (malformed, not a
    /// query), else once the dialer has asked the egress about the name.
    fn serve_dns(&mut self) {
        let socket = self.sockets.get_mut::<udp::Socket>(self.dns_socket);
        while let Ok((len, meta)) = socket.recv_slice(&mut self.scratch) {
            self.counters.dns_queries += 1;
            let query = &self.scratch[..len];
            match self.dns.answer(query, None) {
                Answer::Reply(reply) => {
                    // A full send buffer drops the answer; the guest's resolver asks again.
                    let _ = socket.send_slice(&reply, meta);
                }
                Answer::Ask(name) if self.dns_in_flight < MAX_DNS_IN_FLIGHT => {
                    self.dns_in_flight += 1;
                    let query = query.to_vec();
                    let (egress, inbox, waker) =
                        (self.egress.clone(), self.inbox.clone(), self.waker.clone());
                    dialer::submit(
                        self.owner,
                        dialer::Kind::Lookup,
                        Box::new(move || {
                            let known = egress.knows(&name);
                            deliver(&inbox, &waker, Done::Dns { query, meta, known });
                        }),
                    );
                }
                // Too many waiting: dropped, the guest's resolver asks again.
                Answer::Ask(_) | Answer::Ignore => {}
            }
        }
    }

    /// Bytes the open connections may still move (the egress's budget less what they
    /// moved); None: no cap.
    fn bytes_left(&self) -> Option<u64> {
        let moved: u64 = self
            .relays
            .iter()
            .map(|r| r.traffic.sent + r.traffic.received)
            .sum();
        self.egress
            .byte_budget()
            .map(|budget| budget.saturating_sub(moved))
    }

    /// Moves bytes both ways between each relay's smoltcp socket and its host socket, none
    /// past the egress's byte budget; once it is spent, every connection is reset.
    fn relay(&mut self) {
        let mut left = self.bytes_left();
        // The most the next read or write may move.
        let most = |left: Option<u64>, len: usize| left.map_or(len, |l| len.min(l as usize));
        for r in &mut self.relays {
            let s = self.sockets.get_mut::<tcp::Socket>(r.handle);
            if r.tls.is_some() {
                terminate::relay(r, s, &mut left, &mut self.counters, &*self.egress);
                continue;
            }
            // Host to guest, while the guest's window has room.
            while !r.host_done && s.can_send() && left != Some(0) {
                let got = s.send(|buf| {
                    let n = most(left, buf.len());
                    match r.host.read(&mut buf[..n]) {
                        Ok(0) => (0, Some(0)),
                        Ok(n) => (n, Some(n)),
                        Err(e) if e.kind() == ErrorKind::WouldBlock => (0, None),
                        Err(e) if e.kind() == ErrorKind::Interrupted => (0, Some(usize::MAX)),
                        Err(_) => (0, Some(0)),
                    }
                });
                match got {
                    Ok(Some(usize::MAX)) => {}
                    Ok(Some(0)) => {
                        r.host_done = true;
                        s.close();
                    }
                    Ok(Some(n)) => {
                        self.counters.bytes_to_guest += n as u64;
                        r.traffic.received += n as u64;
                        left = left.map(|l| l - n as u64);
                    }
                    _ => break,
                }
            }
            // Guest to host through the name check, while it lasts: what it lets through
            // waits in `to_host` until the host takes it.
            if let Some(check) = &mut r.check {
                loop {
                    if !r.to_host.is_empty() {
                        let n = most(left, r.to_host.len());
                        match r.host.write(&r.to_host[..n]) {
                            Ok(n) => {
                                r.to_host.drain(..n);
                                self.counters.bytes_to_host += n as u64;
                                r.traffic.sent += n as u64;
                                left = left.map(|l| l - n as u64);
                            }
                            Err(e)
                                if matches!(
                                    e.kind(),
                                    ErrorKind::WouldBlock | ErrorKind::Interrupted
                                ) => {}
                            Err(_) => s.abort(),
                        }
                    }
                    if !r.to_host.is_empty() || !s.can_recv() || left == Some(0) {
                        break;
                    }
                    let fed = s.recv(|buf| (buf.len(), check.feed(buf, &mut r.to_host)));
                    r.traffic.rewritten = check.rewritten();
                    let name = r.name.as_deref().unwrap_or_default();
                    let refusal = match fed {
                        Ok(Err(Refusal::Encrypted)) => match self.egress.interception(name) {
                            // TLS to a host with headers to set: bud terminates it.
                            Some(i) => {
                                let (held, inner) = std::mem::replace(check, NameCheck::new(name))
                                    .into_terminated();
                                match Terminated::new(&i, name, inner, held) {
                                    Ok(t) => {
                                        r.tls = Some(Box::new(t));
                                        break;
                                    }
                                    Err(refusal) => refusal,
                                }
                            }
                            None => Refusal::Encrypted,
                        },
                        Ok(Err(refusal)) => refusal,
                        _ => continue,
                    };
                    self.egress.name_refused(r.id, name, &refusal);
                    r.to_host.clear();
                    s.abort();
                    break;
                }
                if r.tls.is_some() {
                    r.check = None;
                    terminate::relay(r, s, &mut left, &mut self.counters, &*self.egress);
                    continue;
                }
                if check.is_open() && r.to_host.is_empty() {
                    r.check = None;
                }
            }
            // Guest to host, while the host takes it.
            while r.check.is_none() && s.can_recv() && left != Some(0) {
                let sent = s.recv(|buf| match r.host.write(&buf[..most(left, buf.len())]) {
                    Ok(n) => (n, Ok(n)),
                    Err(e) => (0, Err(e.kind())),
                });
                match sent {
                    Ok(Ok(n)) if n > 0 => {
                        self.counters.bytes_to_host += n as u64;
                        r.traffic.sent += n as u64;
                        left = left.map(|l| l - n as u64);
                    }
                    Ok(Err(ErrorKind::WouldBlock | ErrorKind::Interrupted)) => break,
                    Ok(Err(_)) => {
                        s.abort();
                        break;
                    }
                    _ => break,
                }
            }
            // Bytes the check still holds (an unfinished request head) never go.
            if guest_closed(s) && !r.guest_done && s.recv_queue() == 0 && r.to_host.is_empty() {
                r.guest_done = true;
                shutdown_write(&r.host);
            }
        }
        if left == Some(0) {
            // The budget is spent: each connection is reset (the guest sees ECONNRESET) once
            // the guest has acknowledged what it was given, and the reap reports it with
            // what it moved.
            for r in &self.relays {
                let s = self.sockets.get_mut::<tcp::Socket>(r.handle);
                if s.send_queue() == 0 {
                    s.abort();
                }
            }
        }
    }

    /// Drops relays whose connection is over (or whose SYN never came), each reported to
    /// the egress with what it moved.
    fn reap(&mut self) {
        let (sockets, egress) = (&mut self.sockets, &self.egress);
        self.relays.retain(|r| {
            let state = sockets.get::<tcp::Socket>(r.handle).state();
            let over = matches!(state, tcp::State::Closed | tcp::State::TimeWait)
                || (state == tcp::State::Listen && r.created.elapsed() > LISTEN_LIFETIME);
            if over {
                sockets.remove(r.handle);
                egress.closed(r.id, r.traffic);
            }
            !over
        });
    }
}

impl Drop for Stack {
    /// Work of the dialer that has not started is dropped, and so are dials under way (their
    /// sockets close); work already running is dropped when it comes back. The connections
    /// still open are over (their host sockets close with the relays) and reported so.
    fn drop(&mut self) {
        lock(&self.inbox).closed = true;
        dialer::forget(self.owner);
        connect::cancel(self.owner);
        for r in &self.relays {
            self.egress.closed(r.id, r.traffic);
        }
    }
}

/// Whether the guest has closed its side of `s` (its FIN came).
pub(super) fn guest_closed(s: &tcp::Socket) -> bool {
    matches!(
        s.state(),
        tcp::State::CloseWait
            | tcp::State::LastAck
            | tcp::State::Closing
            | tcp::State::TimeWait
            | tcp::State::Closed
    )
}

/// Passes the guest's end of its side of a connection on to the host (`shutdown(SHUT_WR)`).
pub(super) fn shutdown_write(host: &File) {
    // SAFETY: `host` owns a connected socket fd that stays open for the call; shutdown
    // touches no memory of ours, and its failure (a connection already gone) changes nothing
    // the relay relies on.
    unsafe { libc::shutdown(host.as_raw_fd(), libc::SHUT_WR) };
}

/// The source and destination of `frame` if it is a TCP SYN (without ACK) over IPv4.
fn new_syn(frame: &[u8]) -> Option<Conn> {
    let eth = EthernetFrame::new_checked(frame).ok()?;
    if eth.ethertype() != EthernetProtocol::Ipv4 {
        return None;
    }
    let ip = Ipv4Packet::new_checked(eth.payload()).ok()?;
    if ip.next_header() != IpProtocol::Tcp {
        return None;
    }
    let tcp = TcpPacket::new_checked(ip.payload()).ok()?;
    if !tcp.syn() || tcp.ack() {
        return None;
    }
    let (src, dst): (Ipv4Addr, Ipv4Addr) = (ip.src_addr(), ip.dst_addr());
    Some((
        IpEndpoint::new(IpAddress::Ipv4(src), tcp.src_port()),
        IpEndpoint::new(IpAddress::Ipv4(dst), tcp.dst_port()),
    ))
}
