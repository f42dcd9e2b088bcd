"""Shell jobs: ``sh -c CODE sh ARG...`` with busybox ash, without a process spawn per job.

Why a parked shell
------------------
Creating a process is the dearest thing a guest can do under kvm_pvm: ``posix_spawn`` of
/bin/sh costs ~0.2 s, fork+exec ~0.5 s (every page-table operation is emulated). So the
worker starts one shell *before READY* and leaves it blocked reading its script:

    /bin/sh -c '. /proc/self/fd/3' sh        fd 3 = read end of a pipe, fd 4 = status pipe
                                             fds 0/1/2 = the worker's capture files

It first reads and runs :data:`WARM_SCRIPT` from the pipe (builtins, expansions, loops,
redirections, a here-document: the code pages a typical job needs get mapped now, not in
every clone), reports on fd 4, cleans up after itself and blocks in ``read`` on the pipe.
The snapshot holds it there. A shell job in a clone then costs the worker a ``write`` of
the job script into the pipe, a ``close``, and the wait (``poll`` on a pidfd made before
READY, then ``waitpid``), instead of a spawn. The script (:func:`job_script`) is

    set -- 'arg1' 'arg2'             positional parameters, single-quoted
    export NAME='value'              the job's environment
    RANDOM=<from the job's seed>     ash seeds $RANDOM at start-up: same in every clone
    eval '<the code>'

``eval`` runs the code the way ``-c`` does (one string, ``$0`` = ``sh``, ``exit`` exits the
shell, the exit status is the shell's). Known differences from a real ``sh -c``:
- error messages say ``sh: eval: line N:`` where ``-c`` says ``sh: line N-1:``;
- busybox's ``-c`` execs its *last* simple command in place of the shell; ``eval`` forks
  it, so a last command killed by a signal is reported as exit status 128+n, not as
  SIGNALED (the shell itself killed by a signal, ``kill -9 $$``, is still SIGNALED).

The job's stdin is the worker's stdin file (fd 0, written on demand, see ``bud_io``); its
stdout and stderr are the capture files, which the worker copies into the mailbox areas
while it waits (every ``STREAM_INTERVAL``, then FLUSH) and at the end.

Fallback: if the parked shell is gone (dead, or never started because the warm-up failed),
the job runs in a freshly spawned ``sh -c CODE sh ARG...`` with the environment passed to
``posix_spawn``: correct, and ~0.2 s slower.

What this module must never do: leave a process of its own running after a job's DONE
that could still write into the capture files (the wait always reaps the shell), or let
the parked shell inherit the pipe's write end (it would never see end-of-file).
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
STATUS_FD = 4
READY_TOKEN = b"bud-shell-ready\n"

# Signals Python ignores (SIGPIPE, SIGXFSZ) must be default again in a shell, as
# subprocess's restore_signals does.
RESTORED_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)

# Run once by the parked shell before READY; everything it defines is removed again, so
# the shell a job gets is the state `sh -c` starts in. Output goes to /dev/null.
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
  cd /tmp && pwd; command -v echo; eval 'echo "$bud_x"'; echo err >&2
  trap 'echo trap' USR1; trap - USR1
} >/dev/null 2>&1
unset -f bud_warm_fn
unset -v bud_x bud_y bud_z bud_i bud_w bud_line bud_unset
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
    lines.append(b"eval " + quote(code))
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
    """Waits for a child shell while streaming its output: ``poll`` on a pidfd with a
    STREAM_INTERVAL timeout; each timeout copies fd-level output into the areas and rings
    FLUSH if there is any. Then ``waitpid``."""

    def __init__(self, pid):
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        self.poller = select.poll()
        self.poller.register(self.pidfd, select.POLLIN)

    def wait(self, areas):
        timeout_ms = int(bud_io.STREAM_INTERVAL * 1000)
        polls = 1
        while not self.poller.poll(timeout_ms):
            polls += 1
            areas.stream_now()
        bud_io.MARKS["shell_exited"] = time.perf_counter()
        bud_io.MARKS["shell_polls"] = polls
        _, status = posix.waitpid(self.pid, 0)
        bud_io.MARKS["shell_reaped"] = time.perf_counter()
        return outcome_of(status)


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
        status_r, status_w = (_high_fd(fd) for fd in os.pipe())
        try:
            pid = os.posix_spawn(
                self.path,
                list(PARKED_ARGV),
                os.environ,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, script_r, SCRIPT_FD),
                    (os.POSIX_SPAWN_DUP2, status_w, STATUS_FD),
                ],
                setsigdef=RESTORED_SIGNALS,
            )
        finally:
            os.close(script_r)
            os.close(status_w)
        self.waiter = Waiter(pid)
        self._script_fd = script_w
        deadline = time.monotonic() + timeout
        try:
            _write_all(script_w, WARM_SCRIPT)
            token = b""
            while not token.endswith(b"\n") and time.monotonic() < deadline:
                if select.select([status_r], [], [], deadline - time.monotonic())[0]:
                    chunk = os.read(status_r, 64)
                    if not chunk:
                        break
                    token += chunk
        finally:
            os.close(status_r)
        if token != READY_TOKEN:
            self.retire()
            raise OSError(f"parked shell did not get ready (said {token!r})")
        # The token is written just before `exec 4>&-` and the next read: wait until the
        # shell sleeps in that read, so that no clone inherits a shell still running.
        while _state(pid) != b"S" and time.monotonic() < deadline:
            time.sleep(0.001)

    def run(self, script, areas):
        """Feeds ``script`` to the parked shell and waits for it; returns (outcome, code),
        or None if the shell turned out to be gone (the caller falls back)."""
        fd, self._script_fd = self._script_fd, None
        try:
            _write_all(fd, script)
        except BrokenPipeError:
            posix.close(fd)
            self._reap()
            return None
        bud_io.MARKS["shell_fed"] = time.perf_counter()
        posix.close(fd)
        bud_io.MARKS["shell_closed"] = time.perf_counter()
        return self.waiter.wait(areas)

    def retire(self):
        """Kills and reaps the parked shell (a Python job is about to start a process:
        ``os.wait()`` must not find our shell). Two syscalls; idempotent."""
        if self._script_fd is None:
            return
        fd, self._script_fd = self._script_fd, None
        try:
            os.kill(self.waiter.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._reap()
        del fd  # left open: close-on-exec, and the clone is thrown away

    def _reap(self):
        try:
            posix.waitpid(self.waiter.pid, 0)
        except ChildProcessError:
            pass


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
