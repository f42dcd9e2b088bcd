//! The terminated relay's two TLS sessions and the check between them, in memory: a
//! guest's client, bud's [`Terminated`], a host's server.
#![allow(deprecated)] // ring's provider: see bud-server's core/egress/intercept.rs
use super::*;

/// A CA, a certificate for `name` it signed, and the configs bud would use: its
/// server side presents that certificate, its client side trusts only that CA.
pub(crate) fn interception_for(name: &str) -> Interception {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "test CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec![name.to_owned()])
        .unwrap()
        .signed_by(&key, &ca_cert, &ca_key)
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let der = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap();
    let server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![leaf.der().clone()], der)
        .unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca_cert.der().clone()).unwrap();
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Interception {
        server: Arc::new(server),
        client: Arc::new(client),
    }
}

/// Moves bytes between a guest's client session, bud's [`Terminated`] and a host's
/// server session (all in memory) until none move; returns the plaintext the host got.
fn run(
    guest: &mut ClientConnection,
    bud: &mut Terminated,
    host: &mut ServerConnection,
) -> Result<Vec<u8>, Refusal> {
    let mut got = Vec::new();
    for _ in 0..100 {
        let mut wire = Vec::new();
        while guest.wants_write() {
            guest.write_tls(&mut wire).unwrap();
        }
        let mut moved = !wire.is_empty();
        let mut at = 0;
        while at < wire.len() {
            at += bud.take_from_guest(&wire[at..])?;
        }
        let mut to_host = Vec::new();
        moved |= bud.write_to_host(&mut to_host).unwrap() > 0;
        let mut rd = &to_host[..];
        while !rd.is_empty() {
            host.read_tls(&mut rd).unwrap();
            host.process_new_packets().unwrap();
        }
        let mut buf = [0u8; 4096];
        while let Ok(n) = host.reader().read(&mut buf) {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
            host.writer().write_all(b"answer").unwrap();
        }
        let mut from_host = Vec::new();
        while host.wants_write() {
            host.write_tls(&mut from_host).unwrap();
        }
        moved |= !from_host.is_empty();
        let mut rd = &from_host[..];
        while !rd.is_empty() {
            bud.read_from_host(&mut rd)?;
        }
        let mut buf = vec![0u8; 64 << 10];
        let n = bud.write_to_guest(&mut buf);
        moved |= n > 0;
        let mut rd = &buf[..n];
        while !rd.is_empty() {
            guest.read_tls(&mut rd).unwrap();
            guest.process_new_packets().unwrap();
        }
        if !moved {
            break;
        }
    }
    Ok(got)
}

fn sessions(
    name: &str,
    sni: &str,
    headers: Vec<(String, String)>,
) -> (ClientConnection, Terminated, ServerConnection) {
    sessions_with(name, sni, headers, None)
}

/// As [`sessions`]; `bud_client`: bud's client side, if not one trusting the host.
fn sessions_with(
    name: &str,
    sni: &str,
    headers: Vec<(String, String)>,
    bud_client: Option<Arc<rustls::ClientConfig>>,
) -> (ClientConnection, Terminated, ServerConnection) {
    // The guest trusts the CA that signed bud's certificate; the host presents one of
    // a CA of its own, which bud's client trusts.
    let bud_side = interception_for(name);
    let host_side = interception_for(name);
    // The guest is a client trusting the CA of bud's side, as that side's own client is.
    let guest = ClientConnection::new(
        bud_side.client.clone(),
        ServerName::try_from(sni.to_owned()).unwrap(),
    )
    .unwrap();
    let i = Interception {
        server: bud_side.server,
        client: bud_client.unwrap_or(host_side.client),
    };
    let bud =
        Terminated::new(&i, name, NameCheck::with_headers(name, headers), Vec::new()).unwrap();
    let host = ServerConnection::new(host_side.server).unwrap();
    (guest, bud, host)
}

fn header(name: &str, value: &str) -> Vec<(String, String)> {
    vec![(name.to_owned(), value.to_owned())]
}

#[test]
fn requests_inside_the_guests_tls_get_the_headers_and_answers_come_back() {
    let (mut guest, mut bud, mut host) = sessions(
        "api.test",
        "api.test",
        header("Authorization", "Bearer s3cret"),
    );
    guest
        .writer()
        .write_all(b"GET /a HTTP/1.1\r\nHost: api.test\r\nAuthorization: Bearer dummy\r\n\r\n")
        .unwrap();

    let got = run(&mut guest, &mut bud, &mut host).unwrap();
    let mut answer = [0u8; 64];
    let n = guest.reader().read(&mut answer).unwrap();

    let got = String::from_utf8(got).unwrap();
    assert!(got.starts_with("GET /a HTTP/1.1\r\n"), "{got}");
    assert!(got.contains("Authorization: Bearer s3cret\r\n"), "{got}");
    assert!(!got.contains("dummy"), "{got}");
    assert_eq!(&answer[..n], b"answer");
    assert_eq!(bud.rewritten(), 1);
}

#[test]
fn a_request_inside_tls_naming_another_host_is_refused() {
    let (mut guest, mut bud, mut host) = sessions("api.test", "api.test", header("X-Team", "blue"));
    guest
        .writer()
        .write_all(b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n")
        .unwrap();

    let refused = run(&mut guest, &mut bud, &mut host);

    assert_eq!(refused, Err(Refusal::Mismatch("other.test".into())));
}

#[test]
fn a_host_whose_certificate_bud_does_not_trust_fails_its_tls() {
    // bud's client trusts a CA that signed nothing of the host's.
    let strict = interception_for("api.test").client;
    let (mut guest, mut bud, mut host) =
        sessions_with("api.test", "api.test", Vec::new(), Some(strict));
    guest
        .writer()
        .write_all(b"GET / HTTP/1.1\r\nHost: api.test\r\n\r\n")
        .unwrap();

    let failed = run(&mut guest, &mut bud, &mut host);

    assert!(
        matches!(&failed, Err(Refusal::Tls(why)) if why.starts_with("host: ")),
        "{failed:?}"
    );
}

#[test]
fn a_request_sent_with_the_guests_close_notify_reaches_the_host_before_bud_closes() {
    let (mut guest, mut bud, mut host) = sessions("api.test", "api.test", header("X-Team", "blue"));
    // The handshakes first, then the last request and the guest's close in one flight.
    run(&mut guest, &mut bud, &mut host).unwrap();
    guest
        .writer()
        .write_all(b"GET /last HTTP/1.1\r\nHost: api.test\r\n\r\n")
        .unwrap();
    guest.send_close_notify();

    let got = run(&mut guest, &mut bud, &mut host).unwrap();

    let got = String::from_utf8(got).unwrap();
    assert!(got.starts_with("GET /last HTTP/1.1\r\n"), "{got:?}");
    assert!(got.contains("X-Team: blue\r\n"), "{got:?}");
    assert!(bud.host_side_done());
}
