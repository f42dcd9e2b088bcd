//! HTTPS to a host with rules: what the VMM's relay needs to terminate a guest's TLS there
//! ([`vmm::Interception`]), so a rule's headers are set on requests sent over HTTPS too.
//!
//! - **Towards the guest**, a certificate for the host's name signed by bud's egress CA
//!   ([`bud_guest::egress_ca`]: every image trusts its certificate; its key is read here
//!   from `--egress-ca-dir` and never enters a guest). One per name, made the first time a
//!   sandbox is allowed a connection to a name with rules (on a dialer thread, never on a
//!   vCPU's) and made again when it is a month old.
//! - **Towards the host**, bud's own TLS client, verified against the host's trust store
//!   (`/etc/ssl/certs`, or `SSL_CERT_FILE` / `SSL_CERT_DIR` as OpenSSL reads them) and the
//!   certificates of `--egress-upstream-ca`, if given (a private upstream's CA).
//!
//! Hosts without rules are never terminated: their TLS goes end to end, relayed as bytes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bud_guest::egress_ca::{CaError, EgressCa, LEAF_RENEW};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Why the interceptor could not be made (the server does not start).
#[derive(Debug, thiserror::Error)]
pub enum InterceptError {
    #[error("--egress-ca-dir: {0}")]
    Ca(#[from] CaError),
    #[error("--egress-upstream-ca {0}: {1}")]
    UpstreamCa(PathBuf, String),
    #[error(
        "the host's trust store has no certificate bud can use (and no --egress-upstream-ca): {0}"
    )]
    NoRoots(String),
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

/// bud's side of terminated TLS: the CA, the certificates made for names, the client.
pub struct Interceptor {
    ca: EgressCa,
    provider: Arc<CryptoProvider>,
    client: Arc<rustls::ClientConfig>,
    /// Each name's server config, and when its certificate was made.
    made: Mutex<HashMap<String, (Instant, Arc<rustls::ServerConfig>)>>,
    /// The host's certificates trusted ([`Self::system_roots`]).
    system_roots: usize,
}

impl std::fmt::Debug for Interceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interceptor")
            .field("ca", &self.ca)
            .finish_non_exhaustive()
    }
}

impl Interceptor {
    /// The interceptor of the CA in `ca_dir` (made there if it has none), trusting the
    /// host's store and the certificates of `upstream_ca`.
    pub fn new(ca_dir: &Path, upstream_ca: Option<&Path>) -> Result<Self, InterceptError> {
        let ca = EgressCa::load_or_create(ca_dir)?;
        let provider = Arc::new(provider());
        let mut roots = rustls::RootCertStore::empty();
        let native = rustls_native_certs::load_native_certs();
        // A host without a trust store still starts: TLS to hosts with rules then fails at
        // each connection (recorded with reason `tls`), and the server says so at start.
        let (system_roots, _unparsable) = roots.add_parsable_certificates(native.certs);
        if let Some(path) = upstream_ca {
            let bad = |why: String| InterceptError::UpstreamCa(path.to_owned(), why);
            let certs = CertificateDer::pem_file_iter(path)
                .map_err(|e| bad(e.to_string()))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad(e.to_string()))?;
            if certs.is_empty() {
                return Err(bad("holds no certificate".into()));
            }
            for cert in certs {
                roots.add(cert).map_err(|e| bad(e.to_string()))?;
            }
        }
        let client = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Self {
            ca,
            provider,
            client: Arc::new(client),
            made: Mutex::default(),
            system_roots,
        })
    }

    /// How many of the host's trusted certificates bud verifies upstreams against (0: none,
    /// so only `--egress-upstream-ca`'s, if any; the server warns at start).
    pub fn system_roots(&self) -> usize {
        self.system_roots
    }

    /// Makes the certificate for `name` now if it has none or an old one (a name a rule
    /// covers, on the thread that decides its connection); a failure is left for
    /// [`Self::for_name`] to report.
    pub fn prepare(&self, name: &str) {
        let _ = self.server_for(name);
    }

    /// What the relay needs to terminate TLS to `name` (None: its certificate could not be
    /// made; the TLS is then refused).
    pub fn for_name(&self, name: &str) -> Option<vmm::Interception> {
        let server = self.server_for(name).ok()?;
        Some(vmm::Interception {
            server,
            client: self.client.clone(),
        })
    }

    fn server_for(&self, name: &str) -> Result<Arc<rustls::ServerConfig>, InterceptError> {
        let made = || self.made.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, config)) = made().get(name)
            && at.elapsed() < LEAF_RENEW
        {
            return Ok(config.clone());
        }
        // Made outside the lock: a relay asking for another name's never waits for this
        // one's key and signature (two makers of one name at once both succeed; the later
        // is kept).
        let leaf = self.ca.leaf(name)?;
        let key = PrivateKeyDer::try_from(leaf.key_der)
            .map_err(|e| InterceptError::Config(rustls::Error::General(e.to_owned())))?;
        let config = rustls::ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(vec![CertificateDer::from(leaf.cert_der)], key)?;
        let config = Arc::new(config);
        made().insert(name.to_owned(), (Instant::now(), config.clone()));
        Ok(config)
    }
}

/// rustls's provider on ring. rustls 0.23.48 marks it deprecated for one reason: ring has
/// no post-quantum key exchange, which its aws-lc-rs provider has. That provider is a larger
/// C build (measured here: +35 s of a 2-core debug build, on a suite near its time limit);
/// the guest side of a terminated connection never leaves the host, and the host side
/// negotiates X25519 or P-256 as most of today's servers do.
#[allow(deprecated)]
fn provider() -> CryptoProvider {
    rustls::crypto::ring::default_provider()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("bud-intercept-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_names_certificate_is_made_once_and_an_upstream_ca_file_without_one_is_refused() {
        let d = dir("once");
        let i = Interceptor::new(&d.join("ca"), None).unwrap();
        let first = i.for_name("api.test").unwrap();
        let again = i.for_name("api.test").unwrap();
        let other = i.for_name("other.test").unwrap();

        assert!(Arc::ptr_eq(&first.server, &again.server));
        assert!(!Arc::ptr_eq(&first.server, &other.server));
        std::fs::write(d.join("empty.pem"), "nothing here\n").unwrap();
        let err = Interceptor::new(&d.join("ca"), Some(&d.join("empty.pem")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("holds no certificate"), "{err}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
