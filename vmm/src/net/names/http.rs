//! HTTP/1 for the name check: a connection's first line, a request head's names and how its
//! body is framed, a head rebuilt with a rule's headers, and chunked bodies followed.

use super::{MAX_HELD, Refusal, State, Verdict, check};

/// Where a chunked body's parser is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Chunk {
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

/// Header lines a request may have.
pub(super) const MAX_HEADERS: usize = 128;

/// An HTTP/1 request head at the start of `bytes`, whose first `passed` bytes (its request
/// line) went already: its names checked, then how its body is framed; given `headers`,
/// the rest of the head comes back with them set.
pub(super) fn request_head(
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
pub(super) fn with_headers(
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
pub(super) fn chunked(chunk: &mut Chunk, input: &[u8]) -> Result<(usize, bool), Refusal> {
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

/// Whether a head whose bytes so far are `before` then `bytes` may have ended: an empty
/// line after a line's end. (So a head fed a byte at a time is parsed once, not at each.)
pub(super) fn head_may_end(before: &[u8], bytes: &[u8]) -> bool {
    let ends_line = before.last() == Some(&b'\n');
    (ends_line && (bytes.starts_with(b"\r\n") || bytes.starts_with(b"\n")))
        || bytes.windows(2).any(|w| w == b"\n\n")
        || bytes.windows(3).any(|w| w == b"\n\r\n")
}

/// Whether the bytes of a first line so far may still be a request line: empty lines, then
/// a method's token characters and, once it ends, a space (a length prefix or any other
/// binary start is not, and the check is over at once).
pub(super) fn may_be_request_line(line: &[u8]) -> bool {
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
pub(super) fn starts_as_request_line(line: &[u8]) -> bool {
    let method = line
        .iter()
        .take_while(|b| b.is_ascii_uppercase() || **b == b'-' || **b == b'_')
        .count();
    method > 0 && line.get(method) == Some(&b' ')
}

/// What the first line of a connection says of its protocol.
pub(super) enum Line {
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
pub(super) fn first_line(line: &[u8]) -> Line {
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
pub(super) fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}
