//! Code contexts as kernels: each context of a code-interpreter client (E2B's
//! `create_code_context`) runs its cells in a process of its own, as E2B runs a Jupyter
//! kernel per context: a Python interpreter for a Python context, a shell for a bash one.
//! So cells of different contexts run at the same time, beside each other and beside a cell
//! of the session itself, and each context has its own interpreter: modules (or shell
//! variables and functions), working directory, environment, `__main__`. (A context in the
//! template's kernel runtime, JavaScript, is not one of these: it is a namespace of the
//! session's own kernel, `crate::service::contexts`.)
//!
//! A kernel is one of the session's background processes ([`crate::service::processes`]):
//! `python3 -m bud_kernel` (`guest/python/bud_kernel.py`) with a stdin pipe, started at the
//! context's first cell, hidden from process listings ([`crate::core::processes::Start::internal`]).
//! A cell is one JSON line written to its stdin; its output comes back as the process's
//! output, streamed as it comes (the pump's polls), and its end as a frame on stderr,
//! behind a mark only this kernel knows, carrying the displayed value, figures, exception
//! and the context's execution count. One cell of a context runs at a time ([`Kernel`]'s
//! turn); the next waits for it.
//!
//! **A kernel's start is not its first cell's time.** A new kernel first gets a request
//! without code (it enters the context's directory and sets the session's environment),
//! and the cell is sent once that one's frame says the kernel is ready: a fresh `python3`
//! takes ~14 s under kvm_pvm, longer than a cell's default time limit. The start may take
//! [`START_LIMIT`]. Execution counts are kept here, per kernel, from 1.
//!
//! **Time limits and clients that leave.** Past the cell's time limit, or when the client
//! goes away, the kernel gets SIGINT (the cell's `KeyboardInterrupt`); a kernel that has
//! not answered [`INTERRUPT_GRACE`] later is killed, and the context's next cell starts a
//! new one, empty. A kernel that dies (`os._exit`, the OOM killer, a restart) leaves its
//! cell with a `DeadKernelError`, as Jupyter's clients call it.
//!
//! **Shell kernels.** A bash context's kernel is `bash` (busybox `sh` where the template has
//! no bash) running [`SHELL_LOOP`], which sources each cell in the shell itself, so what a
//! cell changes in the shell (`cd`, variables, functions, aliases) is there for the next, as
//! in E2B's bash kernel. A cell comes over stdin in large reads (a shell's `read` takes a
//! byte a system call, and under kvm_pvm a system call costs ~1 ms). The frame carries the
//! status of the cell's last command; an interrupt ends the cell (`return` from the sourced
//! code) and leaves the shell. busybox `sh` ends at a syntax error in sourced code (bash
//! does not): the cell ends with `DeadKernelError` and the next starts a new shell.
//!
//! Why a process and not a thread of the worker: a cell's output below Python's level
//! (child processes, `os.write`) and a blocking call's interrupt are per process; a thread
//! could keep neither apart. Its cost is a process start and a fresh interpreter at a
//! context's first cell (measured in `docs/measurements.md`, "Code contexts as kernels").

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize;
use tokio::sync::{broadcast, mpsc, oneshot};
use vmm::job::Stream;
use vmm::protocol::outcome;
use vmm::{CellError, JobResult, Language, Status};

pub use crate::core::contexts::Kernel;
use crate::core::processes::{Event, Start};
use crate::core::state::AppState;
use crate::service::error::Error;
use crate::service::processes;
use crate::service::record::finished;
use crate::service::task::Sink;

/// How long a kernel has to answer an interrupt before it is killed.
pub const INTERRUPT_GRACE: Duration = Duration::from_secs(3);

/// What a kernel is started as (`python3` finds `bud_kernel` on the guest's PYTHONPATH).
const SCRIPT: &str = "exec python3 -m bud_kernel";

/// What a shell kernel is started as: bash where the template has it, else `/bin/sh`,
/// running [`SHELL_LOOP`] (passed in its environment, which the loop then empties).
const SHELL_SCRIPT: &str = "command -v bash >/dev/null 2>&1 && exec bash -c \"$BUD_KERNEL_LOOP\" bud-kernel; exec /bin/sh -c \"$BUD_KERNEL_LOOP\" bud-kernel";

/// A shell kernel's loop (bash and busybox `sh` alike). Requests come on fd 3 (its stdin
/// pipe): a header line, `MARK SEQ LEN` (the kernel's mark without its leading control
/// character), the cell's LEN bytes of code, then [`SHELL_TRAILER`]. bash reads the code with
/// `read -N` (a few large reads) and sources it from a here-string (in an `eval`, which
/// busybox `sh` does not parse); busybox `sh`, whose `read` takes a byte a system call,
/// sources the pipe itself (buffered reads) up to the trailer's `return`. Either way the
/// cell runs in the shell itself, with an empty stdin. A line that is not a header is
/// skipped (what an interrupted cell left unread). The environment a cell came with is
/// given back after it: the cell's preamble records each name's value before it
/// (`__bud_h_NAME`, `__bud_e_NAME`, the names in `__bud_env`), and the loop restores them
/// (or unsets those that had none). Between cells SIGINT only runs a trap
/// (which ends a waiting `read`, and the loop reads again; a trap, not an ignore, which the
/// cell's commands would inherit); during a cell it ends the cell. The loop's names start
/// with `__bud_`.
pub const SHELL_LOOP: &str = r#"__bud_mark=$BUD_KERNEL_MARK
unset BUD_KERNEL_MARK BUD_KERNEL_LOOP
__bud_sync=${__bud_mark#?}
__bud_sync=${__bud_sync% }
exec 3<&0 </dev/null
__bud_n=0 __bud_env=
while :; do
  __bud_late=0
  trap __bud_late=1 INT
  if read -r __bud_h <&3; then :; elif [ "$__bud_late" = 1 ]; then continue; else exit 0; fi
  case $__bud_h in "$__bud_sync "*) ;; *) continue ;; esac
  __bud_h=${__bud_h#"$__bud_sync "}
  __bud_seq=${__bud_h%% *} __bud_len=${__bud_h#* }
  __bud_n=$((__bud_n + 1)) __bud_intr=0
  if [ -n "$BASH_VERSION" ]; then
    LC_ALL=C IFS= read -r -d '' -N "$__bud_len" __bud_code <&3
    LC_ALL=C IFS= read -r -d '' -N 8 __bud_t <&3
    trap '__bud_intr=1; return 130' INT
    eval '. /dev/fd/4 4<<<"$__bud_code"'
  else
    trap '__bud_intr=1; return 130' INT
    . /dev/fd/3
  fi
  __bud_s=$?
  trap __bud_late=1 INT
  for __bud_v in $__bud_env; do
    eval "if [ -n \"\$__bud_h_$__bud_v\" ]; then export $__bud_v=\"\$__bud_e_$__bud_v\"; else unset $__bud_v; fi; unset __bud_h_$__bud_v __bud_e_$__bud_v"
  done
  __bud_env=
  __bud_o=1
  if [ "$__bud_intr" = 1 ]; then __bud_o=2 __bud_s=2; fi
  printf '%s{"seq": %s, "outcome": %s, "status": %s, "count": %s, "display": {}}\n' "$__bud_mark" "$__bud_seq" "$__bud_o" "$__bud_s" "$__bud_n" >&2
done
"#;

/// What follows a shell cell's code on the pipe: ends busybox `sh`'s sourcing of it, with
/// the status of the cell's last command (bash reads it and drops it).
const SHELL_TRAILER: &str = "\nreturn\n";

/// A kernel's mark: this, a fresh random token in hex, and a space.
const MARK_PREFIX: &str = "\u{1e}bud-kernel-";

/// A cell for a kernel.
#[derive(Debug, Clone)]
pub struct KernelCell {
    /// Python or shell: what the kernel is (a context's language, which never changes). A
    /// context in the template's kernel runtime has no process of its own: its cells are
    /// the session's (`crate::service::contexts`), never a [`KernelCell`].
    pub language: Language,
    pub code: String,
    pub env: BTreeMap<String, String>,
    /// Where a new kernel starts (the context's `cwd`).
    pub cwd: String,
    pub timeout: Duration,
    /// The context's name, for the process's tag.
    pub name: String,
}

/// A kernel cell's end: the result (output, display data, error) and the context's
/// execution count.
#[derive(Debug)]
pub struct Ran {
    pub result: JobResult,
    pub execution_count: u64,
}

/// Runs `cell` in `kernel` of session `id`, starting the kernel first if it has none,
/// output to `sink` as it comes. The cell runs on a task of its own, which finishes it
/// even if this future is dropped (a client gone: the cell is interrupted), so a kernel
/// never starts a cell before the last one's end.
pub async fn run(
    state: &AppState,
    id: &str,
    kernel: Kernel,
    cell: KernelCell,
    route: &str,
    mut sink: Sink,
) -> Result<Ran, Error> {
    let e = crate::service::access::get(state, id)?;
    let origin = crate::core::audit::Origin::here(route, &e.template, Some(id));
    let job = match cell.language {
        Language::Python => vmm::Job::python(cell.code.clone()),
        Language::Shell => vmm::Job::shell(cell.code.clone()),
        Language::Kernel | Language::Program => return Err(not_a_process()),
    };
    let (out_tx, mut out_rx) = mpsc::unbounded_channel();
    let (end_tx, end_rx) = oneshot::channel();
    let (st, sid) = (state.clone(), id.to_owned());
    let cap = state.config().limits.max_output_bytes;
    tokio::spawn(async move {
        let mut end_tx = end_tx;
        let _turn = kernel.turn().await;
        let out = Out {
            tx: out_tx,
            kept: Arc::default(),
            cap,
        };
        let kept = out.kept.clone();
        let mut ran = in_turn(&st, &sid, &kernel, cell, out, &mut end_tx).await;
        if let Ok(r) = &mut ran {
            // The record's output (the answer's is the caller's own copy, below).
            let [stdout, stderr] =
                std::mem::take(&mut *kept.lock().unwrap_or_else(|e| e.into_inner()));
            (r.result.stdout, r.result.stderr) = (stdout, stderr);
        }
        // Recorded here, so that a cell whose client left is recorded too.
        match &ran {
            Ok(r) => finished(&st, &origin, "cell", &job, Ok(&r.result), Duration::ZERO),
            Err(e) => finished(&st, &origin, "cell", &job, Err(e), Duration::ZERO),
        }
        let _ = end_tx.send(ran);
    });
    // The output goes to the sink as it comes, and into the answer up to the server's
    // output cap a stream (the cell is not stopped there; what is past it is left out).
    let cap = state.config().limits.max_output_bytes;
    let mut kept = [Vec::new(), Vec::new()];
    while let Some((stream, bytes)) = out_rx.recv().await {
        sink(stream, &bytes);
        let buf = &mut kept[stream as usize];
        let room = cap.saturating_sub(buf.len());
        buf.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }
    let mut ran = end_rx
        .await
        .unwrap_or_else(|_| Err(Error::internal("the kernel's task ended without an answer")))?;
    let [stdout, stderr] = kept;
    ran.result.stdout = stdout;
    ran.result.stderr = stderr;
    Ok(ran)
}

/// Where a kernel's output goes as it comes: to the caller, and kept (up to the output
/// cap a stream) for the cell's record.
struct Out {
    tx: mpsc::UnboundedSender<(Stream, Vec<u8>)>,
    kept: Arc<std::sync::Mutex<[Vec<u8>; 2]>>,
    cap: usize,
}

impl Out {
    fn send(
        &self,
        (stream, bytes): (Stream, Vec<u8>),
    ) -> Result<(), mpsc::error::SendError<(Stream, Vec<u8>)>> {
        {
            let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
            let buf = &mut kept[stream as usize];
            let room = self.cap.saturating_sub(buf.len());
            buf.extend_from_slice(&bytes[..bytes.len().min(room)]);
        }
        self.tx.send((stream, bytes))
    }
}

async fn in_turn(
    state: &AppState,
    id: &str,
    kernel: &Kernel,
    cell: KernelCell,
    out: Out,
    end: &mut oneshot::Sender<Result<Ran, Error>>,
) -> Result<Ran, Error> {
    // A kernel the session no longer has (it died, was killed, or was lost with a pause it
    // did not survive) is started anew.
    let running = kernel
        .state()
        .pid
        .filter(|&pid| processes::is_running(state, id, pid));
    let fresh = running.is_none();
    let (pid, rx) = match running {
        Some(pid) => (pid, processes::connect(state, id, pid, false)?.rx),
        None => {
            let pid = start(state, id, kernel, &cell).await?;
            let rx = processes::connect(state, id, pid, false)?.rx;
            // Its start is not the cell's time: a request without code enters the context's
            // directory and sets the session's environment, and its frame says the kernel
            // is ready. (A Python kernel taken from the template has the worker's
            // environment; a shell has the session's from its start.)
            let env = match cell.language {
                Language::Python => crate::service::access::get(state, id)?.env.clone(),
                Language::Shell => BTreeMap::new(),
                Language::Kernel | Language::Program => return Err(not_a_process()),
            };
            let probe = KernelCell {
                code: String::new(),
                env: BTreeMap::new(),
                ..cell.clone()
            };
            let line = request(&kernel.state().mark, &probe, 0, &env, true)?;
            processes::stdin(state, id, pid, line, false).await?;
            match wait(state, id, kernel, pid, rx, START_LIMIT, &out, end).await {
                Ok((_, rx)) => (pid, rx),
                Err(lost) => return Ok(lost),
            }
        }
    };
    let seq = kernel.state().count + 1;
    let line = request(&kernel.state().mark, &cell, seq, &cell.env, false)?;
    match processes::stdin(state, id, pid, line, false).await {
        Ok(()) => {}
        // Gone since it was looked at: its state is lost, as if it died during the cell.
        Err(Error::NoProcess { .. } | Error::StdinClosed(_)) if !fresh => {
            kernel.set(|k| k.pid = None);
            return Ok(lost(
                kernel,
                Status::Error,
                "the context's kernel had ended; its state is lost, and the context's next cell starts a new one",
            ));
        }
        Err(e) => return Err(e),
    }
    match wait(state, id, kernel, pid, rx, cell.timeout, &out, end).await {
        Ok(((frame, stopped), _)) => Ok(finish(kernel, frame, stopped)),
        Err(lost) => Ok(lost),
    }
}

/// How long a new kernel may take to start (a fresh `python3` with its imports took ~14 s
/// under kvm_pvm, about twice that on a slow day).
const START_LIMIT: Duration = Duration::from_secs(300);

/// Waits for the frame of the request just sent to kernel `pid`, its output to `out`: past
/// `limit` (or when the cell's client leaves) the kernel gets SIGINT, and
/// [`INTERRUPT_GRACE`] later SIGKILL. The frame and how the cell was stopped, or the cell's
/// end if the kernel did not answer.
#[allow(clippy::too_many_arguments)]
async fn wait(
    state: &AppState,
    id: &str,
    kernel: &Kernel,
    pid: u32,
    mut rx: broadcast::Receiver<Event>,
    limit: Duration,
    out: &Out,
    end: &mut oneshot::Sender<Result<Ran, Error>>,
) -> Result<((Frame, Option<Status>), broadcast::Receiver<Event>), Ran> {
    let mut frames = Frames::new(kernel.state().mark.into_bytes());
    let mut deadline = Instant::now() + limit;
    let mut stopped: Option<Status> = None;
    let ended = loop {
        let ev = tokio::select! {
            ev = rx.recv() => ev,
            () = tokio::time::sleep_until(deadline.into()) => {
                if stopped.is_some() {
                    // No answer to the interrupt: the kernel goes, with its state.
                    let _ = processes::signal(state, id, pid, libc::SIGKILL).await;
                    kernel.set(|k| k.pid = None);
                    return Err(lost(kernel, Status::Timeout, "the cell ran past its time limit and did not stop at the interrupt; its context's kernel was killed, and the context's next cell starts a new one"));
                }
                stopped = Some(Status::Timeout);
                deadline = Instant::now() + INTERRUPT_GRACE;
                let _ = processes::signal(state, id, pid, libc::SIGINT).await;
                continue;
            }
            () = end.closed(), if stopped.is_none() => {
                stopped = Some(Status::Cancelled);
                deadline = Instant::now() + INTERRUPT_GRACE;
                let _ = processes::signal(state, id, pid, libc::SIGINT).await;
                continue;
            }
        };
        match ev {
            Ok(Event::Output(Stream::Stdout, b)) => {
                let _ = out.send((Stream::Stdout, b.to_vec()));
            }
            Ok(Event::Output(Stream::Stderr, b)) => {
                let (text, frame) = frames.push(&b);
                if !text.is_empty() {
                    let _ = out.send((Stream::Stderr, text));
                }
                if let Some(frame) = frame {
                    // Output of the same poll that came after the frame's bytes.
                    while let Ok(Event::Output(s, b)) = rx.try_recv() {
                        if s == Stream::Stdout {
                            let _ = out.send((s, b.to_vec()));
                        }
                    }
                    break Ok(frame);
                }
            }
            Ok(Event::End(exit)) => break Err(exit),
            Err(broadcast::error::RecvError::Lagged(_)) => {}
            Err(broadcast::error::RecvError::Closed) => {
                break Err(crate::core::processes::Exit {
                    exit_code: None,
                    signal: None,
                    lost: Some("the sandbox ended".into()),
                    ended_at: std::time::SystemTime::now(),
                });
            }
        }
    };
    match ended {
        Ok(frame) => Ok(((frame, stopped), rx)),
        Err(exit) => {
            kernel.set(|k| k.pid = None);
            let how = match (exit.exit_code, exit.signal, &exit.lost) {
                (_, _, Some(why)) => why.clone(),
                (Some(c), _, _) => format!("exited with status {c}"),
                (_, Some(s), _) => format!("was killed by signal {s}"),
                _ => "ended".into(),
            };
            Err(lost(
                kernel,
                stopped.unwrap_or(Status::Error),
                &format!(
                    "the context's kernel {how} during the cell; its state is lost, and the context's next cell starts a new one"
                ),
            ))
        }
    }
}

/// What asks a kernel with this `mark` to run `cell` as its cell `seq`, with `env` set, and
/// in a new kernel the context's directory entered.
fn request(
    mark: &str,
    cell: &KernelCell,
    seq: u64,
    env: &BTreeMap<String, String>,
    fresh: bool,
) -> Result<Vec<u8>, Error> {
    let line = match cell.language {
        Language::Python => serde_json::json!({
            "seq": seq,
            "code": cell.code,
            "env": env,
            "mark": mark,
            "cwd": cell.cwd,
        })
        .to_string(),
        Language::Shell => {
            let mut code = String::new();
            if fresh {
                code += &format!("cd -- {} 2>/dev/null\n", sh_quote(&cell.cwd));
            }
            for (name, value) in env {
                if !is_shell_name(name) {
                    return Err(Error::invalid(
                        "env_vars",
                        format!(
                            "{name:?} is not a shell variable's name (letters, digits and _, not first a digit)"
                        ),
                    ));
                }
                // Kept for the loop to give back after the cell (SHELL_LOOP): an
                // execution's environment holds for that execution only (E2B's rule).
                code += &format!(
                    "__bud_env=\"$__bud_env {name}\" __bud_h_{name}=${{{name}+1}} __bud_e_{name}=${{{name}-}}\nexport {name}={}\n",
                    sh_quote(value)
                );
            }
            code += &cell.code;
            let sync = mark.trim_start_matches('\u{1e}').trim_end();
            return Ok(format!("{sync} {seq} {}\n{code}{SHELL_TRAILER}", code.len()).into_bytes());
        }
        Language::Kernel | Language::Program => return Err(not_a_process()),
    };
    Ok((line + "\n").into_bytes())
}

/// `s` as one word of a POSIX shell, as it is.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn is_shell_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
}

/// Starts a kernel for `kernel` in session `id` (the guest hands over the one it started
/// before READY, if it still has it).
async fn start(
    state: &AppState,
    id: &str,
    kernel: &Kernel,
    cell: &KernelCell,
) -> Result<u32, Error> {
    let hex = crate::core::node::random_hex(16).map_err(Error::internal)?;
    let mark = format!("{MARK_PREFIX}{hex} ");
    let tag = Some(format!("kernel of context {}", cell.name));
    let req = match cell.language {
        Language::Python => Start {
            cmd: "python3".into(),
            args: vec!["-m".into(), "bud_kernel".into()],
            script: SCRIPT.into(),
            cwd: None,
            env: BTreeMap::new(),
            tag,
            stdin: true,
            pty: None,
            user: None,
            internal: true,
        },
        Language::Shell => Start {
            cmd: "bash".into(),
            args: Vec::new(),
            script: SHELL_SCRIPT.into(),
            cwd: None,
            env: BTreeMap::from([
                ("BUD_KERNEL_LOOP".to_owned(), SHELL_LOOP.to_owned()),
                ("BUD_KERNEL_MARK".to_owned(), mark.clone()),
            ]),
            tag,
            stdin: true,
            pty: None,
            user: None,
            internal: true,
        },
        Language::Kernel | Language::Program => return Err(not_a_process()),
    };
    let pid = processes::start(state, id, req, "/contexts").await?;
    kernel.set(|k| {
        k.pid = Some(pid);
        k.mark = mark;
        k.count = 0;
    });
    Ok(pid)
}

/// A [`KernelCell`] in [`Language::Kernel`]: a context in the template's kernel runtime is
/// a namespace of the session's kernel, run as a session cell
/// (`crate::service::contexts::run`), never a process here; this is the kernels' own guard.
fn not_a_process() -> Error {
    Error::internal(
        "a context in the template's kernel runtime runs in the session's kernel, not in a kernel process",
    )
}

/// The end of a cell a kernel did not finish.
fn lost(kernel: &Kernel, status: Status, why: &str) -> Ran {
    let mut result = JobResult::of_cell(status, None, None, b"{}");
    result.error = Some(CellError {
        name: "DeadKernelError".into(),
        value: why.to_owned(),
        traceback: String::new(),
    });
    result.crash = Some(why.to_owned());
    let execution_count = kernel.state().count;
    Ran {
        result,
        execution_count,
    }
}

/// A kernel's end-of-cell frame.
#[derive(Debug, Deserialize)]
struct Frame {
    outcome: u32,
    status: i32,
    #[serde(default)]
    display: serde_json::Value,
}

fn finish(kernel: &Kernel, frame: Frame, stopped: Option<Status>) -> Ran {
    let (status, exit_code, signal) = match (frame.outcome, frame.status) {
        (outcome::EXITED, 0) => (Status::Ok, Some(0), None),
        (outcome::EXITED, code) => (Status::Error, Some(code), None),
        (outcome::OUT_OF_MEMORY, _) => (Status::MemoryLimit, Some(1), None),
        (_, sig) => (stopped.unwrap_or(Status::Error), None, Some(sig)),
    };
    let display = serde_json::to_vec(&frame.display).unwrap_or_default();
    // Counted here, not by the kernel (whose count includes its start's empty request).
    let mut count = 0;
    kernel.set(|k| {
        k.count += 1;
        count = k.count;
    });
    Ran {
        result: JobResult::of_cell(status, exit_code, signal, &display),
        execution_count: count,
    }
}

/// Cuts a kernel's end-of-cell frame out of its stderr: what comes before the mark is the
/// cell's stderr; the frame is the line after it.
#[derive(Debug)]
struct Frames {
    mark: Vec<u8>,
    held: Vec<u8>,
    in_frame: bool,
}

impl Frames {
    fn new(mark: Vec<u8>) -> Self {
        Self {
            mark,
            held: Vec::new(),
            in_frame: false,
        }
    }

    /// Takes `bytes` of stderr: the cell's stderr that is surely not the mark, and the
    /// frame once it is whole (a frame that does not parse ends the cell as a broken one).
    fn push(&mut self, bytes: &[u8]) -> (Vec<u8>, Option<Frame>) {
        self.held.extend_from_slice(bytes);
        let mut text = Vec::new();
        if !self.in_frame {
            match find(&self.held, &self.mark) {
                Some(at) => {
                    text.extend_from_slice(&self.held[..at]);
                    self.held.drain(..at + self.mark.len());
                    self.in_frame = true;
                }
                None => {
                    // Keep what could be the start of the mark.
                    let keep = (1..self.mark.len().min(self.held.len() + 1))
                        .rev()
                        .find(|&n| self.held.ends_with(&self.mark[..n]))
                        .unwrap_or(0);
                    let cut = self.held.len() - keep;
                    text.extend(self.held.drain(..cut));
                    return (text, None);
                }
            }
        }
        let Some(nl) = self.held.iter().position(|&b| b == b'\n') else {
            return (text, None);
        };
        let frame = serde_json::from_slice(&self.held[..nl]).unwrap_or(Frame {
            outcome: outcome::EXITED,
            status: 70,
            display: serde_json::Value::Null,
        });
        (text, Some(frame))
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_frame_is_cut_out_of_stderr_whatever_the_chunks() {
        let mark = b"\x1ebud-kernel-ab ".to_vec();
        let whole = b"err 1\nhalf\x1ebud-kernel-ab {\"seq\": 1, \"outcome\": 1, \"status\": 3, \"count\": 4, \"display\": {}}\n";
        for size in [1, 2, 5, 17, whole.len()] {
            let mut f = Frames::new(mark.clone());
            let mut text = Vec::new();
            let mut got = None;
            for chunk in whole.chunks(size) {
                let (t, frame) = f.push(chunk);
                text.extend(t);
                if let Some(frame) = frame {
                    got = Some(frame);
                    break;
                }
            }
            let frame = got.expect("a frame");
            assert_eq!(text, b"err 1\nhalf", "chunks of {size}");
            assert_eq!((frame.outcome, frame.status), (1, 3));
        }
        // A near-mark is passed through once it cannot be the mark.
        let mut f = Frames::new(mark);
        let (t, frame) = f.push(b"\x1ebud-kern");
        assert!(t.is_empty() && frame.is_none());
        let (t, frame) = f.push(b"el! done");
        assert_eq!(t, b"\x1ebud-kernel! done");
        assert!(frame.is_none());
    }
}
