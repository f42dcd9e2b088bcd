//! Bad requests get their status, code and field, and the server goes on serving.

use serde_json::{Value, json};

use super::Served;
use crate::core::config::Limits;

#[tokio::test]
async fn each_request_error_has_its_status_code_and_field() {
    let s = Served::start().await;
    let big_code = "#".repeat(Limits::default().max_code_bytes + 1);
    let big_stdin = "x".repeat(Limits::default().max_stdin_bytes + 1);
    let cases: Vec<(Value, u16, &str, Value)> = vec![
        (json!({}), 400, "invalid_request", json!("code")),
        (
            json!({"code": "x", "language": "ruby"}),
            400,
            "invalid_request",
            json!("language"),
        ),
        (
            json!({"code": "x", "timeout_ms": 0}),
            400,
            "invalid_request",
            json!("timeout_ms"),
        ),
        (
            json!({"code": "x", "timeout_ms": 3_600_000}),
            400,
            "invalid_request",
            json!("timeout_ms"),
        ),
        (
            json!({"code": "x", "stdin_b64": "!!"}),
            400,
            "invalid_request",
            json!("stdin_b64"),
        ),
        (
            json!({"code": "x", "env": {"A=B": "c"}}),
            400,
            "invalid_request",
            json!("env"),
        ),
        (
            json!({"code": "x", "args": ["a\u{0}b"]}),
            400,
            "invalid_request",
            json!("args[0]"),
        ),
        (
            json!({"code": "x", "tiemout_ms": 5}),
            400,
            "invalid_request",
            json!("tiemout_ms"),
        ),
        (json!({"code": big_code}), 413, "too_large", json!("code")),
        (
            json!({"code": "x", "stdin": big_stdin}),
            413,
            "too_large",
            json!("stdin"),
        ),
    ];

    for (body, want_status, want_code, want_field) in cases {
        let (status, r) = s.exec(body.clone()).await;
        let shown: String = body.to_string().chars().take(80).collect();
        assert_eq!(status, want_status, "{shown}: {r}");
        assert_eq!(r["error"]["code"], want_code, "{shown}: {r}");
        assert_eq!(r["error"]["field"], want_field, "{shown}: {r}");
        assert!(
            r["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    assert_eq!(s.engine.counts().jobs, 0, "a refused request ran");
}

#[tokio::test]
async fn batch_errors_name_the_job_and_oversized_batches_are_413() {
    let s = Served::start().await;
    let too_many: Vec<Value> = (0..17).map(|_| json!({"code": "x"})).collect();

    let (bad, b) = s
        .post(
            "/v1/exec/batch",
            &json!({"jobs": [{"code": "x"}, {"code": "x", "timeout_ms": -1}]}),
        )
        .await;
    let (big, g) = s.post("/v1/exec/batch", &json!({"jobs": too_many})).await;

    assert_eq!(
        (bad, &b["error"]["field"]),
        (400, &json!("jobs[1].timeout_ms")),
        "{b}"
    );
    assert_eq!(
        (big, &g["error"]["code"], &g["error"]["field"]),
        (413, &json!("too_many"), &json!("jobs"))
    );
    assert_eq!(s.engine.counts().jobs, 0, "a refused batch ran");
}

#[tokio::test]
async fn streaming_refuses_bad_requests_with_a_status() {
    let s = Served::start().await;

    let (status, r) = s
        .post("/v1/exec/stream", &json!({"code": "x", "timeout_ms": 0}))
        .await;

    assert_eq!((status, &r["error"]["field"]), (400, &json!("timeout_ms")));
}

#[tokio::test]
async fn malformed_json_is_400_and_the_server_keeps_serving() {
    let s = Served::start().await;
    let json = "application/json";

    let (truncated, t) = s
        .post_raw("/v1/exec", json, b"{\"code\": \"print(1)".to_vec())
        .await;
    let (garbage, g) = s
        .post_raw("/v1/exec", json, vec![0xde, 0xad, 0xbe, 0xef])
        .await;
    let (wrong_shape, w) = s
        .post_raw("/v1/exec", json, b"{\"code\": [1, 2]}".to_vec())
        .await;

    assert_eq!(
        (truncated, &t["error"]["code"]),
        (400, &json!("invalid_json"))
    );
    assert_eq!(
        (garbage, &g["error"]["code"]),
        (400, &json!("invalid_json"))
    );
    assert_eq!(
        (wrong_shape, &w["error"]["code"]),
        (400, &json!("invalid_request"))
    );
    s.assert_still_serving().await;
}

#[tokio::test]
async fn a_huge_body_is_413_and_the_server_keeps_serving() {
    let s = Served::start().await;
    let limit = Limits::default().max_body_bytes;
    let body = format!("{{\"code\": \"{}\"}}", "x".repeat(limit + (4 << 20)));

    let (status, r) = s
        .post_raw("/v1/exec", "application/json", body.into_bytes())
        .await;

    assert_eq!(
        (status, &r["error"]["code"]),
        (413, &json!("body_too_large"))
    );
    s.assert_still_serving().await;
}
