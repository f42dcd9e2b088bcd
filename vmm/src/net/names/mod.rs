//! The name a guest's connection carries, checked against the name it was allowed for.
//!
//! bud decides a connection at its SYN, on the name the guest resolved through bud's DNS
//! (each name gets a synthetic address of its own, [`super::dns`]). What the guest then
//! sends may name another host behind the same address: a shared front (a CDN, a cloud load
//! balancer) serves many names at one address, so a sandbox allowed one of them could ask
//! for any other. So the relay passes the guest's bytes through a [`NameCheck`] until they
//! have said which protocol and which name they carry:
//! - **TLS**: the ClientHello's `server_name` must be the allowed name. A hello without one
//!   is let through (the server answers it with its default name, which the guest did not
//!   choose); so is everything after the hello (encrypted).
//! - **HTTP/1.x**: every request's `Host`, and an absolute target's host
//!   (`GET http://name/...`, which a server prefers to `Host`), must be the allowed name (a
//!   port after it aside). Bodies are followed (`Content-Length`, chunked) to find the next
//!   request of a kept-alive connection; ambiguous framing (both, or a coding other than
//!   chunked), two `Host` lines or a request that does not parse is refused, as a request
//!   another parser could read differently. A request that changes protocol (`CONNECT`, an
//!   `Upgrade` header) ends the checking: what follows is the new protocol's.
//! - **Anything else** (SSH, a database's protocol) names no host and is let through as it
//!   is.
//!
//! What is held: a ClientHello until it is whole, and an HTTP request's head from the end
//! of its request line to its end (a server acts on no request before its head ends). The
//! first line of a connection that is not TLS goes on as it comes, so a protocol that sends
//! a line and waits for an answer before ending it never waits on bud; at its end it says
//! whether the connection is HTTP (a request line) or not (the check is over). A first line
//! that cannot be a request line (it does not start with a method and a space) ends the
//! check at once.
//!
//! A mismatch, or bytes held past [`MAX_HELD`] without a verdict, is a [`Refusal`]: the relay
//! resets the connection and tells the egress ([`super::Egress::name_refused`]).
//!
//! What it cannot see: HTTP inside TLS (a guest may send `Host: other` in a TLS session whose
//! SNI was right, as domain fronting does), which only terminating the TLS would show; a
//! server that declines an `Upgrade` and reads what follows as more requests; and HTTP/2
//! without TLS, which does not parse as HTTP/1 and is refused.
//!
//! Why no crate for the TLS part: the check needs one field of one message (the SNI of a
//! ClientHello, ~60 lines here); a TLS library's acceptor would parse all of it to give that
//! field back ([`tls`]). The HTTP part ([`http`]) uses `httparse` (hyper's parser, already in
//! the build).

mod http;
#[cfg(test)]
mod tests;
mod tls;

use http::{
    Chunk, Line, chunked, first_line, head_may_end, may_be_request_line, request_head,
    starts_as_request_line,
};
use tls::{TLS_HANDSHAKE, client_hello, server_name};

/// Bytes of a request head, or of a TLS ClientHello, held at most while waiting for its end.
pub const MAX_HELD: usize = 16 << 10;

/// Why a connection's bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// It named another host (an HTTP `Host` or target, a TLS SNI), lower case.
    Mismatch(String),
    /// It could not be read as the protocol it started as (a reason for the log).
    Unreadable(&'static str),
    /// It started TLS to a host whose requests get headers set
    /// ([`NameCheck::with_headers`]), and bud cannot terminate that TLS (no
    /// [`super::Interception`] for it): the requests must not go without their headers.
    /// Where bud can, the relay terminates it instead ([`super::terminate`]).
    Encrypted,
    /// bud's TLS with the guest or with the host failed (which side, and rustls's error):
    /// a handshake the guest broke off, a host certificate bud does not trust.
    Tls(String),
}

/// Where the check is in the guest's byte stream.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Nothing seen yet.
    Start,
    /// The first line, not TLS: its bytes so far (they have gone on: a server acts on no
    /// request before its head ends, and a protocol that sends a line without its end
    /// must not wait on bud).
    FirstLine(Vec<u8>),
    /// The rest of a first request's head being held, after its request line (which went).
    HeadRest(Vec<u8>),
    /// A TLS ClientHello being held.
    Tls,
    /// An HTTP request head being held (after a first request: the next one).
    Head,
    /// The bytes left of a request body of known length.
    Body(u64),
    /// Inside a chunked request body.
    Chunked(Chunk),
    /// Nothing more to check: everything is let through.
    Open,
}

/// One connection's check (module docs).
#[derive(Debug, Clone)]
pub struct NameCheck {
    /// The allowed name, lower case, without a trailing dot.
    allowed: String,
    state: State,
    /// Bytes taken but not yet let through or refused.
    held: Vec<u8>,
    /// Headers set on each HTTP request (name, value): any of the same name the guest sent
    /// is left out.
    headers: Vec<(String, String)>,
    /// Requests whose head was given [`Self::headers`].
    rewritten: u64,
}

/// What the held bytes of a holding state say.
enum Verdict {
    /// Not enough to tell yet.
    More,
    /// The first `len` held bytes may go (or `head` in their place: a request head with
    /// headers set); then the check is in `next`.
    Pass {
        len: usize,
        next: State,
        head: Option<Vec<u8>>,
    },
}

impl NameCheck {
    /// A check of a connection allowed for `name` (as the guest resolved it).
    pub fn new(name: &str) -> Self {
        Self::with_headers(name, Vec::new())
    }

    /// A check that also sets `headers` (name, value) on each HTTP request of the
    /// connection, in place of any the guest sent under those names (compared without
    /// case), and stops at TLS ([`Refusal::Encrypted`], after the ClientHello's name is
    /// checked: [`Self::into_terminated`] goes on inside it). The values never reach the
    /// guest.
    pub fn with_headers(name: &str, headers: Vec<(String, String)>) -> Self {
        Self {
            allowed: normal(name),
            state: State::Start,
            held: Vec::new(),
            headers,
            rewritten: 0,
        }
    }

    /// After [`Refusal::Encrypted`]: the bytes held (the ClientHello, whose name was checked,
    /// and whatever came after it), and the check for the requests inside that TLS once
    /// bud terminates it (the same name and headers, from the start of a stream).
    pub fn into_terminated(self) -> (Vec<u8>, NameCheck) {
        let inner = Self {
            allowed: self.allowed,
            state: State::Start,
            held: Vec::new(),
            headers: self.headers,
            rewritten: self.rewritten,
        };
        (self.held, inner)
    }

    /// How many requests had their headers set so far.
    pub fn rewritten(&self) -> u64 {
        self.rewritten
    }

    /// Whether the check is over: everything from now on may go as it is, and nothing is
    /// held.
    pub fn is_open(&self) -> bool {
        self.state == State::Open && self.held.is_empty()
    }

    /// Takes the guest's next bytes: appends to `out` those that may go on (in order), and
    /// holds the rest until they say more. After a refusal nothing more may be fed: the
    /// connection is over.
    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>) -> Result<(), Refusal> {
        if self.is_open() {
            out.extend_from_slice(data);
            return Ok(());
        }
        let Self {
            allowed,
            state,
            held,
            headers,
            rewritten,
        } = self;
        held.extend_from_slice(data);
        let mut at = 0;
        let result = loop {
            let rest = &held[at..];
            if rest.is_empty() {
                break Ok(());
            }
            match state {
                State::Open => {
                    out.extend_from_slice(rest);
                    at = held.len();
                }
                State::Body(left) => {
                    let n = (*left).min(rest.len() as u64) as usize;
                    out.extend_from_slice(&rest[..n]);
                    at += n;
                    *left -= n as u64;
                    if *left == 0 {
                        *state = State::Head;
                    }
                }
                State::Chunked(chunk) => match chunked(chunk, rest) {
                    Ok((used, ended)) => {
                        out.extend_from_slice(&rest[..used]);
                        at += used;
                        if ended {
                            *state = State::Head;
                        }
                    }
                    Err(refusal) => break Err(refusal),
                },
                State::FirstLine(line) => match rest.iter().position(|&b| b == b'\n') {
                    None => {
                        line.extend_from_slice(rest);
                        out.extend_from_slice(rest);
                        at = held.len();
                        if !may_be_request_line(line) {
                            *state = State::Open;
                        } else if line.len() > MAX_HELD {
                            // Past any server's request line: a request would be refused.
                            if starts_as_request_line(line) {
                                break Err(Refusal::Unreadable("a request line past 16 KiB"));
                            }
                            *state = State::Open;
                        }
                    }
                    Some(i) => {
                        line.extend_from_slice(&rest[..=i]);
                        out.extend_from_slice(&rest[..=i]);
                        at += i + 1;
                        let line = std::mem::take(line);
                        *state = match first_line(&line) {
                            Line::Blank => State::FirstLine(Vec::new()),
                            Line::Http => State::HeadRest(line),
                            Line::Http2 => break Err(Refusal::Unreadable("HTTP/2 without TLS")),
                            Line::Other => State::Open,
                        };
                    }
                },
                State::Start | State::Tls | State::Head | State::HeadRest(_) => {
                    match verdict(allowed, headers, state, rest) {
                        Ok(Verdict::More) if rest.len() > MAX_HELD => {
                            break Err(Refusal::Unreadable("no name within 16 KiB"));
                        }
                        Ok(Verdict::More) => break Ok(()),
                        Ok(Verdict::Pass { len, next, head }) => {
                            match head {
                                Some(head) => {
                                    out.extend_from_slice(&head);
                                    *rewritten += 1;
                                }
                                None => out.extend_from_slice(&rest[..len]),
                            }
                            at += len;
                            *state = next;
                        }
                        Err(refusal) => break Err(refusal),
                    }
                }
            }
        };
        held.drain(..at);
        result
    }
}

/// `name` in lower case, without a trailing dot.
fn normal(name: &str) -> String {
    name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase()
}

/// `claimed` (a name from the guest's bytes) against the allowed name.
fn check(allowed: &str, claimed: &str) -> Result<(), Refusal> {
    let claimed = normal(claimed);
    if claimed == allowed {
        Ok(())
    } else {
        Err(Refusal::Mismatch(claimed))
    }
}

/// What the held bytes `bytes` of holding state `state` say; `headers`: those to set on
/// each HTTP request.
fn verdict(
    allowed: &str,
    headers: &[(String, String)],
    state: &State,
    bytes: &[u8],
) -> Result<Verdict, Refusal> {
    match state {
        State::Start if bytes[0] == TLS_HANDSHAKE => verdict(allowed, headers, &State::Tls, bytes),
        State::Start => Ok(Verdict::Pass {
            len: 0,
            next: State::FirstLine(Vec::new()),
            head: None,
        }),
        State::Tls => match client_hello(bytes)? {
            None => Ok(Verdict::More),
            Some((hello, len)) => {
                if let Some(name) = server_name(&hello)? {
                    check(allowed, &name)?;
                }
                if !headers.is_empty() {
                    return Err(Refusal::Encrypted);
                }
                Ok(Verdict::Pass {
                    len,
                    next: State::Open,
                    head: None,
                })
            }
        },
        State::HeadRest(line) if head_may_end(line, bytes) => {
            let mut whole = line.clone();
            whole.extend_from_slice(bytes);
            request_head(allowed, headers, &whole, line.len())
        }
        State::Head if head_may_end(&[], bytes) => request_head(allowed, headers, bytes, 0),
        _ => Ok(Verdict::More),
    }
}
