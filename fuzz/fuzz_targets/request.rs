//! What a client sends: a JSON body as `POST /v1/exec` and `/v1/exec/batch` decode it (and
//! turn it into jobs under the default limits), and an E2B file path as envd's routes check
//! it. Input: the body bytes. No panic; a path that passes the check stays inside the work
//! directory.
#![no_main]

use bud_server::Limits;
use bud_server::service::jobs::{BatchRequest, ExecRequest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = Limits::default();
    if let Ok(req) = bud_server::http::body::parse::<ExecRequest>(data) {
        let _ = req.into_job(&limits, "");
    }
    if let Ok(batch) = bud_server::http::body::parse::<BatchRequest>(data) {
        for (i, req) in batch.jobs.into_iter().enumerate() {
            let _ = req.into_job(&limits, &format!("jobs[{i}]."));
        }
    }
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(rel) = bud_server::compat::envd::guest_path(text)
    {
        assert!(!rel.starts_with('/'), "{text:?} -> {rel:?}");
        assert!(!rel.split('/').any(|c| c == ".."), "{text:?} -> {rel:?}");
    }
});
