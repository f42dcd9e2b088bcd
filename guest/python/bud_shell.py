"""Shell jobs: ``sh -c CODE sh ARG...`` with busybox ash, without a process spawn per job.

Why a parked shell
------------------
Process creation and teardown are the dearest things a guest does under kvm_pvm (every
page-table operation is emulated): ``posix_spawn`` of /bin/sh costs ~0.1-0.2 s, fork+exec
~0.5 s, and even the *exit* of a small shell ~0.1-0.2 s (measured in the guest: tearing down
its address space). So the worker starts one shell *before READY* and leaves it blocked
reading its script:

    /bin/sh -c '. /proc/self/fd/3' sh        fd 3 = read end of the script pipe
                                             fd 4 = warm-up report, fd 87 = job status
                                             fds 0/1/2 = the worker's capture files

It first reads and runs :data:`WARM_SCRIPT` from the pipe (builtins, expansions, loops,
redirections, a here-document: the code pages a typical job needs get mapped now, not in
every clone), reports on fd 4, cleans up after itself and blocks in ``read`` on the pipe.
The snapshot holds it there. A shell job in a clone then costs the worker one ``write`` of
the job script (:func:`job_script`) into the pipe and a ``poll`` + ``read`` of the status:

    set -- 'arg1' 'arg2'             positional parameters, single-quoted
    export NAME='value'              the job's environment (non-identifier names dropped,
                                     as a real sh -c drops them too)
    RANDOM=<from the job's seed>     ash seeds $RANDOM at start-up: same in every clone
    trap '<report $? on fd 87, then kill -STOP $$>' EXIT
    eval '<the code>'
    exit

``eval`` runs the code the way ``-c`` does (one string, ``$0`` = ``sh``, ``exit`` exits the
shell, the status is the shell's). The EXIT trap writes the exit status on fd 87 and then
*stops* the shell instead of letting it exit: the worker has the status and rings DONE at
once, and the clone is thrown away with the shell still in it, so no clone ever pays for
the exit. If the shell dies another way (a signal, ``exec``, a job that replaced the EXIT
trap), the worker sees its pidfd and takes the status from ``waitpid``.

Known differences from a real ``sh -c``:
- error messages say ``sh: eval: line N:`` where ``-c`` says ``sh: line N-1:``;
- busybox's ``-c`` execs its *last* simple command in place of the shell; ``eval`` forks
  it, so a last command killed by a signal is reported as exit status 128+n, not as
  SIGNALED (the shell itself killed by a signal, ``kill -9 $$``, is still SIGNALED);
- ``trap`` lists bud's EXIT trap, and fd 87 is open (a job that closes it or points it
  elsewhere gets its status from the shell's exit, at the usual cost).

The job's stdin is the worker's stdin file (fd 0, written on demand, see ``bud_io``); its
stdout and stderr are the capture files, which the worker copies into the mailbox areas
at the end and, while it waits, every ``STREAM_INTERVAL`` with FLUSH
(:data:`STREAM_SHELL_OUTPUT`).

The parked shell is a child of the worker, so a Python job's "wait for any child" calls
(``os.wait()``, ``os.waitpid(-1, ...)``...) would see it: ``bud_io`` wraps those, and the
first such call retires the shell (kill and reap, ~0.1-0.2 s) so that they behave exactly
as in ``python3``. A Python job that merely starts processes (``subprocess``) leaves the
shell alone.

Fallback: if the parked shell is gone (dead, or never started because the warm-up failed),
the job runs in a freshly spawned ``sh -c CODE sh ARG...`` with the environment passed to
``posix_spawn``: correct, and a spawn slower.

What this module must never do: let the parked shell inherit the write end of its script
pipe, or report DONE while the job's shell could still write output (the status comes from
the EXIT trap, after everything the script itself wrote).
"""

import fcntl
import os
import posix
import re
import select
import signal
import time

import _bud
import bud_io

SHELL = "/bin/sh"
# argv of the parked shell: $0 is "sh", as for `sh -c CODE sh ARG...`.
PARKED_ARGV = ("sh", "-c", ". /proc/self/fd/3", "sh")
SCRIPT_FD = 3
WARM_FD = 4
# Where the shell reports a job's exit status: a number no job is likely to take.
STATUS_FD = 87
READY_TOKEN = b"bud-shell-ready\n"
# The EXIT trap of a job script: report $? on STATUS_FD, then stop (never exit, see above).
# Only if fd 87 is still a pipe (a job may have closed it or pointed it elsewhere: then the
# shell just exits, and the worker takes the status from waitpid). `exec >&87` moves fd 1
# for good (no save and restore: fewest syscalls, and nothing runs after it); `command`
# keeps a failed redirection from being fatal.
EXIT_TRAP = (
    b"bud_status=$?; [ -p /proc/self/fd/87 ] && command exec >&87 && "
    b'printf "%d\\n" "$bud_status" && kill -STOP $$; exit "$bud_status"'
)

# Whether the worker wakes every STREAM_INTERVAL while a shell job runs, to stream its
# output. It was off while processes of the guest died of SIGSEGV whenever the worker ran
# (made system calls) beside busybox sh and its children: the cause was the AVX register
# state, which the guest kernel does not save under kvm_pvm (no XSAVE) while glibc used it
# (see `kernel_saves_avx` in guest/agent/src/worker.rs); the agent now starts the worker
# with glibc kept off those registers, so every process's vector state is saved again.
STREAM_SHELL_OUTPUT = True

# Signals Python ignores (SIGPIPE, SIGXFSZ) must be default again in a shell, as
# subprocess's restore_signals does.
RESTORED_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)

# Run once by the parked shell before READY (including what the EXIT trap of a job does:
# trap, command exec, printf to an fd, kill); everything it defines is removed again, so
# the shell a job gets is the state `sh -c` starts in (its working directory too: the
# worker's, a user template's `workdir`). Output goes to /dev/null.
WARM_SCRIPT = b"""exec 3<&-
bud_warm_fn() { local a="$1"; shift; echo "$a" "$#" "$@"; return 0; }
{
  bud_x=1; bud_y="a b c"; set -- one two three; shift
  echo "$bud_x $bud_y $# $@ $*"; printf '%s %d %x %5.2f\\n' str 42 255 3.14159
  [ "$bud_x" = 1 ] && test -n "$bud_y" || :
  case "$bud_y" in a*) bud_z=${bud_y#a} ;; *) bud_z= ;; esac
  bud_i=0; while [ $bud_i -lt 3 ]; do bud_i=$((bud_i + 1)); done
  for bud_w in $bud_y; do bud_warm_fn "$bud_w" 1 2; done
  if false; then :; elif true; then :; else :; fi
  read -r bud_line <<EOF
hello world
EOF
  echo "${#bud_line} ${bud_line%world} ${bud_line:-none} ${bud_unset:=def} ${bud_y##* }"
  export BUD_WARM=1; unset BUD_WARM; :
  bud_d=$PWD; cd /tmp && pwd; cd "$bud_d"; command -v echo; eval 'echo "$bud_x"'; echo err >&2
  trap 'echo trap' USR1; trap - USR1; kill -0 $$
  command exec 5>/dev/null && printf '%d\n' 0 >&5; exec 5>&-
} >/dev/null 2>&1
unset -f bud_warm_fn
unset -v bud_x bud_y bud_z bud_i bud_w bud_line bud_unset bud_d
set --
printf 'bud-shell-ready\\n' >&4
exec 4>&-
"""

_NAME = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*\Z")


def quote(word):
    """``word`` (bytes) as one single-quoted shell word."""
    return b"'" + word.replace(b"'", b"'\\''") + b"'"


def job_script(code, args, env, random_seed):
    """The script the parked shell runs for a job (see the module docs). All bytes.

    Environment names that are not shell identifiers are left out: ``export`` cannot set
    them, and a real ``sh -c`` drops them from its environment too (neither the shell nor
    its children see them)."""
    lines = [b" ".join([b"set --", *map(quote, args)])]
    lines.extend(
        b"export " + name + b"=" + quote(value) for name, value in env if _NAME.match(name)
    )
    if not any(name == b"RANDOM" for name, _ in env):
        lines.append(b"RANDOM=%d" % random_seed)
    lines.append(b"trap " + quote(EXIT_TRAP) + b" EXIT")
    lines.append(b"eval " + quote(code))
    lines.append(b"exit")
    return b"\n".join(lines) + b"\n"


def _high_fd(fd):
    """``fd`` moved to 10 or above (close-on-exec), so spawn file actions cannot clash."""
    if fd >= 10:
        return fd
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


def _state(pid):
    """The one-letter state of process ``pid`` (R, S, Z...) from /proc."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return stat.read().rsplit(b")", 1)[1].split()[0]


def outcome_of(status):
    """(outcome, exit code or signal number) of a ``waitpid`` status."""
    if os.WIFSIGNALED(status):
        return _bud.OUTCOME_SIGNALED, os.WTERMSIG(status)
    return _bud.OUTCOME_EXITED, os.WEXITSTATUS(status)


class Waiter:
    """Waits for a shell: ``poll`` on its pidfd (and on its status pipe, for the parked
    shell). With STREAM_SHELL_OUTPUT, wakes every STREAM_INTERVAL to copy fd-level output
    into the areas and ring FLUSH; without, sleeps until the shell reports or exits."""

    def __init__(self, pid, status_fd=None):
        self.pid = pid
        self.reaped = False
        self.pidfd = os.pidfd_open(pid)
        self.status_fd = status_fd
        self.poller = select.poll()
        self.poller.register(self.pidfd, select.POLLIN)
        if status_fd is not None:
            self.poller.register(status_fd, select.POLLIN)

    def wait(self, areas):
        """(outcome, exit code or signal number) of the shell's job."""
        timeout_ms = int(bud_io.STREAM_INTERVAL * 1000) if STREAM_SHELL_OUTPUT else None
        polls = 0
        while True:
            polls += 1
            ready = [fd for fd, _ in self.poller.poll(timeout_ms)]
            if self.status_fd in ready:
                status = self._read_status()
                if status is not None:
                    bud_io.MARKS["shell_polls"] = polls
                    return _bud.OUTCOME_EXITED, status
            if self.pidfd in ready:
                _, status = posix.waitpid(self.pid, 0)
                self.reaped = True
                bud_io.MARKS["shell_polls"] = polls
                return outcome_of(status)
            if not ready:
                areas.stream_now()

    def _read_status(self):
        """The exit status the EXIT trap wrote, or None (then only the pidfd is watched: a
        child of the job still holds fd 87 and wrote something else, or it is closed)."""
        report = posix.read(self.status_fd, 64)
        try:
            return int(report.split()[-1]) & 0xFF
        except (IndexError, ValueError):
            self.poller.unregister(self.status_fd)
            self.status_fd = None
            return None


class ParkedShell:
    """A busybox sh blocked reading its job script (see the module docs)."""

    def __init__(self, path=SHELL):
        self.path = path
        self.waiter = None
        self._script_fd = None

    @property
    def parked(self):
        return self._script_fd is not None

    def start(self, timeout=10.0):
        """Spawns the shell, runs WARM_SCRIPT in it and waits until it is blocked again
        reading the pipe. Before READY only (costs a spawn and a few round trips)."""
        script_r, script_w = (_high_fd(fd) for fd in os.pipe())
        warm_r, warm_w = (_high_fd(fd) for fd in os.pipe())
        status_r, status_w = (_high_fd(fd) for fd in os.pipe())
        try:
            pid = os.posix_spawn(
                self.path,
                list(PARKED_ARGV),
                os.environ,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, script_r, SCRIPT_FD),
                    (os.POSIX_SPAWN_DUP2, warm_w, WARM_FD),
                    (os.POSIX_SPAWN_DUP2, status_w, STATUS_FD),
                ],
                setsigdef=RESTORED_SIGNALS,
            )
        finally:
            for fd in (script_r, warm_w, status_w):
                os.close(fd)
        self.waiter = Waiter(pid, status_r)
        self._script_fd = script_w
        deadline = time.monotonic() + timeout
        try:
            _write_all(script_w, WARM_SCRIPT)
            token = b""
            while not token.endswith(b"\n") and time.monotonic() < deadline:
                if select.select([warm_r], [], [], deadline - time.monotonic())[0]:
                    chunk = os.read(warm_r, 64)
                    if not chunk:
                        break
                    token += chunk
        finally:
            os.close(warm_r)
        if token != READY_TOKEN:
            self.retire()
            raise OSError(f"parked shell did not get ready (said {token!r})")
        # The token is written just before `exec 4>&-` and the next read: wait until the
        # shell sleeps in that read, so that no clone inherits a shell still running.
        while _state(pid) != b"S" and time.monotonic() < deadline:
            time.sleep(0.001)

    def run(self, script, areas):
        """Feeds ``script`` to the parked shell and waits for its status; returns (outcome,
        code), or None if the shell turned out to be gone (the caller falls back). The
        script pipe stays open: the script ends in ``exit``, and the shell never needs EOF."""
        fd, self._script_fd = self._script_fd, None
        try:
            _write_all(fd, script)
        except BrokenPipeError:
            self._reap()
            return None
        bud_io.MARKS["shell_fed"] = bud_io.MARKS["compiled"] = time.perf_counter()
        return self.waiter.wait(areas)

    def retire(self):
        """Kills and reaps the shell, parked or stopped after a session's shell cell, so
        that a Python job's "wait for any child" finds only its own children. Idempotent.
        The pidfd makes the kill safe against a reused pid."""
        if self.waiter is None or self.waiter.reaped:
            return
        if self._script_fd is not None:
            os.close(self._script_fd)
            self._script_fd = None
        try:
            signal.pidfd_send_signal(self.waiter.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._reap()

    def _reap(self):
        try:
            posix.waitpid(self.waiter.pid, 0)
        except ChildProcessError:
            pass
        self.waiter.reaped = True


def kill(waiter):
    """Kills and reaps the shell ``waiter`` waits for (through its pidfd: safe against a
    reused pid)."""
    if waiter.reaped:
        return
    try:
        signal.pidfd_send_signal(waiter.pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        posix.waitpid(waiter.pid, 0)
    except ChildProcessError:
        pass
    waiter.reaped = True


def spawn_shell(path, code, args, env):
    """``sh -c CODE sh ARG...`` as a new process, environment = ours plus ``env``; returns
    a :class:`Waiter` for it (the fallback path, ~0.2 s of spawn in the guest)."""
    environ = dict(os.environb)
    environ.update(env)
    pid = os.posix_spawn(
        path,
        [b"sh", b"-c", code, b"sh", *args],
        environ,
        setsigdef=RESTORED_SIGNALS,
    )
    return Waiter(pid)


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[posix.write(fd, view) :]
