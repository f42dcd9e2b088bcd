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
//! field back. The HTTP part uses `httparse` (hyper's parser, already in the build).

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
    /// ([`NameCheck::with_headers`]): they cannot be set without terminating the TLS, and
    /// the requests must not go without them.
    Encrypted,
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

/// Where a chunked body's parser is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Chunk {
    /// A chunk's size line, its bytes so far (the size in hex, an extension).
    Size(Vec<u8>),
    /// The bytes left of a chunk's data.
    Data(u64),
    /// The CR LF after a chunk's data: how many of the two came.
    DataEnd(u8),
    /// The trailer after the last chunk: whether at a line's start, and its bytes so far.
    Trailer { line_start: bool, seen: usize },
    /// The LF of the trailer's last (empty) line.
    End,
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
    /// case), and refuses TLS ([`Refusal::Encrypted`]). The values never reach the guest.
    pub fn with_headers(name: &str, headers: Vec<(String, String)>) -> Self {
        Self {
            allowed: normal(name),
            state: State::Start,
            held: Vec::new(),
            headers,
            rewritten: 0,
        }
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
            http(allowed, headers, &whole, line.len())
        }
        State::Head if head_may_end(&[], bytes) => http(allowed, headers, bytes, 0),
        _ => Ok(Verdict::More),
    }
}

/// Whether a head whose bytes so far are `before` then `bytes` may have ended: an empty
/// line after a line's end. (So a head fed a byte at a time is parsed once, not at each.)
fn head_may_end(before: &[u8], bytes: &[u8]) -> bool {
    let ends_line = before.last() == Some(&b'\n');
    (ends_line && (bytes.starts_with(b"\r\n") || bytes.starts_with(b"\n")))
        || bytes.windows(2).any(|w| w == b"\n\n")
        || bytes.windows(3).any(|w| w == b"\n\r\n")
}

/// Whether the bytes of a first line so far may still be a request line: empty lines, then
/// a method's token characters and, once it ends, a space (a length prefix or any other
/// binary start is not, and the check is over at once).
fn may_be_request_line(line: &[u8]) -> bool {
    let start = line
        .iter()
        .position(|&b| b != b'\r' && b != b'\n')
        .unwrap_or(line.len());
    let line = &line[start..];
    let method = line.iter().take_while(|b| is_tchar(**b)).count();
    match line.get(method) {
        None => true,
        Some(&b' ') => method > 0,
        Some(_) => false,
    }
}

/// Whether `line` starts as an HTTP request line does: an upper-case method (as servers
/// read methods), then a space.
fn starts_as_request_line(line: &[u8]) -> bool {
    let method = line
        .iter()
        .take_while(|b| b.is_ascii_uppercase() || **b == b'-' || **b == b'_')
        .count();
    method > 0 && line.get(method) == Some(&b' ')
}

/// What the first line of a connection says of its protocol.
enum Line {
    /// An HTTP/1.x request line.
    Http,
    /// HTTP/2's connection preface in clear (`PRI * HTTP/2.0`).
    Http2,
    /// An empty line (HTTP servers skip those before a request).
    Blank,
    /// Anything else.
    Other,
}

/// Reads a whole first line (its `\n` included).
fn first_line(line: &[u8]) -> Line {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.is_empty() {
        return Line::Blank;
    }
    let mut parts = line.split(|&b| b == b' ');
    let (Some(method), Some(_target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Line::Other;
    };
    if method.is_empty() || !method.iter().all(|&b| is_tchar(b)) {
        return Line::Other;
    }
    match version {
        b"HTTP/1.0" | b"HTTP/1.1" => Line::Http,
        b"HTTP/2.0" => Line::Http2,
        _ => Line::Other,
    }
}

/// A token character of HTTP (RFC 9110, 5.6.2).
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Header lines a request may have.
const MAX_HEADERS: usize = 128;

/// An HTTP/1 request head at the start of `bytes`, whose first `passed` bytes (its request
/// line) went already: its names checked, then how its body is framed; given `headers`,
/// the rest of the head comes back with them set.
fn http(
    allowed: &str,
    headers: &[(String, String)],
    bytes: &[u8],
    passed: usize,
) -> Result<Verdict, Refusal> {
    let mut parsed = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut parsed);
    let len = match req.parse(bytes) {
        Ok(httparse::Status::Partial) => return Ok(Verdict::More),
        Ok(httparse::Status::Complete(len)) => len,
        Err(httparse::Error::TooManyHeaders) => {
            return Err(Refusal::Unreadable("more than 128 header lines"));
        }
        Err(_) => return Err(Refusal::Unreadable("not an HTTP/1 request")),
    };
    let method = req.method.unwrap_or_default();
    let target = req.path.unwrap_or_default();
    if method.eq_ignore_ascii_case("CONNECT") {
        check(allowed, host_of(target)?)?;
    } else if let Some(authority) = absolute_authority(target) {
        check(allowed, host_of(authority)?)?;
    }
    let (mut host, mut length, mut chunked, mut coded, mut upgrade) =
        (None, None, false, false, false);
    for h in req.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("host") {
            if host.is_some() {
                return Err(Refusal::Unreadable("two Host lines"));
            }
            host = Some(text(h.value)?);
        } else if name.eq_ignore_ascii_case("content-length") {
            let n = text(h.value)?
                .trim()
                .parse::<u64>()
                .map_err(|_| Refusal::Unreadable("a Content-Length that is not a number"))?;
            if length.is_some_and(|l| l != n) {
                return Err(Refusal::Unreadable("two Content-Lengths"));
            }
            length = Some(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            // The last coding must be chunked for a request's body to be framed (RFC 9112,
            // 6.3); codings may come in several lines, in order.
            let value = text(h.value)?;
            coded = true;
            chunked = value
                .rsplit(',')
                .next()
                .is_some_and(|c| c.trim().eq_ignore_ascii_case("chunked"));
        } else if name.eq_ignore_ascii_case("upgrade") {
            upgrade = true;
        }
    }
    if let Some(host) = host {
        check(allowed, host_of(host)?)?;
    }
    let next = if method.eq_ignore_ascii_case("CONNECT") || upgrade {
        State::Open
    } else if coded && length.is_some() {
        return Err(Refusal::Unreadable(
            "both Transfer-Encoding and Content-Length",
        ));
    } else if coded && !chunked {
        return Err(Refusal::Unreadable(
            "a Transfer-Encoding not ending in chunked",
        ));
    } else if chunked {
        State::Chunked(Chunk::Size(Vec::new()))
    } else {
        match length {
            Some(n) if n > 0 => State::Body(n),
            _ => State::Head,
        }
    };
    let head = (!headers.is_empty())
        .then(|| with_headers(&bytes[..len], req.headers, headers, passed == 0));
    Ok(Verdict::Pass {
        len: len - passed,
        next,
        head,
    })
}

/// Request head `head` (its parsed `lines`) rebuilt with `set` in place of the lines of
/// those names: the request line as it was (if `with_line`), the other lines as
/// `name: value`, then `set`.
fn with_headers(
    head: &[u8],
    lines: &[httparse::Header<'_>],
    set: &[(String, String)],
    with_line: bool,
) -> Vec<u8> {
    let start = head
        .iter()
        .position(|&b| b != b'\r' && b != b'\n')
        .unwrap_or(0);
    let line_end = head[start..]
        .iter()
        .position(|&b| b == b'\n')
        .map_or(head.len(), |i| start + i + 1);
    let mut out = Vec::with_capacity(head.len() + 256);
    if with_line {
        out.extend_from_slice(&head[start..line_end]);
    }
    let kept = lines
        .iter()
        .filter(|line| {
            !set.iter()
                .any(|(name, _)| name.eq_ignore_ascii_case(line.name))
        })
        .map(|line| (line.name, line.value));
    let added = set
        .iter()
        .map(|(name, value)| (name.as_str(), value.as_bytes()));
    for (name, value) in kept.chain(added) {
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

/// A header's value as text (HTTP allows other bytes in values; not in those read here).
fn text(value: &[u8]) -> Result<&str, Refusal> {
    std::str::from_utf8(value).map_err(|_| Refusal::Unreadable("a header that is not text"))
}

/// The authority of an absolute request target (`http://name:80/path`), if it is one.
fn absolute_authority(target: &str) -> Option<&str> {
    let (scheme, rest) = target.split_once("://")?;
    if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
        return None;
    }
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..end];
    Some(
        authority
            .rsplit_once('@')
            .map_or(authority, |(_, host)| host),
    )
}

/// The host of an authority or a `Host` value: a port after it left out. An IPv6 literal
/// (`[::1]:80`) stays whole: it is no name.
fn host_of(authority: &str) -> Result<&str, Refusal> {
    let authority = authority.trim();
    if authority.starts_with('[') {
        return Ok(authority
            .find(']')
            .map_or(authority, |end| &authority[..=end]));
    }
    match authority.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => Ok(host),
        Some(_) => Err(Refusal::Unreadable("a host with a bad port")),
        None => Ok(authority),
    }
}

/// Takes chunked body bytes from `input`: returns how many it used, and whether the body
/// ended with them.
fn chunked(chunk: &mut Chunk, input: &[u8]) -> Result<(usize, bool), Refusal> {
    let mut i = 0;
    while i < input.len() {
        match chunk {
            Chunk::Size(line) => {
                let b = input[i];
                i += 1;
                if b != b'\n' {
                    line.push(b);
                    if line.len() > 1024 {
                        return Err(Refusal::Unreadable("a chunk size line past 1 KiB"));
                    }
                    continue;
                }
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                let hex = line.split(|&b| b == b';').next().unwrap_or_default();
                let hex = std::str::from_utf8(hex)
                    .ok()
                    .map(str::trim)
                    .filter(|h| !h.is_empty() && h.len() <= 15)
                    .ok_or(Refusal::Unreadable("a bad chunk size"))?;
                let size = u64::from_str_radix(hex, 16)
                    .map_err(|_| Refusal::Unreadable("a bad chunk size"))?;
                *chunk = if size == 0 {
                    Chunk::Trailer {
                        line_start: true,
                        seen: 0,
                    }
                } else {
                    Chunk::Data(size)
                };
            }
            Chunk::Data(left) => {
                let n = (*left).min((input.len() - i) as u64);
                i += n as usize;
                *left -= n;
                if *left == 0 {
                    *chunk = Chunk::DataEnd(0);
                }
            }
            Chunk::DataEnd(k) => {
                let expected = if *k == 0 { b'\r' } else { b'\n' };
                if input[i] != expected {
                    return Err(Refusal::Unreadable("chunk data not followed by CR LF"));
                }
                i += 1;
                *chunk = if *k == 0 {
                    Chunk::DataEnd(1)
                } else {
                    Chunk::Size(Vec::new())
                };
            }
            Chunk::Trailer { line_start, seen } => {
                let b = input[i];
                i += 1;
                *seen += 1;
                if *seen > MAX_HELD {
                    return Err(Refusal::Unreadable("a trailer past 16 KiB"));
                }
                if *line_start && b == b'\r' {
                    *chunk = Chunk::End;
                } else if *line_start && b == b'\n' {
                    return Ok((i, true));
                } else {
                    *line_start = b == b'\n';
                }
            }
            Chunk::End => {
                if input[i] != b'\n' {
                    return Err(Refusal::Unreadable("a trailer not ended by CR LF"));
                }
                return Ok((i + 1, true));
            }
        }
    }
    Ok((i, false))
}

/// A TLS record's content type for the handshake.
const TLS_HANDSHAKE: u8 = 22;
/// A TLS record's payload, at most (2^14 plus the expansion TLS 1.2 allows).
const MAX_RECORD: usize = (1 << 14) + 2048;

/// The ClientHello at the start of `bytes` (its body, reassembled from its records) and how
/// many bytes its records take; None: its records have not all come yet.
fn client_hello(bytes: &[u8]) -> Result<Option<(Vec<u8>, usize)>, Refusal> {
    let mut message = Vec::new();
    let mut at = 0;
    loop {
        let Some(header) = bytes.get(at..at + 5) else {
            return Ok(None);
        };
        if header[0] != TLS_HANDSHAKE {
            return Err(Refusal::Unreadable(
                "a TLS record before the ClientHello's end",
            ));
        }
        let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        if len == 0 || len > MAX_RECORD {
            return Err(Refusal::Unreadable("a TLS record of a bad length"));
        }
        let Some(payload) = bytes.get(at + 5..at + 5 + len) else {
            return Ok(None);
        };
        message.extend_from_slice(payload);
        at += 5 + len;
        if message.len() >= 4 {
            if message[0] != 1 {
                return Err(Refusal::Unreadable(
                    "a TLS handshake that is not a ClientHello",
                ));
            }
            let body = usize::from(message[1]) << 16
                | usize::from(message[2]) << 8
                | usize::from(message[3]);
            if body > MAX_HELD {
                return Err(Refusal::Unreadable("a ClientHello past 16 KiB"));
            }
            if message.len() >= 4 + body {
                message.truncate(4 + body);
                message.drain(..4);
                return Ok(Some((message, at)));
            }
        }
    }
}

/// The host name of a ClientHello's `server_name` extension (RFC 6066), if it has one.
fn server_name(hello: &[u8]) -> Result<Option<String>, Refusal> {
    const BAD: Refusal = Refusal::Unreadable("a malformed ClientHello");
    let mut r = Reader(hello);
    r.take(2 + 32).ok_or(BAD)?; // version, random
    let session = r.u8().ok_or(BAD)?;
    r.take(session.into()).ok_or(BAD)?;
    let suites = r.u16().ok_or(BAD)?;
    r.take(suites.into()).ok_or(BAD)?;
    let compression = r.u8().ok_or(BAD)?;
    r.take(compression.into()).ok_or(BAD)?;
    if r.0.is_empty() {
        return Ok(None); // no extensions
    }
    let len = r.u16().ok_or(BAD)?;
    let mut extensions = Reader(r.take(len.into()).ok_or(BAD)?);
    while !extensions.0.is_empty() {
        let kind = extensions.u16().ok_or(BAD)?;
        let len = extensions.u16().ok_or(BAD)?;
        let data = extensions.take(len.into()).ok_or(BAD)?;
        if kind != 0 {
            continue;
        }
        let mut list = Reader(data);
        let len = list.u16().ok_or(BAD)?;
        let mut names = Reader(list.take(len.into()).ok_or(BAD)?);
        while !names.0.is_empty() {
            let kind = names.u8().ok_or(BAD)?;
            let len = names.u16().ok_or(BAD)?;
            let name = names.take(len.into()).ok_or(BAD)?;
            if kind == 0 {
                let name = std::str::from_utf8(name).map_err(|_| BAD)?;
                return Ok(Some(name.to_owned()));
            }
        }
        return Ok(None);
    }
    Ok(None)
}

/// Big-endian fields read off the front of a slice.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TLS ClientHello record naming `sni` (none: no server_name extension), with another
    /// extension before it.
    fn hello(sni: Option<&str>) -> Vec<u8> {
        let mut ext = vec![0x00, 0x0a, 0x00, 0x04, 0x00, 0x02, 0x00, 0x1d];
        if let Some(name) = sni {
            let n = name.len() as u16;
            ext.extend_from_slice(&[0x00, 0x00]);
            ext.extend_from_slice(&(n + 5).to_be_bytes());
            ext.extend_from_slice(&(n + 3).to_be_bytes());
            ext.push(0);
            ext.extend_from_slice(&n.to_be_bytes());
            ext.extend_from_slice(name.as_bytes());
        }
        let mut body = vec![0x03, 0x03];
        body.extend_from_slice(&[0x5a; 32]);
        body.extend_from_slice(&[0, 0, 2, 0x13, 0x01, 1, 0]);
        body.extend_from_slice(&(ext.len() as u16).to_be_bytes());
        body.extend_from_slice(&ext);
        let mut message = vec![1, 0];
        message.extend_from_slice(&(body.len() as u16).to_be_bytes());
        message.extend_from_slice(&body);
        let mut record = vec![TLS_HANDSHAKE, 3, 1];
        record.extend_from_slice(&(message.len() as u16).to_be_bytes());
        record.extend_from_slice(&message);
        record
    }

    /// Feeds `chunks` to a check of `echo.test`: what went through, and the refusal if any.
    fn run(chunks: &[&[u8]]) -> (Vec<u8>, Option<Refusal>, bool) {
        let mut check = NameCheck::new("Echo.test.");
        let mut out = Vec::new();
        for chunk in chunks {
            if let Err(refusal) = check.feed(chunk, &mut out) {
                return (out, Some(refusal), false);
            }
        }
        (out, None, check.is_open())
    }

    /// The same, one byte at a time.
    fn run_bytewise(bytes: &[u8]) -> (Vec<u8>, Option<Refusal>, bool) {
        let chunks: Vec<&[u8]> = bytes.chunks(1).collect();
        run(&chunks)
    }

    /// `stream` fed whole and a byte at a time gives `expected` both ways.
    fn both_ways(stream: &[u8], expected: (Vec<u8>, Option<Refusal>, bool)) {
        assert_eq!(run(&[stream]), expected);
        assert_eq!(run_bytewise(stream), expected);
    }

    fn mismatch(name: &str) -> Option<Refusal> {
        Some(Refusal::Mismatch(name.into()))
    }

    #[test]
    fn a_client_hello_for_the_allowed_name_opens_the_connection_even_split_bytewise() {
        let mut stream = hello(Some("ECHO.test"));
        stream.extend_from_slice(b"\x17\x03\x03\x00\x01encrypted");
        assert_eq!(run(&[&stream]), (stream.clone(), None, true));
        assert_eq!(run_bytewise(&stream), (stream.clone(), None, true));
        let no_sni = hello(None);
        assert_eq!(run(&[&no_sni]), (no_sni.clone(), None, true));
    }

    #[test]
    fn a_client_hello_for_another_name_is_refused_before_a_byte_goes() {
        let other = hello(Some("other.test"));
        assert_eq!(run(&[&other]), (vec![], mismatch("other.test"), false));
        assert_eq!(
            run_bytewise(&other),
            (vec![], mismatch("other.test"), false)
        );
        // A record that is not the handshake's, and a hello cut short inside.
        // The hello's first 4 bytes in a record of their own, then an alert record.
        let mut split = vec![TLS_HANDSHAKE, 3, 1, 0, 4];
        split.extend_from_slice(&other[5..9]);
        split.extend_from_slice(&[21, 3, 3, 0, 2, 2, 40]);
        assert_eq!(
            run(&[&split]).1,
            Some(Refusal::Unreadable(
                "a TLS record before the ClientHello's end"
            ))
        );
        let mut short = hello(Some("echo.test"));
        short[8] = 0xff; // the hello's length, past its record
        short.truncate(20);
        assert_eq!(run(&[&short]), (vec![], None, false), "waits for more");
    }

    #[test]
    fn each_request_of_a_kept_alive_connection_is_checked_bodies_skipped() {
        let first = b"POST /a HTTP/1.1\r\nHost: echo.test:8080\r\nContent-Length: 22\r\n\r\nHost: other.test\r\n\r\n12";
        let second = b"GET /b HTTP/1.1\r\nhost: other.test\r\n\r\n";
        let stream = [&first[..], &second[..]].concat();
        both_ways(&stream, (first.to_vec(), mismatch("other.test"), false));
        let fine = b"GET /c HTTP/1.1\r\nHost: echo.test\r\n\r\n";
        let both = [&first[..], &fine[..]].concat();
        assert_eq!(run_bytewise(&both), (both.clone(), None, false));
    }

    #[test]
    fn a_chunked_body_with_a_trailer_is_followed_to_the_next_request() {
        let body = b"PUT / HTTP/1.1\r\nHost: echo.test\r\nTransfer-Encoding: gzip, chunked\r\n\r\n5;x=y\r\nHost:\r\n10\r\n0123456789abcdef\r\n0\r\nTrailer: 1\r\n\r\n";
        let next = b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n";
        let stream = [&body[..], &next[..]].concat();
        both_ways(&stream, (body.to_vec(), mismatch("other.test"), false));
        let bad_end =
            b"PUT / HTTP/1.1\r\nHost: echo.test\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nxyz";
        assert!(matches!(run(&[bad_end]).1, Some(Refusal::Unreadable(_))));
    }

    #[test]
    fn other_names_in_a_target_or_a_connect_and_ambiguous_heads_are_refused() {
        for (head, refusal) in [
            (
                &b"GET http://user@other.test:80/x HTTP/1.1\r\nHost: echo.test\r\n\r\n"[..],
                mismatch("other.test"),
            ),
            (
                b"CONNECT other.test:443 HTTP/1.1\r\nHost: echo.test\r\n\r\n",
                mismatch("other.test"),
            ),
            (b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n", mismatch("[::1]")),
            (
                b"GET / HTTP/1.1\r\nHost: echo.test\r\nHost: echo.test\r\n\r\n",
                Some(Refusal::Unreadable("two Host lines")),
            ),
            (
                b"POST / HTTP/1.1\r\nHost: echo.test\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
                Some(Refusal::Unreadable(
                    "both Transfer-Encoding and Content-Length",
                )),
            ),
            (
                b"POST / HTTP/1.1\r\nHost: echo.test\r\nTransfer-Encoding: gzip\r\n\r\n",
                Some(Refusal::Unreadable(
                    "a Transfer-Encoding not ending in chunked",
                )),
            ),
            (
                b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
                Some(Refusal::Unreadable("HTTP/2 without TLS")),
            ),
        ] {
            assert_eq!(run(&[head]).1, refusal, "{}", String::from_utf8_lossy(head));
        }
    }

    #[test]
    fn protocols_that_name_no_host_go_at_once_and_an_upgrade_ends_the_checking() {
        for opaque in [
            &b"SSH-2.0-OpenSSH_9.2\r\n"[..],
            b"EHLO mail.test\r\n",
            b"\x00\x00\x00\x08\x04\xd2\x16\x2f",
            b"*1\r\n$4\r\nPING\r\n",
        ] {
            assert_eq!(run(&[opaque]), (opaque.to_vec(), None, true));
        }
        let upgrade = b"GET /ws HTTP/1.1\r\nHost: echo.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n\x81\x05hello";
        assert_eq!(run_bytewise(upgrade), (upgrade.to_vec(), None, true));
    }

    #[test]
    fn a_head_that_never_ends_is_refused_past_the_limit() {
        let mut head = b"GET / HTTP/1.1\r\nHost: echo.test\r\nX-Long: ".to_vec();
        head.extend(std::iter::repeat_n(b'a', MAX_HELD));
        // The request line goes at once (no server acts on it alone); the rest is held.
        let line = b"GET / HTTP/1.1\r\n".to_vec();
        assert_eq!(
            run(&[&head]),
            (
                line.clone(),
                Some(Refusal::Unreadable("no name within 16 KiB")),
                false
            )
        );
        // Under the limit it waits.
        assert_eq!(run(&[&head[..1000]]), (line, None, false));
        // A line without its end goes on at once, so no protocol waits on bud for it; the
        // check waits for its end, unless it cannot be a request line.
        assert_eq!(
            run(&[b"through bud"]),
            (b"through bud".to_vec(), None, false)
        );
        assert_eq!(run(&[b"GET /x HT"]), (b"GET /x HT".to_vec(), None, false));
        assert_eq!(
            run(&[b"{\"op\": 1}"]),
            (b"{\"op\": 1}".to_vec(), None, true)
        );
    }
}

#[cfg(test)]
mod header_tests {
    use super::*;

    fn set() -> Vec<(String, String)> {
        vec![
            ("Authorization".into(), "Bearer s3cret".into()),
            ("X-Team".into(), "blue".into()),
        ]
    }

    #[test]
    fn each_request_gets_the_headers_in_place_of_the_guests_own() {
        let first = b"POST /v1 HTTP/1.1\r\nHost: echo.test\r\nauthorization: Bearer dummy\r\nContent-Length: 4\r\n\r\nbody";
        let second = b"GET /v2 HTTP/1.1\r\nHost: echo.test\r\nAccept: */*\r\n\r\n";
        let stream = [&first[..], &second[..]].concat();
        for chunks in [vec![&stream[..]], stream.chunks(1).collect()] {
            let mut check = NameCheck::with_headers("echo.test", set());
            let mut out = Vec::new();
            for chunk in chunks {
                check.feed(chunk, &mut out).unwrap();
            }
            assert_eq!(
                String::from_utf8(out).unwrap(),
                "POST /v1 HTTP/1.1\r\nHost: echo.test\r\nContent-Length: 4\r\n\
                 Authorization: Bearer s3cret\r\nX-Team: blue\r\n\r\nbody\
                 GET /v2 HTTP/1.1\r\nHost: echo.test\r\nAccept: */*\r\n\
                 Authorization: Bearer s3cret\r\nX-Team: blue\r\n\r\n"
            );
            assert_eq!(check.rewritten(), 2);
        }
    }

    #[test]
    fn tls_to_a_host_with_headers_is_refused_and_other_protocols_go_as_they_are() {
        let mut hello = vec![TLS_HANDSHAKE, 3, 1, 0, 42, 1, 0, 0, 38, 3, 3];
        hello.extend_from_slice(&[0; 32]);
        hello.extend_from_slice(&[0, 0, 0, 0]);
        let mut check = NameCheck::with_headers("echo.test", set());
        assert_eq!(check.feed(&hello, &mut Vec::new()), Err(Refusal::Encrypted));

        let mut check = NameCheck::with_headers("echo.test", set());
        let mut out = Vec::new();
        check.feed(b"SSH-2.0-x\r\n", &mut out).unwrap();
        assert_eq!(out, b"SSH-2.0-x\r\n");
        assert_eq!(check.rewritten(), 0);
    }
}
