//! The name check's tests: what it lets through, holds and refuses, fed whole and a byte at a
//! time, and the headers it sets.

mod checks {
    use super::super::tls::TLS_HANDSHAKE;
    use super::super::*;

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

mod headers {
    use super::super::tls::TLS_HANDSHAKE;
    use super::super::*;

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
