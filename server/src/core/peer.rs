//! Talking to another bud node over HTTP: what a drain needs (the other node's health, an
//! import of a session file) and forwarding a request for a session this node handed over.
//! hyper's own client over plain HTTP, one pool for the process; nodes talk on a trusted
//! network (docs/cluster.md says so), as HAProxy talks to them.

use std::sync::OnceLock;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, Request, Response, StatusCode, Uri, header};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Why a call to another node failed.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("{0:?} is not an http:// URL of a node")]
    Url(String),
    #[error("calling {url}: {why}")]
    Call { url: String, why: String },
    #[error("{url} answered {status}: {body}")]
    Status {
        url: String,
        status: StatusCode,
        body: String,
    },
}

fn client() -> &'static Client<HttpConnector, Body> {
    static CLIENT: OnceLock<Client<HttpConnector, Body>> = OnceLock::new();
    CLIENT.get_or_init(|| {
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(Duration::from_secs(5)));
        http.set_nodelay(true);
        Client::builder(TokioExecutor::new()).build(http)
    })
}

/// `base` (`http://HOST:PORT`, no path) with `path_and_query`.
pub fn url(base: &str, path_and_query: &str) -> Result<Uri, PeerError> {
    let base = base.trim_end_matches('/');
    let ok = base.strip_prefix("http://").is_some_and(|rest| {
        !rest.is_empty() && !rest.contains('/') && !rest.contains('?') && !rest.contains('@')
    });
    if !ok {
        return Err(PeerError::Url(base.to_owned()));
    }
    format!("{base}{path_and_query}")
        .parse()
        .map_err(|_| PeerError::Url(base.to_owned()))
}

/// Sends `req` and reads the whole answer (for calls whose answers are small JSON).
pub async fn call(req: Request<Body>) -> Result<(StatusCode, Bytes), PeerError> {
    let url = req.uri().to_string();
    let fail = |why: String| PeerError::Call {
        url: url.clone(),
        why,
    };
    let resp = client()
        .request(req)
        .await
        .map_err(|e| fail(crate::core::error_chain(&e)))?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| fail(e.to_string()))?
        .to_bytes();
    Ok((status, body))
}

/// `call` that wants a 2xx JSON answer.
pub async fn json(req: Request<Body>) -> Result<serde_json::Value, PeerError> {
    let url = req.uri().to_string();
    let (status, body) = call(req).await?;
    if !status.is_success() {
        return Err(PeerError::Status {
            url,
            status,
            body: String::from_utf8_lossy(&body).chars().take(500).collect(),
        });
    }
    serde_json::from_slice(&body).map_err(|e| PeerError::Call {
        url,
        why: format!("not JSON: {e}"),
    })
}

/// A request to `uri` with `auth` (the drain request's own key: nodes of one cluster
/// share their keys) as its Authorization.
pub fn request(
    method: &str,
    uri: Uri,
    auth: Option<&HeaderValue>,
    content_type: Option<&str>,
    body: Body,
) -> Request<Body> {
    let mut b = Request::builder().method(method).uri(uri);
    if let Some(a) = auth {
        b = b.header(header::AUTHORIZATION, a.clone());
    }
    if let Some(t) = content_type {
        b = b.header(header::CONTENT_TYPE, t);
    }
    b.body(body).expect("a request of valid parts")
}

/// Forwards `req` as it is (method, path, query, headers, streamed body) to `base`, and
/// its answer back as it comes (a stream stays a stream). A node that cannot be reached
/// is a 502 saying which.
pub async fn forward(base: &str, mut req: Request<Body>) -> Response<Body> {
    let pq = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let uri = match url(base, &pq) {
        Ok(u) => u,
        Err(e) => return bad_gateway(&e.to_string()),
    };
    *req.uri_mut() = uri;
    // hop-by-hop headers are this hop's.
    for h in [
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        req.headers_mut().remove(h);
    }
    match client().request(req).await {
        Ok(resp) => resp.map(Body::new),
        Err(e) => bad_gateway(&format!(
            "forwarding to {base}, the node this session moved to: {}",
            crate::core::error_chain(&e)
        )),
    }
}

fn bad_gateway(message: &str) -> Response<Body> {
    let body = serde_json::json!({
        "error": {"code": "forward_failed", "message": message, "field": null}
    });
    Response::builder()
        .status(StatusCode::BAD_GATEWAY)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .expect("a response of valid parts")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_node_urls_are_taken() {
        assert_eq!(
            url("http://127.0.0.1:8080/", "/v1/health").unwrap(),
            "http://127.0.0.1:8080/v1/health"
        );
        for bad in [
            "https://a:1",
            "http://",
            "http://a/b",
            "ftp://x",
            "http://u@h:1",
        ] {
            assert!(url(bad, "/x").is_err(), "{bad}");
        }
    }
}
