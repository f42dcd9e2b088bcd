//! What a paused session's file from outside must pass before it is a paused session here
//! (`POST /v1/sessions/import`): a file is untrusted input, even signed.
//!
//! 1. vmm's checks: footer, header CRC, the MAC with this server's session keys (an
//!    unsigned, altered or foreign-key file is refused here), runs and lengths, every
//!    page's SHA-256; its template and host this server's, and its machine state the
//!    template's (vmm's `session_file::check`).
//! 2. Its record: this server's version, a well-formed id not in use here, and the limits
//!    a session started here gets ([`check_record`]): lifetime, idle timeout, memory,
//!    metadata, environment names and sizes, processes and contexts; and each dialect's
//!    rules for its attachment (`AttachmentRules`: E2B's sandbox record). The same limits are
//!    applied again when a paused session resumes (`service::resume`'s `clamp`), so a file
//!    found at start written under looser flags runs under today's.
//!
//! Every refusal is 400 `invalid_request` (field `body`) saying what was wrong, never a
//! path of the state directory.

use vmm::session_file;

use crate::core::durable::{Paused, RECORD_VERSION, SessionRecord, StateDir};
use crate::core::state::AppState;
use crate::service::error::Error;
use crate::service::jobs::ExecRequest;
use crate::service::templates;

/// Most bytes of a record's JSON metadata (as `POST /v1/sessions` allows).
const MAX_METADATA_BYTES: usize = 4096;
/// Most bytes of a record's attachment as JSON: what a dialect keeps of a session (E2B's
/// sandbox: ids, token, key name, metadata within its own 4 096 bytes) is far less.
const MAX_ATTACHMENT_BYTES: usize = 64 << 10;

fn refuse(why: impl std::fmt::Display) -> Error {
    Error::invalid("body", why.to_string())
}

/// Checks the upload at `tmp` (module docs): the paused session it would be.
pub fn check_import(
    state: &AppState,
    dir: &StateDir,
    tmp: &std::path::Path,
) -> Result<(Paused, Option<String>), Error> {
    let f = session_file::read(tmp, dir.keys()).map_err(refuse)?;
    let mut record: SessionRecord = serde_json::from_slice(f.app())
        .map_err(|e| refuse(format!("not a paused session's file: {e}")))?;
    if record.version != RECORD_VERSION {
        return Err(refuse(format!(
            "record version {}, this server reads {RECORD_VERSION}",
            record.version
        )));
    }
    let id = record.id.clone();
    if !crate::core::node::is_session_id(&id) {
        return Err(refuse(format!(
            "its id is not a session id (ses_ and at most {} letters, digits, _ and -)",
            crate::core::node::MAX_ID_LEN
        )));
    }
    check_record(state, &record, f.page_bytes())?;
    let exec = templates::executor_for(state, Some(&record.template))?;
    f.check_template(exec.template()).map_err(refuse)?;
    f.verify_pages().map_err(refuse)?;
    if state.sessions().get(&id).is_ok() || dir.paused().get(&id).is_some() {
        return Err(Error::Exists(id));
    }
    let key = exec.template().key();
    let bytes = std::fs::metadata(tmp).map_or(0, |m| m.len());
    let _ = exec.template().pin(dir.holder());
    let trace = record.trace.take();
    Ok((
        Paused {
            record,
            bytes,
            key,
            written_here: true,
        },
        trace,
    ))
}

/// Checks a record against this server's session limits, as a start checks a request's:
/// `page_bytes` is the memory the file holds.
pub fn check_record(state: &AppState, r: &SessionRecord, page_bytes: u64) -> Result<(), Error> {
    let lim = &state.config().sessions;
    if !(1..=lim.max_idle_timeout_s).contains(&r.idle_timeout_s) {
        return Err(refuse(format!(
            "its idle timeout ({} s) is not within 1..={} s",
            r.idle_timeout_s, lim.max_idle_timeout_s
        )));
    }
    let max_life_ms = lim.max_lifetime_s.saturating_mul(1000);
    if !(1..=max_life_ms).contains(&r.lifetime_left_ms) {
        return Err(refuse(format!(
            "its lifetime left ({} ms) is not within 1..={max_life_ms} ms",
            r.lifetime_left_ms
        )));
    }
    if page_bytes > lim.max_memory_bytes {
        return Err(refuse(format!(
            "it holds {page_bytes} bytes of memory, more than all sessions here may ({})",
            lim.max_memory_bytes
        )));
    }
    if serde_json::to_vec(&r.metadata).map_or(0, |v| v.len()) > MAX_METADATA_BYTES {
        return Err(refuse(format!(
            "its metadata is more than {MAX_METADATA_BYTES} bytes of JSON"
        )));
    }
    check_env(state, &r.env).map_err(|e| refuse(format!("its environment: {e}")))?;
    if r.processes.len() > lim.max_processes || r.watches.len() > lim.max_processes {
        return Err(refuse(format!(
            "it has {} processes and {} watchers, at most {} each here",
            r.processes.len(),
            r.watches.len(),
            lim.max_processes
        )));
    }
    if r.contexts.made.len() > crate::core::contexts::Contexts::MAX {
        return Err(refuse(format!(
            "it has {} code contexts, at most {}",
            r.contexts.made.len(),
            crate::core::contexts::Contexts::MAX
        )));
    }
    if r.parent
        .as_ref()
        .is_some_and(|p| p.len() > crate::core::node::MAX_ID_LEN)
    {
        return Err(refuse("its parent's id is too long"));
    }
    // The dialects' own rules first: they say what is wrong in their words.
    for rules in state.attachment_rules() {
        rules
            .check(&r.id, r.owner.as_deref(), &r.attachment)
            .map_err(refuse)?;
    }
    let attached = serde_json::to_vec(&r.attachment).map_or(usize::MAX, |v| v.len());
    if attached > MAX_ATTACHMENT_BYTES {
        return Err(refuse(format!(
            "its attachment is {attached} bytes of JSON, more than {MAX_ATTACHMENT_BYTES}"
        )));
    }
    Ok(())
}

/// A session's environment, as a job's is checked (names, NUL bytes, total size).
pub fn check_env(
    state: &AppState,
    env: &std::collections::BTreeMap<String, String>,
) -> Result<(), Error> {
    let probe = ExecRequest {
        code: Some(String::new()),
        env: env.clone(),
        ..ExecRequest::default()
    };
    probe.into_job(&state.config().limits, "").map(|_| ())
}
