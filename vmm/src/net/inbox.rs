//! Work a network stack hands off its vCPU thread ([`super::dialer`], [`super::connect`])
//! and the way it comes back: a dial's outcome or a DNS query's answer, left in the stack's
//! [`Inbox`] by a dial thread or the connect thread, which then wakes the stack's vCPU
//! ([`Waker::wake`]). An inbox closes with its stack (a reset makes a new one), and work
//! that comes back to a closed inbox is dropped: a connection dialed for a stack that is
//! gone is closed, and wakes nothing.

use std::fs::File;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Mutex, MutexGuard};

use smoltcp::socket::udp;
use smoltcp::wire::IpEndpoint;

use super::connect::DialError;
use super::waker::Waker;

/// A guest connection: its source and destination.
pub(crate) type Conn = (IpEndpoint, IpEndpoint);

/// What a dial handed to the dialer came back with.
#[derive(Debug)]
pub(crate) enum Dialed {
    /// The egress refused the connection.
    Refused,
    /// The dial failed (or the socket could not be prepared).
    Failed,
    /// Connected, non-blocking, watched by the VM's waker. A `File`, so that the relay reads
    /// and writes it with `read(2)` and `write(2)` (what a job thread may call).
    Connected(File),
}

/// Work of the dialer, come back to the stack.
#[derive(Debug)]
pub(crate) enum Done {
    Dial(Conn, Dialed),
    Dns {
        query: Vec<u8>,
        meta: udp::UdpMetadata,
        known: bool,
    },
}

/// Where the dialer leaves its work for one stack. Closed when the stack goes (a reset):
/// work that comes back later is dropped, and wakes nothing.
#[derive(Debug, Default)]
pub(crate) struct Inbox {
    pub(crate) done: Vec<Done>,
    pub(crate) closed: bool,
}

/// The inbox, whatever a panicking holder left in it.
pub(crate) fn lock(inbox: &Mutex<Inbox>) -> MutexGuard<'_, Inbox> {
    inbox.lock().unwrap_or_else(|e| e.into_inner())
}

/// Hands `done` to the stack of `inbox` and wakes it, unless that stack is gone. Under the
/// inbox's lock, so that a reset (which closes it, then clears the waker's mark) never sees
/// a mark left by the stack it replaced.
pub(crate) fn deliver(inbox: &Mutex<Inbox>, waker: &Waker, done: Done) {
    let mut i = lock(inbox);
    if i.closed {
        return;
    }
    i.done.push(done);
    waker.wake();
}

/// The outcome of a dial ([`super::connect`]) made ready for the relay: non-blocking (it
/// is), without Nagle, watched by the VM's waker.
pub(crate) fn connected(outcome: Result<TcpStream, DialError>, waker: &Waker) -> Dialed {
    let Ok(host) = outcome else {
        return Dialed::Failed;
    };
    let _ = host.set_nodelay(true);
    let host = File::from(OwnedFd::from(host));
    if waker.watch(host.as_raw_fd()).is_err() {
        return Dialed::Failed;
    }
    Dialed::Connected(host)
}
