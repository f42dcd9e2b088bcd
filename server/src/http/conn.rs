//! Connections: bud's own accept loop over hyper, so that a slow client is cut off.
//!
//! `axum::serve` gives no way to bound the time a request's head takes to arrive: a client
//! trickling one header byte a second held its connection (and a task) open for as long as
//! it liked. Here every connection is served by hyper's HTTP/1 server with a timer and a
//! header-read timeout (`Limits::header_timeout_ms`). hyper itself only closes such a
//! connection, silently; bud answers `408 request_timeout` first when part of a request had
//! arrived, and closes without a word a connection that was merely idle between requests
//! (a keep-alive client must not read a stray 408 as the answer to its next request).
//! The body has its own bound, in [`crate::http::body`].
//!
//! To still own the socket after hyper gives up on it, the connection's I/O ([`Watched`])
//! reads and writes through a shared `Arc<TcpStream>` (tokio's `try_read`/`try_write` take
//! `&self`), and notes whether bytes came in since the last answer went out.
//!
//! Shutdown is graceful: the loop stops accepting, every connection finishes the request it
//! is serving and closes, then [`serve_connections`] returns.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

use crate::http::error::ApiError;

/// Serves `app` on `listener` until `shutdown` resolves, then waits for every connection to
/// finish the request it is serving.
pub async fn serve_connections(
    listener: TcpListener,
    app: Router,
    header_timeout: Duration,
    shutdown: impl Future<Output = ()>,
) {
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                // Out of fds or memory, or a connection reset before it was accepted: the
                // listener itself is fine; let the condition pass instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Small JSON answers: do not let Nagle hold them back waiting for an ACK.
        let _ = tcp.set_nodelay(true);
        let io = Watched::new(tcp);
        let (tcp, partial) = (io.tcp.clone(), io.partial.clone());
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(header_timeout)
            .serve_connection(TokioIo::new(io), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let Err(e) = conn.await else { return };
            if e.is_timeout() && partial.load(Ordering::Acquire) {
                let answer = ApiError::RequestTimeout {
                    part: "headers",
                    after: header_timeout,
                };
                answer_and_close(&tcp, &answer).await;
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// Writes `error` as a complete `Connection: close` response (best effort, bounded).
async fn answer_and_close(tcp: &TcpStream, error: &ApiError) {
    let body = serde_json::to_vec(&error.body()).unwrap_or_default();
    let status = error.status();
    let head = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    );
    let mut out = head.into_bytes();
    out.extend_from_slice(&body);
    let write_all = async {
        let mut at = 0;
        while at < out.len() {
            tcp.writable().await?;
            match tcp.try_write(&out[at..]) {
                Ok(n) => at += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        io::Result::Ok(())
    };
    // A client that reads nothing does not hold this task: one second, then the fd closes.
    let _ = tokio::time::timeout(Duration::from_secs(1), write_all).await;
}

/// A connection's socket, shared with the task that may still answer on it after hyper
/// gave up, noting whether a request has begun to arrive.
struct Watched {
    tcp: Arc<TcpStream>,
    /// Bytes were read since the last bytes were written: a request is (partly) in.
    partial: Arc<AtomicBool>,
}

impl Watched {
    fn new(tcp: TcpStream) -> Self {
        Self {
            tcp: Arc::new(tcp),
            partial: Arc::new(AtomicBool::new(false)),
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            ready!(self.tcp.poll_read_ready(cx))?;
            // try_read clears the readiness when it would block; then poll again.
            match self.tcp.try_read(buf.initialize_unfilled()) {
                Ok(n) => {
                    if n > 0 {
                        self.partial.store(true, Ordering::Release);
                    }
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.tcp.poll_write_ready(cx))?;
            match self.tcp.try_write(data) {
                Ok(n) => {
                    if n > 0 {
                        self.partial.store(false, Ordering::Release);
                    }
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Writes go straight to the socket.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // The socket closes when the connection's task drops its last handle, right after
        // hyper is done with it (or after a 408).
        Poll::Ready(Ok(()))
    }
}
