//! This server as one node of many (docs/cluster.md): its id, which every session and
//! snapshot id it issues carries, whether it is draining, and where the sessions it handed
//! to another node went.
//!
//! **Ids.** A session id is `ses_<node>_<32 hex>` and a snapshot id `snap_<node>_<32 hex>`:
//! a router (bud ships an HAProxy configuration) reads the node out of the id and sends the
//! request there, with no table shared between nodes. A node asked for an id of another
//! node that it does not hold (an imported session keeps its id) answers 421 `wrong_node`
//! naming that node. Ids of the older form `ses_<hex>` name no node and are this node's.
//!
//! **Node ids** are 1 to 63 characters of `a-z`, `0-9` and `-` (a DNS label), so that an
//! id fits a host name (E2B's `PORT-ID.DOMAIN`) and a Kubernetes node can be named by its
//! address (`10-0-0-5`). Without `--node-id`, the host name is used, lowercased, with
//! every other character turned into `-`.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// `bud serve`'s options for running as one node of many.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct ClusterConfig {
    /// This node's id, carried by every session and snapshot id it issues (1-63 of a-z,
    /// 0-9 and -). Default: the host name.
    #[arg(long, env = "BUD_NODE_ID", value_parser = parse_node_id)]
    pub node_id: Option<String>,
    /// Answer HAProxy's agent checks on this TCP port (same address as --listen): the
    /// node's free capacity as a weight, `drain` while draining, `down` until ready.
    #[arg(long)]
    pub agent_port: Option<u16>,
    /// Register this node's sandboxes in Redis (redis://HOST:PORT[/DB]) so that E2B's
    /// sandbox list shows every node's.
    #[arg(long, env = "BUD_REDIS")]
    pub redis: Option<String>,
}

/// Why a node id is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("node id {0:?} must be 1-63 characters of a-z, 0-9 and -, not starting or ending with -")]
pub struct BadNodeId(pub String);

/// `--node-id`'s check.
pub fn parse_node_id(s: &str) -> Result<String, BadNodeId> {
    let ok = (1..=63).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-');
    if ok {
        Ok(s.to_owned())
    } else {
        Err(BadNodeId(s.to_owned()))
    }
}

/// A node id from a host name: lowercased, other characters as `-`, trimmed to a label.
pub fn node_id_from_host(host: &str) -> String {
    let mut id: String = host
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9') => c,
            _ => '-',
        })
        .take(63)
        .collect();
    while id.ends_with('-') {
        id.pop();
    }
    let id = id.trim_start_matches('-').to_owned();
    if id.is_empty() { "node".to_owned() } else { id }
}

/// This machine's host name.
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into our buffer.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// The node an id names (`ses_<node>_<hex>`, `snap_<node>_<hex>`), if it names one.
pub fn node_of(id: &str) -> Option<&str> {
    let mut parts = id.split('_');
    let (_kind, node, rest) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || rest.is_empty() || parse_node_id(node).is_err() {
        return None;
    }
    Some(node)
}

/// Longest id of a session or snapshot, everywhere: an import, a file found at start.
/// (`ses_`, a node id of up to 63 characters, `_`, 32 hex digits: 100.)
pub const MAX_ID_LEN: usize = 128;

/// Whether `id` is a well-formed session id (what an import accepts).
pub fn is_session_id(id: &str) -> bool {
    id.len() <= MAX_ID_LEN
        && id.starts_with("ses_")
        && id[4..]
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        && id.len() > 4
}

/// Where a session this node handed over went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Moved {
    /// The node that took it.
    pub node: String,
    /// That node's URL, where this node forwards the session's requests.
    pub url: String,
}

/// This node (module docs).
#[derive(Debug)]
pub struct Node {
    id: String,
    draining: AtomicBool,
    moved: Mutex<HashMap<String, Moved>>,
    /// Sessions being handed over now.
    moving: Mutex<HashSet<String>>,
    /// Requests in progress per session (past the node layer, up to their answer's head).
    inflight: Mutex<HashMap<String, usize>>,
    /// Wakes requests waiting for a hand-over, and a hand-over waiting for requests.
    moved_now: tokio::sync::Notify,
}

/// A request in progress on a session ([`Node::enter`]); leaves on drop.
#[derive(Debug)]
pub struct Inflight<'a> {
    node: &'a Node,
    id: String,
}

impl Drop for Inflight<'_> {
    fn drop(&mut self) {
        let mut map = self.node.inflight.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = map.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.id);
            }
        }
        drop(map);
        self.node.moved_now.notify_waiters();
    }
}

impl Node {
    pub fn new(id: String) -> Self {
        Self {
            id,
            draining: AtomicBool::new(false),
            moved: Mutex::default(),
            moving: Mutex::default(),
            inflight: Mutex::default(),
            moved_now: tokio::sync::Notify::new(),
        }
    }

    /// The node of `config`: its `--node-id`, else the host name's.
    pub fn of(config: &ClusterConfig) -> Self {
        Self::new(
            config
                .node_id
                .clone()
                .unwrap_or_else(|| node_id_from_host(&host_name())),
        )
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// A new random id of `kind` (`ses`, `snap`) on this node: 128 bits from the host's
    /// CSPRNG, so an id is the capability to use what it names.
    pub fn new_id(&self, kind: &str) -> Result<String, vmm::identity::IdentityError> {
        Ok(format!("{kind}_{}_{}", self.id, random_hex(16)?))
    }

    /// The other node `id` names, if it names one that is not this one.
    pub fn elsewhere<'a>(&self, id: &'a str) -> Option<&'a str> {
        node_of(id).filter(|n| *n != self.id)
    }

    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    pub fn set_draining(&self, on: bool) {
        self.draining.store(on, Ordering::SeqCst);
    }

    /// Records that session `id` now lives on `to`.
    pub fn moved_to(&self, id: &str, to: Moved) {
        self.moved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_owned(), to);
    }

    /// Where session `id` went, if this node handed it over.
    pub fn moved(&self, id: &str) -> Option<Moved> {
        self.moved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
    }

    /// Marks session `id` as being handed over: new requests wait ([`Self::enter`]).
    pub fn start_moving(&self, id: &str) {
        let _entering = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        self.moving_set().insert(id.to_owned());
    }

    /// The hand-over of `id` is over (done or failed): its waiting requests go on.
    pub fn end_moving(&self, id: &str) {
        self.moving_set().remove(id);
        self.moved_now.notify_waiters();
    }

    /// Enters a request on session `id`, once no hand-over of it is under way: a
    /// hand-over starts only when the requests entered before it have left
    /// ([`Self::quiet`]), and requests that come during one wait for it to end.
    pub async fn enter(&self, id: &str) -> Inflight<'_> {
        loop {
            let woken = self.moved_now.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            {
                let mut map = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
                if !self.moving_set().contains(id) {
                    *map.entry(id.to_owned()).or_default() += 1;
                    return Inflight {
                        node: self,
                        id: id.to_owned(),
                    };
                }
            }
            woken.await;
        }
    }

    /// Waits until no request is entered on session `id` (after [`Self::start_moving`],
    /// none can enter).
    pub async fn quiet(&self, id: &str) {
        loop {
            let woken = self.moved_now.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let busy = self
                .inflight
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains_key(id);
            if !busy {
                return;
            }
            woken.await;
        }
    }

    fn moving_set(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.moving.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forgets a hand-over (the session came back).
    pub fn back(&self, id: &str) {
        self.moved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }
}

/// `bytes` bytes from the host's CSPRNG, in hex: ids, tokens, marks.
pub fn random_hex(bytes: usize) -> Result<String, vmm::identity::IdentityError> {
    let mut b = vec![0u8; bytes];
    vmm::identity::host_random(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_are_dns_labels() {
        assert_eq!(parse_node_id("n1"), Ok("n1".into()));
        assert_eq!(parse_node_id("10-0-0-5"), Ok("10-0-0-5".into()));
        for bad in ["", "-a", "a-", "N1", "a_b", "a.b", &"x".repeat(64)] {
            assert_eq!(parse_node_id(bad), Err(BadNodeId(bad.into())), "{bad:?}");
        }
    }

    #[test]
    fn host_names_become_node_ids() {
        assert_eq!(
            node_id_from_host("Build-Box.example.com"),
            "build-box-example-com"
        );
        assert_eq!(node_id_from_host("--"), "node");
        assert_eq!(node_id_from_host(""), "node");
        let long = node_id_from_host(&"a".repeat(100));
        assert_eq!(long.len(), 63);
        assert!(parse_node_id(&node_id_from_host("_x_")).is_ok());
    }

    #[test]
    fn ids_name_their_node() {
        let n = Node::new("n2".into());
        let id = n.new_id("ses").unwrap();
        assert!(id.starts_with("ses_n2_") && id.len() == 4 + 3 + 32, "{id}");
        assert_eq!(node_of(&id), Some("n2"));
        assert_eq!(n.elsewhere(&id), None);
        assert_eq!(Node::new("n1".into()).elsewhere(&id), Some("n2"));
        assert_eq!(node_of("ses_0123abcd"), None);
        assert_eq!(node_of("snap_10-0-0-5_ab"), Some("10-0-0-5"));
        assert_eq!(node_of("ses_BAD_ab"), None);
        assert!(is_session_id(&id) && is_session_id("ses_0123") && !is_session_id("ses_"));
        assert!(!is_session_id("ses_a/b") && !is_session_id("snap_n1_ab"));
    }

    #[tokio::test]
    async fn a_hand_over_waits_for_requests_in_progress_and_holds_new_ones() {
        let node = std::sync::Arc::new(Node::new("n1".into()));
        let first = node.enter("s").await;
        node.start_moving("s");
        // The hand-over waits for the request that entered before it...
        let quiet = {
            let node = node.clone();
            tokio::spawn(async move { node.quiet("s").await })
        };
        // ...and a request that comes now waits for the hand-over.
        let later = {
            let node = node.clone();
            tokio::spawn(async move {
                let _in = node.enter("s").await;
                node.moved("s")
            })
        };
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!quiet.is_finished() && !later.is_finished());
        // Other sessions are not held.
        drop(node.enter("other").await);
        drop(first);
        quiet.await.unwrap();
        assert!(!later.is_finished());
        node.moved_to(
            "s",
            Moved {
                node: "n2".into(),
                url: "http://127.0.0.1:1".into(),
            },
        );
        node.end_moving("s");
        assert_eq!(later.await.unwrap().map(|m| m.node), Some("n2".into()));
    }
}
