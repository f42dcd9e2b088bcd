//! API keys: who may use the server.
//!
//! `bud serve --api-keys-file PATH` reads one key a line, `NAME KEY` (blank lines and
//! `#` comments skipped; a key is at least 16 characters). With keys, every route but
//! `GET /v1/health` needs one of them, presented as `Authorization: Bearer KEY`,
//! `X-API-Key: KEY` (E2B's SDK sends that), or a bare `Authorization: KEY` (Piston's
//! clients send that); a missing or wrong key is 401 with a JSON error. Keys are compared
//! in constant time, every configured key each time. Without keys the server is open, which
//! `bud serve` allows only on a loopback address.
//!
//! The check itself is the edge's (`crate::KeyGate`, `crate::require_key`). Routes the
//! edge declares exempt need no key: `GET /v1/health`,
//! and E2B's in-sandbox routes (envd's and the code interpreter's), which carry no API key
//! in E2B's SDK but the sandbox's own access token, checked by the compat layer.

use std::path::{Path, PathBuf};

use axum::http::HeaderMap;

/// The shortest key accepted.
pub const MIN_KEY_LEN: usize = 16;

/// The configured keys, by name.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKeys {
    keys: Vec<(String, Vec<u8>)>,
}

impl std::fmt::Debug for ApiKeys {
    /// Names only: keys never reach a log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.keys.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("ApiKeys").field("names", &names).finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    #[error("cannot read the API keys file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("API keys file line {line}: {why}")]
    Line { line: usize, why: String },
    #[error("the API keys file has no key")]
    Empty,
}

impl ApiKeys {
    pub fn load(path: &Path) -> Result<Self, KeysError> {
        let text = std::fs::read_to_string(path).map_err(|source| KeysError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text)
    }

    /// Parses `NAME KEY` lines (module docs).
    pub fn parse(text: &str) -> Result<Self, KeysError> {
        let mut keys: Vec<(String, Vec<u8>)> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |why: &str| KeysError::Line {
                line: i + 1,
                why: why.to_owned(),
            };
            let mut parts = line.split_whitespace();
            let (Some(name), Some(key), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(bad("expected `NAME KEY`"));
            };
            if key.len() < MIN_KEY_LEN {
                return Err(bad(&format!(
                    "the key of {name} is shorter than {MIN_KEY_LEN} characters"
                )));
            }
            if keys.iter().any(|(n, _)| n == name) {
                return Err(bad(&format!("the name {name} is repeated")));
            }
            keys.push((name.to_owned(), key.as_bytes().to_vec()));
        }
        if keys.is_empty() {
            return Err(KeysError::Empty);
        }
        Ok(Self { keys })
    }

    /// How many keys there are.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Never true: a file without keys is refused.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Whether a key is named `name`.
    pub fn has(&self, name: &str) -> bool {
        self.keys.iter().any(|(n, _)| n == name)
    }

    /// The name of the key `presented` is, comparing with every key in constant time.
    pub fn name_of(&self, presented: &[u8]) -> Option<&str> {
        let mut found = None;
        for (name, key) in &self.keys {
            if constant_time_eq(key, presented) {
                found = Some(name.as_str());
            }
        }
        found
    }
}

/// Equality whose time depends on the lengths only, not on where the bytes differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// The key a request presents (module docs), if any.
pub fn presented(headers: &HeaderMap) -> Option<&[u8]> {
    if let Some(v) = headers.get("x-api-key") {
        return Some(v.as_bytes());
    }
    let auth = headers.get(axum::http::header::AUTHORIZATION)?.as_bytes();
    Some(auth.strip_prefix(b"Bearer ").unwrap_or(auth))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_by_name_and_match_exactly() {
        let keys =
            ApiKeys::parse("# ops\nalice 0123456789abcdef\n\nbob  fedcba9876543210xyz\n").unwrap();
        assert_eq!(keys.name_of(b"0123456789abcdef"), Some("alice"));
        assert_eq!(keys.name_of(b"fedcba9876543210xyz"), Some("bob"));
        assert_eq!(keys.name_of(b"0123456789abcdeF"), None);
        assert_eq!(keys.name_of(b"0123456789abcde"), None);
        assert_eq!(keys.name_of(b""), None);
    }

    #[test]
    fn bad_key_files_say_which_line() {
        let e = ApiKeys::parse("alice short\n").unwrap_err();
        assert_eq!(
            e.to_string(),
            "API keys file line 1: the key of alice is shorter than 16 characters"
        );
        let e = ApiKeys::parse("a 0123456789abcdef\na 0123456789abcdeg\n").unwrap_err();
        assert_eq!(
            e.to_string(),
            "API keys file line 2: the name a is repeated"
        );
        let e = ApiKeys::parse("a 0123456789abcdef extra\n").unwrap_err();
        assert_eq!(e.to_string(), "API keys file line 1: expected `NAME KEY`");
        assert_eq!(
            ApiKeys::parse("# none\n").unwrap_err().to_string(),
            "the API keys file has no key"
        );
    }

    #[test]
    fn keys_are_found_in_every_header_form() {
        let mut h = HeaderMap::new();
        assert_eq!(presented(&h), None);
        h.insert("authorization", "Bearer k1".parse().unwrap());
        assert_eq!(presented(&h), Some(&b"k1"[..]));
        h.insert("authorization", "k2".parse().unwrap());
        assert_eq!(presented(&h), Some(&b"k2"[..]));
        h.insert("x-api-key", "k3".parse().unwrap());
        assert_eq!(presented(&h), Some(&b"k3"[..]));
    }
}
