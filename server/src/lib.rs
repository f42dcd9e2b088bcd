//! bud's HTTP API over the `vmm` library.
//!
//! A stub for now: the server (tokio + axum, `bud serve`) is built in its own issue. This crate
//! exists so the workspace layout is the one users and docs rely on.
