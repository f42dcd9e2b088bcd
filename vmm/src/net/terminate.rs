//! A guest's TLS terminated by bud, for a host whose HTTP requests get headers set
//! (`Headers::Set`): the guest's TLS ends here, answered with a certificate of bud's egress
//! CA for the allowed name (the images trust that CA, its key is the server's alone);
//! bud opens TLS of its own to the host, verified against the host's trust store; between
//! the two, the decrypted requests go through the same [`NameCheck`] as plain HTTP does,
//! which checks each `Host` and sets the headers. A connection to such a host without TLS
//! needs none of this (the check sees its requests as they are).
//!
//! Everything runs on the vCPU thread, between guest exits, with rustls's buffers in
//! memory: the TLS of both sides is read and written in the relay's turn ([`super::stack`])
//! and makes no system call of its own but the host socket's `read` and `write` (rustls
//! draws its randomness with `getrandom`, which a jailed job thread may call).
//!
//! Backpressure: the guest's bytes are taken only while everything bud made of earlier ones
//! has gone to the host, and the host's only while everything made of earlier ones has gone
//! to the guest, so each side holds at most one read's worth at a time.
//!
//! Why a crate (rustls, with ring): TLS is where a hand-written implementation would be
//! wrong; rustls is memory-safe and already answers both roles here.

use std::fs::File;
use std::io::{self, ErrorKind, Read, Write};
use std::sync::Arc;

use smoltcp::socket::tcp;

use rustls::pki_types::ServerName;
use rustls::{ClientConnection, ServerConnection};

use super::egress::Egress;
use super::names::{NameCheck, Refusal};
use super::stack::{Relay, StackCounters, guest_closed, shutdown_write};

/// How bud terminates a guest's TLS to one host ([`super::Egress::interception`]).
#[derive(Clone)]
pub struct Interception {
    /// Answers the guest as the allowed name, with a certificate of bud's egress CA.
    pub server: Arc<rustls::ServerConfig>,
    /// Opens bud's own TLS to the host, verified against the host's trust store.
    pub client: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for Interception {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interception").finish_non_exhaustive()
    }
}

/// Plaintext of a read, at most.
const CHUNK: usize = 16 << 10;

/// One connection's two TLS sessions and the check between them.
pub(crate) struct Terminated {
    /// With the guest (bud is the server).
    guest: ServerConnection,
    /// With the host (bud is the client).
    host: ClientConnection,
    /// The decrypted requests' check, which sets the headers.
    check: NameCheck,
    /// Plaintext the check let through that the host's session has not taken yet.
    to_host: Vec<u8>,
    /// Plaintext from the host that the guest's session has not taken yet.
    to_guest: Vec<u8>,
    /// The guest ended its side (TCP FIN or TLS close_notify): passed on once written.
    guest_ended: bool,
    /// The host ended its side: passed on to the guest once written.
    host_ended: bool,
    /// A failure ended the connection (it was reset): nothing more is read or written.
    broken: bool,
    scratch: Vec<u8>,
}

impl std::fmt::Debug for Terminated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Terminated")
            .field("guest_ended", &self.guest_ended)
            .field("host_ended", &self.host_ended)
            .finish_non_exhaustive()
    }
}

/// A TLS failure as the relay reports it (never any secret: rustls's errors name
/// certificates and alerts, not application data).
fn failed(side: &str, e: impl std::fmt::Display) -> Refusal {
    Refusal::Tls(format!("{side}: {e}"))
}

impl Terminated {
    /// TLS for a connection allowed for `name`, whose decrypted requests go through
    /// `check` (the connection's own, with its headers), starting with the guest's bytes
    /// `held` (its ClientHello, whose name was checked, and what followed).
    pub(crate) fn new(
        i: &Interception,
        name: &str,
        check: NameCheck,
        held: Vec<u8>,
    ) -> Result<Self, Refusal> {
        let server_name =
            ServerName::try_from(name.to_owned()).map_err(|e| failed("the host's name", e))?;
        let guest = ServerConnection::new(i.server.clone()).map_err(|e| failed("guest", e))?;
        let host =
            ClientConnection::new(i.client.clone(), server_name).map_err(|e| failed("host", e))?;
        let mut t = Self {
            guest,
            host,
            check,
            to_host: Vec::new(),
            to_guest: Vec::new(),
            guest_ended: false,
            host_ended: false,
            broken: false,
            scratch: vec![0; CHUNK],
        };
        let mut at = 0;
        while at < held.len() {
            match t.take_from_guest(&held[at..])? {
                0 => return Err(failed("guest", "a ClientHello larger than bud takes")),
                n => at += n,
            }
        }
        Ok(t)
    }

    /// Requests that had their headers set.
    pub(crate) fn rewritten(&self) -> u64 {
        self.check.rewritten()
    }

    /// Marks the connection over after a failure: bytes still buffered on either side
    /// (rustls's, the relay socket's) are never read again.
    pub(crate) fn break_off(&mut self) {
        self.broken = true;
    }

    /// Whether a failure ended the connection.
    pub(crate) fn is_broken(&self) -> bool {
        self.broken
    }

    /// Whether the guest's bytes may be taken now (what bud made of earlier ones has gone).
    pub(crate) fn takes_from_guest(&self) -> bool {
        !self.guest_ended && self.to_host.is_empty() && !self.host.wants_write()
    }

    /// Whether the host's bytes may be read now.
    pub(crate) fn takes_from_host(&self) -> bool {
        !self.host_ended && self.to_guest.is_empty() && !self.guest.wants_write()
    }

    /// Takes the guest's TLS bytes `data` (all of them, or as many as rustls holds at once:
    /// the count taken), decrypts them and passes the requests through the check.
    pub(crate) fn take_from_guest(&mut self, data: &[u8]) -> Result<usize, Refusal> {
        let mut rest = data;
        while !rest.is_empty() {
            let n = match self.guest.read_tls(&mut rest) {
                Ok(n) => n,
                // rustls holds as much as it may: the rest waits for the next turn.
                Err(e) if e.kind() == ErrorKind::Other => 0,
                Err(e) => return Err(failed("guest", e)),
            };
            self.guest
                .process_new_packets()
                .map_err(|e| failed("guest", e))?;
            self.guest_plaintext()?;
            if n == 0 {
                break;
            }
        }
        Ok(data.len() - rest.len())
    }

    /// The guest ended its side (its TCP FIN, or its close_notify): passed on to the host
    /// after what it sent before ([`Self::flush_plain_to_host`]).
    pub(crate) fn guest_closed(&mut self) {
        self.guest_ended = true;
        self.flush_plain_to_host();
    }

    /// Decrypted requests from the guest, through the check, to the host's session.
    fn guest_plaintext(&mut self) -> Result<(), Refusal> {
        loop {
            match self.guest.reader().read(&mut self.scratch) {
                Ok(0) => {
                    self.guest_closed();
                    break;
                }
                Ok(n) => self.check.feed(&self.scratch[..n], &mut self.to_host)?,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => return Err(failed("guest", e)),
            }
        }
        self.flush_plain_to_host();
        Ok(())
    }

    /// Gives the host's session the plaintext the check let through that it takes; once
    /// the guest has ended, all of it went and the handshake is over (plaintext written
    /// during it waits in rustls until it ends), the host's close_notify (sent once).
    fn flush_plain_to_host(&mut self) {
        if !self.to_host.is_empty() {
            let n = self.host.writer().write(&self.to_host).unwrap_or(0);
            self.to_host.drain(..n);
        }
        if self.guest_ended && self.to_host.is_empty() && !self.host.is_handshaking() {
            self.host.send_close_notify();
        }
    }

    /// Writes what bud's session has for the host to `host`: bytes written (0 when the
    /// socket is full or nothing waits). An error other than a full socket ends the
    /// connection.
    pub(crate) fn write_to_host(&mut self, host: &mut dyn Write) -> io::Result<usize> {
        self.flush_plain_to_host();
        let mut written = 0;
        while self.host.wants_write() {
            match self.host.write_tls(host) {
                Ok(0) => break,
                Ok(n) => written += n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(written)
    }

    /// Whether everything for the host has gone and the guest has ended: the host's side
    /// may be shut.
    pub(crate) fn host_side_done(&self) -> bool {
        self.guest_ended
            && self.to_host.is_empty()
            && !self.host.is_handshaking()
            && !self.host.wants_write()
    }

    /// Reads the host's TLS bytes from `host` (bytes read; `Ok(0)` with nothing read when
    /// the socket has none now or the host ended), decrypts them for the guest's session.
    pub(crate) fn read_from_host(&mut self, host: &mut dyn Read) -> Result<usize, Refusal> {
        let n = match self.host.read_tls(host) {
            Ok(0) => {
                self.host_ended = true;
                0
            }
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                return Ok(0);
            }
            Err(e) if e.kind() == ErrorKind::Other => 0,
            Err(e) => return Err(failed("host", e)),
        };
        self.host
            .process_new_packets()
            .map_err(|e| failed("host", e))?;
        loop {
            match self.host.reader().read(&mut self.scratch) {
                Ok(0) => {
                    self.host_ended = true;
                    break;
                }
                Ok(got) => self.to_guest.extend_from_slice(&self.scratch[..got]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                // The host closed its socket without close_notify: what came is kept, the
                // connection ends.
                Err(e) if e.kind() == ErrorKind::UnexpectedEof => {
                    self.host_ended = true;
                    break;
                }
                Err(e) => return Err(failed("host", e)),
            }
        }
        self.flush_plain_to_guest();
        Ok(n)
    }

    /// Gives the guest's session the host's plaintext it takes; once the host has ended and
    /// all of it went, the guest's close_notify (rustls sends it once).
    fn flush_plain_to_guest(&mut self) {
        if !self.to_guest.is_empty() {
            let n = self.guest.writer().write(&self.to_guest).unwrap_or(0);
            self.to_guest.drain(..n);
        }
        if self.host_ended && self.to_guest.is_empty() {
            self.guest.send_close_notify();
        }
    }

    /// Whether bud's session has bytes for the guest.
    pub(crate) fn has_for_guest(&self) -> bool {
        self.guest.wants_write() || !self.to_guest.is_empty()
    }

    /// Writes what bud's session has for the guest into `buf` (bytes written).
    pub(crate) fn write_to_guest(&mut self, buf: &mut [u8]) -> usize {
        self.flush_plain_to_guest();
        let mut out: &mut [u8] = buf;
        let len = out.len();
        while self.guest.wants_write() && !out.is_empty() {
            match self.guest.write_tls(&mut out) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        len - out.len()
    }

    /// Whether the host has ended and everything for the guest has gone: the guest's side
    /// may be closed.
    pub(crate) fn guest_side_done(&self) -> bool {
        self.host_ended && !self.has_for_guest()
    }
}

/// How a terminated relay's turn ended badly.
enum Broken {
    /// A TLS failure or a request the check refused: reported to the egress.
    Refused(Refusal),
    /// The host's socket failed (the host went): the guest's connection is reset, as a
    /// relay without TLS does.
    Host,
}

/// The host's socket, read and written no further than the byte budget `left` allows,
/// counting what moved.
struct Budgeted<'a> {
    host: &'a mut File,
    left: &'a mut Option<u64>,
    moved: u64,
}

impl Budgeted<'_> {
    fn most(&self, len: usize) -> usize {
        self.left.map_or(len, |l| len.min(l as usize))
    }

    fn took(&mut self, n: usize) {
        self.moved += n as u64;
        *self.left = self.left.map(|l| l - n as u64);
    }
}

impl Read for Budgeted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let most = self.most(buf.len());
        if most == 0 {
            return Err(ErrorKind::WouldBlock.into());
        }
        let n = self.host.read(&mut buf[..most])?;
        self.took(n);
        Ok(n)
    }
}

impl Write for Budgeted<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let most = self.most(buf.len());
        if most == 0 {
            return Err(ErrorKind::WouldBlock.into());
        }
        let n = self.host.write(&buf[..most])?;
        self.took(n);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Moves a relay's bytes through bud's two TLS sessions ([`super::terminate`]) both ways,
/// none past the byte budget `left`; a failure resets the guest's connection (a refusal is
/// reported to `egress` first).
pub(super) fn relay(
    r: &mut Relay,
    s: &mut tcp::Socket,
    left: &mut Option<u64>,
    counters: &mut StackCounters,
    egress: &dyn Egress,
) {
    let Some(t) = r.tls.as_deref_mut().filter(|t| !t.is_broken()) else {
        return;
    };
    let mut host = Budgeted {
        host: &mut r.host,
        left,
        moved: 0,
    };
    let mut turn = || -> Result<(), Broken> {
        loop {
            let mut moved = false;
            // The guest's bytes into bud's session with it, and what that makes for the host.
            if t.takes_from_guest() && s.can_recv() {
                let taken = s.recv(|buf| match t.take_from_guest(buf) {
                    Ok(n) => (n, Ok(n)),
                    Err(refusal) => (0, Err(refusal)),
                });
                match taken {
                    Ok(Ok(n)) => moved |= n > 0,
                    Ok(Err(refusal)) => return Err(Broken::Refused(refusal)),
                    Err(_) => {}
                }
            }
            let before = host.moved;
            t.write_to_host(&mut host).map_err(|_| Broken::Host)?;
            let sent = host.moved - before;
            counters.bytes_to_host += sent;
            r.traffic.sent += sent;
            moved |= sent > 0;
            // The host's bytes into bud's session with it, and what that makes for the guest.
            if t.takes_from_host() && *host.left != Some(0) {
                let before = host.moved;
                t.read_from_host(&mut host).map_err(Broken::Refused)?;
                let received = host.moved - before;
                counters.bytes_to_guest += received;
                r.traffic.received += received;
                moved |= received > 0;
            }
            while t.has_for_guest() && s.can_send() {
                match s.send(|buf| {
                    let n = t.write_to_guest(buf);
                    (n, n)
                }) {
                    Ok(n) if n > 0 => moved = true,
                    _ => break,
                }
            }
            if !moved {
                return Ok(());
            }
        }
    };
    let ended = turn();
    r.traffic.rewritten = t.rewritten();
    match ended {
        Ok(()) => {
            if guest_closed(s) && s.recv_queue() == 0 {
                t.guest_closed();
                // The close_notify for the host, if it fits now (else at the next turn).
                let before = host.moved;
                let _ = t.write_to_host(&mut host);
                let sent = host.moved - before;
                counters.bytes_to_host += sent;
                r.traffic.sent += sent;
            }
            if t.host_side_done() && !r.guest_done {
                r.guest_done = true;
                shutdown_write(&r.host);
            }
            if t.guest_side_done() && !r.host_done {
                r.host_done = true;
                s.close();
            }
        }
        Err(Broken::Refused(refusal)) => {
            t.break_off();
            egress.name_refused(r.id, r.name.as_deref().unwrap_or_default(), &refusal);
            s.abort();
        }
        Err(Broken::Host) => {
            t.break_off();
            s.abort();
        }
    }
}

#[cfg(test)]
#[path = "terminate_tests.rs"]
mod tests;
