//! The cluster's shared list of sandboxes, in Redis (`--redis`; docs/cluster.md): each
//! node publishes what it holds, and any node reads every node's, so that a list asked
//! of any node through the front shows the whole cluster.
//!
//! **Why Redis, and this shape.** Nodes share no state otherwise (a sandbox's id names its
//! node); the list is the one cross-node read. A router fan-out would need every node to
//! know every other and wait for the slowest; Redis (Debian's `redis-server`) is one
//! round trip. Each node writes ONE key per kind, `bud:KIND:node:NODE`, holding a JSON
//! array of its entries, with an expiry ([`TTL_S`]), every [`PUBLISH_EVERY`] and at once
//! when its sandboxes change; and adds NODE to the set `bud:KIND:nodes`. A reader takes
//! the set and `MGET`s the keys: two round trips whatever the number of sandboxes. A node
//! that dies stops refreshing, and its key expires: its sandboxes leave the list within
//! [`TTL_S`] seconds (their requests answer the front's `node_down` meanwhile).
//!
//! The entries are opaque here (the core names no dialect): the E2B layer publishes its
//! listing rows (`crate::compat::e2b::cluster`).

use std::time::Duration;

use redis::aio::ConnectionManager;
use serde_json::Value;
use tokio::sync::OnceCell;

/// Seconds a node's published entries live without a refresh.
pub const TTL_S: u64 = 5;
/// How often a node refreshes its entries (and at once on a change).
pub const PUBLISH_EVERY: Duration = Duration::from_secs(1);

/// Why the registry could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("the Redis URL {url:?} is not valid: {why}")]
    Url { url: String, why: String },
    #[error("Redis at {url}: {why}")]
    Redis { url: String, why: String },
    #[error("a node's entries in Redis are not JSON: {0}")]
    Json(String),
}

/// A connection to the registry (made at first use, then kept and reconnected by the
/// redis crate's connection manager).
#[derive(Debug)]
pub struct Registry {
    url: String,
    conn: OnceCell<ConnectionManager>,
    /// Wakes the publisher when this node's sandboxes change.
    pub changed: tokio::sync::Notify,
}

impl Registry {
    /// A registry at `url` (`redis://HOST:PORT[/DB]`), checked but not yet connected.
    pub fn new(url: &str) -> Result<Self, RegistryError> {
        redis::Client::open(url).map_err(|e| RegistryError::Url {
            url: url.to_owned(),
            why: e.to_string(),
        })?;
        Ok(Self {
            url: url.to_owned(),
            conn: OnceCell::new(),
            changed: tokio::sync::Notify::new(),
        })
    }

    fn fail(&self, e: impl std::fmt::Display) -> RegistryError {
        RegistryError::Redis {
            url: self.url.clone(),
            why: e.to_string(),
        }
    }

    async fn conn(&self) -> Result<ConnectionManager, RegistryError> {
        self.conn
            .get_or_try_init(|| async {
                let client = redis::Client::open(self.url.as_str()).map_err(|e| self.fail(e))?;
                let config = redis::aio::ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(Duration::from_secs(2)))
                    .set_response_timeout(Some(Duration::from_secs(2)))
                    .set_number_of_retries(1);
                ConnectionManager::new_with_config(client, config)
                    .await
                    .map_err(|e| self.fail(e))
            })
            .await
            .cloned()
    }

    /// Publishes `node`'s `entries` of `kind` (replacing what it published before).
    pub async fn publish(
        &self,
        kind: &str,
        node: &str,
        entries: &[Value],
    ) -> Result<(), RegistryError> {
        let mut c = self.conn().await?;
        let json = serde_json::to_string(entries).map_err(|e| self.fail(e))?;
        redis::pipe()
            .cmd("SET")
            .arg(format!("bud:{kind}:node:{node}"))
            .arg(json)
            .arg("EX")
            .arg(TTL_S)
            .ignore()
            .cmd("SADD")
            .arg(format!("bud:{kind}:nodes"))
            .arg(node)
            .ignore()
            .query_async::<()>(&mut c)
            .await
            .map_err(|e| self.fail(e))
    }

    /// Every node's entries of `kind` but `except`'s (a node lists its own itself, fresh).
    pub async fn gather(&self, kind: &str, except: &str) -> Result<Vec<Value>, RegistryError> {
        let mut c = self.conn().await?;
        let mut nodes: Vec<String> = redis::cmd("SMEMBERS")
            .arg(format!("bud:{kind}:nodes"))
            .query_async(&mut c)
            .await
            .map_err(|e| self.fail(e))?;
        nodes.retain(|n| n != except);
        if nodes.is_empty() {
            return Ok(Vec::new());
        }
        nodes.sort();
        let keys: Vec<String> = nodes
            .iter()
            .map(|n| format!("bud:{kind}:node:{n}"))
            .collect();
        let found: Vec<Option<String>> = redis::cmd("MGET")
            .arg(&keys)
            .query_async(&mut c)
            .await
            .map_err(|e| self.fail(e))?;
        let mut all = Vec::new();
        let mut gone = Vec::new();
        for (node, json) in nodes.iter().zip(found) {
            match json {
                Some(j) => {
                    let entries: Vec<Value> =
                        serde_json::from_str(&j).map_err(|e| RegistryError::Json(e.to_string()))?;
                    all.extend(entries);
                }
                None => gone.push(node.clone()),
            }
        }
        if !gone.is_empty() {
            // Nodes whose entries expired: out of the set (a node that comes back adds itself).
            let _: Result<(), _> = redis::cmd("SREM")
                .arg(format!("bud:{kind}:nodes"))
                .arg(&gone)
                .query_async(&mut c)
                .await;
        }
        Ok(all)
    }
}
