//! The core: the data the service reads and the machinery under it, whoever asks and
//! whatever the transport. Configuration ([`config`]), the server's state ([`state`]:
//! templates, their engines, limits), the session registry ([`sessions`]) with its code
//! contexts ([`contexts`]) and background processes ([`processes`]), the job threads
//! ([`jobs`]), the engine that runs work on VMs ([`engine`]: the VMM's, or a test's),
//! durable state on disk ([`durable`]), what a sandbox's network may reach ([`egress`]),
//! the audit trail ([`audit`]), metrics ([`metrics`]), API keys ([`keys`]), the jail
//! ([`jail`]), this node and its peers ([`node`], [`peer`], [`registry`]), the clock
//! ([`clock`]), and what an error message may repeat of a client's value ([`echo`]).
//!
//! The core imports nothing from the layers above it (`service`, `http`, `compat`) and
//! names no dialect; `server/tests/layers.rs` checks it from the paths.

pub mod audit;
pub mod builds;
pub mod clock;
pub mod config;
pub mod contexts;
pub mod durable;
/// What an error may repeat of a client's value (shared with the user templates' checks).
pub use bud_guest::echo;
pub mod egress;
pub mod engine;
pub mod jail;
pub mod jobs;
pub mod keys;
pub mod metrics;
pub mod node;
pub mod peer;
pub mod processes;
pub mod registry;
pub mod session_keys;
pub mod sessions;
pub mod state;
pub mod trace;

/// An error and its sources, `a: b: c` (what a log line or an answer says of a failure
/// whose cause is a few sources deep: a template build, a call to another node).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
