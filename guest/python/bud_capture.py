"""Fd-level output capture: what a job writes *below* Python's level, and when the worker
collects it.

What this module owns
---------------------
- :class:`FdCapture`: what happens *below* Python's level. fds 0, 1 and 2 of the worker
  (and so of every process a job starts) are anonymous files on /tmp (``O_TMPFILE``), made
  before READY and empty in the template. fd-level output (``os.write(1, ...)``, a
  subprocess, ``os.system``, a shell job) lands in them and is copied into the areas by
  :meth:`FdCapture.sync`: one ``fstat`` per stream, plus one ``preadv`` straight into the
  area when the file grew. In a guest the files live on their own tmpfs,
  :data:`CAPTURE_DIR`, sized to the request's output cap plus ``CAPTURE_SLACK`` (resized,
  one remount, only for a request whose cap differs from the last one's): a writer that
  floods fd 1 or 2 gets ``ENOSPC`` once the cap is passed, the job ends, and the host, seeing
  more than the cap, says ``output_limit`` (a shell's ``head -c 100000000 /dev/zero`` used to
  fill the guest's RAM page by page until its timeout). What was copied out is freed
  (``punch_hole``, in whole multiples of :data:`PUNCH_EVERY`), so a session's files never
  fill that file system with output already delivered. The job's stdin is written to the stdin file (one ``pwrite``
  from the mailbox) only when something below Python's level may read fd 0.

When fd-level output is collected (the zero-syscall rule)
--------------------------------------------------------
A job that never goes below Python's level must not pay for fd capture, so ``sync`` runs
only when the job *may* have written at fd level, as far as cheap signals tell:
- an audit event (``sys.addaudithook``, installed by the job runner) that starts a process
  or loads native code: ``subprocess.Popen``, ``os.system``, ``os.posix_spawn*``,
  ``os.fork``, ``os.forkpty``, ``os.exec``, ``os.spawn``, ``pty.spawn``, ``ctypes.*``; and
  ``open`` of an fd number or of a path under /dev or /proc (``/dev/stdout``,
  ``/proc/self/fd/1``). These make the capture *sticky*: a process or file object may write
  at any time, so from then on both streams are synced before each streaming FLUSH, before
  a Python-level write at most every STREAM_INTERVAL, and at the job's end.
- ``os.write`` is not audited, so :func:`install_os_wrappers` puts stand-ins in front of
  ``os.write``, ``os.writev``, ``os.pwrite``, ``os.pwritev``, ``os.sendfile``, ``os.splice``
  and ``os.copy_file_range`` that mark the capture dirty and call the original (native
  ``_bud.Hooked`` objects: no worker frame in a job's tracebacks; ``posix.write`` itself is
  untouched). ``fileno()`` of the job's streams marks it too (``os.write(sys.stdout.fileno(),
  ...)``, ``subprocess.run(..., stdout=sys.stdout)``, ``faulthandler``). A dirty stream is
  synced before the next Python-level write to it, so ``os.write`` and
  ``print(..., flush=True)`` keep their order.
- Missed, by design: native code that writes fds 1/2 without any of the above (a C
  extension calling ``write(1, ...)``; none is in the image), and output of background
  processes that outlive the job.

Ordering between Python-level and fd-level output is approximate: fd-level bytes are
copied in at the sync points above, so they land after Python output that was already in
the area and before Python output still buffered in the text layer (which is where
``python3`` itself would put them for block-buffered stdout on a pipe).

The areas it copies into, the streams and the original ``os`` functions are ``bud_io``'s.
"""

import os
import time

import _bud
from bud_io import _ORIGINAL, OS_READERS, OS_WAITERS, OS_WRITERS, STDERR, STDOUT, STREAM_INTERVAL

# Where the capture files live in a guest: a tmpfs of its own, mounted by the agent
# (guest/agent/src/mounts.rs) at the default cap plus the slack, with 2 MiB folios.
CAPTURE_DIR = "/run/bud-output"
# The copied part of a capture file is freed in whole multiples of this (the file system's
# huge folio size): a hole that ended inside a 2 MiB folio would split it into 512 pages.
PUNCH_EVERY = 2 << 20
_PAGE = 4096

# Audit events after which fd-level output is possible at any time (see the module docs).
STICKY_EVENTS = frozenset(
    {
        "subprocess.Popen",
        "os.system",
        "os.posix_spawn",
        "os.posix_spawnp",
        "os.fork",
        "os.forkpty",
        "os.exec",
        "os.spawn",
        "pty.spawn",
    }
)
# glibc's O_TMPFILE (Python has it as os.O_TMPFILE on Linux).
_O_TMPFILE = getattr(os, "O_TMPFILE", 0o20200000)


def _open_tmpfile(directory, flags):
    """An anonymous file in ``directory`` (O_TMPFILE; a named file unlinked at once where
    the file system lacks it)."""
    try:
        return os.open(directory, _O_TMPFILE | flags, 0o600)
    except OSError:
        path = os.path.join(directory, f".bud-capture-{os.getpid()}-{flags}")
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)
        return fd


class FdCapture:
    """fds 0, 1, 2 of this process as anonymous files, and copying what lands in 1 and 2
    into the output areas (see the module docs for when)."""

    def __init__(self, directory="/tmp", clock=time.perf_counter, bounded=False):
        self._clock = clock
        self._directory = directory
        # Size of the bounded capture file system (None: not bounded, e.g. /tmp in tests).
        self._size = _bud.DEFAULT_OUTPUT_LIMIT + _bud.CAPTURE_SLACK if bounded else None
        # Saved before the redirection: the console (worker diagnostics, crash dumps).
        self.console_out = os.dup(1)
        self.console_err = os.dup(2)
        # Our own descriptors on the three files (close-on-exec): a job may dup2 over 0-2.
        self.stdin_fd = _open_tmpfile(directory, os.O_RDWR)
        self._fds = (
            _open_tmpfile(directory, os.O_RDWR | os.O_APPEND),
            _open_tmpfile(directory, os.O_RDWR | os.O_APPEND),
        )
        for fd, target in ((self.stdin_fd, 0), (self._fds[0], 1), (self._fds[1], 2)):
            os.dup2(fd, target)  # inheritable: every process a job starts gets them
        self._consumed = [0, 0]
        self._punched = [0, 0]  # bytes at the start of each file already freed
        self.dirty = [False, False]  # per stream: fd-level output may be waiting
        self._last_sync = [0.0, 0.0]
        self.sticky = False
        self._stdin_source = None  # a StdinReader while a job runs
        self._stdin_done = False

    def begin(self, stdin_reader, output_limit=0):
        """A job starts: ``stdin_reader`` holds its stdin (written to fd 0 on demand), and
        its output cap bounds the capture file system (0: leave it as it is)."""
        self._stdin_source = stdin_reader
        self._stdin_done = False
        if self._size is not None and output_limit:
            size = -(-(output_limit + _bud.CAPTURE_SLACK) // _PAGE) * _PAGE
            if size != self._size:
                try:
                    _bud.resize_tmpfs(self._directory, size)
                    self._size = size
                except OSError:
                    # Smaller than what a session's files still hold unread: keep the
                    # larger bound (the host enforces the cap itself in any case).
                    pass

    def reset(self):
        """Back to empty files (between warm-up jobs; a clone never needs this)."""
        for fd in (self.stdin_fd, *self._fds):
            os.ftruncate(fd, 0)
        os.lseek(self.stdin_fd, 0, os.SEEK_SET)
        self._consumed = [0, 0]
        self._punched = [0, 0]
        self.dirty = [False, False]
        self.sticky = False
        self._stdin_source = None
        self._stdin_done = False

    def next_request(self):
        """A session's next request starts: its stdin starts empty (one truncate, only if the
        last request's stdin reached the file). Output files are not truncated: reading goes
        on from where the last request stopped, and a process a cell left running keeps
        writing to them (so ``sticky`` stays)."""
        if self._stdin_done:
            os.ftruncate(self.stdin_fd, 0)
            os.lseek(self.stdin_fd, 0, os.SEEK_SET)
        self._stdin_source = None
        self._stdin_done = False

    def mark_dirty(self, stream=None):
        """fd-level output may be waiting in ``stream`` (both if None)."""
        if stream is None:
            self.dirty[STDOUT] = self.dirty[STDERR] = True
        else:
            self.dirty[stream] = True

    def mark_sticky(self):
        """A process or a file object on fds 1/2 may write at any time from now on."""
        self.sticky = True
        self.mark_dirty()

    def may_have_output(self):
        return self.sticky or self.dirty[STDOUT] or self.dirty[STDERR]

    def wants_sync(self, stream):
        """Before a Python-level write to ``stream``: sync it first? (keeps order)"""
        if self.dirty[stream]:
            return True
        return self.sticky and self._clock() - self._last_sync[stream] >= STREAM_INTERVAL

    def sync(self, areas, stream):
        """Copies what fd-level writers appended to ``stream``'s file into its area."""
        fd = self._fds[stream]
        self.dirty[stream] = False
        if self.sticky:  # the clock is only consulted for sticky captures
            self._last_sync[stream] = self._clock()
        size = os.fstat(fd).st_size
        if size < self._consumed[stream]:
            # truncated (`: > /dev/stdout`): start again
            self._consumed[stream] = self._punched[stream] = 0
        count = size - self._consumed[stream]
        if count > 0:
            self._consumed[stream] += areas.fill_from_fd(
                stream, fd, self._consumed[stream], count
            )
            if self._consumed[stream] - self._punched[stream] >= PUNCH_EVERY:
                end = self._consumed[stream] // PUNCH_EVERY * PUNCH_EVERY
                _bud.punch_hole(fd, end)
                self._punched[stream] = end

    def sync_all(self, areas):
        """Both streams, if there may be anything (the job's end, os._exit)."""
        if self.may_have_output():
            self.sync(areas, STDOUT)
            self.sync(areas, STDERR)

    def materialize_stdin(self):
        """Writes the job's unread stdin into the stdin file, once: from now on fd 0 (in
        this process and in every process it starts) reads it."""
        if self._stdin_done or self._stdin_source is None:
            return
        self._stdin_done = True
        data = self._stdin_source.remaining()
        done = 0
        while done < len(data):
            done += _ORIGINAL["pwrite"](self.stdin_fd, data[done:], done)


def _waits_for_any(name, args):
    """Does this call of os.``name`` wait for children it does not name by pid?"""
    if name in ("wait", "wait3"):
        return True
    if name == "waitid":
        return bool(args) and args[0] in (os.P_ALL, os.P_PGID)
    return bool(args) and args[0] <= 0  # waitpid, wait4: -1, 0 or a process group


def install_os_wrappers(state):
    """Puts hooks in front of the ``os`` writers (mark the capture dirty), readers (fd 0:
    materialize the job's stdin first), waiters (waiting for any child:
    ``state.before_wait_any()`` first) and ``os._exit`` (copy fd-level output into the
    areas first, as those bytes would already be in a pipe). ``state`` is the job runner:
    its ``capture``, ``areas`` and ``active`` attributes are looked up on each call.

    The stand-ins are ``_bud.Hooked`` objects: native, so they add no frame to a job's
    tracebacks. Hooks run only while a job is active and never raise. Idempotent."""
    if isinstance(os.write, _bud.Hooked):
        return

    def on_write(args, kwargs):
        if state.active:
            fd = args[0] if args else (kwargs or {}).get("fd")
            state.capture.mark_dirty(STDERR if fd == 2 else STDOUT if fd == 1 else None)

    def on_read(args, kwargs):
        del kwargs
        if state.active and args and args[0] == 0:
            state.capture.materialize_stdin()

    def on_wait(name):
        def hook(args, kwargs):
            del kwargs
            if state.active and _waits_for_any(name, args):
                state.before_wait_any()

        return hook

    def on_exit(args, kwargs):
        del args, kwargs
        if state.active and not state.areas.forked:
            try:
                state.capture.sync_all(state.areas)
            except BaseException:  # noqa: BLE001 - exiting regardless
                pass

    for name in OS_WRITERS:
        if name in _ORIGINAL:
            setattr(os, name, _bud.Hooked(_ORIGINAL[name], on_write))
    for name in OS_READERS:
        setattr(os, name, _bud.Hooked(_ORIGINAL[name], on_read))
    for name in OS_WAITERS:
        if name in _ORIGINAL:
            setattr(os, name, _bud.Hooked(_ORIGINAL[name], on_wait(name)))
    os._exit = _bud.Hooked(_exit_original, on_exit)


def _exit_original(status):
    """``os._exit`` as looked up at call time (host tests put a fake host's in its place)."""
    _ORIGINAL["_exit"](status)


_exit_original.__name__ = _exit_original.__qualname__ = "_exit"
_exit_original.__doc__ = _ORIGINAL["_exit"].__doc__
