//! Egress: what a sandbox's network may reach (issue 39, stage 2 of
//! `docs/network-design.md`). A policy in E2B's shape ([`policy`]), the ranges no policy
//! opens and the names the operator pins ([`ranges`]), the server's own listening sockets,
//! which nothing opens ([`listeners`]), the headers set on a sandbox's requests to a host
//! ([`rules`]) and the operator's secrets their values may name ([`secrets`]), bud's side of
//! the TLS it terminates to set them over HTTPS ([`intercept`]), and the gate that applies
//! them to each name and
//! connection of one sandbox and records every attempt ([`gate`]): it is the
//! [`vmm::Egress`] of that sandbox's network card.
//!
//! Nothing here dials: the VMM's stack dials what the gate names.

pub mod gate;
pub mod intercept;
pub mod listeners;
mod names;
pub mod policy;
pub mod ranges;
pub mod rules;
pub mod secrets;

pub use gate::{Attempt, Gate, Site};
pub use intercept::{InterceptError, Interceptor};
pub use listeners::Listeners;
pub use policy::{Decision, Policy, PolicyError, PolicySpec};
pub use ranges::{Hosts, HostsError, Private};
pub use rules::{Rules, RulesSpec};
pub use secrets::{Secrets, SecretsError};
