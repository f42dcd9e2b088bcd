//! A session's code contexts: what each is (its language and starting directory) and the
//! handle of its kernel, the process that runs its cells (`crate::service::kernels`,
//! `crate::service::contexts`), or for a context in the template's kernel runtime
//! (JavaScript) its namespace in the session's own kernel. They belong to the session ([`crate::core::sessions::Entry`]):
//! saved with it when it pauses or is snapshotted, copied into the children of a fork, the
//! same whichever API (bud's, E2B's code interpreter) made them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

/// The kernel of one context: the process, if one was started, and the turn its cells
/// take. A handle: clones share it. [`Kernel::copy`] makes another (a forked session's
/// context, whose VM has its own copy of the process).
#[derive(Debug, Clone, Default)]
pub struct Kernel(Arc<Inner>);

#[derive(Debug, Default)]
struct Inner {
    turn: tokio::sync::Mutex<()>,
    state: Mutex<KernelState>,
}

/// What a kernel keeps between cells (and in a paused session's record).
#[derive(Debug, Default, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct KernelState {
    /// The kernel process; None before the first cell and after it died or was killed.
    pub pid: Option<u32>,
    /// The mark before its end-of-cell frames.
    pub mark: String,
    /// Cells run by this kernel (E2B's `execution_count`, per context as per kernel).
    pub count: u64,
}

impl PartialEq for Kernel {
    fn eq(&self, other: &Self) -> bool {
        self.state() == other.state()
    }
}

impl Eq for Kernel {}

impl Serialize for Kernel {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.state().serialize(s)
    }
}

impl<'de> Deserialize<'de> for Kernel {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Self::with(KernelState::deserialize(d)?))
    }
}

impl Kernel {
    fn with(state: KernelState) -> Self {
        Self(Arc::new(Inner {
            turn: tokio::sync::Mutex::new(()),
            state: Mutex::new(state),
        }))
    }

    /// Another kernel with this one's state (not its turn).
    pub fn copy(&self) -> Self {
        Self::with(self.state())
    }

    pub fn state(&self) -> KernelState {
        self.0
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn set(&self, f: impl FnOnce(&mut KernelState)) {
        f(&mut self.0.state.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// Waits for the kernel's turn: one cell at a time.
    pub async fn turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.0.turn.lock().await
    }

    /// Forgets the kernel's process and returns it (to be killed: a restarted or removed
    /// context). A cell running in it ends with `DeadKernelError`.
    pub fn take_pid(&self) -> Option<u32> {
        let mut pid = None;
        self.set(|k| {
            pid = k.pid.take();
            k.count = 0;
        });
        pid
    }
}

/// One code context: a kernel of its own, a Python interpreter or a shell after its
/// language; or, in the template's kernel runtime (JavaScript), a namespace of the
/// session's kernel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Context {
    pub id: String,
    /// `python` or `bash` (as the client named it), or the name of the template's kernel
    /// runtime (`javascript`).
    pub language: String,
    /// Where its kernel (or namespace) starts.
    pub cwd: String,
    /// The context's kernel (a handle: clones of the context share it). A namespace
    /// context has no process: only its turn and execution count are used.
    #[serde(default)]
    pub kernel: Kernel,
    /// A context in the template's kernel runtime: its namespace in the session's kernel
    /// (`vmm::CellOptions::namespace`: 1, 2, ..., never reused in a session; 0 is the
    /// session's own). 0 for a context with a kernel process of its own.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub namespace: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A session's contexts: those made by clients (each a kernel, or a namespace of the
/// session's kernel runtime) and the default bash one (E2B's cells with `language` bash and
/// no context). The default Python and JavaScript contexts are the session's own
/// namespace 0, not kernels.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct Contexts {
    pub made: BTreeMap<String, Context>,
    #[serde(default)]
    pub bash: Kernel,
    /// The last namespace given to a context ([`Contexts::add`] with `namespaced`).
    #[serde(default)]
    pub next_namespace: u32,
}

impl Contexts {
    /// Most contexts a session may have (each may hold a kernel process in the guest).
    pub const MAX: usize = 64;

    /// A forked session's contexts: the same, each kernel a copy (the child's VM has its
    /// own copy of each kernel process).
    pub fn copy(&self) -> Self {
        let mut c = self.clone();
        for ctx in c.made.values_mut() {
            ctx.kernel = ctx.kernel.copy();
        }
        c.bash = self.bash.copy();
        c
    }

    /// A new context with a fresh id, or None at [`Contexts::MAX`]; `namespaced`: one in
    /// the template's kernel runtime, given the next namespace (1, 2, ...; a removed
    /// context's is not given again).
    pub fn add(
        &mut self,
        language: &str,
        cwd: &str,
        id: String,
        namespaced: bool,
    ) -> Option<Context> {
        if self.made.len() >= Self::MAX {
            return None;
        }
        let namespace = if namespaced {
            self.next_namespace = self.next_namespace.checked_add(1)?;
            self.next_namespace
        } else {
            0
        };
        let c = Context {
            id,
            language: language.to_owned(),
            cwd: cwd.to_owned(),
            kernel: Kernel::default(),
            namespace,
        };
        self.made.insert(c.id.clone(), c.clone());
        Some(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contexts_are_added_up_to_the_cap_and_copied_with_kernels_of_their_own() {
        let mut c = Contexts::default();
        let a = c
            .add("python", "/home/user", "ctx_a".into(), false)
            .unwrap();
        a.kernel.set(|k| k.pid = Some(7));
        c.add("bash", "/tmp", "ctx_b".into(), false).unwrap();
        for i in 2..Contexts::MAX {
            c.add("python", "/", format!("ctx_{i}"), false).unwrap();
        }
        assert!(c.add("python", "/", "ctx_over".into(), false).is_none());
        let copy = c.copy();
        assert_eq!(copy.made["ctx_a"].kernel.state().pid, Some(7));
        copy.made["ctx_a"].kernel.set(|k| k.pid = None);
        assert_eq!(
            c.made["ctx_a"].kernel.state().pid,
            Some(7),
            "a copy, not a share"
        );
        assert_eq!(copy.made["ctx_b"].cwd, "/tmp");
        assert_eq!(copy.made["ctx_a"].namespace, 0);
    }

    #[test]
    fn namespaced_contexts_get_namespaces_never_given_again_and_forks_go_on_counting() {
        let mut c = Contexts::default();
        let a = c.add("javascript", "/tmp", "ctx_a".into(), true).unwrap();
        let p = c.add("python", "/tmp", "ctx_p".into(), false).unwrap();
        let b = c.add("javascript", "/tmp", "ctx_b".into(), true).unwrap();
        c.made.remove("ctx_b");
        let d = c.add("javascript", "/tmp", "ctx_d".into(), true).unwrap();
        let mut fork = c.copy();
        let e = fork
            .add("javascript", "/tmp", "ctx_e".into(), true)
            .unwrap();

        assert_eq!(
            (
                a.namespace,
                p.namespace,
                b.namespace,
                d.namespace,
                e.namespace
            ),
            (1, 0, 2, 3, 4)
        );
        // Saved and read back (a pause, a snapshot) with its namespaces and counter.
        let back: Contexts = serde_json::from_value(serde_json::to_value(&c).unwrap()).unwrap();
        assert_eq!(back.made["ctx_d"].namespace, 3);
        assert_eq!(back.next_namespace, 3);
        // A record from before namespaced contexts reads as none.
        let old: Context = serde_json::from_value(
            serde_json::json!({"id": "ctx_o", "language": "python", "cwd": "/tmp"}),
        )
        .unwrap();
        assert_eq!(old.namespace, 0);
    }
}
