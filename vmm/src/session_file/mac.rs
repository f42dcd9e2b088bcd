//! The keys that authenticate session files, and the MAC itself.
//!
//! A session file leaves the process that wrote it: it sits in a state directory, is
//! exported over HTTP and imported by another node. Its CRC-32s find torn files, but anyone
//! can recompute them. So every file carries an HMAC-SHA256 made with a key the server
//! holds, and a file is read only if one of the keys it knows verifies it.
//!
//! **What the MAC covers.** The header holds the SHA-256 of the pages; the MAC is taken over
//! the footer's fields (format version, lengths, the key's id) and the whole header. So it
//! covers every byte of the file (hash, then MAC: the usual construction), and the header
//! (the machine state, the caller's record) is authenticated when the file is opened, for
//! the cost of its own few KiB; the pages when they are read back
//! ([`super::SessionFile::verify_pages`]), which reads them anyway.
//!
//! **Keys.** [`SessionKeys`] is a list: the first key signs, every one verifies (rotation
//! with an overlap: add the new key second on every node, then move it first, then drop the
//! old one). A file names its key by an 8-byte id derived from the key (never the key), so
//! a reader tries one key, not all. Keys are at least [`MIN_KEY_BYTES`] bytes.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a MAC.
pub const MAC_LEN: usize = 32;
/// Bytes of a key's id in the footer.
pub const KEY_ID_LEN: usize = 8;
/// Shortest key accepted: 128 bits.
pub const MIN_KEY_BYTES: usize = 16;
/// Bytes of a key [`SessionKeys::generate`] makes.
pub const GENERATED_KEY_BYTES: usize = 32;

/// Errors of making or reading keys.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("no key given")]
    Empty,
    #[error("key {index} is not hex")]
    NotHex { index: usize },
    #[error("key {index} has {bytes} bytes, at least {MIN_KEY_BYTES} are needed")]
    Short { index: usize, bytes: usize },
    #[error("key {index} is key {first} again")]
    Repeated { index: usize, first: usize },
    #[error("drawing a key from the host's CRNG: {0}")]
    Random(crate::identity::IdentityError),
}

/// One key and its id.
#[derive(Clone)]
struct Key {
    id: [u8; KEY_ID_LEN],
    secret: Vec<u8>,
}

impl Key {
    fn new(secret: Vec<u8>) -> Self {
        let mut h = Sha256::new();
        h.update(b"bud session file key id\0");
        h.update(&secret);
        let digest = h.finalize();
        let mut id = [0u8; KEY_ID_LEN];
        id.copy_from_slice(&digest[..KEY_ID_LEN]);
        Self { id, secret }
    }

    fn mac(&self) -> HmacSha256 {
        // HMAC takes a key of any length: this cannot fail.
        HmacSha256::new_from_slice(&self.secret).unwrap_or_else(|_| unreachable!())
    }
}

/// The keys a server signs and checks session files with (module docs). Its `Debug` shows
/// the keys' ids, never the keys.
#[derive(Clone)]
pub struct SessionKeys {
    keys: Vec<Key>,
}

impl std::fmt::Debug for SessionKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.keys.iter().map(|k| hex(&k.id)))
            .finish()
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

impl SessionKeys {
    /// Keys from their bytes: the first signs.
    pub fn new(secrets: Vec<Vec<u8>>) -> Result<Self, KeyError> {
        if secrets.is_empty() {
            return Err(KeyError::Empty);
        }
        let mut keys: Vec<Key> = Vec::with_capacity(secrets.len());
        for (index, secret) in secrets.into_iter().enumerate() {
            if secret.len() < MIN_KEY_BYTES {
                return Err(KeyError::Short {
                    index: index + 1,
                    bytes: secret.len(),
                });
            }
            if let Some(first) = keys.iter().position(|k| k.secret == secret) {
                return Err(KeyError::Repeated {
                    index: index + 1,
                    first: first + 1,
                });
            }
            keys.push(Key::new(secret));
        }
        Ok(Self { keys })
    }

    /// Keys as a key file holds them: one key per line in hex, the first signs; blank lines
    /// and lines starting with `#` are ignored.
    pub fn parse(text: &str) -> Result<Self, KeyError> {
        let mut secrets = Vec::new();
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let index = secrets.len() + 1;
            secrets.push(unhex(line).ok_or(KeyError::NotHex { index })?);
        }
        Self::new(secrets)
    }

    /// One new key from the host's CRNG.
    pub fn generate() -> Result<Self, KeyError> {
        let mut secret = vec![0u8; GENERATED_KEY_BYTES];
        crate::identity::host_random(&mut secret).map_err(KeyError::Random)?;
        Self::new(vec![secret])
    }

    /// The keys as a key file holds them ([`SessionKeys::parse`] reads it back).
    pub fn to_file_text(&self) -> String {
        self.keys
            .iter()
            .map(|k| format!("{}\n", hex(&k.secret)))
            .collect()
    }

    /// The id of the key that signs (hex; for logs: it says which key, not what it is).
    pub fn signer_id(&self) -> String {
        hex(&self.keys[0].id)
    }

    /// A MAC in progress with the key that signs, and that key's id.
    pub(crate) fn sign(&self) -> (HmacSha256, [u8; KEY_ID_LEN]) {
        let k = &self.keys[0];
        (k.mac(), k.id)
    }

    /// A MAC in progress with the key of id `id`, if it is one of these.
    /// An HMAC-SHA256 of `input` under the signing key: (the key's id, the MAC), in hex.
    /// For other records than session files (a session trace's seal): the caller puts a
    /// domain of its own at the start of `input`, so no MAC of one kind passes for another.
    pub fn sign_bytes(&self, input: &[u8]) -> (String, String) {
        let (mut m, id) = self.sign();
        m.update(input);
        (hex(&id), hex(&m.finalize().into_bytes()))
    }

    /// Whether `mac` (hex) is the HMAC of `input` under the key whose id is `key_id` (hex),
    /// one of these keys.
    pub fn verify_bytes(&self, key_id: &str, mac: &str, input: &[u8]) -> bool {
        let (Some(id), Some(tag)) = (unhex(key_id), unhex(mac)) else {
            return false;
        };
        let Some(mut m) = self.verifier(&id) else {
            return false;
        };
        m.update(input);
        m.verify_slice(&tag).is_ok()
    }

    pub(crate) fn verifier(&self, id: &[u8]) -> Option<HmacSha256> {
        self.keys.iter().find(|k| k.id == id).map(Key::mac)
    }
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The MAC of a file: over its footer's fields before the MAC, then its header.
pub(crate) fn mac_of(mut m: HmacSha256, footer_fields: &[u8], header: &[u8]) -> [u8; MAC_LEN] {
    m.update(footer_fields);
    m.update(header);
    m.finalize().into_bytes().into()
}

/// Whether `tag` is the MAC of the footer's fields and header (compared in constant time).
pub(crate) fn verify(m: HmacSha256, footer_fields: &[u8], header: &[u8], tag: &[u8]) -> bool {
    let mut m = m;
    m.update(footer_fields);
    m.update(header);
    m.verify_slice(tag).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
    const B: &str = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100";

    #[test]
    fn hmac_sha256_matches_rfc_4231_test_case_2() {
        // RFC 4231, 4.3: key "Jefe", data "what do ya want for nothing?".
        let m = HmacSha256::new_from_slice(b"Jefe").unwrap();

        let tag = mac_of(m, b"what do ya want ", b"for nothing?");

        assert_eq!(
            hex(&tag),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn bytes_signed_verify_with_any_key_of_the_set_and_nothing_else() {
        let old = SessionKeys::parse(A).unwrap();
        let rotating = SessionKeys::parse(&format!("{B}\n{A}\n")).unwrap();
        let other = SessionKeys::parse(B).unwrap();

        let (id, mac) = old.sign_bytes(b"domain\0record");

        assert!(old.verify_bytes(&id, &mac, b"domain\0record"));
        assert!(rotating.verify_bytes(&id, &mac, b"domain\0record"));
        assert!(!other.verify_bytes(&id, &mac, b"domain\0record"));
        assert!(!old.verify_bytes(&id, &mac, b"domain\0recorD"));
        assert!(!old.verify_bytes(&id, "zz", b"domain\0record"));
    }

    #[test]
    fn the_first_key_signs_and_every_key_verifies() {
        let old = SessionKeys::parse(&format!("{A}\n")).unwrap();
        let rotating = SessionKeys::parse(&format!("# new first\n{B}\n\n{A}\n")).unwrap();
        let new = SessionKeys::parse(B).unwrap();
        let (m, id) = old.sign();
        let tag = mac_of(m, b"footer", b"header");

        let by_rotating = rotating
            .verifier(&id)
            .map(|m| verify(m, b"footer", b"header", &tag));
        let by_new = new.verifier(&id);
        let (_, rotating_signer) = rotating.sign();

        assert_eq!(by_rotating, Some(true));
        assert!(by_new.is_none(), "a key not in the list verifies nothing");
        assert_eq!(rotating_signer, new.sign().1);
    }

    #[test]
    fn a_changed_byte_or_another_key_fails() {
        let keys = SessionKeys::parse(A).unwrap();
        let other = SessionKeys::new(vec![vec![0x5a; 32]]).unwrap();
        let (m, id) = keys.sign();
        let tag = mac_of(m, b"footer", b"header");
        let (m2, _) = other.sign();
        let forged = mac_of(m2, b"footer", b"header");
        let mut flipped = tag;
        flipped[31] ^= 1;

        let check = |footer: &[u8], header: &[u8], tag: &[u8]| {
            verify(keys.verifier(&id).unwrap(), footer, header, tag)
        };

        assert!(check(b"footer", b"header", &tag));
        assert!(!check(b"footer", b"headeR", &tag));
        assert!(!check(b"Footer", b"header", &tag));
        assert!(!check(b"footer", b"header", &flipped));
        assert!(!check(b"footer", b"header", &forged));
        assert!(!check(b"footer", b"header", &tag[..16]));
    }

    #[test]
    fn key_files_are_checked() {
        assert!(matches!(SessionKeys::parse(""), Err(KeyError::Empty)));
        assert!(matches!(
            SessionKeys::parse("# only a comment\n"),
            Err(KeyError::Empty)
        ));
        assert!(matches!(
            SessionKeys::parse("00112233"),
            Err(KeyError::Short { index: 1, bytes: 4 })
        ));
        assert!(matches!(
            SessionKeys::parse(&format!("{A}\nnot hex at all, no\n")),
            Err(KeyError::NotHex { index: 2 })
        ));
        assert!(matches!(
            SessionKeys::parse(&format!("{A}\n{B}\n{A}\n")),
            Err(KeyError::Repeated { index: 3, first: 1 })
        ));
    }

    #[test]
    fn a_generated_key_survives_its_file_and_debug_shows_no_secret() {
        let keys = SessionKeys::generate().unwrap();
        let text = keys.to_file_text();

        let again = SessionKeys::parse(&text).unwrap();
        let shown = format!("{keys:?}");

        assert_eq!(again.sign().1, keys.sign().1);
        assert_eq!(text.trim().len(), GENERATED_KEY_BYTES * 2);
        assert!(!shown.contains(text.trim()), "{shown}");
        assert!(shown.contains(&keys.signer_id()));
    }
}
