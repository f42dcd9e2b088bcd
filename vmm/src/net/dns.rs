//! bud's own DNS answers, on the gateway's UDP port 53: a name the VM's [`Egress`] knows gets
//! a synthetic address from [`SYNTHETIC_NET`] (stable per name for the VM's life), so that a
//! connection to that address carries the name the guest asked for; any other name gets
//! NXDOMAIN. Nothing is ever resolved or forwarded upstream from here (no DNS exfiltration).
//!
//! The parser takes what resolvers send (one question, no compression in it) and answers
//! everything else with FORMERR or NOTIMP; every query is untrusted input and nothing here
//! panics on it.

use std::collections::HashMap;
use std::net::Ipv4Addr;

#[cfg(doc)]
use super::egress::Egress;

/// The synthetic pool, 198.18.0.0/15 (RFC 2544's benchmarking range: never a real host).
pub const SYNTHETIC_NET: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 0);
/// Its prefix length.
pub const SYNTHETIC_PREFIX: u8 = 15;
/// Addresses handed out at most per VM (the pool's size less network and broadcast).
const SYNTHETIC_MAX: u32 = (1 << (32 - SYNTHETIC_PREFIX)) - 2;
/// Seconds a guest may cache an answer (the map lives as long as the VM's stack).
const ANSWER_TTL: u32 = 60;
/// Longest name in a query (RFC 1035).
const MAX_NAME: usize = 255;

const HEADER_LEN: usize = 12;
const TYPE_A: u16 = 1;
const CLASS_IN: u16 = 1;
const FLAG_QR: u16 = 0x8000;
const FLAG_RD: u16 = 0x0100;
const FLAG_RA: u16 = 0x0080;
const OPCODE_MASK: u16 = 0x7800;
const RCODE_FORMERR: u16 = 1;
const RCODE_NXDOMAIN: u16 = 3;
const RCODE_NOTIMP: u16 = 4;

/// What becomes of one query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Send this reply.
    Reply(Vec<u8>),
    /// Ask the VM's [`Egress`] whether it knows this name (it may resolve it: off the vCPU
    /// thread), then answer the same query again with what it said.
    Ask(String),
    /// Not a query worth answering (a response, or shorter than a header).
    Ignore,
}

/// Names the guest resolved and the synthetic addresses they got.
#[derive(Debug, Default)]
pub(crate) struct DnsMap {
    by_name: HashMap<String, Ipv4Addr>,
    by_addr: HashMap<Ipv4Addr, String>,
}

impl DnsMap {
    /// The name behind synthetic address `addr`, if the guest resolved one to it.
    pub(crate) fn name_of(&self, addr: Ipv4Addr) -> Option<&str> {
        self.by_addr.get(&addr).map(String::as_str)
    }

    /// Whether no name was handed out.
    pub(crate) fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// The address of `name`, allocating the next one on first use (`None` when the pool
    /// is exhausted).
    fn address_for(&mut self, name: &str) -> Option<Ipv4Addr> {
        if let Some(&a) = self.by_name.get(name) {
            return Some(a);
        }
        let n = u32::try_from(self.by_name.len()).ok()?;
        if n >= SYNTHETIC_MAX {
            return None;
        }
        let addr = Ipv4Addr::from(u32::from(SYNTHETIC_NET) + 1 + n);
        self.by_name.insert(name.to_owned(), addr);
        self.by_addr.insert(addr, name.to_owned());
        Some(addr)
    }

    /// What to do with `query` (a UDP payload), given whether the egress knows the name it
    /// asks for: `known` is `None` until the egress was asked ([`Answer::Ask`]).
    pub(crate) fn answer(&mut self, query: &[u8], known: Option<bool>) -> Answer {
        match self.reply(query, known) {
            Some(Ok(reply)) => Answer::Reply(reply),
            Some(Err(name)) => Answer::Ask(name),
            None => Answer::Ignore,
        }
    }

    /// The reply to `query`, or the name to ask about first, or `None` (not a query).
    fn reply(&mut self, query: &[u8], known: Option<bool>) -> Option<Result<Vec<u8>, String>> {
        let id = u16::from_be_bytes([*query.first()?, *query.get(1)?]);
        let flags = u16::from_be_bytes([*query.get(2)?, *query.get(3)?]);
        if query.len() < HEADER_LEN || flags & FLAG_QR != 0 {
            return None;
        }
        let reply_flags = FLAG_QR | (flags & (OPCODE_MASK | FLAG_RD)) | FLAG_RA;
        let qdcount = u16::from_be_bytes([query[4], query[5]]);
        if flags & OPCODE_MASK != 0 {
            return Some(Ok(header(id, reply_flags | RCODE_NOTIMP, 0, 0)));
        }
        let Some(q) = (qdcount == 1).then(|| question(query)).flatten() else {
            return Some(Ok(header(id, reply_flags | RCODE_FORMERR, 0, 0)));
        };
        let Some(known) = known else {
            return Some(Err(q.name));
        };
        let addr = known.then(|| self.address_for(&q.name)).flatten();
        let Some(addr) = addr else {
            let mut out = header(id, reply_flags | RCODE_NXDOMAIN, 1, 0);
            out.extend_from_slice(&query[HEADER_LEN..q.end]);
            return Some(Ok(out));
        };
        // A known name: its A record; NOERROR with no answer for any other type (AAAA: the
        // guest has no IPv6), so the resolver does not fall back to anything else.
        let a = q.qtype == TYPE_A && q.qclass == CLASS_IN;
        let mut out = header(id, reply_flags, 1, u16::from(a));
        out.extend_from_slice(&query[HEADER_LEN..q.end]);
        if a {
            // The name as a pointer to the question's (offset 12), then type, class, TTL,
            // length and the address.
            out.extend_from_slice(&[0xc0, HEADER_LEN as u8]);
            out.extend_from_slice(&TYPE_A.to_be_bytes());
            out.extend_from_slice(&CLASS_IN.to_be_bytes());
            out.extend_from_slice(&ANSWER_TTL.to_be_bytes());
            out.extend_from_slice(&4u16.to_be_bytes());
            out.extend_from_slice(&addr.octets());
        }
        Some(Ok(out))
    }
}

fn header(id: u16, flags: u16, qdcount: u16, ancount: u16) -> Vec<u8> {
    let mut h = Vec::with_capacity(64);
    h.extend_from_slice(&id.to_be_bytes());
    h.extend_from_slice(&flags.to_be_bytes());
    h.extend_from_slice(&qdcount.to_be_bytes());
    h.extend_from_slice(&ancount.to_be_bytes());
    h.extend_from_slice(&[0, 0, 0, 0]);
    h
}

/// The one question of a query.
struct Question {
    /// Lower case, dot-separated, no trailing dot.
    name: String,
    qtype: u16,
    qclass: u16,
    /// Offset just past the question in the query.
    end: usize,
}

fn question(query: &[u8]) -> Option<Question> {
    let mut at = HEADER_LEN;
    let mut name = String::new();
    loop {
        let len = usize::from(*query.get(at)?);
        at += 1;
        if len == 0 {
            break;
        }
        // No compression pointers (0xc0) or extended label types in a question.
        if len > 63 {
            return None;
        }
        let label = query.get(at..at + len)?;
        if !label
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_')
        {
            return None;
        }
        if !name.is_empty() {
            name.push('.');
        }
        name.push_str(&String::from_utf8_lossy(label).to_ascii_lowercase());
        if name.len() > MAX_NAME {
            return None;
        }
        at += len;
    }
    let fixed = query.get(at..at + 4)?;
    Some(Question {
        name,
        qtype: u16::from_be_bytes([fixed[0], fixed[1]]),
        qclass: u16::from_be_bytes([fixed[2], fixed[3]]),
        end: at + 4,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An egress that knows one name: asked first, then answered (as the stack does).
    struct Knows(&'static str);

    impl DnsMap {
        fn ask(&mut self, query: &[u8], egress: &Knows) -> Option<Vec<u8>> {
            match self.answer(query, None) {
                Answer::Reply(r) => Some(r),
                Answer::Ignore => None,
                Answer::Ask(name) => match self.answer(query, Some(name == egress.0)) {
                    Answer::Reply(r) => Some(r),
                    other => panic!("asked again: {other:?}"),
                },
            }
        }
    }

    /// A query as glibc sends it: id, RD, one question.
    fn query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
        let mut q = header(id, FLAG_RD, 1, 0);
        for label in name.split('.') {
            q.push(label.len() as u8);
            q.extend_from_slice(label.as_bytes());
        }
        q.push(0);
        q.extend_from_slice(&qtype.to_be_bytes());
        q.extend_from_slice(&CLASS_IN.to_be_bytes());
        q
    }

    fn rcode(answer: &[u8]) -> u16 {
        u16::from_be_bytes([answer[2], answer[3]]) & 0xf
    }

    #[test]
    fn a_known_name_gets_a_stable_synthetic_address_that_maps_back_to_it() {
        let mut map = DnsMap::default();
        let egress = Knows("echo.test");

        let first = map.ask(&query(7, "Echo.Test", TYPE_A), &egress).unwrap();
        let again = map.ask(&query(8, "echo.test", TYPE_A), &egress).unwrap();

        assert_eq!(&first[..2], &7u16.to_be_bytes());
        assert_eq!(rcode(&first), 0);
        assert_eq!(u16::from_be_bytes([first[6], first[7]]), 1, "one answer");
        let addr = Ipv4Addr::new(198, 18, 0, 1);
        assert_eq!(&first[first.len() - 4..], &addr.octets());
        assert_eq!(&again[again.len() - 4..], &addr.octets());
        assert_eq!(map.name_of(addr), Some("echo.test"));
    }

    #[test]
    fn an_unknown_name_is_nxdomain_and_a_known_name_has_no_aaaa() {
        let mut map = DnsMap::default();
        let egress = Knows("echo.test");

        let unknown = map.ask(&query(1, "evil.test", TYPE_A), &egress).unwrap();
        let aaaa = map.ask(&query(2, "echo.test", 28), &egress).unwrap();

        assert_eq!(rcode(&unknown), RCODE_NXDOMAIN);
        assert_eq!(rcode(&aaaa), 0);
        assert_eq!(u16::from_be_bytes([aaaa[6], aaaa[7]]), 0, "no answer");
        assert!(map.is_empty() || map.name_of(Ipv4Addr::new(198, 18, 0, 1)).is_some());
        assert_eq!(map.name_of(Ipv4Addr::new(198, 18, 0, 2)), None);
    }

    #[test]
    fn malformed_queries_get_formerr_or_nothing_and_never_panic() {
        let mut map = DnsMap::default();
        let egress = Knows("a");
        let mut pointer = header(3, FLAG_RD, 1, 0);
        pointer.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1]);
        let mut response = query(4, "a", TYPE_A);
        response[2] |= 0x80;

        let truncated = map.ask(&query(5, "a", TYPE_A)[..14], &egress).unwrap();
        let compressed = map.ask(&pointer, &egress).unwrap();

        assert_eq!(rcode(&truncated), RCODE_FORMERR);
        assert_eq!(rcode(&compressed), RCODE_FORMERR);
        assert_eq!(map.ask(&response, &egress), None);
        assert_eq!(map.ask(&[1, 2, 3], &egress), None);
        for len in 0..40 {
            let q: Vec<u8> = (0..len).map(|i| (i * 37 % 256) as u8).collect();
            let _ = map.ask(&q, &egress);
        }
    }
}
