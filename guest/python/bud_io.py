"""A job's standard streams in a clone: mailbox output areas and stdin (fd-level capture:
``bud_capture``).

What this module owns
---------------------
- :class:`Areas`: the stdout and stderr areas of the mailbox (``vmm/src/protocol.rs``,
  ``result``) and the FLUSH doorbell. Bytes are copied into the area at its fill counter
  (``RESULT_STDOUT_LEN`` / ``RESULT_STDERR_LEN``); a full area rings FLUSH, the host copies
  both areas out, zeroes both counters and resumes us, and the copy continues from 0.
  Output also streams: a write or flush rings FLUSH when output is pending and the last FLUSH
  (or the job's start) is at least :data:`STREAM_INTERVAL` ago, so a long job's output
  reaches the host while it runs, at most ~20 doorbells a second. Writing is user-mode
  memory copies and ``perf_counter`` (a vDSO read): **no syscalls, no fresh pages** (the
  mailbox is locked and touched before READY).
- :class:`AreaWriter` / :class:`StdinReader`: the binary layers under the job's
  ``sys.stdout`` / ``sys.stderr`` / ``sys.stdin``, built by :func:`make_streams` with the
  text settings ``python3 -c`` has here (see there).
- fd-level capture (what happens *below* Python's level) is ``bud_capture``'s.

What this module must never do: syscalls on the path of a job that stays at Python's level,
or ring anything but FLUSH (DONE belongs to the job runner). In a forked child (the mailbox
is MADV_DONTFORK, so it is not mapped there) it never touches the mailbox or the doorbell:
the writers fall back to plain ``os.write`` on fds 1/2, which the parent collects.
"""

import io
import os
import struct
import sys
import threading
import time

import _bud

# Output pending for this long (since the last FLUSH or the job's start) is pushed to the
# host by the next write or flush. Bounds doorbells to ~20 a second while streaming.
STREAM_INTERVAL = 0.05

STDOUT, STDERR = 0, 1

# perf_counter() marks of this clone's job path (vDSO reads: no syscalls), for measuring it
# from inside a job: ``import bud_io; print(bud_io.MARKS)``. bud_jobs sets resumed (serve()
# entered), read (request read), clock (wall clock checked), identity (random seeded, clock
# checked), started (job about to run), compiled (Python code compiled; shell: script fed),
# finished (set just before DONE: only threads and atexit handlers see it); bud_shell adds
# shell_fed (script written) and shell_polls. write_phases sends four of them to the host.
MARKS = {}

# Protocol offsets (vmm/src/protocol.rs via _bud).
_AREAS = (
    (_bud.RESULT_STDOUT_AREA, _bud.RESULT_STDOUT_AREA_END),
    (_bud.RESULT_STDERR_AREA, _bud.RESULT_STDERR_AREA_END),
)
# STDOUT_LEN and STDERR_LEN are adjacent u32s: one 'I' view over both.
assert _bud.RESULT_STDERR_LEN == _bud.RESULT_STDOUT_LEN + 4

# os functions that write to a descriptor; wrapped to mark the capture dirty.
OS_WRITERS = ("write", "writev", "pwrite", "pwritev", "sendfile", "splice", "copy_file_range")
# os functions that read a descriptor; wrapped to put the job's stdin into fd 0 first.
OS_READERS = ("read", "readv")
# os functions that may wait for *any* child; wrapped to retire the parked shell first.
OS_WAITERS = ("wait", "wait3", "waitpid", "wait4", "waitid")

class Areas:
    """The two output areas of the mailbox, their fill counters and the FLUSH doorbell.

    ``ring(code, a, b)`` is ``_bud.ring`` in a guest, a fake host in tests. ``capture`` (an
    :class:`FdCapture` or None) is synced before each streaming FLUSH. Thread-safe: one
    re-entrant lock around every copy (jobs may print from several threads).
    """

    def __init__(self, view, ring, clock=time.perf_counter):
        self._view = view
        self._lens = view[_bud.RESULT_STDOUT_LEN : _bud.RESULT_STDOUT_LEN + 8].cast("I")
        self.ring = ring  # replaceable: the warm-up jobs before READY ring a fake host
        self._clock = clock
        self._lock = threading.RLock()
        self.capture = None
        # Streaming FLUSHes are off between jobs and while the runner finishes a job (DONE
        # follows at once and drains the areas anyway).
        self.streaming = False
        self.last_flush = 0.0
        # True in a forked child: the mailbox is not mapped there (MADV_DONTFORK).
        self.forked = False

    def start(self):
        """A job starts now: its output streams from here."""
        self.last_flush = self._clock()
        self.streaming = True

    def reset(self):
        """Empties both areas without telling the host (between warm-up jobs only)."""
        self._lens[STDOUT] = 0
        self._lens[STDERR] = 0
        self.streaming = False

    def write(self, stream, data):
        """Copies all of ``data`` (any bytes-like object) into ``stream``'s area; returns its
        length. Rings FLUSH as often as the area fills up."""
        if type(data) is not bytes:  # TextIOWrapper hands over bytes: the fast path
            data = memoryview(data).cast("B")
        n = len(data)
        lock = self._lock
        lock.acquire()
        try:
            capture = self.capture
            if capture is not None and (capture.sticky or capture.dirty[stream]):
                if capture.wants_sync(stream):
                    capture.sync(self, stream)
            start, end = _AREAS[stream]
            pos = self._lens[stream]
            if n <= end - start - pos:
                self._view[start + pos : start + pos + n] = data
                self._lens[stream] = pos + n
            else:
                self._write_in_pieces(stream, memoryview(data), start, end)
            if self.streaming and self._clock() - self.last_flush >= STREAM_INTERVAL:
                self.stream_now()
        finally:
            lock.release()
        return n

    def _write_in_pieces(self, stream, m, start, end):
        """``write`` for data larger than the room left: fill, FLUSH, repeat."""
        lens = self._lens
        done = 0
        while done < len(m):
            pos = lens[stream]
            k = min(end - start - pos, len(m) - done)
            if k <= 0:
                self.flush_now()
                continue
            self._view[start + pos : start + pos + k] = m[done : done + k]
            lens[stream] = pos + k
            done += k

    def fill_from_fd(self, stream, fd, offset, count):
        """Copies ``count`` bytes at ``offset`` of file ``fd`` straight into ``stream``'s
        area (``preadv`` into the mailbox: no buffer in between). Returns the bytes copied
        (fewer if the file is shorter)."""
        with self._lock:
            start, end = _AREAS[stream]
            lens = self._lens
            done = 0
            while done < count:
                pos = lens[stream]
                k = min(end - start - pos, count - done)
                if k <= 0:
                    self.flush_now()
                    continue
                got = os.preadv(fd, [self._view[start + pos : start + pos + k]], offset + done)
                if got <= 0:
                    break
                lens[stream] = pos + got
                done += got
            return done

    def maybe_stream(self):
        """Rings FLUSH if output is pending and the last FLUSH is STREAM_INTERVAL ago."""
        if (
            self.streaming
            and (self._lens[STDOUT] or self._lens[STDERR])
            and self._clock() - self.last_flush >= STREAM_INTERVAL
        ):
            self.stream_now()

    def stream_now(self):
        """Collects fd-level output if there may be any, then rings FLUSH if anything is
        pending (used by the shell runner's wait loop and by maybe_stream)."""
        with self._lock:
            capture = self.capture
            if capture is not None and capture.may_have_output():
                capture.sync(self, STDOUT)
                capture.sync(self, STDERR)
            if self._lens[STDOUT] or self._lens[STDERR]:
                self.flush_now()

    def flush_now(self):
        """Rings FLUSH: the host drains both areas and zeroes both counters."""
        with self._lock:
            self.ring(_bud.FLUSH, 0, 0)
            self.last_flush = self._clock()

    def after_fork_in_child(self):
        """In a forked child: never touch the mailbox again (see the module docs)."""
        self.forked = True
        self.streaming = False
        self._lock = threading.RLock()  # another thread may have held it at the fork


class AreaWriter(io.BufferedIOBase):
    """The binary layer of the job's ``sys.stdout`` / ``sys.stderr``: writes go into the
    mailbox area (``sys.stdout.buffer.write(b)`` works too). ``flush()`` lets output stream
    (see :meth:`Areas.maybe_stream`). ``fileno()`` is the real fd 1 or 2, whose output is
    captured below Python's level, and marks that capture dirty."""

    def __init__(self, areas, stream, fd, name):
        super().__init__()
        self._areas = areas
        self._stream = stream
        self._fd = fd
        self._name = name

    @property
    def name(self):
        return self._name

    @property
    def mode(self):
        return "wb"

    @property
    def raw(self):
        return self

    def writable(self):
        return True

    def readable(self):
        return False

    def seekable(self):
        return False

    def isatty(self):
        return False

    def fileno(self):
        capture = self._areas.capture
        if capture is not None:
            capture.mark_dirty(self._stream)
        return self._fd

    def write(self, data):
        if self.closed:
            raise ValueError("write to closed file")
        areas = self._areas
        if areas.forked:
            return _write_all_fd(self._fd, data)
        return areas.write(self._stream, data)

    def flush(self):
        if self.closed:
            raise ValueError("flush of closed file")
        areas = self._areas
        if areas.streaming:
            areas.maybe_stream()


class StdinReader(io.RawIOBase):
    """The raw layer of the job's ``sys.stdin``: reads the job's stdin straight from the
    request data area of the mailbox, no copy up front. ``fileno()`` is the real fd 0,
    filled with what Python has not read yet (as a real fd 0 would hold)."""

    def __init__(self):
        super().__init__()
        self._data = memoryview(b"")
        self._pos = 0
        self._capture = None
        self._forked = False

    def attach(self, data, capture):
        """The job's stdin bytes (a memoryview on the mailbox) and the fd capture."""
        self._data = data
        self._pos = 0
        self._capture = capture

    def remaining(self):
        """What Python-level reads have not consumed (read-ahead counts as consumed)."""
        return self._data[self._pos :]

    @property
    def name(self):
        return "<stdin>"

    @property
    def mode(self):
        return "rb"

    def readable(self):
        return True

    def seekable(self):
        return False

    def isatty(self):
        return False

    def fileno(self):
        if self._capture is not None:
            self._capture.materialize_stdin()
        return 0

    def after_fork_in_child(self):
        """In a forked child the mailbox is not mapped: read the real fd 0 (the parent
        wrote the unread stdin there when it saw the fork)."""
        self._forked = True
        self._data = memoryview(b"")

    def readinto(self, buffer):
        if self._forked:
            return _ORIGINAL["readv"](0, [buffer])
        with memoryview(buffer) as dest:
            if dest.ndim != 1 or dest.format != "B":
                dest = dest.cast("B")
            k = min(len(dest), len(self._data) - self._pos)
            dest[:k] = self._data[self._pos : self._pos + k]
            self._pos += k
            return k

    def readall(self):
        if self._forked:
            return super().readall()
        chunk = bytes(self._data[self._pos :])
        self._pos = len(self._data)
        return chunk


def _write_all_fd(fd, data):
    with memoryview(data) as m:
        if m.ndim != 1 or m.format != "B":
            m = m.cast("B")
        done = 0
        while done < len(m):
            done += _ORIGINAL["write"](fd, m[done:])
        return done


class Streams:
    """One job's stdin, stdout and stderr: the text layers and the objects under them."""

    def __init__(self, stdin, stdout, stderr, reader, out, err):
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.reader, self.out, self.err = reader, out, err

    def install(self):
        """Makes these the job's ``sys.std*`` and ``sys.__std*__``."""
        sys.stdin = sys.__stdin__ = self.stdin
        sys.stdout = sys.__stdout__ = self.stdout
        sys.stderr = sys.__stderr__ = self.stderr


# A str longer than this written at once is encoded and written in pieces of this many
# characters: the host's interrupt at the output cap then lands between pieces, so a huge
# write stops after about the cap's worth instead of first encoding all of it into a new
# buffer (fresh guest pages: ~1.3 ms each under kvm_pvm; a 50 MB write spent ~35 s there).
WRITE_PIECE = 1 << 20


# TextIOWrapper's own write, called directly: every print goes through TextStream.write
# (twice), and a zero-argument super() there cost ~0.35 us more per print than this (1e6
# prints on the host: 0.40 s plain, 0.53 s this way, 0.88 s with super()).
_TEXT_WRITE = io.TextIOWrapper.write


class TextStream(io.TextIOWrapper):
    """The job's ``sys.stdout`` / ``sys.stderr``: a ``TextIOWrapper`` that writes a huge
    str in pieces (:data:`WRITE_PIECE`); the same bytes in the same order."""

    def write(self, s):
        if type(s) is str and len(s) > WRITE_PIECE:
            for at in range(0, len(s), WRITE_PIECE):
                _TEXT_WRITE(self, s[at : at + WRITE_PIECE])
            return len(s)
        return _TEXT_WRITE(self, s)


def make_streams(areas, text_settings):
    """The job's text streams, as ``python3 -c`` sets them up for a non-tty in this
    environment (``text_settings`` = (encoding, errors) for stdin, stdout, stderr; see
    :func:`python_text_settings`): stdout block-buffered (TextIOWrapper's own 8 KiB pending
    buffer), stderr line-buffered, stdin buffered; ``newline="\\n"`` (no translation), as
    CPython's ``create_stdio`` does on POSIX. The areas are the buffer, so there is no
    BufferedWriter in between."""
    (in_enc, in_err), (out_enc, out_err), (err_enc, err_err) = text_settings
    reader = StdinReader()
    out = AreaWriter(areas, STDOUT, 1, "<stdout>")
    err = AreaWriter(areas, STDERR, 2, "<stderr>")
    stdin = io.TextIOWrapper(
        io.BufferedReader(reader), encoding=in_enc, errors=in_err, newline="\n"
    )
    stdout = TextStream(out, encoding=out_enc, errors=out_err, newline="\n")
    stderr = TextStream(
        err, encoding=err_enc, errors=err_err, newline="\n", line_buffering=True
    )
    for stream, mode in ((stdin, "r"), (stdout, "w"), (stderr, "w")):
        stream.mode = mode
    return Streams(stdin, stdout, stderr, reader, out, err)


def python_text_settings():
    """(encoding, errors) of stdin, stdout and stderr that this interpreter chose for its
    own streams: what ``python3 -c`` in the same environment would have (in the guest's
    C.UTF-8: utf-8 with surrogateescape, stderr backslashreplace)."""
    settings = []
    for stream, errors in (
        (sys.__stdin__, "surrogateescape"),
        (sys.__stdout__, "surrogateescape"),
        (sys.__stderr__, "backslashreplace"),
    ):
        encoding = getattr(stream, "encoding", None) or "utf-8"
        settings.append((encoding, getattr(stream, "errors", None) or errors))
    return tuple(settings)


# The os functions as they were before install_os_wrappers (the worker uses these).
_ORIGINAL = {
    name: getattr(os, name)
    for name in (*OS_WRITERS, *OS_READERS, *OS_WAITERS, "_exit")
    if hasattr(os, name)
}


def write_phases(view, marks, flags=0):
    """The phase marks of ``result::PHASE_*_NS``: nanoseconds from ``resumed`` to the end of
    each phase (0 for a phase not reached), as four little-endian u64s; then
    ``result::GUEST_FLAGS``."""
    start = marks.get("resumed")
    values = []
    for name in ("read", "identity", "compiled", "finished"):
        at = marks.get(name)
        values.append(0 if start is None or at is None else max(0, int((at - start) * 1e9)))
    struct.pack_into("<4Q", view, _bud.RESULT_PHASE_READ_NS, *values)
    struct.pack_into("<I", view, _bud.RESULT_GUEST_FLAGS, flags)


def write_u32_pair(view, offset, first, second):
    """Two little-endian 32-bit fields (u32, i32) at ``offset`` (OUTCOME, EXIT_CODE)."""
    struct.pack_into("<Ii", view, offset, first, second)
