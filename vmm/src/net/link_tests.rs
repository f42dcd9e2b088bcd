//! The stack driven by raw Ethernet frames, as the guest's kernel would send them (no card, no
//! guest): ARP for the gateway, DNS on the gateway's port 53, a SYN the egress refuses, a
//! connection relayed to a host socket and the bytes it moved reported.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use smoltcp::phy::ChecksumCapabilities;
use smoltcp::wire::{
    ArpOperation, ArpPacket, ArpRepr, EthernetAddress, EthernetFrame, EthernetProtocol,
    EthernetRepr, IpAddress, IpProtocol, Ipv4Packet, Ipv4Repr, TcpControl, TcpPacket, TcpRepr,
    TcpSeqNumber, UdpPacket, UdpRepr,
};

use super::connect::{self, tests::hanging_listener};
use super::dialer;
use super::egress::{ConnectRequest, Egress, Limit, Traffic, Verdict};
use super::stack::{MAX_DIALS_IN_FLIGHT, Stack};
use super::waker::Waker;
use super::{DNS_PORT, GATEWAY_IP, GATEWAY_MAC, GUEST_IP};
use crate::devices::virtio::net::DEFAULT_MAC;
use crate::vcpu::Kicker;

#[derive(Debug)]
struct KnowsOneName;

impl Egress for KnowsOneName {
    fn knows(&self, name: &str) -> bool {
        name == "echo.test"
    }
    fn connect(&self, _: &ConnectRequest<'_>) -> Verdict {
        Verdict::Refuse
    }
}

/// Refuses every connection, each once the test lets it.
#[derive(Debug)]
struct RefusesWhenLet(Mutex<mpsc::Receiver<()>>);

impl Egress for RefusesWhenLet {
    fn knows(&self, _: &str) -> bool {
        false
    }
    fn connect(&self, _: &ConnectRequest<'_>) -> Verdict {
        let _ = self.0.lock().unwrap().recv();
        Verdict::Refuse
    }
}

fn stack() -> (Stack, Arc<Waker>) {
    stack_with(Arc::new(KnowsOneName))
}

fn stack_with(egress: Arc<dyn Egress>) -> (Stack, Arc<Waker>) {
    let waker = Waker::new(Kicker::new());
    let stack = Stack::new(
        crate::devices::virtio::net::DEFAULT_MTU,
        egress,
        waker.clone(),
    );
    (stack, waker)
}

fn ethernet(dst: EthernetAddress, ethertype: EthernetProtocol, payload: usize) -> Vec<u8> {
    let mut frame = vec![0u8; 14 + payload];
    EthernetRepr {
        src_addr: EthernetAddress(DEFAULT_MAC),
        dst_addr: dst,
        ethertype,
    }
    .emit(&mut EthernetFrame::new_unchecked(&mut frame));
    frame
}

fn arp_request() -> Vec<u8> {
    let repr = ArpRepr::EthernetIpv4 {
        operation: ArpOperation::Request,
        source_hardware_addr: EthernetAddress(DEFAULT_MAC),
        source_protocol_addr: GUEST_IP,
        target_hardware_addr: EthernetAddress([0; 6]),
        target_protocol_addr: GATEWAY_IP,
    };
    let mut frame = ethernet(
        EthernetAddress::BROADCAST,
        EthernetProtocol::Arp,
        repr.buffer_len(),
    );
    repr.emit(&mut ArpPacket::new_unchecked(&mut frame[14..]));
    frame
}

fn ipv4(dst: Ipv4Addr, protocol: IpProtocol, payload: usize) -> (Vec<u8>, Ipv4Repr) {
    let ip = Ipv4Repr {
        src_addr: GUEST_IP,
        dst_addr: dst,
        next_header: protocol,
        payload_len: payload,
        hop_limit: 64,
    };
    let mut frame = ethernet(
        EthernetAddress(GATEWAY_MAC),
        EthernetProtocol::Ipv4,
        20 + payload,
    );
    ip.emit(
        &mut Ipv4Packet::new_unchecked(&mut frame[14..]),
        &ChecksumCapabilities::default(),
    );
    (frame, ip)
}

fn dns_query(name: &str) -> Vec<u8> {
    let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in name.split('.') {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    let udp = UdpRepr {
        src_port: 40000,
        dst_port: DNS_PORT,
    };
    let (mut frame, _) = ipv4(GATEWAY_IP, IpProtocol::Udp, 8 + q.len());
    udp.emit(
        &mut UdpPacket::new_unchecked(&mut frame[34..]),
        &IpAddress::from(GUEST_IP),
        &IpAddress::from(GATEWAY_IP),
        q.len(),
        |buf| buf.copy_from_slice(&q),
        &ChecksumCapabilities::default(),
    );
    frame
}

fn syn(dst: Ipv4Addr, port: u16) -> Vec<u8> {
    segment(dst, port, TcpControl::Syn, 1000, None, &[])
}

/// A TCP segment from the guest's port 40001 to `dst:port`.
fn segment(
    dst: Ipv4Addr,
    port: u16,
    control: TcpControl,
    seq: i32,
    ack: Option<i32>,
    payload: &[u8],
) -> Vec<u8> {
    segment_from(40001, dst, port, control, seq, ack, payload)
}

/// A SYN from the guest's port `src` to `dst:port`.
fn syn_from(src: u16, dst: Ipv4Addr, port: u16) -> Vec<u8> {
    segment_from(src, dst, port, TcpControl::Syn, 1000, None, &[])
}

/// A TCP segment from the guest's port `src` to `dst:port`.
fn segment_from(
    src: u16,
    dst: Ipv4Addr,
    port: u16,
    control: TcpControl,
    seq: i32,
    ack: Option<i32>,
    payload: &[u8],
) -> Vec<u8> {
    let tcp = TcpRepr {
        src_port: src,
        dst_port: port,
        control,
        seq_number: TcpSeqNumber(seq),
        ack_number: ack.map(TcpSeqNumber),
        window_len: 65535,
        window_scale: None,
        max_seg_size: (control == TcpControl::Syn).then_some(1460),
        sack_permitted: false,
        sack_ranges: [None, None, None],
        timestamp: None,
        payload,
    };
    let (mut frame, _) = ipv4(dst, IpProtocol::Tcp, tcp.buffer_len());
    tcp.emit(
        &mut TcpPacket::new_unchecked(&mut frame[34..]),
        &IpAddress::from(GUEST_IP),
        &IpAddress::from(dst),
        &ChecksumCapabilities::default(),
    );
    frame
}

/// Polls the stack, then again each time the dialer's work for it comes back, until none
/// is under way (as the card's run loop does on the waker's kicks).
fn poll_settled(stack: &mut Stack, waker: &Waker) {
    stack.poll();
    let started = Instant::now();
    while stack.is_waiting() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the dialer never answered"
        );
        if waker.take_pending() {
            stack.poll();
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// The one frame the stack sent back, as (ethertype, IPv4 payload protocol, bytes).
fn only_reply(stack: &mut Stack) -> Vec<u8> {
    assert_eq!(stack.link.to_guest.len(), 1, "one frame back");
    stack.link.to_guest.pop_front().unwrap()
}

#[test]
fn the_gateway_answers_arp_for_itself() {
    let (mut stack, _waker) = stack();
    stack.link.to_stack.push_back(arp_request());

    stack.poll();

    let reply = only_reply(&mut stack);
    let eth = EthernetFrame::new_checked(&reply[..]).unwrap();
    let arp = ArpRepr::parse(&ArpPacket::new_checked(eth.payload()).unwrap()).unwrap();
    let ArpRepr::EthernetIpv4 {
        operation,
        source_hardware_addr,
        source_protocol_addr,
        ..
    } = arp
    else {
        panic!("{arp:?}");
    };
    assert_eq!(operation, ArpOperation::Reply);
    assert_eq!(source_hardware_addr, EthernetAddress(GATEWAY_MAC));
    assert_eq!(source_protocol_addr, GATEWAY_IP);
}

#[test]
fn dns_on_the_gateway_answers_a_known_name_with_a_synthetic_address_and_others_nxdomain() {
    let (mut stack, waker) = stack();
    stack.link.to_stack.push_back(arp_request());
    stack.poll();
    stack.link.to_guest.clear();

    stack.link.to_stack.push_back(dns_query("echo.test"));
    poll_settled(&mut stack, &waker);
    let known = only_reply(&mut stack);
    stack.link.to_stack.push_back(dns_query("other.test"));
    poll_settled(&mut stack, &waker);
    let unknown = only_reply(&mut stack);

    let payload = |frame: &[u8]| frame[14 + 20 + 8..].to_vec();
    let (known, unknown) = (payload(&known), payload(&unknown));
    assert_eq!(&known[..2], &[0x12, 0x34]);
    assert_eq!(known[3] & 0xf, 0, "NOERROR");
    assert_eq!(&known[known.len() - 4..], &[198, 18, 0, 1]);
    assert_eq!(unknown[3] & 0xf, 3, "NXDOMAIN");
    assert!(!stack.is_pristine(), "a name was handed out");
}

#[test]
fn a_refused_syn_gets_a_rst_and_leaves_no_connection() {
    let (let_go, gate) = mpsc::channel();
    let (mut stack, waker) = stack_with(Arc::new(RefusesWhenLet(Mutex::new(gate))));
    stack.link.to_stack.push_back(arp_request());
    stack.poll();
    stack.link.to_guest.clear();

    let refused = syn(Ipv4Addr::new(192, 0, 2, 1), 80);
    stack.link.to_stack.push_back(refused.clone());
    stack.poll();
    assert!(
        stack.link.to_guest.is_empty(),
        "held while the egress is asked"
    );
    assert!(stack.is_waiting());
    // The guest's retransmit while it is held is dropped, not asked about again (the
    // egress would wait for a second go, and this test never gives one).
    stack.link.to_stack.push_back(refused);
    stack.poll();
    assert!(stack.link.to_stack.is_empty() && stack.link.to_guest.is_empty());
    let_go.send(()).unwrap();
    poll_settled(&mut stack, &waker);

    let reply = only_reply(&mut stack);
    let tcp = TcpPacket::new_checked(&reply[34..]).unwrap();
    assert!(tcp.rst());
    assert_eq!(tcp.src_port(), 80);
    assert_eq!(stack.counters().connections_refused, 1);
    assert!(stack.is_pristine());
}

/// Dials one host address for every connection, keeps what it is told of their ends and
/// refusals, and allows `cap` bytes in all (None: no cap).
#[derive(Debug)]
struct DialsOne {
    to: SocketAddr,
    cap: Option<u64>,
    closed: Mutex<Vec<(u64, Traffic)>>,
    ids: Mutex<Vec<u64>>,
    limits: Mutex<Vec<Limit>>,
}

impl DialsOne {
    fn new(to: SocketAddr, cap: Option<u64>) -> Arc<Self> {
        Arc::new(Self {
            to,
            cap,
            closed: Mutex::default(),
            ids: Mutex::default(),
            limits: Mutex::default(),
        })
    }
}

impl Egress for DialsOne {
    fn knows(&self, _: &str) -> bool {
        false
    }
    fn connect(&self, req: &ConnectRequest<'_>) -> Verdict {
        self.ids.lock().unwrap().push(req.id);
        Verdict::Dial(self.to)
    }
    fn over_limit(&self, _: &ConnectRequest<'_>, limit: Limit) {
        self.limits.lock().unwrap().push(limit);
    }
    fn byte_budget(&self) -> Option<u64> {
        let spent: u64 = self
            .closed
            .lock()
            .unwrap()
            .iter()
            .map(|(_, t)| t.sent + t.received)
            .sum();
        self.cap.map(|c| c.saturating_sub(spent))
    }
    fn closed(&self, id: u64, traffic: Traffic) {
        self.closed.lock().unwrap().push((id, traffic));
    }
}

/// One segment the stack sent the guest.
struct Seg {
    seq: u32,
    rst: bool,
    payload: Vec<u8>,
}

/// Polls until the stack has sent the guest a frame, and returns it.
fn next_segment(stack: &mut Stack, waker: &Waker) -> Seg {
    let started = Instant::now();
    loop {
        poll_settled(stack, waker);
        if let Some(frame) = stack.link.to_guest.pop_front() {
            let tcp = TcpPacket::new_checked(&frame[34..]).unwrap();
            return Seg {
                seq: tcp.seq_number().0 as u32,
                rst: tcp.rst(),
                payload: tcp.payload().to_vec(),
            };
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no segment came"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The next segment with a payload or a RST.
fn next_data_or_rst(stack: &mut Stack, waker: &Waker) -> Seg {
    loop {
        let seg = next_segment(stack, waker);
        if seg.rst || !seg.payload.is_empty() {
            return seg;
        }
    }
}

const DST: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);

/// A stack for `egress`, a guest connection to DST:80 relayed to `listener` (the host's end
/// returned), and the guest's `hello` sent through it and read by the host.
fn relayed_hello(
    egress: Arc<DialsOne>,
    listener: &TcpListener,
) -> (Stack, Arc<Waker>, std::net::TcpStream) {
    let (mut stack, waker) = stack_with(egress);
    stack.link.to_stack.push_back(arp_request());
    stack.poll();
    stack.link.to_guest.clear();
    // The handshake: held, dialed, then the SYN opens the listening socket.
    stack.link.to_stack.push_back(syn(DST, 80));
    let their_seq = next_segment(&mut stack, &waker).seq;
    let (mut host, _) = listener.accept().unwrap();
    let ack = their_seq.wrapping_add(1) as i32;
    let hello = segment(DST, 80, TcpControl::None, 1001, Some(ack), b"hello");
    stack.link.to_stack.push_back(hello);
    stack.poll();
    let mut got = [0u8; 5];
    host.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"hello");
    (stack, waker, host)
}

#[test]
fn a_relayed_connection_reports_the_bytes_it_moved_each_way_when_its_stack_goes() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let egress = DialsOne::new(listener.local_addr().unwrap(), None);
    let (mut stack, waker, mut host) = relayed_hello(egress.clone(), &listener);

    host.write_all(b"world!").unwrap();
    let seg = next_data_or_rst(&mut stack, &waker);
    assert_eq!((seg.rst, seg.payload.as_slice()), (false, &b"world!"[..]));
    assert!(egress.closed.lock().unwrap().is_empty(), "still open");

    drop(stack);

    let id = egress.ids.lock().unwrap()[0];
    let expected = Traffic {
        sent: 5,
        received: 6,
        rewritten: 0,
    };
    assert_eq!(*egress.closed.lock().unwrap(), [(id, expected)]);
}

#[test]
fn no_byte_passes_the_budget_then_the_connection_is_reset_and_new_ones_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let egress = DialsOne::new(listener.local_addr().unwrap(), Some(8));
    let (mut stack, waker, mut host) = relayed_hello(egress.clone(), &listener);

    // 5 bytes up are spent: 3 of the host's 6 come down, then the budget is gone; once the
    // guest acknowledges them, the connection is reset.
    host.write_all(b"world!").unwrap();
    let first = next_data_or_rst(&mut stack, &waker);
    let ack = first.seq.wrapping_add(3) as i32;
    let acked = segment(DST, 80, TcpControl::None, 1006, Some(ack), &[]);
    stack.link.to_stack.push_back(acked);
    let reset = next_data_or_rst(&mut stack, &waker);
    poll_settled(&mut stack, &waker);
    stack.link.to_guest.clear();
    stack
        .link
        .to_stack
        .push_back(segment(DST, 443, TcpControl::Syn, 5000, None, &[]));
    let refused = next_data_or_rst(&mut stack, &waker);

    assert_eq!((first.rst, first.payload.as_slice()), (false, &b"wor"[..]));
    assert!(
        reset.rst,
        "the connection is reset once the budget is spent"
    );
    let id = egress.ids.lock().unwrap()[0];
    let expected = Traffic {
        sent: 5,
        received: 3,
        rewritten: 0,
    };
    assert_eq!(*egress.closed.lock().unwrap(), [(id, expected)]);
    assert!(refused.rst, "a new connection is refused");
    assert_eq!(*egress.limits.lock().unwrap(), [Limit::Bytes]);
    assert_eq!(egress.ids.lock().unwrap().len(), 1, "and never dialed");
}

/// A stack for `egress` that has answered the guest's ARP (so it can send it frames).
fn linked_stack(egress: Arc<dyn Egress>) -> (Stack, Arc<Waker>) {
    let (mut stack, waker) = stack_with(egress);
    stack.link.to_stack.push_back(arp_request());
    stack.poll();
    stack.link.to_guest.clear();
    (stack, waker)
}

/// `n` SYNs from as many guest ports to DST:80, each held while it is dialed.
fn hold_syns(stack: &mut Stack, n: usize) {
    for i in 0..n {
        stack
            .link
            .to_stack
            .push_back(syn_from(41000 + i as u16, DST, 80));
    }
    stack.poll();
}

#[test]
fn many_vms_whose_dials_hang_leave_another_vms_dial_to_complete_while_theirs_still_hang() {
    let (hanging, _filler) = hanging_listener();
    let good = TcpListener::bind("127.0.0.1:0").unwrap();
    // More VMs than the dial pool has threads, each with as many hanging dials as it may
    // have: blocking dials would hold every thread until the first timed out.
    let mut hostile: Vec<(Stack, Arc<Waker>)> = (0..dialer::THREADS)
        .map(|_| {
            let (mut stack, waker) =
                linked_stack(DialsOne::new(hanging.local_addr().unwrap(), None));
            // Longer than the test may take: none ends by its timeout meanwhile.
            stack.set_dial_timeout(Duration::from_secs(600));
            hold_syns(&mut stack, MAX_DIALS_IN_FLIGHT);
            (stack, waker)
        })
        .collect();
    let (mut victim, waker) = linked_stack(DialsOne::new(good.local_addr().unwrap(), None));

    victim.link.to_stack.push_back(syn(DST, 80));
    let answer = next_segment(&mut victim, &waker);
    let accepted = good.accept();
    for (stack, _) in &mut hostile {
        stack.poll();
    }

    assert!(
        !answer.rst,
        "the victim's dial connected: its SYN opened a socket"
    );
    assert!(accepted.is_ok());
    for (stack, _) in &hostile {
        assert!(stack.is_waiting(), "every hanging dial is still under way");
        assert!(stack.link.to_guest.is_empty());
        assert_eq!(stack.counters().dials_failed, 0);
    }
}

#[test]
fn a_syn_past_the_vms_dials_in_flight_is_refused_at_once_and_reported() {
    let (hanging, _filler) = hanging_listener();
    let egress = DialsOne::new(hanging.local_addr().unwrap(), None);
    let (mut stack, _waker) = linked_stack(egress.clone());
    stack.set_dial_timeout(Duration::from_secs(600));
    hold_syns(&mut stack, MAX_DIALS_IN_FLIGHT);
    assert!(stack.link.to_guest.is_empty(), "all held");

    stack.link.to_stack.push_back(syn_from(40999, DST, 443));
    stack.poll();

    let reply = only_reply(&mut stack);
    let tcp = TcpPacket::new_checked(&reply[34..]).unwrap();
    assert!(tcp.rst(), "refused without waiting for any dial");
    assert_eq!((tcp.src_port(), tcp.dst_port()), (443, 40999));
    assert_eq!(*egress.limits.lock().unwrap(), [Limit::Dials]);
    assert_eq!(stack.counters().connections_refused, 1);
}

#[test]
fn a_dial_that_never_answers_ends_at_the_stacks_dial_timeout_with_a_rst() {
    let (hanging, _filler) = hanging_listener();
    let (mut stack, waker) = linked_stack(DialsOne::new(hanging.local_addr().unwrap(), None));
    stack.set_dial_timeout(Duration::from_millis(20));

    stack.link.to_stack.push_back(syn(DST, 80));
    let answer = next_segment(&mut stack, &waker);

    assert!(
        answer.rst,
        "the guest's connect is refused once the dial gave up"
    );
    assert_eq!(stack.counters().dials_failed, 1);
    assert!(stack.is_pristine());
}

#[test]
fn a_stack_that_goes_cancels_its_dials_under_way() {
    let (hanging, _filler) = hanging_listener();
    let (mut stack, _waker) = linked_stack(DialsOne::new(hanging.local_addr().unwrap(), None));
    stack.set_dial_timeout(Duration::from_secs(600));
    hold_syns(&mut stack, 4);
    let owner = stack.owner();
    let started = Instant::now();
    while connect::in_flight_of(owner) < 4 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the dials never started"
        );
        std::thread::sleep(Duration::from_millis(1));
    }

    drop(stack);

    assert_eq!(connect::in_flight_of(owner), 0);
}
