//! User templates built while the server runs (`POST /v1/templates`): each build's record
//! (its state and its log, which `GET /v1/templates/{name}/build` streams), and the builder
//! that runs builds **outside the server's process**.
//!
//! Why another process: a build fetches packages (apt, pip), runs the host's tools
//! (`dpkg-deb`, the guest's Python compiling modules) and boots the new guest; the jailed
//! server may do none of that (no `execve`, no new processes: `crate::core::jail`). So
//! `bud serve` starts a helper process before its jail closes, `bud template builder`, and
//! sends it one JSON line per build on its stdin; the helper builds each in a child process
//! of its own (killed at the build time limit) and answers with JSON lines on its stdout:
//! the build's log lines, then its end ([`Report`]). The server reads them on a thread of
//! its own ([`HelperBuilder`]). The server itself only loads the finished template.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// The most log lines a build keeps (the first ones and the last ones are what matter; a
/// build that says more keeps its last lines and counts the dropped).
const MAX_LINES: usize = 5_000;
/// The longest log line kept, in bytes.
const MAX_LINE: usize = 2_000;

/// What `bud serve` allows of user-template builds (docs/templates.md).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct BuildConfig {
    /// User-template builds that may run at once (`POST /v1/templates`); 0 turns builds
    /// over HTTP off.
    #[arg(long, default_value_t = BuildConfig::default().template_builds)]
    pub template_builds: usize,
    /// Longest a user-template build may take, in seconds (then it is stopped and fails).
    #[arg(long, default_value_t = BuildConfig::default().template_build_timeout_s)]
    pub template_build_timeout_s: u64,
    /// Most Debian packages and Python requirements a user template may name.
    #[arg(long, default_value_t = BuildConfig::default().template_max_packages)]
    pub template_max_packages: usize,
    /// Largest image a user template may have, in MiB (the guest unpacks it at its first
    /// boot and every VM's memory holds it).
    #[arg(long, default_value_t = BuildConfig::default().template_max_image_mib)]
    pub template_max_image_mib: u64,
}

impl Default for BuildConfig {
    fn default() -> Self {
        Self {
            template_builds: 2,
            template_build_timeout_s: 1800,
            template_max_packages: 64,
            template_max_image_mib: 1024,
        }
    }
}

/// The file in the state directory naming the user templates this server built and
/// serves, one a line, `NAME` or `NAME OWNER` (the name of the API key that built it, for a
/// server with keys): served again after a restart (`bud serve` adds them to its
/// templates), each still its owner's (docs/templates.md).
pub const RECORD_FILE: &str = "user-templates";

/// One user template of the record ([`RECORD_FILE`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub name: String,
    /// The API key's name that built it; None: built without keys, nobody's.
    pub owner: Option<String>,
}

/// The user templates recorded in `state_dir` with their owners (none if it has no
/// record). A line that is not a template name, with an optional key name after it, is
/// skipped.
pub fn recorded_owned(state_dir: &std::path::Path) -> Vec<Recorded> {
    std::fs::read_to_string(state_dir.join(RECORD_FILE))
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let mut parts = line.split_whitespace();
            let (name, owner) = (parts.next()?, parts.next());
            (bud_guest::definition::valid_name(name) && parts.next().is_none()).then(|| Recorded {
                name: name.to_owned(),
                owner: owner.map(str::to_owned),
            })
        })
        .collect()
}

/// The names of the user templates recorded in `state_dir`.
pub fn recorded(state_dir: &std::path::Path) -> Vec<String> {
    recorded_owned(state_dir)
        .into_iter()
        .map(|r| r.name)
        .collect()
}

/// The user templates of the record in `state_dir` a server started with `keys` serves
/// again, in order, and those it does not: built under an API key that `keys` no longer
/// has (no key could see, use or delete them). Those stay in the record, and come back
/// with their key; the stored definition and build stay cached, so a key that POSTs the
/// same definition gets it at once. Without keys every recorded template is served.
pub fn to_serve_again(
    state_dir: &std::path::Path,
    keys: Option<&crate::core::keys::ApiKeys>,
) -> (Vec<String>, Vec<Recorded>) {
    let (kept, left): (Vec<Recorded>, Vec<Recorded>) = recorded_owned(state_dir)
        .into_iter()
        .partition(|r| match (keys, &r.owner) {
            (Some(keys), Some(owner)) => keys.has(owner),
            _ => true,
        });
    (kept.into_iter().map(|r| r.name).collect(), left)
}

/// Adds `name` to the record in `state_dir`, as `owner`'s (`Some`: an API key's name),
/// replacing a line of that name; written atomically.
pub fn record(state_dir: &std::path::Path, name: &str, owner: Option<&str>) -> std::io::Result<()> {
    rewrite(state_dir, name, |all| {
        all.push(Recorded {
            name: name.to_owned(),
            owner: owner.map(str::to_owned),
        })
    })
}

/// Takes `name` out of the record in `state_dir`; written atomically.
pub fn forget(state_dir: &std::path::Path, name: &str) -> std::io::Result<()> {
    rewrite(state_dir, name, |_| {})
}

fn rewrite(
    state_dir: &std::path::Path,
    name: &str,
    then: impl FnOnce(&mut Vec<Recorded>),
) -> std::io::Result<()> {
    let mut all = recorded_owned(state_dir);
    all.retain(|r| r.name != name);
    then(&mut all);
    let path = state_dir.join(RECORD_FILE);
    let tmp = state_dir.join(format!("{RECORD_FILE}.tmp"));
    let text: String = all
        .iter()
        .map(|r| match &r.owner {
            Some(owner) => format!("{} {owner}\n", r.name),
            None => format!("{}\n", r.name),
        })
        .collect();
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, &path)
}

/// One request to the helper: build `definition` (a user template's JSON) under `id`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Request {
    pub id: u64,
    pub definition: serde_json::Value,
}

/// One line of the helper's answer about build `id`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Report {
    pub id: u64,
    #[serde(flatten)]
    pub what: ReportKind,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ReportKind {
    /// A line of the build's log.
    Line(String),
    /// The build is over: `Ok` (the template is built and stored) or why not.
    Done(Result<(), String>),
}

/// Where a build stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BuildState {
    Building,
    /// Built, and served by this server.
    Ready,
    Failed(String),
}

/// One line of a build's log.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LogLine {
    /// Seconds since the build started.
    pub t_s: f64,
    pub line: String,
}

#[derive(Debug)]
struct Inner {
    state: BuildState,
    lines: Vec<LogLine>,
    /// Lines dropped past [`MAX_LINES`] (the oldest after the first half).
    dropped: usize,
    finished_s: Option<f64>,
}

/// One build: its record, and a watch that ticks on every change.
#[derive(Debug)]
pub struct Build {
    pub name: String,
    /// The API key's name that asked for it (None without keys).
    pub owner: Option<String>,
    started: Instant,
    inner: Mutex<Inner>,
    changed: watch::Sender<u64>,
}

impl Build {
    fn new(name: &str, owner: Option<&str>) -> Arc<Self> {
        Arc::new(Self {
            name: name.to_owned(),
            owner: owner.map(str::to_owned),
            started: Instant::now(),
            inner: Mutex::new(Inner {
                state: BuildState::Building,
                lines: Vec::new(),
                dropped: 0,
                finished_s: None,
            }),
            changed: watch::channel(0).0,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn tick(&self) {
        self.changed.send_modify(|n| *n += 1);
    }

    /// Adds a line to the log.
    pub fn line(&self, text: &str) {
        let mut text = text.trim_end().to_owned();
        if text.len() > MAX_LINE {
            let mut end = MAX_LINE;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
            text.push('…');
        }
        let t_s = self.started.elapsed().as_secs_f64();
        {
            let mut inner = self.lock();
            if inner.lines.len() >= MAX_LINES {
                inner.lines.remove(MAX_LINES / 2);
                inner.dropped += 1;
            }
            inner.lines.push(LogLine { t_s, line: text });
        }
        self.tick();
    }

    /// Ends the build in `state` (`Ready` or `Failed`).
    pub fn finish(&self, state: BuildState) {
        {
            let mut inner = self.lock();
            inner.finished_s = Some(self.started.elapsed().as_secs_f64());
            inner.state = state;
        }
        self.tick();
    }

    pub fn state(&self) -> BuildState {
        self.lock().state.clone()
    }

    /// The log from line `from` on, and the state once the build is over.
    pub fn since(&self, from: usize) -> (Vec<LogLine>, Option<BuildState>, usize) {
        let inner = self.lock();
        let lines = inner.lines.get(from..).unwrap_or_default().to_vec();
        let over = (inner.state != BuildState::Building).then(|| inner.state.clone());
        (lines, over, inner.lines.len())
    }

    /// Seconds the build took, once it is over.
    pub fn seconds(&self) -> Option<f64> {
        self.lock().finished_s
    }

    /// Waits for the next change.
    pub fn watch(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}

/// Runs builds outside the server's process.
pub trait Builder: Send + Sync + std::fmt::Debug {
    /// The names of the built-in templates (a user template may not take one).
    fn built_in(&self) -> Vec<String>;

    /// Starts building `definition` (checked already); `done` is called once, on another
    /// thread, with the end; `line` for each log line before it.
    fn start(
        &self,
        definition: serde_json::Value,
        line: Box<dyn Fn(&str) + Send + Sync>,
        done: Box<dyn FnOnce(Result<(), String>) + Send>,
    );
}

/// The server's builds, by template name (the latest of each name).
#[derive(Debug, Default)]
pub struct Builds {
    all: Mutex<HashMap<String, Arc<Build>>>,
}

impl Builds {
    /// Starts the record of a build of `name` for `owner` (an API key's name, if the
    /// server has keys); `None` while one of that name is building.
    pub fn begin(&self, name: &str, owner: Option<&str>) -> Option<Arc<Build>> {
        let mut all = self.all.lock().unwrap_or_else(|p| p.into_inner());
        if all
            .get(name)
            .is_some_and(|b| b.state() == BuildState::Building)
        {
            return None;
        }
        let build = Build::new(name, owner);
        all.insert(name.to_owned(), build.clone());
        Some(build)
    }

    /// The latest build of `name`.
    pub fn get(&self, name: &str) -> Option<Arc<Build>> {
        self.all
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
    }

    /// How many are building.
    pub fn building(&self) -> usize {
        self.all
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|b| b.state() == BuildState::Building)
            .count()
    }
}

type Pending = HashMap<
    u64,
    (
        Box<dyn Fn(&str) + Send + Sync>,
        Box<dyn FnOnce(Result<(), String>) + Send>,
    ),
>;

/// The [`Builder`] of `bud serve`: the helper process (module docs), started by the caller
/// before the jail closes and handed over with its pipes.
pub struct HelperBuilder {
    built_in: Vec<String>,
    stdin: Mutex<Option<ChildStdin>>,
    pending: Arc<Mutex<Pending>>,
    next: Mutex<u64>,
    /// Held, never waited for (see `Drop`).
    _child: Child,
}

impl std::fmt::Debug for HelperBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HelperBuilder").finish_non_exhaustive()
    }
}

impl HelperBuilder {
    /// Takes over `child` (spawned with piped stdin and stdout) and reads its reports on a
    /// thread of its own. If the helper ends, every build in flight fails saying so.
    /// `built_in` names the built-in templates.
    pub fn new(mut child: Child, built_in: Vec<String>) -> std::io::Result<Self> {
        let stdout: ChildStdout = child
            .stdout
            .take()
            .ok_or_else(|| std::io::Error::other("the builder's stdout is not piped"))?;
        let stdin = child
            .stdin
            .take()
            .ok_or_else(|| std::io::Error::other("the builder's stdin is not piped"))?;
        let pending: Arc<Mutex<Pending>> = Arc::default();
        let reader_pending = pending.clone();
        std::thread::Builder::new()
            .name("bud-builds".into())
            .spawn(move || read_reports(stdout, &reader_pending))?;
        Ok(Self {
            built_in,
            stdin: Mutex::new(Some(stdin)),
            pending,
            next: Mutex::new(0),
            _child: child,
        })
    }
}

fn read_reports(stdout: ChildStdout, pending: &Mutex<Pending>) {
    for line in BufReader::new(stdout).lines() {
        let Ok(line) = line else { break };
        let Ok(report) = serde_json::from_str::<Report>(&line) else {
            continue;
        };
        let mut pending = pending.lock().unwrap_or_else(|p| p.into_inner());
        match report.what {
            ReportKind::Line(text) => {
                if let Some((line, _)) = pending.get(&report.id) {
                    line(&text);
                }
            }
            ReportKind::Done(result) => {
                if let Some((_, done)) = pending.remove(&report.id) {
                    done(result);
                }
            }
        }
    }
    let mut pending = pending.lock().unwrap_or_else(|p| p.into_inner());
    for (_, (_, done)) in pending.drain() {
        done(Err("the template builder process ended".into()));
    }
}

impl Builder for HelperBuilder {
    fn built_in(&self) -> Vec<String> {
        self.built_in.clone()
    }

    fn start(
        &self,
        definition: serde_json::Value,
        line: Box<dyn Fn(&str) + Send + Sync>,
        done: Box<dyn FnOnce(Result<(), String>) + Send>,
    ) {
        let id = {
            let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
            *next += 1;
            *next
        };
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, (line, done));
        let request = serde_json::to_string(&Request { id, definition }).unwrap_or_default();
        let mut stdin = self.stdin.lock().unwrap_or_else(|p| p.into_inner());
        let sent = stdin
            .as_mut()
            .is_some_and(|s| writeln!(s, "{request}").and_then(|_| s.flush()).is_ok());
        if !sent {
            *stdin = None;
            let entry = self
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
            if let Some((_, done)) = entry {
                done(Err("the template builder process is not running".into()));
            }
        }
    }
}

impl Drop for HelperBuilder {
    fn drop(&mut self) {
        // Closing its stdin tells the helper to stop; builds in flight end with it. Nothing
        // more: the jailed server may not signal or reap a process (`kill` and `wait4` are
        // outside its filters, and a call outside them kills the server with SIGSYS), and
        // this runs as the server stops, so the helper is reaped with it.
        self.stdin.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_of_served_user_templates_adds_and_removes_names() {
        let dir = std::env::temp_dir().join(format!("bud-builds-record-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();

        assert!(recorded(&dir).is_empty());
        record(&dir, "a", None).unwrap();
        record(&dir, "b", None).unwrap();
        record(&dir, "a", None).unwrap();
        assert_eq!(recorded(&dir), ["b", "a"]);
        forget(&dir, "b").unwrap();
        assert_eq!(recorded(&dir), ["a"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn templates_of_a_key_the_keys_file_no_longer_has_are_not_served_again() {
        let dir = std::env::temp_dir().join(format!("bud-builds-gone-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        record(&dir, "plain", None).unwrap();
        record(&dir, "alices", Some("alice")).unwrap();
        record(&dir, "bobs", Some("bob")).unwrap();
        let only_bob =
            crate::core::keys::ApiKeys::parse("bob 0123456789abcdef0123456789abcdef").unwrap();

        let (served, left) = to_serve_again(&dir, Some(&only_bob));
        let (all, none_left) = to_serve_again(&dir, None);

        assert_eq!(served, ["plain", "bobs"]);
        assert_eq!(
            left,
            [Recorded {
                name: "alices".into(),
                owner: Some("alice".into())
            }]
        );
        assert_eq!(all, ["plain", "alices", "bobs"]);
        assert!(none_left.is_empty());
        assert_eq!(
            recorded(&dir).len(),
            3,
            "the record keeps them for their key"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_record_keeps_each_templates_owner_and_reads_a_record_without_owners() {
        let dir = std::env::temp_dir().join(format!("bud-builds-owners-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A record an older server wrote: names only, nobody's.
        std::fs::write(dir.join(RECORD_FILE), "old\n\nBad Name\n").unwrap();

        record(&dir, "report", Some("alice")).unwrap();
        record(&dir, "plain", None).unwrap();
        record(&dir, "old", Some("bob")).unwrap();

        let text = std::fs::read_to_string(dir.join(RECORD_FILE)).unwrap();
        assert_eq!(text, "report alice\nplain\nold bob\n");
        let owned = |name: &str, owner: Option<&str>| Recorded {
            name: name.into(),
            owner: owner.map(Into::into),
        };
        assert_eq!(
            recorded_owned(&dir),
            [
                owned("report", Some("alice")),
                owned("plain", None),
                owned("old", Some("bob"))
            ]
        );
        forget(&dir, "report").unwrap();
        assert_eq!(recorded(&dir), ["plain", "old"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reports_are_one_json_line_each() {
        let line = Report {
            id: 3,
            what: ReportKind::Line("pip download tabulate".into()),
        };
        let done = Report {
            id: 3,
            what: ReportKind::Done(Err("no wheel".into())),
        };

        let texts = [line.clone(), done.clone()].map(|r| serde_json::to_string(&r).unwrap());

        assert_eq!(texts[0], r#"{"id":3,"line":"pip download tabulate"}"#);
        assert_eq!(texts[1], r#"{"id":3,"done":{"Err":"no wheel"}}"#);
        assert_eq!(serde_json::from_str::<Report>(&texts[1]).unwrap(), done);
    }

    #[test]
    fn a_build_keeps_its_log_and_one_of_a_name_builds_at_once() {
        let builds = Builds::default();
        let build = builds.begin("a", Some("alice")).unwrap();

        assert_eq!(build.owner.as_deref(), Some("alice"));
        assert!(builds.begin("a", None).is_none());
        build.line("one");
        build.line(&"x".repeat(3 * MAX_LINE));
        let (lines, over, next) = build.since(0);
        assert_eq!((lines.len(), over, next), (2, None, 2));
        assert!(lines[1].line.len() <= MAX_LINE + 3);
        build.finish(BuildState::Failed("why".into()));
        assert_eq!(
            build.since(2),
            (vec![], Some(BuildState::Failed("why".into())), 2)
        );
        assert_eq!(builds.building(), 0);
        assert!(builds.begin("a", None).is_some());
    }

    #[test]
    fn a_long_log_keeps_its_start_and_its_end() {
        let build = Build::new("a", None);
        for i in 0..MAX_LINES + 10 {
            build.line(&i.to_string());
        }

        let (lines, _, _) = build.since(0);

        assert_eq!(lines.len(), MAX_LINES);
        assert_eq!(lines[0].line, "0");
        assert_eq!(lines[MAX_LINES - 1].line, (MAX_LINES + 9).to_string());
    }
}
