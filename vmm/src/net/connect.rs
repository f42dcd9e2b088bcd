//! Dials that hold no thread while they wait: a connection the egress allowed is started as
//! a non-blocking `connect()` on a thread of [`super::dialer`] ([`dial`]), which is then free
//! at once; one thread of the process (`bud-connect`) waits, in an `epoll` of its own, for
//! each connect to complete (writable, then `SO_ERROR`) or for its timeout, and hands the
//! outcome to the dial's [`Finish`] (which leaves it in the stack's inbox). So a host that
//! never answers costs its dial a socket and an entry here for the timeout, never a thread:
//! however many sandboxes dial ports that hang, no other sandbox's dial or lookup waits for
//! them (issue 58).
//!
//! **Why a thread of its own and not the wake-up thread ([`super::waker`]).** The wake-up
//! thread only marks VMs pending and kicks their vCPUs: one token and one timer per VM,
//! no system call but the wait and a signal. A connect's completion needs its own calls
//! (`getsockopt`, `epoll_ctl`, `setsockopt`), a deadline per connection (not per VM) and a
//! hand-off to the stack's inbox. Kept here, a dial's whole life after the egress's
//! decision (start, completion, timeout, the count in flight) is in one module, and the
//! wake-up thread stays what it is; the cost is one more thread and `epoll` for the process,
//! asleep while no dial is under way.
//!
//! A stack caps its own dials in flight (`MAX_DIALS_IN_FLIGHT` in [`super::stack`]); this
//! module bounds nothing itself but each dial's time. A stack that goes (a reset, the end of
//! a job) cancels its dials still under way ([`cancel`]): their sockets close at once
//! rather than at their timeout, so a VM reset again and again does not pile up dials.
//! [`in_flight`] is the dials under way, all VMs together, for the server's metrics.

use std::collections::{BTreeSet, HashMap};
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::dialer::Owner;

/// How long a dial may take (the guest's SYN is held meanwhile).
pub(crate) const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// `epoll` data of the control eventfd (dials are numbered from 0 and never reach it).
const CONTROL: u64 = u64::MAX;

/// Why a dial did not connect.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DialError {
    #[error("creating the socket: {0}")]
    Socket(#[source] io::Error),
    #[error("connecting: {0}")]
    Connect(#[source] io::Error),
    #[error("watching the connect: {0}")]
    Watch(#[source] io::Error),
    #[error("reading the connect's outcome: {0}")]
    Outcome(#[source] io::Error),
    #[error("no answer within {0:?}")]
    TimedOut(Duration),
}

/// What is done with a dial's outcome: a connected, non-blocking stream, or why not. Called
/// once, on the thread that started the dial (it connected at once or failed) or on the
/// `bud-connect` thread: it must not block.
pub(crate) type Finish = Box<dyn FnOnce(Result<TcpStream, DialError>) + Send>;

/// Starts dialing `target` for `owner` and returns at once; `finish` gets the outcome when
/// the connect completes, fails, or has not completed within `timeout` (and is dropped
/// uncalled if `owner` cancels it first).
pub(crate) fn dial(owner: Owner, target: SocketAddr, timeout: Duration, finish: Finish) {
    let fd = match socket(target) {
        Ok(fd) => fd,
        Err(e) => return finish(Err(DialError::Socket(e))),
    };
    match start_connect(&fd, target) {
        Ok(true) => return finish(Ok(TcpStream::from(fd))),
        Ok(false) => {}
        Err(e) => return finish(Err(DialError::Connect(e))),
    }
    let poller = poller();
    let raw = fd.as_raw_fd();
    let mut p = poller.pending();
    let id = p.next_id;
    p.next_id += 1;
    // Registered under the lock, so the thread (which takes it to find the dial) never
    // sees an event for a dial it does not hold yet.
    if let Err(e) = poller.epoll.ctl(
        ControlOperation::Add,
        raw,
        EpollEvent::new(EventSet::OUT, id),
    ) {
        drop(p);
        return finish(Err(DialError::Watch(e)));
    }
    let deadline = Instant::now() + timeout;
    p.dials.insert(
        id,
        Connecting {
            owner,
            fd,
            deadline,
            timeout,
            finish,
        },
    );
    p.deadlines.insert((deadline, id));
    let earliest = p.deadlines.first() == Some(&(deadline, id));
    drop(p);
    if earliest {
        // The thread may be waiting for a later deadline: make it look again.
        let _ = poller.control.write(1);
    }
}

/// Dials under way (connects started, not yet completed), all VMs together.
pub fn in_flight() -> usize {
    POLLER.get().map_or(0, |p| p.pending().dials.len())
}

/// Abandons `owner`'s dials under way: each socket closes (which also takes it out of the
/// `epoll`) and its finish is dropped uncalled. Makes no call but `close` (a job thread's
/// stack goes on the job thread, which a jailed server allows little else), and only takes
/// a lock when no dial is under way.
pub(crate) fn cancel(owner: Owner) {
    let Some(p) = POLLER.get() else { return };
    let gone: Vec<Connecting> = {
        let mut pending = p.pending();
        if pending.dials.is_empty() {
            return;
        }
        let ids: Vec<u64> = pending
            .dials
            .iter()
            .filter(|(_, c)| c.owner == owner)
            .map(|(id, _)| *id)
            .collect();
        ids.into_iter().filter_map(|id| pending.take(id)).collect()
    };
    // Outside the lock: closing a socket and dropping a finish (its stack's handles).
    drop(gone);
}

/// `owner`'s dials under way.
#[cfg(test)]
pub(crate) fn in_flight_of(owner: Owner) -> usize {
    POLLER.get().map_or(0, |p| {
        p.pending()
            .dials
            .values()
            .filter(|c| c.owner == owner)
            .count()
    })
}

/// Starts the `bud-connect` thread if it has not started ([`super::start`]).
pub(crate) fn start() {
    poller();
}

/// One connect under way.
struct Connecting {
    owner: Owner,
    fd: OwnedFd,
    deadline: Instant,
    timeout: Duration,
    finish: Finish,
}

#[derive(Default)]
struct Pending {
    next_id: u64,
    dials: HashMap<u64, Connecting>,
    /// (deadline, id) of every dial in `dials`.
    deadlines: BTreeSet<(Instant, u64)>,
}

impl Pending {
    fn take(&mut self, id: u64) -> Option<Connecting> {
        let c = self.dials.remove(&id)?;
        self.deadlines.remove(&(c.deadline, id));
        Some(c)
    }
}

struct Poller {
    epoll: Epoll,
    /// Written to make the thread look at the deadlines again.
    control: EventFd,
    pending: Mutex<Pending>,
}

impl Poller {
    fn pending(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }
}

static POLLER: OnceLock<&'static Poller> = OnceLock::new();

fn poller() -> &'static Poller {
    POLLER.get_or_init(|| {
        // Without its epoll or thread no VM could ever connect: fail loudly at the first
        // executor rather than leave guests waiting on every connection.
        let p: &'static Poller = Box::leak(Box::new(Poller {
            epoll: Epoll::new().expect("cannot create bud's dial epoll"),
            control: EventFd::new(libc::EFD_NONBLOCK).expect("cannot create an eventfd"),
            pending: Mutex::default(),
        }));
        p.epoll
            .ctl(
                ControlOperation::Add,
                p.control.as_raw_fd(),
                EpollEvent::new(EventSet::IN, CONTROL),
            )
            .expect("cannot watch the dial thread's eventfd");
        std::thread::Builder::new()
            .name("bud-connect".into())
            .spawn(move || wait_loop(p))
            .expect("cannot start bud's dial thread");
        p
    })
}

fn wait_loop(p: &Poller) {
    let mut events = [EpollEvent::default(); 64];
    loop {
        let timeout = match p.pending().deadlines.first() {
            None => -1,
            // Round up: waking before the deadline would only wait again.
            Some(&(deadline, _)) => {
                let left = deadline.saturating_duration_since(Instant::now());
                i32::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
            }
        };
        let ready = match p.epoll.wait(timeout, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // An epoll that fails is a bug; dials then end only by failing at once.
            Err(_) => return,
        };
        let (mut completed, mut expired) = (Vec::new(), Vec::new());
        {
            let mut pending = p.pending();
            for e in &events[..ready] {
                if e.data() == CONTROL {
                    let _ = p.control.read();
                } else if let Some(c) = pending.take(e.data()) {
                    completed.push(c);
                }
            }
            let now = Instant::now();
            while let Some(&(deadline, id)) = pending.deadlines.first() {
                if deadline > now {
                    break;
                }
                expired.extend(pending.take(id));
            }
        }
        // Outside the lock: a finish may take a while (it hands the socket on).
        for c in completed {
            let _ = p.epoll.ctl(
                ControlOperation::Delete,
                c.fd.as_raw_fd(),
                EpollEvent::default(),
            );
            let outcome = match so_error(c.fd.as_raw_fd()) {
                Ok(0) => Ok(TcpStream::from(c.fd)),
                Ok(errno) => Err(DialError::Connect(io::Error::from_raw_os_error(errno))),
                Err(e) => Err(DialError::Outcome(e)),
            };
            (c.finish)(outcome);
        }
        for c in expired {
            let _ = p.epoll.ctl(
                ControlOperation::Delete,
                c.fd.as_raw_fd(),
                EpollEvent::default(),
            );
            // Closing the socket abandons the connect.
            drop(c.fd);
            (c.finish)(Err(DialError::TimedOut(c.timeout)));
        }
    }
}

/// A non-blocking TCP socket for `target`'s family, closed on exec.
fn socket(target: SocketAddr) -> io::Result<OwnedFd> {
    let domain = match target {
        SocketAddr::V4(_) => libc::AF_INET,
        SocketAddr::V6(_) => libc::AF_INET6,
    };
    // SAFETY: socket takes no pointers; a negative result is an error, anything else a new
    // descriptor that nothing else owns.
    let fd = unsafe {
        libc::socket(
            domain,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Starts connecting `fd` to `target`: true if it connected at once, false if the connect
/// is under way.
fn start_connect(fd: &OwnedFd, target: SocketAddr) -> io::Result<bool> {
    let rc = match target {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: `sin` is a complete sockaddr_in that lives across the call, and the
            // length passed is its size; `fd` is an open socket.
            unsafe {
                libc::connect(
                    fd.as_raw_fd(),
                    (&raw const sin).cast(),
                    size_of::<libc::sockaddr_in>() as libc::socklen_t,
                )
            }
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above, for a complete sockaddr_in6.
            unsafe {
                libc::connect(
                    fd.as_raw_fd(),
                    (&raw const sin6).cast(),
                    size_of::<libc::sockaddr_in6>() as libc::socklen_t,
                )
            }
        }
    };
    if rc == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        // A non-blocking connect goes on in the kernel, interrupted or not.
        Some(libc::EINPROGRESS | libc::EINTR) => Ok(false),
        _ => Err(e),
    }
}

/// The socket's pending error (`SO_ERROR`, cleared by reading it): 0 once a connect
/// succeeded.
fn so_error(fd: RawFd) -> io::Result<i32> {
    let mut err: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `err` and `len` are live locals of the sizes passed; `fd` is an open socket.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&raw mut err).cast(),
            &raw mut len,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(err)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::mpsc;

    /// Longer than any wait here that must end.
    const PATIENCE: Duration = Duration::from_secs(30);

    /// A loopback listener whose accept queue is full: backlog 0 and one connection never
    /// accepted, so Linux drops every further SYN and a connect to it hangs. The listener
    /// and the connection that fills it are returned, to keep them open.
    pub(crate) fn hanging_listener() -> (TcpListener, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        // SAFETY: listen takes no pointers; `listener` is a bound socket that stays open.
        // Listening again only changes the backlog.
        let rc = unsafe { libc::listen(listener.as_raw_fd(), 0) };
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
        let filler = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        (listener, filler)
    }

    /// A finish that sends the outcome (connected or the error's text) to `tx`.
    fn to(tx: &mpsc::Sender<Result<(), String>>) -> Finish {
        let tx = tx.clone();
        Box::new(move |r| {
            let _ = tx.send(r.map(drop).map_err(|e| e.to_string()));
        })
    }

    #[test]
    fn hanging_dials_hold_no_thread_and_a_dial_to_a_listening_port_completes_meanwhile() {
        let (hanging, _filler) = hanging_listener();
        let good = TcpListener::bind("127.0.0.1:0").unwrap();
        let (hung_tx, hung) = mpsc::channel();
        let (done_tx, done) = mpsc::channel();
        // More hanging dials than the dial pool has threads, started from one thread.
        let (hostile, other) = (Owner::new(), Owner::new());
        for _ in 0..super::super::dialer::THREADS * 8 {
            dial(
                hostile,
                hanging.local_addr().unwrap(),
                PATIENCE,
                to(&hung_tx),
            );
        }

        dial(other, good.local_addr().unwrap(), PATIENCE, to(&done_tx));
        let outcome = done.recv_timeout(PATIENCE);

        assert_eq!(outcome, Ok(Ok(())));
        assert!(hung.try_recv().is_err(), "the hanging dials are under way");
        assert_eq!(in_flight_of(hostile), super::super::dialer::THREADS * 8);
        assert!(in_flight() >= super::super::dialer::THREADS * 8);
        cancel(hostile);
    }

    #[test]
    fn cancelled_dials_close_and_never_finish_and_others_dials_go_on() {
        let (hanging, _filler) = hanging_listener();
        let (gone, kept) = (Owner::new(), Owner::new());
        let (gone_tx, gone_rx) = mpsc::channel();
        let (kept_tx, kept_rx) = mpsc::channel();
        for _ in 0..4 {
            dial(gone, hanging.local_addr().unwrap(), PATIENCE, to(&gone_tx));
        }
        dial(kept, hanging.local_addr().unwrap(), PATIENCE, to(&kept_tx));
        drop((gone_tx, kept_tx));

        cancel(gone);

        assert_eq!(in_flight_of(gone), 0);
        assert_eq!(
            gone_rx.recv_timeout(PATIENCE),
            Err(mpsc::RecvTimeoutError::Disconnected),
            "every finish dropped uncalled"
        );
        assert_eq!(in_flight_of(kept), 1);
        assert!(kept_rx.try_recv().is_err(), "still under way");
        cancel(kept);
    }

    #[test]
    fn a_dial_that_hangs_ends_at_its_timeout_and_a_refused_one_fails() {
        let (hanging, _filler) = hanging_listener();
        let closed = TcpListener::bind("127.0.0.1:0").unwrap();
        let closed_addr = closed.local_addr().unwrap();
        drop(closed);
        let (tx, rx) = mpsc::channel();

        dial(
            Owner::new(),
            hanging.local_addr().unwrap(),
            Duration::from_millis(50),
            to(&tx),
        );
        let hung = rx.recv_timeout(PATIENCE).unwrap();
        dial(Owner::new(), closed_addr, PATIENCE, to(&tx));
        let refused = rx.recv_timeout(PATIENCE).unwrap();

        assert_eq!(hung, Err("no answer within 50ms".to_owned()));
        assert!(
            refused.as_ref().is_err_and(|e| e.contains("refused")),
            "{refused:?}"
        );
    }
}
