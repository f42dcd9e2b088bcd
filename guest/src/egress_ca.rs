//! bud's egress certificate authority: the CA whose certificate every image trusts and
//! whose key signs, on the server, the certificates bud answers a guest's TLS with when it
//! terminates that TLS to add a rule's headers (`docs/network.md`, "Rules over HTTPS").
//!
//! One per build directory (`build/egress-ca/`): made by the first image build or server
//! that needs it, then read by both, so the images a server boots trust the key that server
//! holds. The certificate goes into each image's certificate bundles ([`crate::image`]);
//! the key never enters an image: it stays in `key.pem` (mode 0600) beside `cert.pem`.
//! Nodes that move sessions between them (import, HAProxy) share it by copying the
//! directory, as they share the cluster key.
//!
//! Why a crate (rcgen, with ring): certificates are DER with signatures; writing X.509 by
//! hand is where TLS implementations get their bugs.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use sha2::{Digest, Sha256};

/// The directory of the CA under a build directory.
pub const DIR: &str = "egress-ca";
/// The CA's certificate (PEM), which images trust.
pub const CERT_FILE: &str = "cert.pem";
/// The CA's private key (PEM, mode 0600), which only the server reads.
pub const KEY_FILE: &str = "key.pem";

/// How long the CA is valid from its making.
const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// How long a host's certificate is valid from its making (the server makes them again well
/// before: [`LEAF_RENEW`]).
const LEAF_LIFETIME: Duration = Duration::from_secs(90 * 24 * 3600);
/// How old a host's certificate may be before the server makes a new one.
pub const LEAF_RENEW: Duration = Duration::from_secs(30 * 24 * 3600);
/// A certificate's start is put this far in the past, for clocks a little behind.
const BACKDATE: Duration = Duration::from_secs(24 * 3600);

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "bud's egress CA in {dir} is not usable: {why} (remove the directory to make a new one; images made with the old one are made again)"
    )]
    Unusable { dir: PathBuf, why: String },
    #[error("making a certificate: {0}")]
    Make(#[from] rcgen::Error),
}

/// A host certificate made by the CA: its chain (the host's certificate) and its key, DER.
#[derive(Debug, Clone)]
pub struct Leaf {
    pub cert_der: Vec<u8>,
    pub key_der: Vec<u8>,
}

/// bud's egress CA, loaded with its key.
pub struct EgressCa {
    cert_pem: String,
    key: KeyPair,
    /// The CA as a host certificate's issuer (its subject, extensions and key identifier,
    /// as it was made), rebuilt once at load from the key.
    issuer: rcgen::Certificate,
}

impl std::fmt::Debug for EgressCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("EgressCa")
            .field("name", &self.common_name())
            .finish_non_exhaustive()
    }
}

/// Where the CA of `build_dir` is.
pub fn dir_of(build_dir: &Path) -> PathBuf {
    build_dir.join(DIR)
}

impl EgressCa {
    /// The CA in `dir`, made there first if it has none (two processes making it at once
    /// end with one CA: the second finds the first's).
    pub fn load_or_create(dir: &Path) -> Result<Self, CaError> {
        if !dir.join(KEY_FILE).exists() {
            Self::create(dir)?;
        }
        Self::load(dir)
    }

    /// The CA in `dir`, which must have one.
    pub fn load(dir: &Path) -> Result<Self, CaError> {
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read_to_string(&path).map_err(io_error("read", &path))
        };
        let (key_pem, cert_pem) = (read(KEY_FILE)?, read(CERT_FILE)?);
        let unusable = |why: String| CaError::Unusable {
            dir: dir.to_owned(),
            why,
        };
        let key = KeyPair::from_pem(&key_pem).map_err(|e| unusable(format!("its key: {e}")))?;
        let issuer = ca_params(&key)?.self_signed(&key)?;
        let ca = Self {
            cert_pem,
            key,
            issuer,
        };
        if !ca.cert_pem.contains("BEGIN CERTIFICATE") {
            return Err(unusable(format!("{CERT_FILE} holds no certificate")));
        }
        Ok(ca)
    }

    /// Makes a CA in `dir` unless one appears there meanwhile: both files are written in a
    /// directory of this process beside it, which is then renamed into place, so a reader
    /// never sees one file without the other, and of two makers the first rename wins (the
    /// second finds `dir` full and drops its own).
    fn create(dir: &Path) -> Result<(), CaError> {
        let parent = dir.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent).map_err(io_error("create", parent))?;
        let name = dir.file_name().unwrap_or_default().to_string_lossy();
        static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = parent.join(format!(".{name}.{}.{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir(&tmp).map_err(io_error("create", &tmp))?;
        let made = Self::write_new(&tmp);
        let placed = made.and_then(|()| match std::fs::rename(&tmp, dir) {
            Ok(()) => Ok(()),
            // Another maker's CA is in place: it is the one.
            Err(_) if dir.join(KEY_FILE).exists() => Ok(()),
            Err(source) => Err(io_error("rename into place", dir)(source)),
        });
        let _ = std::fs::remove_dir_all(&tmp);
        placed
    }

    /// Writes a new CA's key (mode 0600) and certificate into `dir`.
    fn write_new(dir: &Path) -> Result<(), CaError> {
        let key = KeyPair::generate()?;
        let mut params = ca_params(&key)?;
        let now = SystemTime::now();
        params.not_before = (now - BACKDATE).into();
        params.not_after = (now + CA_LIFETIME).into();
        let cert = params.self_signed(&key)?;
        for (name, text, mode) in [
            (KEY_FILE, key.serialize_pem(), 0o600),
            (CERT_FILE, cert.pem(), 0o644),
        ] {
            let path = dir.join(name);
            let fail = |what| io_error(what, &path);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .open(&path)
                .map_err(fail("create"))?;
            f.write_all(text.as_bytes()).map_err(fail("write"))?;
            f.sync_all().map_err(fail("sync"))?;
        }
        Ok(())
    }

    /// The CA's certificate, PEM (what images trust).
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA's name (its subject's common name: "bud egress CA" and a digest of its key,
    /// so two installations' CAs never share a name).
    pub fn common_name(&self) -> String {
        common_name(&self.key)
    }

    /// A certificate for `host` (a DNS name), signed by the CA, with a key of its own.
    pub fn leaf(&self, host: &str) -> Result<Leaf, CaError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec![host.to_owned()])?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, host);
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let now = SystemTime::now();
        params.not_before = (now - BACKDATE).into();
        params.not_after = (now + LEAF_LIFETIME).into();
        let cert = params.signed_by(&key, &self.issuer, &self.key)?;
        Ok(Leaf {
            cert_der: cert.der().to_vec(),
            key_der: key.serialize_der(),
        })
    }
}

/// What becomes of an I/O error of `what` on `path`.
fn io_error(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CaError {
    let path = path.to_owned();
    move |source| CaError::Io { what, path, source }
}

/// "bud egress CA" and the first 8 bytes of the SHA-256 of `key`'s public key, in hex.
fn common_name(key: &KeyPair) -> String {
    let digest = Sha256::digest(key.public_key_der());
    format!("bud egress CA {}", hex::encode(&digest[..8]))
}

/// The CA's subject and extensions for `key` (the same each time: a host certificate's
/// issuer must match the CA certificate's subject, and its key identifier the CA's key).
fn ca_params(key: &KeyPair) -> Result<CertificateParams, CaError> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "bud");
    dn.push(DnType::CommonName, common_name(key));
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    Ok(params)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("bud-egress-ca-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_ca_is_made_once_its_key_kept_private_and_loaded_the_same_again() {
        use std::os::unix::fs::PermissionsExt;
        let d = dir("once");
        let made = EgressCa::load_or_create(&d).unwrap();
        let again = EgressCa::load_or_create(&d).unwrap();

        assert_eq!(made.cert_pem(), again.cert_pem());
        assert_eq!(made.common_name(), again.common_name());
        assert!(made.common_name().starts_with("bud egress CA "));
        let mode = std::fs::metadata(d.join(KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(!made.cert_pem().contains("PRIVATE KEY"));
        assert!(!format!("{made:?}").contains("PRIVATE"));
        let names = |dir: &Path| -> Vec<String> {
            let mut n: Vec<String> = std::fs::read_dir(dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            n.sort();
            n
        };
        assert_eq!(names(&d), [CERT_FILE, KEY_FILE]);
        assert_eq!(
            names(d.parent().unwrap())
                .iter()
                .filter(|n| n.starts_with(".bud-egress-ca-once"))
                .count(),
            0,
            "no temporary directory left"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn makers_racing_end_with_one_ca() {
        let d = dir("race");
        let made: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| EgressCa::load_or_create(&d).map(|ca| ca.cert_pem().to_owned()))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap().unwrap())
                .collect()
        });

        assert!(made.iter().all(|c| *c == made[0]));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_directory_with_a_damaged_key_is_an_error_that_says_what_to_do() {
        let d = dir("damaged");
        EgressCa::load_or_create(&d).unwrap();
        std::fs::write(d.join(KEY_FILE), "not a key").unwrap();

        let err = EgressCa::load(&d).unwrap_err().to_string();

        assert!(err.contains("remove the directory"), "{err}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
