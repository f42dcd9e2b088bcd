//! The user-mode network stack behind the card: smoltcp as a socket-level proxy. The guest's
//! TCP connections end in smoltcp sockets here, and each allowed one is relayed to one host
//! socket that the VMM dialed itself; bud's DNS answers on the gateway's UDP port 53. No tap,
//! no raw sockets, nothing that needs privileges: upstream is an ordinary `connect()`.
//!
//! **Transparent accept.** smoltcp accepts packets for any destination routed through the
//! gateway (`any_ip`); before a frame reaches it, a TCP SYN for a connection no socket holds
//! is put to the VM's [`Egress`]: refused (or a dial that fails) leaves no socket, so smoltcp
//! answers the SYN with a RST (`ECONNREFUSED` in the guest); allowed, the host socket is
//! dialed and a smoltcp socket listens on the SYN's destination, which the SYN then opens.
//! Stage 1 dials synchronously with a short timeout (tests dial loopback, which answers at
//! once); holding the SYN while a dial runs elsewhere is stage 2's (`docs/network-design.md`
//! section 2.1).
//!
//! Everything here runs on the vCPU thread, between guest exits ([`super::Nic`]); host sockets
//! are non-blocking and registered with the VM's [`Waker`], which kicks the vCPU when one is
//! ready or when smoltcp's next timer is due.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::phy::{self, Checksum, DeviceCapabilities, Medium};
use smoltcp::socket::{tcp, udp};
use smoltcp::wire::{
    EthernetAddress, EthernetFrame, EthernetProtocol, IpAddress, IpCidr, IpEndpoint,
    IpListenEndpoint, IpProtocol, Ipv4Packet, TcpPacket,
};

use super::dns::DnsMap;
use super::egress::{ConnectRequest, Egress, Verdict};
use super::waker::Waker;
use super::{DNS_PORT, GATEWAY_IP, GATEWAY_MAC, GUEST_PREFIX};

/// How long a dial may hold the vCPU (stage 1: synchronous; see the module docs).
const DIAL_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections (relays) one VM may have open at once; a SYN past it is refused.
const MAX_RELAYS: usize = 64;
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
struct Relay {
    handle: SocketHandle,
    host: TcpStream,
    created: Instant,
    /// The host closed its side (its FIN was passed on to the guest).
    host_done: bool,
    /// The guest closed its side (passed on to the host with `shutdown(Write)`).
    guest_done: bool,
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

    pub(crate) fn counters(&self) -> StackCounters {
        self.counters
    }

    /// Whether the stack holds nothing a fresh one would not: no connection, no name handed
    /// out, no frame queued either way.
    pub(crate) fn is_pristine(&self) -> bool {
        self.relays.is_empty()
            && self.dns.is_empty()
            && self.link.to_stack.is_empty()
            && self.link.to_guest.is_empty()
    }

    fn now(&self) -> smoltcp::time::Instant {
        smoltcp::time::Instant::from_micros(self.origin.elapsed().as_micros() as i64)
    }

    /// Runs the stack over what is queued: the guest's frames (each SYN classified first),
    /// DNS, the relays both ways, then smoltcp's output. Returns when smoltcp next wants to
    /// run (a timer), if ever.
    pub(crate) fn poll(&mut self) -> Option<Duration> {
        let now = self.now();
        while let Some(frame) = self.link.to_stack.front() {
            if let Some((src, dst)) = new_syn(frame) {
                self.accept(src, dst);
            }
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

    /// A SYN from the guest's `src` to `dst` that no socket holds: ask the egress, dial,
    /// and leave a socket listening on `dst` if the connection goes ahead.
    fn accept(&mut self, src: IpEndpoint, dst: IpEndpoint) {
        let held = self.relays.iter().any(|r| {
            let s = self.sockets.get::<tcp::Socket>(r.handle);
            s.remote_endpoint() == Some(src)
                || (s.state() == tcp::State::Listen && s.listen_endpoint().port == dst.port && {
                    s.listen_endpoint().addr == Some(dst.addr)
                })
        });
        if held {
            return;
        }
        let IpAddress::Ipv4(addr) = dst.addr;
        let name = self.dns.name_of(addr).map(str::to_owned);
        let req = ConnectRequest {
            name: name.as_deref(),
            addr,
            port: dst.port,
        };
        let verdict = if self.relays.len() >= MAX_RELAYS {
            Verdict::Refuse
        } else {
            self.egress.connect(&req)
        };
        let Verdict::Dial(target) = verdict else {
            self.counters.connections_refused += 1;
            return;
        };
        let host = match TcpStream::connect_timeout(&target, DIAL_TIMEOUT)
            .and_then(|s| s.set_nonblocking(true).map(|()| s))
        {
            Ok(s) => s,
            Err(_) => {
                self.counters.dials_failed += 1;
                return;
            }
        };
        let _ = host.set_nodelay(true);
        let mut socket = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0; RELAY_BUFFER]),
            tcp::SocketBuffer::new(vec![0; RELAY_BUFFER]),
        );
        socket.set_nagle_enabled(false);
        // Acknowledge at once: a delayed ACK would need a timer exit to go out.
        socket.set_ack_delay(None);
        if socket.listen(dst).is_err() || self.waker.watch(host.as_raw_fd()).is_err() {
            self.counters.dials_failed += 1;
            return;
        }
        self.counters.connections_allowed += 1;
        let handle = self.sockets.add(socket);
        self.relays.push(Relay {
            handle,
            host,
            created: Instant::now(),
            host_done: false,
            guest_done: false,
        });
    }

    fn serve_dns(&mut self) {
        let socket = self.sockets.get_mut::<udp::Socket>(self.dns_socket);
        while let Ok((len, meta)) = socket.recv_slice(&mut self.scratch) {
            self.counters.dns_queries += 1;
            if let Some(reply) = self.dns.answer(&self.scratch[..len], self.egress.as_ref()) {
                // A full send buffer drops the answer; the guest's resolver asks again.
                let _ = socket.send_slice(&reply, meta.endpoint);
            }
        }
    }

    /// Moves bytes both ways between each relay's smoltcp socket and its host socket.
    fn relay(&mut self) {
        for r in &mut self.relays {
            let s = self.sockets.get_mut::<tcp::Socket>(r.handle);
            // Host to guest, while the guest's window has room.
            while !r.host_done && s.can_send() {
                let got = s.send(|buf| match r.host.read(buf) {
                    Ok(0) => (0, Some(0)),
                    Ok(n) => (n, Some(n)),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => (0, None),
                    Err(e) if e.kind() == ErrorKind::Interrupted => (0, Some(usize::MAX)),
                    Err(_) => (0, Some(0)),
                });
                match got {
                    Ok(Some(usize::MAX)) => {}
                    Ok(Some(0)) => {
                        r.host_done = true;
                        s.close();
                    }
                    Ok(Some(n)) => self.counters.bytes_to_guest += n as u64,
                    _ => break,
                }
            }
            // Guest to host, while the host takes it.
            while s.can_recv() {
                let sent = s.recv(|buf| match r.host.write(buf) {
                    Ok(n) => (n, Ok(n)),
                    Err(e) => (0, Err(e.kind())),
                });
                match sent {
                    Ok(Ok(n)) if n > 0 => self.counters.bytes_to_host += n as u64,
                    Ok(Err(ErrorKind::WouldBlock | ErrorKind::Interrupted)) => break,
                    Ok(Err(_)) => {
                        s.abort();
                        break;
                    }
                    _ => break,
                }
            }
            let guest_closed = matches!(
                s.state(),
                tcp::State::CloseWait
                    | tcp::State::LastAck
                    | tcp::State::Closing
                    | tcp::State::TimeWait
                    | tcp::State::Closed
            );
            if guest_closed && !r.guest_done && s.recv_queue() == 0 {
                r.guest_done = true;
                let _ = r.host.shutdown(Shutdown::Write);
            }
        }
    }

    /// Drops relays whose connection is over (or whose SYN never came).
    fn reap(&mut self) {
        let sockets = &mut self.sockets;
        self.relays.retain(|r| {
            let state = sockets.get::<tcp::Socket>(r.handle).state();
            let over = matches!(state, tcp::State::Closed | tcp::State::TimeWait)
                || (state == tcp::State::Listen && r.created.elapsed() > LISTEN_LIFETIME);
            if over {
                sockets.remove(r.handle);
            }
            !over
        });
    }
}

/// The source and destination of `frame` if it is a TCP SYN (without ACK) over IPv4.
fn new_syn(frame: &[u8]) -> Option<(IpEndpoint, IpEndpoint)> {
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
