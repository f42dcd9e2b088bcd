//! A session's background processes as the server keeps them: what each was started as, the
//! output it wrote (a bounded record, for clients that connect later), its end, and the
//! channel its connected clients read. The guest holds only the pipes (`vmm::process`); the
//! service (`service::processes`) starts processes, feeds their events in here and keeps
//! the session's VM running while any lives.
//!
//! One lock covers a process's record and its channel, so a client that connects gets the
//! recorded output and then every later event, each exactly once.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use axum::body::Bytes;
use serde::Serialize;
use tokio::sync::broadcast;
use vmm::job::Stream;
use vmm::process::{Changed, ProcessEvent};

/// Output kept per process for clients that connect later (the oldest goes first).
pub const OUTPUT_KEPT: usize = 1 << 20;

/// Ended processes whose record is kept (oldest dropped first).
pub const ENDED_KEPT: usize = 64;

/// Events a connected client may fall behind by before it loses output.
const CHANNEL: usize = 4096;

/// Clients one session's processes and watchers may have connected at once (output and
/// watch streams): each holds a channel and a task on the server.
pub const MAX_STREAMS: usize = 64;

/// Changes a directory watcher keeps for its client to take (the oldest go first).
pub const CHANGES_KEPT: usize = 10_000;

/// A watched directory's changes, kept until its client takes them, and sent to its
/// streaming clients.
#[derive(Debug)]
struct Watch {
    path: String,
    changes: VecDeque<Changed>,
    dropped: u64,
    tx: broadcast::Sender<Changed>,
}

/// A process to start (also kept in a paused session's record: `crate::core::durable`).
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct Start {
    /// The command line as the client gave it (for listings).
    pub cmd: String,
    pub args: Vec<String>,
    /// The shell script that runs (`/bin/sh -c`).
    pub script: String,
    pub cwd: Option<String>,
    /// Variables on top of the session's.
    pub env: BTreeMap<String, String>,
    /// A client's name for it (E2B's tag).
    pub tag: Option<String>,
    /// Give it a stdin pipe.
    pub stdin: bool,
    /// Run it on a terminal of this size (rows, columns).
    pub pty: Option<(u16, u16)>,
    /// Run it as this user of the guest (`user`, `root`, ...; its ids and its `HOME`,
    /// `USER`, `LOGNAME`, `SHELL`); None: as the guest's worker, root, with its environment.
    pub user: Option<String>,
    /// bud's own (a code context's kernel, `crate::service::kernels`): left out of the
    /// sandbox's process listings, as E2B's kernels are not envd's processes.
    #[serde(default)]
    pub internal: bool,
}

/// How a process ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Exit {
    /// Its exit status, if it exited.
    pub exit_code: Option<i32>,
    /// The signal that killed it, if one did.
    pub signal: Option<i32>,
    /// When bud did not see it end in the guest: why it is over (the sandbox ended).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lost: Option<String>,
    /// When the server saw it end (at the poll that brought its end: within a guest
    /// wakeup of the end itself).
    #[serde(skip)]
    pub ended_at: SystemTime,
}

/// A started process: its pid, what it was started as, and when.
#[derive(Debug, Clone)]
pub struct Info {
    pub pid: u32,
    pub start: Start,
    pub started_at: SystemTime,
}

impl Info {
    /// Whether it reads what is written to it: a stdin pipe, or a terminal.
    pub fn takes_input(&self) -> bool {
        self.start.stdin || self.start.pty.is_some()
    }
}

/// A process as kept: what it was started as, and how it ended if it did.
pub type Kept = (Arc<Info>, Option<Exit>);

/// An event of one process, as its clients see it.
#[derive(Debug, Clone)]
pub enum Event {
    Output(Stream, Bytes),
    End(Exit),
}

/// A client's view of one process: what it missed (from the start, if it asked) and the
/// channel of what comes next; `ended` if it already has.
#[derive(Debug)]
pub struct Subscription {
    pub info: Arc<Info>,
    pub replay: Vec<Event>,
    /// Bytes of output dropped from the start of the record (over [`OUTPUT_KEPT`]).
    pub dropped: u64,
    pub ended: Option<Exit>,
    pub rx: broadcast::Receiver<Event>,
}

#[derive(Debug)]
struct Proc {
    info: Arc<Info>,
    log: VecDeque<(Stream, Bytes)>,
    log_bytes: usize,
    dropped: u64,
    end: Option<Exit>,
    stdin_open: bool,
    tx: broadcast::Sender<Event>,
}

#[derive(Debug, Default)]
struct Table {
    procs: BTreeMap<u32, Proc>,
    watches: BTreeMap<u32, Watch>,
    ended: VecDeque<u32>,
    /// A task keeps the VM running for them (see `service::processes`).
    pumping: bool,
    /// The session ended: no process starts any more.
    closed: Option<String>,
}

/// A session's processes.
#[derive(Debug, Default)]
pub struct Processes {
    table: Mutex<Table>,
    /// The session's trace, where each end the guest reports is written.
    trace: std::sync::OnceLock<(String, Arc<crate::core::trace::Traces>)>,
    /// Starts (of processes and watchers) under way, which a poll beside a cell must not
    /// overtake ([`Processes::starting`]).
    starts: std::sync::atomic::AtomicUsize,
}

/// A start under way ([`Processes::starting`]), until dropped.
#[derive(Debug)]
pub struct Starting<'a>(&'a Processes);

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        self.0
            .starts
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

impl Processes {
    /// Writes the ends of this session's processes (`id`) to `traces` from now on.
    pub fn trace_to(&self, id: &str, traces: Arc<crate::core::trace::Traces>) {
        let _ = self.trace.set((id.to_owned(), traces));
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks a start under way until the guard is dropped, after its record is made: a
    /// process started beside a cell could otherwise end, and its end be polled, before
    /// the server knew its pid (events of unknown pids are dropped). The pump polls beside
    /// a cell only while none is under way ([`Processes::is_starting`]).
    pub fn starting(&self) -> Starting<'_> {
        self.starts
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Starting(self)
    }

    /// Whether a start is under way.
    pub fn is_starting(&self) -> bool {
        self.starts.load(std::sync::atomic::Ordering::Acquire) > 0
    }

    /// Whether a client is connected to a process that has not ended.
    pub fn watched(&self) -> bool {
        self.table()
            .procs
            .values()
            .any(|p| p.end.is_none() && p.tx.receiver_count() > 0)
    }

    /// Directory watchers.
    pub fn watchers(&self) -> usize {
        self.table().watches.len()
    }

    /// Processes that have not ended.
    pub fn live(&self) -> usize {
        self.table()
            .procs
            .values()
            .filter(|p| p.end.is_none())
            .count()
    }

    /// Records a started process; returns false if the session has ended meanwhile.
    pub fn add(&self, info: Info) -> bool {
        let mut t = self.table();
        if t.closed.is_some() {
            return false;
        }
        let (tx, _) = broadcast::channel(CHANNEL);
        let stdin_open = info.takes_input();
        t.procs.insert(
            info.pid,
            Proc {
                info: Arc::new(info),
                log: VecDeque::new(),
                log_bytes: 0,
                dropped: 0,
                end: None,
                stdin_open,
                tx,
            },
        );
        true
    }

    /// Takes a poll's events. Events of a pid it does not know (a process started by a
    /// cell's own code is not one of these: only ours are polled) are dropped.
    pub fn record(&self, events: Vec<ProcessEvent>) {
        let mut t = self.table();
        for e in events {
            match e {
                ProcessEvent::Output { pid, stream, data } => {
                    let Some(p) = t.procs.get_mut(&pid) else {
                        continue;
                    };
                    let data = Bytes::from(data);
                    let _ = p.tx.send(Event::Output(stream, data.clone()));
                    p.log_bytes += data.len();
                    p.log.push_back((stream, data));
                    while p.log_bytes > OUTPUT_KEPT {
                        let Some((_, old)) = p.log.pop_front() else {
                            break;
                        };
                        p.log_bytes -= old.len();
                        p.dropped += old.len() as u64;
                    }
                }
                ProcessEvent::Watch { watcher, changed } => {
                    let Some(w) = t.watches.get_mut(&watcher) else {
                        continue;
                    };
                    let _ = w.tx.send(changed.clone());
                    w.changes.push_back(changed);
                    if w.changes.len() > CHANGES_KEPT {
                        w.changes.pop_front();
                        w.dropped += 1;
                    }
                }
                ProcessEvent::Exit {
                    pid,
                    exit_code,
                    signal,
                } => {
                    let exit = Exit {
                        exit_code,
                        signal,
                        lost: None,
                        ended_at: SystemTime::now(),
                    };
                    if let Some((id, traces)) = self.trace.get() {
                        traces.record(id, "process_end", |_| {
                            serde_json::json!({"pid": pid, "exit_code": exit_code, "signal": signal})
                        });
                    }
                    end(&mut t, pid, exit);
                }
            }
        }
    }

    /// Records watcher `id` of directory `path`; false if the session has ended meanwhile.
    pub fn add_watch(&self, id: u32, path: &str) -> bool {
        let mut t = self.table();
        if t.closed.is_some() {
            return false;
        }
        let (tx, _) = broadcast::channel(CHANNEL);
        let w = Watch {
            path: path.to_owned(),
            changes: VecDeque::new(),
            dropped: 0,
            tx,
        };
        t.watches.insert(id, w);
        true
    }

    /// Watcher `id`'s changes since the last take (and how many were dropped over
    /// [`CHANGES_KEPT`]); None if there is no such watcher.
    pub fn take_changes(&self, id: u32) -> Option<(Vec<Changed>, u64)> {
        let mut t = self.table();
        let w = t.watches.get_mut(&id)?;
        let dropped = std::mem::take(&mut w.dropped);
        Some((w.changes.drain(..).collect(), dropped))
    }

    /// A streaming client of watcher `id`: every change from now on.
    pub fn subscribe_watch(&self, id: u32) -> Option<broadcast::Receiver<Changed>> {
        Some(self.table().watches.get(&id)?.tx.subscribe())
    }

    /// Forgets watcher `id`; its streaming clients' channels close. False if unknown.
    pub fn remove_watch(&self, id: u32) -> bool {
        self.table().watches.remove(&id).is_some()
    }

    /// Every watcher, (id, watched directory), by id: what a fork child or a resumed session
    /// takes over (the guest's watchers are part of the VM).
    pub fn watch_list(&self) -> Vec<(u32, String)> {
        let mut all: Vec<_> = self
            .table()
            .watches
            .iter()
            .map(|(id, w)| (*id, w.path.clone()))
            .collect();
        all.sort();
        all
    }

    /// The watched directory of watcher `id`.
    pub fn watch_path(&self, id: u32) -> Option<String> {
        Some(self.table().watches.get(&id)?.path.clone())
    }

    /// The session ended (`why`): every live process ends with it, and none starts.
    pub fn close(&self, why: &str) {
        let mut t = self.table();
        t.closed = Some(why.to_owned());
        t.watches.clear();
        let live: Vec<u32> = t
            .procs
            .iter()
            .filter(|(_, p)| p.end.is_none())
            .map(|(pid, _)| *pid)
            .collect();
        for pid in live {
            let exit = Exit {
                exit_code: None,
                signal: None,
                lost: Some(format!("the sandbox ended ({why})")),
                ended_at: SystemTime::now(),
            };
            end(&mut t, pid, exit);
        }
    }

    /// Clients connected to the session's processes and watchers now.
    pub fn streams(&self) -> usize {
        let t = self.table();
        let procs: usize = t.procs.values().map(|p| p.tx.receiver_count()).sum();
        procs
            + t.watches
                .values()
                .map(|w| w.tx.receiver_count())
                .sum::<usize>()
    }

    /// Connects a client to `pid`: with what it wrote so far if `from_start`.
    pub fn subscribe(&self, pid: u32, from_start: bool) -> Option<Subscription> {
        let t = self.table();
        let p = t.procs.get(&pid)?;
        let mut replay: Vec<Event> = if from_start {
            p.log
                .iter()
                .map(|(s, b)| Event::Output(*s, b.clone()))
                .collect()
        } else {
            Vec::new()
        };
        if let Some(end) = &p.end {
            replay.push(Event::End(end.clone()));
        }
        Some(Subscription {
            info: p.info.clone(),
            replay,
            dropped: if from_start { p.dropped } else { 0 },
            ended: p.end.clone(),
            rx: p.tx.subscribe(),
        })
    }

    /// Every process kept, oldest first, and how each ended if it did.
    pub fn list(&self) -> Vec<Kept> {
        let t = self.table();
        let mut all: Vec<_> = t
            .procs
            .values()
            .map(|p| (p.info.clone(), p.end.clone()))
            .collect();
        all.sort_by_key(|(i, _)| i.started_at);
        all
    }

    /// Whether any process kept has not ended.
    pub fn any_running(&self) -> bool {
        self.table().procs.values().any(|p| p.end.is_none())
    }

    /// Process `pid`, and how it ended if it did.
    pub fn get(&self, pid: u32) -> Option<(Arc<Info>, Option<Exit>, bool)> {
        let t = self.table();
        let p = t.procs.get(&pid)?;
        Some((p.info.clone(), p.end.clone(), p.stdin_open))
    }

    /// Process `pid`'s stdin was closed.
    pub fn stdin_closed(&self, pid: u32) {
        if let Some(p) = self.table().procs.get_mut(&pid) {
            p.stdin_open = false;
        }
    }

    /// Whether the caller should start the task that keeps the VM running: true once, while
    /// some process lives and no task does.
    pub fn claim_pump(&self) -> bool {
        let mut t = self.table();
        let live = t.procs.values().any(|p| p.end.is_none()) || !t.watches.is_empty();
        if t.pumping || !live || t.closed.is_some() {
            return false;
        }
        t.pumping = true;
        true
    }

    /// The pump's check before each round: true (and the pump is released) when nothing
    /// lives any more or the session ended.
    pub fn pump_should_stop(&self) -> bool {
        let mut t = self.table();
        let live = t.procs.values().any(|p| p.end.is_none()) || !t.watches.is_empty();
        if live && t.closed.is_none() {
            return false;
        }
        t.pumping = false;
        true
    }
}

fn end(t: &mut Table, pid: u32, exit: Exit) {
    let Some(p) = t.procs.get_mut(&pid) else {
        return;
    };
    if p.end.is_some() {
        return;
    }
    p.stdin_open = false;
    p.end = Some(exit.clone());
    let _ = p.tx.send(Event::End(exit));
    t.ended.push_back(pid);
    while t.ended.len() > ENDED_KEPT {
        if let Some(old) = t.ended.pop_front() {
            t.procs.remove(&old);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(pid: u32) -> Info {
        Info {
            pid,
            start: Start {
                cmd: "sh".into(),
                script: "true".into(),
                stdin: true,
                ..Start::default()
            },
            started_at: SystemTime::now(),
        }
    }

    fn out(pid: u32, s: &str) -> ProcessEvent {
        ProcessEvent::Output {
            pid,
            stream: Stream::Stdout,
            data: s.as_bytes().to_vec(),
        }
    }

    #[test]
    fn a_client_gets_the_record_then_the_rest_once() {
        let p = Processes::default();
        assert!(p.add(info(5)));
        assert!(p.claim_pump());
        assert!(!p.claim_pump(), "one pump at a time");
        p.record(vec![out(5, "a"), out(6, "unknown pid")]);
        let mut late = p.subscribe(5, true).unwrap();
        let mut now = p.subscribe(5, false).unwrap();
        assert_eq!(late.replay.len(), 1);
        assert!(now.replay.is_empty());
        p.record(vec![
            out(5, "b"),
            ProcessEvent::Exit {
                pid: 5,
                exit_code: Some(0),
                signal: None,
            },
        ]);
        for rx in [&mut late.rx, &mut now.rx] {
            assert!(matches!(rx.try_recv(), Ok(Event::Output(_, b)) if b == "b"));
            assert!(matches!(rx.try_recv(), Ok(Event::End(e)) if e.exit_code == Some(0)));
            assert!(rx.try_recv().is_err());
        }
        assert_eq!(p.live(), 0);
        assert!(p.pump_should_stop());
        let again = p.subscribe(5, true).unwrap();
        assert_eq!(again.replay.len(), 3, "both outputs and the end");
        assert!(again.ended.is_some());
    }

    #[test]
    fn the_record_is_bounded_and_says_what_it_dropped() {
        let p = Processes::default();
        p.add(info(1));
        let chunk = "x".repeat(OUTPUT_KEPT / 4);
        for _ in 0..6 {
            p.record(vec![out(1, &chunk)]);
        }
        let s = p.subscribe(1, true).unwrap();
        assert_eq!(s.replay.len(), 4);
        assert_eq!(s.dropped, 2 * chunk.len() as u64);
    }

    #[test]
    fn a_closed_session_ends_its_processes_and_takes_no_more() {
        let p = Processes::default();
        p.add(info(1));
        let mut s = p.subscribe(1, false).unwrap();
        p.close("deleted");
        assert!(matches!(s.rx.try_recv(), Ok(Event::End(e)) if e.lost.is_some()));
        assert!(!p.add(info(2)));
        assert!(!p.claim_pump());
        assert_eq!(p.live(), 0);
    }

    #[test]
    fn ended_records_are_bounded() {
        let p = Processes::default();
        for pid in 0..(ENDED_KEPT as u32 + 10) {
            p.add(info(pid));
            p.record(vec![ProcessEvent::Exit {
                pid,
                exit_code: Some(1),
                signal: None,
            }]);
        }
        assert_eq!(p.list().len(), ENDED_KEPT);
        assert!(p.get(0).is_none());
    }
}
