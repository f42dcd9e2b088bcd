"""A sandbox's background processes, guest side: the table the worker keeps between requests.

A ``LANGUAGE_PROCESS`` request (``vmm/src/protocol.rs``, ``process_op``) starts a process,
polls the live ones for output and exits, writes to a process's stdin or signals it. The
host (``vmm/src/process.rs``, the server's ``service/processes.rs``) keeps each process's
output, its clients and its end; this module only holds the pipes.

- **Start**: ``/bin/sh -c SCRIPT`` through ``subprocess`` (vfork and exec: the worker's
  pages are not write-protected), in a session of its own (``setsid``), so a signal reaches
  the process and everything it started; stdout and stderr on pipes, stdin on a pipe or
  ``/dev/null``. The worker is the parent, so nobody else reaps it; its exit is seen through
  a pidfd, which becomes readable when it ends (no SIGCHLD handler, no polling).
- **Poll**: one ``select`` over every pipe and pidfd, for up to the wait the host asked; it
  returns as soon as there is something to report (output is taken as it comes, up to a
  byte budget), or when the host interrupts it (the host has another request for this
  sandbox; the interrupt is taken only in the ``select``, see :meth:`Table.run`). While no request runs the VM is stopped, so a process whose
  pipe fills between polls simply blocks on its write until the next one.
- **A user**: a START naming a user of the guest's ``/etc/passwd`` (``bud_users``) runs the
  process as that user: its uid, gid and groups, and ``HOME``, ``USER``, ``LOGNAME`` and
  ``SHELL`` from its entry (the request's env may still set them). ``Popen``'s own
  ``user=`` would make CPython ``fork`` instead of ``vfork`` (2.6-8.4 s a start here instead
  of ~0.45 s), so the worker's thread takes the user's ids itself around the spawn
  (``_bud.thread_as_user``, see ``guest/pyext/src/creds.rs``) and the child inherits them.
  A terminal's device is given to the user. Without a user the process runs as the worker
  does (root, with the worker's environment).
- **A terminal** (PTY): the process runs on a new pseudo-terminal as its controlling
  terminal (busybox ``setsid -c``: the worker spawns without ``preexec_fn``, so the child
  cannot ``TIOCSCTTY`` itself), which is its stdin, stdout and stderr; its output is one
  stream, input goes to the terminal, and a resize sets the terminal's size (the kernel
  sends SIGWINCH).
- **Watchers**: a directory (and its subdirectories, recursive) watched with inotify
  (``_bud.inotify_*``); the descriptor is one more fd in the poll's ``select``, its events
  become ``WATCH`` events (E2B's create / write / remove / rename / chmod, the path relative
  to the watched directory). A recursive watcher adds each new subdirectory as it appears.
  One made with ``entries`` adds the entry (``bud_session.entry_of``: lstat, owner and
  group, metadata) to each create, write and chmod event, read when the poll takes it.
- **Kernels** (a code context's, ``bud_kernel``): in a template whose manifest asks for
  them (``kernels``), the worker makes them before READY (:meth:`Table.prepare_kernels`) by
  forking itself right after the template's imports and warm-up, so every clone has them
  with their imports done; a START of the kernel's script takes one (a pid like any other)
  instead of paying a fresh ``python3``. Others start as any process does.
- A process is reported ended only after its pipes are drained to EOF or it is reaped and
  its pipes have nothing more (a child it left behind may hold them open: its output after
  that is dropped with the pipes).

Costs under kvm_pvm (guest-kernel work is emulated): starting a process is the vfork and
exec of busybox ``sh`` (~0.4 s measured, most of it the exec); a poll with nothing new is a
``select`` and the DONE; each output event a ``read``.
"""

import errno
import fcntl
import json
import os
import select
import signal
import struct
import subprocess
import termios
import time

import _bud
import bud_session
import bud_users

# The event header (``process_event::HEADER``): pid, kind, value, length.
EVENT = struct.Struct("<IIiI")
assert EVENT.size == _bud.PROCESS_EVENT_HEADER

# Bytes taken from one pipe per read.
READ_CHUNK = 64 << 10

# After the first event of a poll, how long to wait for more before answering (seconds):
# a process that writes a line at a time then costs one round trip per burst, not per line.
GATHER_S = 0.002

# Without a pidfd (a kernel older than 5.3) an exit is noticed at the next output or after
# this long.
NO_PIDFD_RECHECK_S = 1.0


class ProcessError(Exception):
    """A refused process operation: ``status`` is a ``FILE_STATUS_*`` code."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def run_operation(request, write_out, write_err, wait):
    """Runs a file request (``bud_session.file_op``) or a process request (``TABLE.run``),
    as the worker's main thread and the lane beside it both do; returns its exit code. A
    refusal (``FileError``, ``ProcessError``) is its message on ``write_err`` and its
    status. ``wait``: a process poll's wait (see ``Table.run``)."""
    try:
        if request.language == _bud.LANGUAGE_FILES:
            return bud_session.file_op(request.file_op, request.code, request.stdin, write_out)
        if request.language == _bud.LANGUAGE_PROCESS:
            return TABLE.run(request, write_out, wait)
        raise ProcessError(_bud.FILE_STATUS_BAD_PATH,
                           f"language {request.language} is not a file or process request")
    except (bud_session.FileError, ProcessError) as error:
        write_err(f"{error}\n".encode("utf-8", "backslashreplace"))
        return error.status


def _size(text):
    """``ROWSxCOLS`` as the ``struct winsize`` of TIOCSWINSZ."""
    try:
        rows, cols = (int(n) for n in text.split("x"))
    except ValueError:
        raise ProcessError(_bud.FILE_STATUS_BAD_PATH, f"bad terminal size {text!r}") from None
    if not (1 <= rows <= 1000 and 1 <= cols <= 1000):
        raise ProcessError(_bud.FILE_STATUS_BAD_PATH, f"terminal size {text} out of range")
    return struct.pack("HHHH", rows, cols, 0, 0)


class Process:
    """One live process: its ``Popen``, its open output fds (fd -> kind), where its input
    goes, and its pidfd."""

    def __init__(self, popen, master=None):
        self.popen = popen
        self.pid = popen.pid
        self.pipes = {}
        # The file objects of the pipes (fd -> object): a pipe is closed through its object,
        # never by number alone, or the object would close the number again when collected,
        # by then another open's (a file operation's read failed with EBADF so).
        self._streams = {}
        self.master = master
        if master is not None:
            os.set_blocking(master, False)
            self.pipes[master] = _bud.PROCESS_EVENT_PTY
            self.stdin = _Fd(master)
        else:
            for kind, stream in ((_bud.PROCESS_EVENT_STDOUT, popen.stdout),
                                 (_bud.PROCESS_EVENT_STDERR, popen.stderr)):
                fd = stream.fileno()
                os.set_blocking(fd, False)
                self.pipes[fd] = kind
                self._streams[fd] = stream
            self.stdin = popen.stdin
        if self.stdin is not None:
            os.set_blocking(self.stdin.fileno(), False)
        try:
            self.pidfd = os.pidfd_open(self.pid)
        except OSError:
            self.pidfd = None  # a kernel without pidfds: reaped when its pipes close
        self.status = None  # the exit event's value once reaped

    def reap(self):
        """Its exit event's value if it has ended (reaping it), else None."""
        if self.status is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 255 << 8  # reaped by someone else: status lost
            if pid == 0:
                return None
            if os.WIFSIGNALED(status):
                self.status = -os.WTERMSIG(status)
            else:
                self.status = os.waitstatus_to_exitcode(status)
            self.popen.returncode = self.status  # so Popen never waits for it again
        return self.status

    def close_pipe(self, fd):
        """Closes output pipe ``fd`` (not the terminal's) and forgets it."""
        stream = self._streams.pop(fd, None)
        if stream is not None:
            stream.close()
        elif fd != self.master:
            os.close(fd)
        self.pipes.pop(fd, None)

    def close(self):
        for fd in list(self.pipes):
            if fd != self.master:
                self.close_pipe(fd)
        self.pipes.clear()
        if self.master is not None:
            self.stdin = None
        if self.stdin is not None:
            self.close_stdin()
        if self.master is not None:
            os.close(self.master)
            self.master = None
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def close_stdin(self):
        if self.master is None:
            try:
                self.stdin.close()
            except OSError:
                pass
        else:
            # A terminal's input is the terminal: "closing" it is the end-of-file character.
            try:
                os.write(self.master, b"\x04")
            except OSError:
                pass
        self.stdin = None


class _Fd:
    """A bare descriptor where a file object is expected (a terminal's input)."""

    def __init__(self, fd):
        self.fd = fd

    def fileno(self):
        return self.fd


# inotify's event bits (linux/inotify.h) and what E2B calls each.
IN_MODIFY, IN_ATTRIB, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_IGNORED, IN_ISDIR = 0x100, 0x200, 0x8000, 0x40000000
WATCH_MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
WATCH_KINDS = ((IN_CREATE | IN_MOVED_TO, _bud.WATCH_EVENT_CREATE),
               (IN_MODIFY, _bud.WATCH_EVENT_WRITE), (IN_DELETE, _bud.WATCH_EVENT_REMOVE),
               (IN_MOVED_FROM, _bud.WATCH_EVENT_RENAME), (IN_ATTRIB, _bud.WATCH_EVENT_CHMOD))
INOTIFY_EVENT = struct.Struct("iIII")
# The events that carry their entry for a watcher made with ``entries`` (envd's too).
ENTRY_KINDS = frozenset({_bud.WATCH_EVENT_CREATE, _bud.WATCH_EVENT_WRITE,
                         _bud.WATCH_EVENT_CHMOD})

# Directories one recursive watcher may watch.
WATCH_DIRS_MAX = 4096

# Entries reported as created when a recursive watcher adopts a new directory tree (a
# clone of a large repository must not overflow one poll's answer).
ADOPT_MAX = 1000


class Watcher:
    """A watched directory: its inotify descriptor and what each watch descriptor is."""

    def __init__(self, wid, root, recursive, entries=False):
        self.wid = wid
        self.root = root
        self.recursive = recursive
        self.entries = entries  # create, write and chmod events carry the entry
        self.fd = _bud.inotify_init()
        self.dirs = {}
        try:
            self._add(root, "")
            if recursive:
                for here, subdirs, _ in os.walk(root):
                    for d in subdirs:
                        full = os.path.join(here, d)
                        self._add(full, os.path.relpath(full, root))
        except BaseException:
            os.close(self.fd)
            raise

    def _add(self, path, rel):
        if len(self.dirs) >= WATCH_DIRS_MAX:
            return
        try:
            self.dirs[_bud.inotify_add_watch(self.fd, path, WATCH_MASK)] = rel
        except OSError:
            pass  # gone again, or not readable: nothing to watch there

    def take(self, write_out, root, room):
        """Writes the events waiting on the descriptor, stopping once about ``room`` bytes
        are written (the rest stay queued in the kernel for the next poll); returns how
        many events and bytes."""
        taken = written = 0
        while written < room:
            try:
                data = os.read(self.fd, 16 << 10)
            except BlockingIOError:
                break
            at = 0
            while at + INOTIFY_EVENT.size <= len(data):
                wd, mask, _, length = INOTIFY_EVENT.unpack_from(data, at)
                name = data[at + INOTIFY_EVENT.size : at + INOTIFY_EVENT.size + length]
                at += INOTIFY_EVENT.size + length
                base = self.dirs.get(wd)
                if mask & IN_IGNORED:
                    self.dirs.pop(wd, None)
                if base is None:
                    continue
                rel = os.path.join(base, os.fsdecode(name.rstrip(b"\0")))
                for bits, kind in WATCH_KINDS:
                    if mask & bits:
                        written += self._report(write_out, kind, rel)
                        taken += 1
                        break
                if (self.recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO)):
                    n, b = self._adopt(write_out, root, rel, [ADOPT_MAX])
                    taken += n
                    written += b
        return taken, written

    def _report(self, write_out, kind, rel):
        b = rel.encode("utf-8", "surrogateescape")
        if self.entries and kind in ENTRY_KINDS:
            try:
                entry = bud_session.entry_of(os.path.join(self.root, rel), True)
                b += b"\0" + json.dumps(entry).encode("utf-8", "surrogateescape")
            except OSError:
                pass  # gone again: the event without its entry, as envd sends it
        write_out(EVENT.pack(self.wid, _bud.PROCESS_EVENT_WATCH, kind, len(b)) + b)
        return EVENT.size + len(b)

    def _adopt(self, write_out, root, rel, budget):
        """Watches new directory ``rel`` and what is in it already (made before its watch
        was: ``mkdir -p a/b && touch a/b/f``), reported as created, at most ``budget[0]``
        entries of the tree; returns how many events and bytes."""
        self._add(os.path.join(root, rel), rel)
        taken = written = 0
        try:
            entries = list(os.scandir(os.path.join(root, rel)))
        except OSError:
            return 0, 0
        for entry in entries:
            if budget[0] <= 0:
                break
            budget[0] -= 1
            sub = os.path.join(rel, entry.name)
            written += self._report(write_out, _bud.WATCH_EVENT_CREATE, sub)
            taken += 1
            if entry.is_dir(follow_symlinks=False):
                n, b = self._adopt(write_out, root, sub, budget)
                taken += n
                written += b
        return taken, written


class Table:
    """The worker's live processes, by pid, and its directory watchers, by number."""

    def __init__(self):
        self.live = {}
        self.watchers = {}  # number -> (Watcher, root)
        self.next_watcher = 1
        self.kernels = []  # kernels made before READY (_Forked), not yet handed out

    def prepare_kernels(self, count):
        """Makes ``count`` code-context kernels before READY, each a fork of the worker as
        it stands when called (the template's modules imported and warmed up), and waits
        until each says ``ready`` (``bud_kernel.held``: its memory its own by then), so that
        they are template state: a START of :data:`KERNEL_SCRIPT` takes one instead of
        paying a fresh ``python3`` that imports the modules again (116-132 s of the
        datascience template's boot under kvm_pvm, against a fork). Call it before the
        worker starts threads or opens its mailbox: the fork copies neither, and has nothing
        of them to close. Returns the problems met (a kernel that did not come up is left
        out)."""
        problems = []
        for _ in range(count):
            try:
                kernel = _fork_kernel()
            except OSError as error:
                problems.append(f"kernel: {error}")
                continue
            line = kernel.stdout.readline()
            if line != b"ready\n":
                kernel.kill()
                kernel.wait()
                problems.append(f"kernel: {(line + kernel.stderr.read())[-300:]!r}")
                continue
            self.kernels.append(kernel)
        return problems

    def run(self, request, write_out, wait=None):
        """Runs process request ``request``; returns its exit code (a ``FILE_STATUS_*``).
        ``wait(fds, timeout)``: a ``select`` for readable ``fds`` that returns False if the
        host's interrupt came (the only place a poll may be interrupted: anywhere else it
        could lose an event it has taken)."""
        op = request.file_op
        args = [a.decode("utf-8", "surrogateescape") for a in request.args]
        if op == _bud.PROCESS_OP_START:
            pid = self.start(request, args[0] if args else "")
            write_out(str(pid).encode())
        elif op == _bud.PROCESS_OP_POLL:
            wait_ms, budget = (int(a) for a in args[:2])
            self.poll(wait_ms / 1000, budget, write_out, wait or _select)
        elif op == _bud.PROCESS_OP_STDIN:
            taken = self.stdin(self._process(request.code), request.stdin,
                               close=args[:1] == ["close"])
            write_out(str(taken).encode())
        elif op == _bud.PROCESS_OP_SIGNAL:
            self.signal(self._process(request.code), int(args[0]))
        elif op == _bud.PROCESS_OP_WATCH:
            wid = self.watch(request.code, args[:1] == ["recursive"], args[1:2] == ["entries"])
            write_out(str(wid).encode())
        elif op == _bud.PROCESS_OP_UNWATCH:
            w = self.watchers.pop(_number(request.code), None)
            if w is None:
                raise ProcessError(_bud.FILE_STATUS_NOT_FOUND, f"no watcher {request.code!r}")
            os.close(w[0].fd)
        elif op == _bud.PROCESS_OP_RESIZE:
            p = self._process(request.code)
            if p.master is None:
                raise ProcessError(_bud.FILE_STATUS_NOT_FOUND, f"process {p.pid} has no terminal")
            fcntl.ioctl(p.master, termios.TIOCSWINSZ, _size(args[0] if args else ""))
        else:
            raise ProcessError(_bud.FILE_STATUS_BAD_PATH, f"unknown process operation {op}")
        return _bud.FILE_STATUS_OK

    def watch(self, code, recursive, entries=False):
        path = os.path.join(WORKDIR, code.decode("utf-8", "surrogateescape"))
        if not os.path.exists(path):
            raise ProcessError(_bud.FILE_STATUS_NOT_FOUND, f"{path} does not exist")
        if not os.path.isdir(path):
            raise ProcessError(_bud.FILE_STATUS_BAD_PATH, f"{path} is not a directory")
        wid = self.next_watcher
        self.next_watcher += 1
        self.watchers[wid] = (Watcher(wid, path, recursive, entries), path)
        return wid

    def _process(self, code):
        try:
            pid = int(code)
        except ValueError:
            raise ProcessError(_bud.FILE_STATUS_BAD_PATH, f"bad pid {code!r}") from None
        p = self.live.get(pid)
        if p is None:
            raise ProcessError(_bud.FILE_STATUS_NOT_FOUND, f"no running process {pid}")
        return p

    def start(self, request, cwd):
        if self.kernels and _takes_kernel(request, cwd):
            p = Process(self.kernels.pop())
            self.live[p.pid] = p
            return p.pid
        if cwd and not os.path.isdir(cwd):
            raise ProcessError(_bud.FILE_STATUS_BAD_PATH, f"{cwd!r} is not a directory")
        user = _user(request)
        env = dict(os.environ)
        if user is not None:
            env.update(HOME=user.home, USER=user.name, LOGNAME=user.name, SHELL=user.shell)
        env.update((k.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape"))
                   for k, v in request.env)
        with_stdin = bool(request.flags & _bud.JOB_FLAGS_PROCESS_STDIN)
        script = request.code.decode("utf-8", "surrogateescape")
        if request.flags & _bud.JOB_FLAGS_PROCESS_PTY:
            if not any(k == b"TERM" for k, _ in request.env):
                env["TERM"] = "xterm-256color"  # a terminal, not the worker's "dumb"
            return self._start_pty(script, cwd, env, args_size(request), user)
        popen = _spawn(user, lambda: subprocess.Popen(
            ["/bin/sh", "-c", script],
            stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd or None, env=env,
            start_new_session=True, close_fds=True))
        p = Process(popen)
        self.live[p.pid] = p
        return p.pid

    def _start_pty(self, script, cwd, env, size, user):
        winsize = _size(size)
        master, slave = os.openpty()
        try:
            fcntl.ioctl(slave, termios.TIOCSWINSZ, winsize)
            if user is not None:
                # Its terminal is the user's (as login makes it): /dev/tty opens for it.
                os.fchown(slave, user.uid, user.gid)
            # setsid -c: a new session whose controlling terminal is its stdin (the slave).
            popen = _spawn(user, lambda: subprocess.Popen(
                ["/bin/busybox", "setsid", "-c", "/bin/sh", "-c", script],
                stdin=slave, stdout=slave, stderr=slave, cwd=cwd or None, env=env,
                close_fds=True))
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        p = Process(popen, master)
        self.live[p.pid] = p
        return p.pid

    def poll(self, wait_s, budget, write_out, wait):
        """Reports output and exits (module docs); returns when there is something to report
        (after gathering for GATHER_S more), after ``wait_s``, or at the host's interrupt."""
        taken = 0
        now = time.monotonic()
        end = now + wait_s
        while self.live or self.watchers:
            got, ended = self._take(budget - taken, write_out)
            taken += got
            for w, root in self.watchers.values():
                n, written = w.take(write_out, root, max(budget - taken, 0))
                ended += n
                taken += written
            if taken >= budget:
                return
            now = time.monotonic()
            if (got or ended) and end > now + GATHER_S:
                end = now + GATHER_S  # something came: gather a little more, then answer
            timeout = end - now
            if timeout <= 0:
                return
            fds = [fd for p in self.live.values() for fd in p.pipes]
            pidfds = [p.pidfd for p in self.live.values() if p.pidfd is not None]
            pidfds += [w.fd for w, _ in self.watchers.values()]
            if len(pidfds) < len(self.live) + len(self.watchers):
                timeout = min(timeout, NO_PIDFD_RECHECK_S)
            if not wait(fds + pidfds, timeout):
                return  # the host wants the VM for another request: answer now

    def _take(self, room, write_out):
        """Reads what the pipes hold and reaps what ended; returns the output bytes taken and
        the exits reported."""
        taken = ended = 0
        for pid, p in list(self.live.items()):
            for fd, kind in list(p.pipes.items()):
                while taken < room:
                    try:
                        data = os.read(fd, min(READ_CHUNK, room - taken))
                    except BlockingIOError:
                        break
                    except OSError:
                        data = b""  # a terminal whose other side is all closed: EIO
                    if not data:
                        if fd != p.master:  # the terminal stays open for input
                            p.close_pipe(fd)
                        p.pipes.pop(fd, None)
                        break
                    write_out(EVENT.pack(pid, kind, 0, len(data)) + data)
                    taken += len(data)
            if taken >= room:
                break
            status = p.reap()
            if status is not None and not self._pending(p):
                p.close()
                del self.live[pid]
                write_out(EVENT.pack(pid, _bud.PROCESS_EVENT_EXIT, status, 0))
                ended += 1
        return taken, ended

    @staticmethod
    def _pending(p):
        """Whether a reaped process's pipes still hold output (a child of it may keep them
        open forever: only what is there now is its)."""
        return bool(p.pipes) and bool(select.select(list(p.pipes), (), (), 0)[0])

    def stdin(self, p, data, close):
        if p.stdin is None:
            raise ProcessError(_bud.FILE_STATUS_NOT_FOUND,
                               f"process {p.pid} has no open stdin")
        taken = 0
        if data:
            try:
                taken = os.write(p.stdin.fileno(), data)
            except BlockingIOError:
                taken = 0
            except BrokenPipeError:
                raise ProcessError(_bud.FILE_STATUS_NOT_FOUND,
                                   f"process {p.pid} closed its stdin") from None
        if close:
            p.close_stdin()
        return taken

    def signal(self, p, signum):
        try:
            os.killpg(p.pid, signum)
        except ProcessLookupError:
            # The group is gone (the process reset its session, or is a zombie): the
            # process itself then.
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:
                pass
        except (OSError, ValueError) as error:
            raise ProcessError(_bud.FILE_STATUS_OS_ERROR, f"signal {signum}: {error}") from None


WORKDIR = "/tmp"

# What a code context's kernel is started as (``server/src/service/kernels.rs``).
KERNEL_SCRIPT = "exec python3 -m bud_kernel"


class _Forked:
    """A kernel forked by the worker, as :class:`Process` and :meth:`Table.prepare_kernels`
    use a ``Popen``: its pid, its ends of the pipes as files, its return code."""

    def __init__(self, pid, stdin, stdout, stderr):
        self.pid = pid
        self.stdin = os.fdopen(stdin, "wb")
        self.stdout = os.fdopen(stdout, "rb")
        self.stderr = os.fdopen(stderr, "rb")
        self.returncode = None

    def kill(self):
        os.kill(self.pid, signal.SIGKILL)

    def wait(self):
        _, status = os.waitpid(self.pid, 0)
        self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _fork_kernel():
    """Forks the worker into a code-context kernel (``bud_kernel.held``) on three new
    pipes, in a session of its own as :meth:`Table.start` starts processes; returns it."""
    import sys

    ends = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr: (read, write) each
    child_ends = (ends[0][0], ends[1][1], ends[2][1])
    # Text the worker has buffered would be written again by the child.
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            for target, fd in enumerate(child_ends):
                os.dup2(fd, target)
            # Nothing of the worker's: the pipes' other ends, its console and directory
            # descriptors (module globals, never collected, so never closed again).
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            os.chdir(WORKDIR)
            import bud_kernel

            bud_kernel.held()
        except BaseException:  # noqa: BLE001 - the parent reads why from the stderr pipe
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(70)  # held() never returns; this is the worker's code after it
    for fd in child_ends:
        os.close(fd)
    return _Forked(pid, ends[0][1], ends[1][0], ends[2][0])


def _takes_kernel(request, cwd):
    """Whether START ``request`` may take a kernel started before READY: the kernel's own
    script, with a stdin pipe, no terminal, no user and no directory, which is how the host
    starts a kernel. Its environment is the worker's: a kernel takes a cell's from the
    cell's request."""
    return (request.code == KERNEL_SCRIPT.encode() and not cwd and _user(request) is None
            and request.flags & _bud.JOB_FLAGS_PROCESS_STDIN
            and not request.flags & _bud.JOB_FLAGS_PROCESS_PTY)


# The worker's own supplementary groups, given back after a spawn as a user.
ROOT_GROUPS = os.getgroups()


def _user(request):
    """The user a START names (``args[2]``), or None: the worker's own (root)."""
    name = request.args[2].decode("utf-8", "surrogateescape") if len(request.args) > 2 else ""
    if not name:
        return None
    user = bud_users.TABLE.user(name)
    if user is None:
        raise ProcessError(_bud.FILE_STATUS_BAD_PATH, f"the guest has no user {name!r}")
    return user


def _spawn(user, popen):
    """``popen()``, run as ``user`` (or as the worker if None): the worker's thread takes
    the user's ids for the spawn only, so the ``vfork`` child inherits them (module docs)."""
    try:
        if user is None or user.uid == 0:
            return popen()  # the worker is root
        _bud.thread_as_user(user.uid, user.gid, user.groups)
        try:
            return popen()
        finally:
            _bud.thread_as_root(ROOT_GROUPS)
    except OSError as error:
        # A working directory or program the user may not enter or run is the request's.
        refused = error.errno in (errno.EACCES, errno.ENOENT, errno.ENOTDIR)
        status = _bud.FILE_STATUS_BAD_PATH if refused else _bud.FILE_STATUS_OS_ERROR
        raise ProcessError(status, f"starting the process: {error}") from None


def _number(code):
    try:
        return int(code)
    except ValueError:
        raise ProcessError(_bud.FILE_STATUS_BAD_PATH, f"bad number {code!r}") from None


def args_size(request):
    """The terminal size of a START (its second argument)."""
    return request.args[1].decode() if len(request.args) > 1 else ""


def _select(fds, timeout):
    select.select(fds, (), (), timeout)
    return True


TABLE = Table()
