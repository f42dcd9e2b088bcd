//! TLS for the name check: a ClientHello reassembled from its handshake records, and the
//! host name of its `server_name` extension.

use super::{MAX_HELD, Refusal};

/// A TLS record's content type for the handshake.
pub(super) const TLS_HANDSHAKE: u8 = 22;

/// A TLS record's payload, at most (2^14 plus the expansion TLS 1.2 allows).
const MAX_RECORD: usize = (1 << 14) + 2048;

/// The ClientHello at the start of `bytes` (its body, reassembled from its records) and how
/// many bytes its records take; None: its records have not all come yet.
pub(super) fn client_hello(bytes: &[u8]) -> Result<Option<(Vec<u8>, usize)>, Refusal> {
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
pub(super) fn server_name(hello: &[u8]) -> Result<Option<String>, Refusal> {
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
