//! Retention and the quota: which ended traces go, swept each minute and at each end.

use std::sync::atomic::Ordering;
use std::time::SystemTime;

use super::{OverQuota, Traces};

impl Traces {
    /// Removes ended traces past the retention time, then (with `prune`) ended traces
    /// oldest first while all are over the quota. Traces of live sessions are never
    /// removed.
    pub fn sweep(&self, now: SystemTime) {
        let retention = self.config.retention();
        let mut index = self.index();
        let mut ended: Vec<(SystemTime, String)> = index
            .iter()
            .filter_map(|(id, k)| k.ended.map(|t| (t, id.clone())))
            .collect();
        ended.sort();
        let mut gone = Vec::new();
        for (t, id) in &ended {
            if now.duration_since(*t).unwrap_or_default() >= retention {
                gone.push(id.clone());
            }
        }
        let quota = self.config.quota_mib << 20;
        let mut used: u64 = index.values().map(|k| k.bytes).sum::<u64>()
            - gone
                .iter()
                .filter_map(|id| index.get(id))
                .map(|k| k.bytes)
                .sum::<u64>();
        if self.config.over_quota == OverQuota::Prune {
            for (_, id) in &ended {
                if used <= quota {
                    break;
                }
                if !gone.contains(id) {
                    used -= index.get(id).map_or(0, |k| k.bytes);
                    gone.push(id.clone());
                }
            }
        }
        for id in gone {
            match std::fs::remove_file(self.path(&id)) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(session = id, error = %e, "cannot remove an old trace");
                    continue;
                }
            }
            index.remove(&id);
            self.counts.removed.fetch_add(1, Ordering::Relaxed);
        }
    }
}
