//! What the host's memory management does with many VMs in one process: detected, so that
//! a server can say why its sessions slow down (docs/sessions.md, "Many sessions on one
//! server"; figures in docs/measurements.md, issue 60).
//!
//! Every VM registers an MMU notifier on the process's memory, and the host calls every one
//! of them for each page-table entry it ages or replaces in the process. Most of that is
//! per fault and so grows with the VMs alive. One host feature makes it grow with their
//! square: **DAMON on physical memory** (a `kdamond` whose context monitors `paddr`, as a
//! proactive-reclaim setup runs). To sample a page it walks every mapping of that page and
//! clears its accessed bit there, calling every notifier of the process each time; a page of
//! a template's memory file is mapped by every VM that read it. Measured on the development
//! host (a `paddr` kdamond with a `pageout` scheme, 1 024 to 8 192 regions sampled every
//! 0.5 s): with ~300 live sessions the kdamond took two thirds of both cores and a session's
//! first cell reached seconds; with it stopped, 1 000 sessions answered first cells in tens
//! of milliseconds. bud cannot switch it off (it is the host's); parking idle sessions
//! (`bud serve --park-idle-s`) keeps the VMs alive few, and several server processes divide
//! the VMs each notifier list holds.

use std::path::Path;

/// The DAMON sysfs interface's directory of kdamonds.
const KDAMONDS: &str = "/sys/kernel/mm/damon/admin/kdamonds";

/// A kdamond at work on physical memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PhysicalMonitor {
    /// Its number under the sysfs directory (`kdamond.N` in `ps`).
    pub index: String,
    /// Its thread's pid, when sysfs gives it.
    pub pid: Option<u32>,
    /// What its schemes do with the pages they find (`pageout`, `lru_prio`, ...).
    pub actions: Vec<String>,
}

impl PhysicalMonitor {
    /// The kdamonds of this host that are on and monitor physical memory (none where DAMON
    /// is not built, not used, or only monitors processes' virtual memory).
    pub fn running() -> Vec<Self> {
        Self::running_in(Path::new(KDAMONDS))
    }

    /// [`PhysicalMonitor::running`] against a given kdamonds directory (for tests).
    pub(crate) fn running_in(kdamonds: &Path) -> Vec<Self> {
        let read = |p: &Path| std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned());
        let mut found = Vec::new();
        let Ok(entries) = std::fs::read_dir(kdamonds) else {
            return found;
        };
        for entry in entries.flatten() {
            let dir = entry.path();
            if read(&dir.join("state")).as_deref() != Some("on") {
                continue;
            }
            let contexts = dir.join("contexts");
            let mut physical = false;
            let mut actions = Vec::new();
            for ctx in children(&contexts) {
                if read(&ctx.join("operations")).as_deref() != Some("paddr") {
                    continue;
                }
                physical = true;
                for scheme in children(&ctx.join("schemes")) {
                    if let Some(action) = read(&scheme.join("action")) {
                        actions.push(action);
                    }
                }
            }
            if physical {
                found.push(Self {
                    index: entry.file_name().to_string_lossy().into_owned(),
                    pid: read(&dir.join("pid")).and_then(|p| p.parse().ok()),
                    actions,
                });
            }
        }
        found.sort_by(|a, b| a.index.cmp(&b.index));
        found
    }

    /// What it costs a server with many VMs, in words (for its log and health).
    pub fn note(&self) -> String {
        let pid = self.pid.map(|p| format!(", pid {p}")).unwrap_or_default();
        let actions = if self.actions.is_empty() {
            String::new()
        } else {
            format!(" ({})", self.actions.join(", "))
        };
        format!(
            "the host's DAMON monitors physical memory (kdamond.{}{pid}{actions}): to sample a \
             page it calls every VM's MMU notifier for every mapping of it, a cost that grows \
             with the square of the live VMs of one process; park idle sessions \
             (--park-idle-s) or run several servers (docs/sessions.md)",
            self.index
        )
    }
}

/// The numbered subdirectories of `dir` (DAMON's sysfs lists contexts and schemes as
/// `0`, `1`, ... beside a `nr_*` file).
fn children(dir: &Path) -> Vec<std::path::PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut all: Vec<_> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .map(|e| e.path())
        .collect();
    all.sort();
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kdamond directory as DAMON's sysfs lays it out.
    fn kdamond(root: &Path, n: &str, state: &str, ops: &str, actions: &[&str]) {
        let d = root.join(n);
        let ctx = d.join("contexts").join("0");
        std::fs::create_dir_all(ctx.join("schemes")).unwrap();
        std::fs::write(d.join("state"), format!("{state}\n")).unwrap();
        std::fs::write(d.join("pid"), "105\n").unwrap();
        std::fs::write(d.join("contexts").join("nr_contexts"), "1\n").unwrap();
        std::fs::write(ctx.join("operations"), format!("{ops}\n")).unwrap();
        for (i, a) in actions.iter().enumerate() {
            let s = ctx.join("schemes").join(i.to_string());
            std::fs::create_dir_all(&s).unwrap();
            std::fs::write(s.join("action"), format!("{a}\n")).unwrap();
        }
    }

    #[test]
    fn only_kdamonds_that_are_on_and_monitor_physical_memory_are_found() {
        let root = std::env::temp_dir().join(format!("bud-damon-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        kdamond(&root, "0", "on", "paddr", &["pageout"]);
        kdamond(&root, "1", "off", "paddr", &["pageout"]);
        kdamond(&root, "2", "on", "vaddr", &["stat"]);
        std::fs::write(root.join("nr_kdamonds"), "3\n").unwrap();

        let found = PhysicalMonitor::running_in(&root);
        let none = PhysicalMonitor::running_in(&root.join("missing"));
        let _ = std::fs::remove_dir_all(&root);

        assert_eq!(
            found,
            [PhysicalMonitor {
                index: "0".into(),
                pid: Some(105),
                actions: vec!["pageout".into()],
            }]
        );
        assert!(found[0].note().starts_with(
            "the host's DAMON monitors physical memory (kdamond.0, pid 105 (pageout))"
        ));
        assert_eq!(none, []);
    }
}
