//! What the relay's name check adds to a connection (`vmm::net::names`), on the host, per
//! thing it reads: a TLS ClientHello's SNI checked, an HTTP request head's `Host` checked,
//! and the same head with two headers set by a rule (issue 59's target: a request through a
//! rule at most 2 ms slower than one without). No VM: the guest side of the same requests is
//! emulated TCP, milliseconds a request, measured in docs/measurements.md. Figures there.

use criterion::{Criterion, black_box, criterion_group, criterion_main};
use vmm::net::names::NameCheck;

/// A ClientHello record naming `api.test`, with a 1 200-byte key share as clients send.
fn hello() -> Vec<u8> {
    let name = b"api.test";
    let mut ext = vec![0x00, 0x33, 0x04, 0xb4];
    ext.extend(std::iter::repeat_n(0x42, 0x4b4));
    ext.extend_from_slice(&[0x00, 0x00, 0x00, 0x0d, 0x00, 0x0b, 0x00, 0x00, 0x08]);
    ext.extend_from_slice(name);
    let mut body = vec![0x03, 0x03];
    body.extend_from_slice(&[0x5a; 32]);
    body.extend_from_slice(&[0, 0, 2, 0x13, 0x01, 1, 0]);
    body.extend_from_slice(&(ext.len() as u16).to_be_bytes());
    body.extend_from_slice(&ext);
    let mut message = vec![1, 0];
    message.extend_from_slice(&(body.len() as u16).to_be_bytes());
    message.extend_from_slice(&body);
    let mut record = vec![22, 3, 1];
    record.extend_from_slice(&(message.len() as u16).to_be_bytes());
    record.extend_from_slice(&message);
    record
}

const HEAD: &[u8] = b"POST /v1/chat/completions HTTP/1.1\r\nHost: api.test\r\n\
    User-Agent: python-requests/2.31\r\nAccept: */*\r\nContent-Type: application/json\r\n\
    Authorization: Bearer dummy\r\nContent-Length: 0\r\n\r\n";

fn benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("egress_names");
    let hello = hello();
    let mut out = Vec::with_capacity(8192);
    g.bench_function("tls_hello_sni", |b| {
        b.iter(|| {
            out.clear();
            let mut check = NameCheck::new("api.test");
            check.feed(black_box(&hello), &mut out).unwrap();
            assert!(check.is_open());
        })
    });
    g.bench_function("http_head_host", |b| {
        b.iter(|| {
            out.clear();
            let mut check = NameCheck::new("api.test");
            check.feed(black_box(HEAD), &mut out).unwrap();
        })
    });
    let set = vec![
        (
            "Authorization".to_owned(),
            "Bearer sk-live-0123456789abcdef".to_owned(),
        ),
        ("X-Team".to_owned(), "blue".to_owned()),
    ];
    g.bench_function("http_head_two_headers_set", |b| {
        b.iter(|| {
            out.clear();
            let mut check = NameCheck::with_headers("api.test", set.clone());
            check.feed(black_box(HEAD), &mut out).unwrap();
            assert_eq!(check.rewritten(), 1);
        })
    });
    g.finish();
}

criterion_group!(egress, benches);
criterion_main!(egress);
