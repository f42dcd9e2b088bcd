//! E2B's sandbox list across the nodes of a cluster (`--redis`; `crate::core::registry` says
//! why Redis and how): this node publishes its listing rows ([`super::control::Row`],
//! every sandbox whoever made it; no access tokens) and reads the other nodes' for a list.
//!
//! The publisher wakes every 100 ms and publishes when this node's sandboxes changed
//! (their count, a creation, a pause), and at least every [`crate::core::registry::PUBLISH_EVERY`]
//! (the rows' end times and expiry need refreshing): another node's list sees a new
//! sandbox within about 100 ms, a change in a row's fields within a second.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::Value;

use super::Sandbox;
use crate::compat::Compat;
use crate::core::registry::PUBLISH_EVERY;
use crate::http::error::Error;

/// A listed sandbox, as the listing filters and orders it and as every node publishes it
/// to the others (`super::cluster`): its place, the API key that made it, what filters
/// read, and the listing's JSON of it.
#[derive(Debug, Clone, serde::Serialize, Deserialize)]
pub struct Row {
    /// Its start, ns since the epoch (the first half of its place).
    pub at_ns: u64,
    pub id: String,
    pub key: Option<String>,
    pub metadata: BTreeMap<String, String>,
    /// The template name the client asked for, and bud's template.
    pub template_id: String,
    pub template: String,
    pub running: bool,
    pub body: Value,
}

impl Row {
    /// Its place in the listing order: its start, then its id.
    pub fn position(&self) -> (u128, String) {
        (u128::from(self.at_ns), self.id.clone())
    }
}

/// Every E2B sandbox of this node, running and paused, whoever made it.
pub fn local_rows(c: &Compat) -> Vec<Row> {
    let all: Vec<Arc<Sandbox>> = c.own.e2b.map().values().cloned().collect();
    let mut rows: Vec<Row> = all
        .into_iter()
        .filter_map(|s| {
            let e = c.app.sessions().get(&s.id).ok()?;
            let body = super::info_body(c, &s, &e);
            let at_ns = e
                .created_at
                .duration_since(std::time::SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            Some(Row {
                at_ns,
                id: s.id.clone(),
                key: s.key.clone(),
                metadata: s.metadata.clone(),
                template_id: s.template_id.clone(),
                template: e.template.clone(),
                running: true,
                body,
            })
        })
        .collect();
    rows.extend(
        super::lifecycle::paused_sandboxes(c)
            .into_iter()
            .map(|(s, p)| Row {
                at_ns: p.record.created_at_ms.saturating_mul(1_000_000),
                id: s.id.clone(),
                key: s.key.clone(),
                metadata: s.metadata.clone(),
                template_id: s.template_id.clone(),
                template: p.record.template.clone(),
                running: super::lifecycle::is_parked(&p),
                body: super::lifecycle::paused_info(c, &s, &p),
            }),
    );
    rows
}

/// What the publisher compares to see a change, cheaply (without the rows' JSON): each
/// sandbox's id and whether it runs, sorted.
fn fingerprint(c: &Compat) -> Vec<(String, bool)> {
    let ids: Vec<String> = c.own.e2b.map().keys().cloned().collect();
    let mut seen: Vec<(String, bool)> = ids
        .into_iter()
        .filter(|id| c.app.sessions().get(id).is_ok())
        .map(|id| (id, true))
        .collect();
    seen.extend(
        super::lifecycle::paused_sandboxes(c)
            .into_iter()
            .map(|(s, _)| (s.id.clone(), false)),
    );
    seen.sort();
    seen
}

/// The registry's kind for E2B's rows.
const KIND: &str = "e2b";

/// The other nodes' rows, without the ids in `here` (this node's rows: a session handed
/// over may be in its old node's rows until that node's next publish). None without a
/// registry.
pub async fn other_nodes(c: &Compat, here: &[Row]) -> Result<Vec<Row>, Error> {
    let Some(reg) = c.app.registry() else {
        return Ok(Vec::new());
    };
    let values = reg
        .gather(KIND, c.app.node().id())
        .await
        .map_err(|e| Error::internal(format!("the cluster-wide list could not be read: {e}")))?;
    let here: HashSet<&str> = here.iter().map(|r| r.id.as_str()).collect();
    let mut rows = Vec::with_capacity(values.len());
    for v in values {
        let row: Row = serde_json::from_value(v)
            .map_err(|e| Error::internal(format!("a node published a row bud cannot read: {e}")))?;
        if !here.contains(row.id.as_str()) {
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Starts publishing this node's rows, if the server has a registry and runs on Tokio.
pub fn start_publisher(c: &Compat) {
    let (Some(reg), Ok(rt)) = (
        c.app.registry().cloned(),
        tokio::runtime::Handle::try_current(),
    ) else {
        return;
    };
    let c = c.clone();
    rt.spawn(async move {
        let node = c.app.node().id().to_owned();
        let mut last: Option<(Instant, Vec<(String, bool)>)> = None;
        let mut failing = false;
        loop {
            let seen = fingerprint(&c);
            let due = last
                .as_ref()
                .is_none_or(|(at, before)| at.elapsed() >= PUBLISH_EVERY || *before != seen);
            if due {
                let values: Vec<serde_json::Value> = local_rows(&c)
                    .iter()
                    .filter_map(|r| serde_json::to_value(r).ok())
                    .collect();
                match reg.publish(KIND, &node, &values).await {
                    Ok(()) => {
                        if failing {
                            tracing::info!("publishing to the sandbox registry again");
                        }
                        failing = false;
                        last = Some((Instant::now(), seen));
                    }
                    Err(e) => {
                        if !failing {
                            tracing::warn!("cannot publish this node's sandboxes: {e}");
                        }
                        failing = true;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}
