//! The exit-report port: the guest kernel says the worker is ending, before it tears it down.
//!
//! A job that ends the warm worker process (`os._exit`, a fatal signal, `abort`, the OOM
//! killer) used to be answered when the guest agent reaped the worker, after the guest kernel
//! had freed its whole address space: 3.6-4.9 s of emulated kernel work on kvm_pvm. bud's
//! guest kernel patch `guest/kernel/patches/0010-bud-exit-report.patch` instead sends the
//! dying process's wait status (what `waitpid` would return) with one 32-bit `out` to
//! [`PORT`] as soon as its thread group starts to exit, for the one process the agent names
//! (the worker). The VMM ends the job there; the VM is then reset or discarded, so the
//! teardown never runs. The same on every host kind: it costs one exit.
//!
//! Hostile guest code can write this port too (a root job may `ioperm` it): all it can say is
//! that its own job ended with some status, which it could do by exiting.

/// I/O port of the report (past the host-zero port).
pub(crate) const PORT: u16 = 0x0bd8;
