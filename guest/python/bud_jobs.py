"""The job protocol, guest side: from ``ready()`` returning in a clone to the DONE doorbell.

The layout is ``vmm/src/protocol.rs`` (``job``, ``result``, ``outcome``), read through the
constants ``_bud`` exports; the host side is ``vmm/src/job.rs``. A clone runs exactly one
job: :meth:`JobRunner.serve` reads the request from the mailbox, gives the clone its own
identity, runs the job, writes ``OUTCOME`` / ``EXIT_CODE`` and rings DONE, and rings DONE
again every time it is resumed after that (it never runs a second job).

Per-clone identity (:class:`Identity`): the host has done the expensive part before the
clone resumes, by writing guest memory (``vmm/src/identity.rs``): the guest kernel's CRNG
keys, input pool and batched entropy replaced with host randomness, and CLOCK_REALTIME
moved to the host's wall clock (the clone keeps its template's monotonic clock, so the
kernel has no elapsed time to account). Here, with no syscall: Python's global ``random``
is seeded from ``job::SEED`` (a secret of its own, not the kernel's), and the clock is
checked against ``job::WALL_CLOCK_NS``; only if it is off by more than its tolerance
(a host that did not set it) does the worker call ``clock_settime`` (milliseconds of
emulated kernel work under kvm_pvm). Clones of one template still share CPython's hash
seed (``PYTHONHASHSEED`` is fixed at interpreter start): set and dict iteration orders of
str keys are the same in every clone.

Python jobs (:meth:`JobRunner._run_python`) get ``python3 -c CODE ARG...`` semantics in
this very process: a fresh ``__main__``, ``sys.argv == ['-c', *args]``, ``''`` at the front
of ``sys.path``, the job's environment in ``os.environ``, std streams from ``bud_io`` (the
mailbox areas, no syscalls), ``SystemExit`` / uncaught-exception handling and exit codes
as CPython's ``pymain``/``PyErr_Print`` do (the traceback printed by ``sys.excepthook``,
without the worker's own frame), then interpreter-exit order: non-daemon threads joined,
``atexit`` handlers, fd-level output collected, text layers flushed. An uncaught
``MemoryError`` is ``OUT_OF_MEMORY`` (exit code 1); an uncaught ``KeyboardInterrupt`` is
SIGNALED(SIGINT), as python3 re-raises it as a signal. Not reproduced: ``sys.flags``
(the worker runs with ``-s -P``), and ``os.exec*`` from a job (it replaces the worker: the
job ends as the agent's FAILED(WORKER_EXITED), and its fd-level output is not collected).

Shell jobs: ``bud_shell`` (a shell parked before READY). Everything a job could touch for
the first time on this path (stream objects, the ``__main__`` module, the audit hook, the
os wrappers, the shell) is created and exercised by :meth:`JobRunner.prepare`, before READY.

What this module must never do: enter the kernel on a pure-Python job's path beyond the
identity syscalls, run anything after DONE, or ring from a forked child.
"""

import atexit
import builtins
import faulthandler
import os
import posix
import random
import signal
import struct
import sys
import tempfile
import threading
import time
import types

import _bud
import bud_io
import bud_session
import bud_shell

# The clock is set only when it is off by more than these: bud's host sets the guest's clock
# itself before the clone resumes, which saves the clone a clock_settime (1-3 ms of emulated
# kernel here). WALL_CLOCK_NS is the host's time when it wrote the request, so a right clock
# reads it plus the time from then to this check: never less, and more by however long the
# host took to resume the vCPU (milliseconds, more on a loaded host). Behind it is wrong at
# once; ahead of it only by more than any plausible resume delay.
CLOCK_BEHIND_TOLERANCE_NS = 20_000_000
CLOCK_AHEAD_TOLERANCE_NS = 10_000_000_000

# The job's outcome when the worker itself failed to run it (its stderr says why).
EXIT_INTERNAL = 70

MARKS = bud_io.MARKS  # timing marks of the job path (see bud_io)

# LANGUAGE, CODE_LEN, STDIN_LEN, ARGC, ARGS_LEN, ENVC, ENV_LEN: seven adjacent u32s.
_REQUEST_HEADER = struct.Struct("<7I")
assert _bud.JOB_ENV_LEN == _bud.JOB_LANGUAGE + 6 * 4
_WALL_CLOCK = struct.Struct("<Q")  # also the output limit's u64
# MODE, FLAGS, SEQUENCE, FILE_OP: four adjacent u32s.
_REQUEST_KIND = struct.Struct("<4I")
_U32 = struct.Struct("<I")
_SEQUENCE = struct.Struct("<I")
assert _bud.JOB_FILE_OP == _bud.JOB_MODE + 3 * 4


class ProtocolError(Exception):
    """The request in the mailbox does not fit the protocol."""


def _split(blob, count):
    """``count`` NUL-terminated byte strings from ``blob``."""
    parts = bytes(blob).split(b"\0")
    if len(parts) != count + 1 or parts[-1]:
        raise ProtocolError(f"expected {count} NUL-terminated strings")
    return parts[:count]


class Request:
    """One job request, read from the mailbox. ``stdin`` is a memoryview on the mailbox
    (not copied); the rest are bytes, args and env as lists."""

    __slots__ = ("language", "code", "stdin", "args", "env", "wall_clock_ns", "seed", "mode",
                 "flags", "sequence", "file_op", "namespace", "output_limit")

    def __init__(self, language, code, stdin=b"", args=(), env=(), wall_clock_ns=0, seed=b"",
                 mode=_bud.MODE_JOB, flags=0, sequence=0, file_op=0, namespace=0,
                 output_limit=0):
        self.language = language
        self.code = code
        self.stdin = memoryview(stdin)
        self.args = list(args)
        self.env = list(env)
        self.wall_clock_ns = wall_clock_ns
        self.seed = seed
        self.mode = mode
        self.flags = flags
        self.sequence = sequence
        self.file_op = file_op
        self.namespace = namespace
        self.output_limit = output_limit  # 0: not given (the capture keeps its size)

    @property
    def reseed(self):
        """Whether Python's ``random`` takes this request's seed (a one-shot job always; a
        session when it starts or forks, so its own random state carries between cells)."""
        return self.mode == _bud.MODE_JOB or bool(self.flags & _bud.JOB_FLAGS_RESEED)

    @classmethod
    def read(cls, view):
        language, code_len, stdin_len, argc, args_len, envc, env_len = (
            _REQUEST_HEADER.unpack_from(view, _bud.JOB_LANGUAGE)
        )
        if code_len + stdin_len + args_len + env_len > _bud.JOB_DATA_END - _bud.JOB_DATA:
            raise ProtocolError("request data larger than its area")
        at = _bud.JOB_DATA
        code = bytes(view[at : at + code_len])
        at += code_len
        stdin = view[at : at + stdin_len]
        at += stdin_len
        args = _split(view[at : at + args_len], argc)
        at += args_len
        env = [entry.partition(b"=")[::2] for entry in _split(view[at : at + env_len], envc)]
        (wall_clock_ns,) = _WALL_CLOCK.unpack_from(view, _bud.JOB_WALL_CLOCK_NS)
        seed = bytes(view[_bud.JOB_SEED : _bud.JOB_SEED + _bud.JOB_SEED_LEN])
        mode, flags, sequence, file_op = _REQUEST_KIND.unpack_from(view, _bud.JOB_MODE)
        (namespace,) = _U32.unpack_from(view, _bud.JOB_NAMESPACE)
        (output_limit,) = _WALL_CLOCK.unpack_from(view, _bud.JOB_OUTPUT_LIMIT)
        return cls(language, code, stdin, args, env, wall_clock_ns, seed, mode, flags,
                   sequence, file_op, namespace, output_limit)


class Identity:
    """Makes a clone distinct on the Python side: ``random`` (and numpy's global random state
    when numpy is loaded) and a clock check (module docs).

    ``enabled=False`` (host tests: setting the clock needs root and would change the *host's*
    clock) skips the clock; ``random`` is still reseeded."""

    def __init__(self, enabled):
        self.enabled = enabled
        self.clock_set = False  # whether the last apply() had to set the clock

    def apply(self, request, warn):
        """Returns None, or why the clone must not run the job. A failed clock is only a
        warning (``warn``): the job runs with the template's."""
        if request.reseed:
            random.seed(int.from_bytes(request.seed, "little"))
            tempfile._name_sequence = None  # its own Random, seeded before READY
            # A template that imported numpy (datascience) holds numpy's global RandomState
            # as seeded before READY: every clone would draw the same numbers.
            # (default_rng() and SeedSequence() take fresh entropy from the reseeded CRNG.)
            numpy_random = sys.modules.get("numpy.random")
            if numpy_random is not None:
                seed = request.seed
                numpy_random.seed([int.from_bytes(seed[i : i + 4], "little")
                                   for i in range(0, len(seed), 4)])
        if not self.enabled:
            return None
        ahead = time.time_ns() - request.wall_clock_ns
        self.clock_set = not -CLOCK_BEHIND_TOLERANCE_NS <= ahead <= CLOCK_AHEAD_TOLERANCE_NS
        if self.clock_set:
            try:
                time.clock_settime_ns(time.CLOCK_REALTIME, request.wall_clock_ns)
            except OSError as error:
                warn(f"clock_settime: {error}")
        MARKS["clock"] = time.perf_counter()
        return None


def _exit_status(error):
    """The exit status of ``SystemExit`` as CPython's ``handle_system_exit`` makes it; a
    non-integer code is printed to ``sys.stderr`` first."""
    code = error.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF if -(2**63) <= code < 2**63 else 0xFF
    try:
        if sys.stderr is not None:
            print(code, file=sys.stderr)
    except Exception:  # noqa: BLE001 - as CPython: the status is 1 regardless
        pass
    return 1


def _join_threads():
    """Joins non-daemon threads until none is left (``threading._shutdown`` without
    stopping the main thread, so that it can also run before READY)."""
    me = threading.current_thread()
    while True:
        others = [t for t in threading.enumerate() if t is not me and not t.daemon]
        if not others:
            return
        for thread in others:
            thread.join()


class _Context:
    """What one job uses and a clone must not build after READY: its streams and its
    ``__main__``."""

    def __init__(self, areas, text_settings):
        self.streams = bud_io.make_streams(areas, text_settings)
        main = types.ModuleType("__main__")
        main.__loader__ = builtins.__loader__
        main.__annotations__ = {}
        main.__builtins__ = builtins
        self.main = main


# Jobs run before READY through the same path as real ones (output to a fake host), so that
# clones find their code paths warm: printing, stdin, argv/env, SystemExit, tracebacks,
# syntax errors, fd-level output, FLUSH cycles.
WARM_JOBS = (
    (b"print(1+1)", b"", (), ()),
    (
        b"import os, sys\nprint(sys.stdin.read(), sys.argv, os.environ['BUD_WARM'], "
        b"file=sys.stderr)\nsys.stdout.buffer.write(sys.stdin.buffer.read())\n"
        b"raise SystemExit(3)",
        b"line one\nline two\n",
        (b"arg",),
        ((b"BUD_WARM", b"1"),),
    ),
    (b"def f():\n    return 1 / 0\nf()", b"", (), ()),
    (b"def broken(:", b"", (), ()),
    (b"import os, sys\nos.write(1, b'fd\\n')\nprint('x' * 70000, end='')\nsys.exit('bye')",
     b"", (), ()),
)


class JobRunner:
    """Runs the one job of a clone. ``view``: the mailbox memoryview; ``ring``: ``_bud.ring``
    (or a fake host); ``identity``: False on hosts (see :class:`Identity`)."""

    def __init__(self, view, ring, *, identity=True, capture_dir="/tmp",
                 shell=bud_shell.SHELL, clock=time.perf_counter):
        self.view = view
        self.ring = _from_any_thread(ring) if ring is _bud.ring else ring
        self.areas = bud_io.Areas(view, self.ring, clock)
        self.capture = bud_io.FdCapture(capture_dir, clock,
                                        bounded=capture_dir == bud_io.CAPTURE_DIR)
        self.areas.capture = self.capture
        self.identity = Identity(identity)
        self.text_settings = bud_io.python_text_settings()
        self.shell = bud_shell.ParkedShell(shell)
        self.shell_path = shell
        self.active = False
        # The host's interrupt is raised as KeyboardInterrupt only while a request runs
        # (``_interruptible``); one that lands before (the clone resumed past its deadline)
        # or after (the job ended as its time ran out) is held for the request it names.
        self._interruptible = False
        self._held = 0
        self.warnings = []
        self._context = None
        self._current = None
        self._display = None  # display data of the last cell (bud_session.display_of)
        self._figures = []  # the figures of the last Python request (bud_session.take_figures)
        self._error = None  # the last cell's exception, when asked for in the display
        self._namespaces = {}  # a session's namespaces other than __main__, by number

    # ---- before READY

    def prepare(self, park_shell=True):
        """Everything before READY: hooks, the parked shell, warm-up jobs, and the objects
        the clone's job will use. Returns the warm-up problems (empty when all went well)."""
        faulthandler.enable(file=self.capture.console_err)
        bud_io.install_os_wrappers(self)
        sys.addaudithook(self._audit)
        os.register_at_fork(after_in_child=self._after_fork_in_child)
        problems = []
        if park_shell:
            try:
                self.shell.start()
            except OSError as error:
                problems.append(f"no parked shell ({error}); shell jobs will spawn one")
        problems.extend(self._warm_up())
        self._context = _Context(self.areas, self.text_settings)
        return problems

    def _warm_up(self):
        bud_shell.job_script(b"echo 'hi'", [b"a b"], [(b"K", b"v")], 1)
        Request.read(self.view)  # an all-zero request: exercises the reader
        real_ring = self.areas.ring
        self.areas.ring = self._warm_ring
        problems = []
        try:
            for code, stdin, args, env in WARM_JOBS:
                request = Request(_bud.LANGUAGE_PYTHON, code, stdin, args, env, 0, bytes(32))
                saved = _save_interpreter_state()
                try:
                    random.seed(int.from_bytes(request.seed, "little"))
                    self._run(request, _Context(self.areas, self.text_settings), warm=True)
                except BaseException as error:  # noqa: BLE001 - reported, not fatal
                    problems.append(f"warm job {code[:20]!r}: {error!r}")
                finally:
                    self.active = False
                    _restore_interpreter_state(saved)
                    self.areas.reset()
                    self.capture.reset()
        finally:
            self.areas.ring = real_ring
        return problems

    def _warm_ring(self, code, a=0, b=0):
        """The host's part of FLUSH, before READY: drop the output."""
        del a, b
        self.areas.reset()
        self.areas.streaming = True
        return code

    # ---- in the clone

    def serve(self):
        """Runs the requests the host gives this clone, one per resume, and reports each with
        DONE. Never returns. A one-shot job's VM gets one request (and file operations around
        it); a session's gets one per cell. Resumed without a new request (the sequence
        number of the one it ran), it rings DONE again without running anything."""
        done = None  # sequence number of the last request run
        first = True
        while True:
            MARKS.clear()  # the warm-up jobs' (or the last request's) marks
            MARKS["resumed"] = time.perf_counter()
            request = failure = None
            try:
                request = Request.read(self.view)
            except BaseException as error:  # noqa: BLE001 - see below
                failure = f"{type(error).__name__}: {error}"
            if request is not None and request.sequence == done:
                self._ring_done(done)
                continue
            if request is not None:
                done = request.sequence
            try:
                if not first:
                    self.areas.reset()
                    self.capture.next_request()
                first = False
                MARKS["read"] = time.perf_counter()
                if request is None:
                    raise ProtocolError(failure)
                failure = self.identity.apply(request, self.warn)
                MARKS["identity"] = time.perf_counter()
                if failure is None:
                    outcome, code = self._run_interruptible(request)
                else:
                    outcome, code = self._internal_failure(failure)
            except KeyboardInterrupt:
                # The host's interrupt, landed in bud's own code around the job: the job
                # ends as interrupted (the host gives the status).
                outcome, code = _bud.OUTCOME_SIGNALED, signal.SIGINT
            except BaseException as error:  # noqa: BLE001 - a bug of ours: report, never hang
                outcome, code = self._internal_failure(f"{type(error).__name__}: {error}")
            MARKS["finished"] = time.perf_counter()
            self.areas.streaming = False
            self.active = False
            bud_io.write_u32_pair(self.view, _bud.RESULT_OUTCOME, outcome, code)
            flags = _bud.GUEST_FLAGS_CLOCK_SET if self.identity.clock_set else 0
            bud_io.write_phases(self.view, MARKS, flags)
            if self._display or self._figures or self._error:
                bud_session.write_display(self.view, self._display or (), self._figures,
                                          self._error)
            self._display = None
            self._figures = []
            self._error = None
            self._ring_done(done)

    def _run_interruptible(self, request):
        """Runs ``request`` with the host's interrupt armed; one held for it (sent before it
        started) ends it before it runs anything."""
        self._interruptible = True  # first: an interrupt from here on raises
        try:
            if self._held == request.sequence:
                return _bud.OUTCOME_SIGNALED, signal.SIGINT
            return self._run(request, self._context)
        finally:
            self._interruptible = False

    def _ring_done(self, sequence):
        """DONE, even if a SIGINT that raises lands now (one not from the watcher: the
        watcher's are held outside a run, see ``on_sigint``), whose KeyboardInterrupt would
        otherwise escape serve and end the worker. If it lands as ``ring`` returns, the host
        has resumed the VM with a new request: serve it."""
        while True:
            try:
                self.ring(_bud.DONE, 0, 0)
                return
            except KeyboardInterrupt:
                if _SEQUENCE.unpack_from(self.view, _bud.JOB_SEQUENCE)[0] != sequence:
                    return

    def warn(self, message):
        """One line on the console (not the job's output)."""
        self.warnings.append(message)
        try:
            posix.write(self.capture.console_err, f"bud-worker: {message}\n".encode())
        except OSError:
            pass

    def _internal_failure(self, message):
        self.warn(message)
        try:
            self.areas.streaming = False
            self.areas.write(bud_io.STDERR, f"bud-worker: {message}\n".encode())
        except BaseException:  # noqa: BLE001 - the outcome still goes out
            pass
        return _bud.OUTCOME_EXITED, EXIT_INTERNAL

    def _run(self, request, context, warm=False):
        self._current = context
        context.streams.reader.attach(request.stdin, self.capture)
        self.capture.begin(context.streams.reader, request.output_limit)
        self.active = True
        self.areas.start()
        MARKS["started"] = time.perf_counter()
        if request.language == _bud.LANGUAGE_PYTHON and request.mode == _bud.MODE_CELL:
            return self._run_cell(request, context)
        if request.language == _bud.LANGUAGE_PYTHON:
            return self._run_python(request, context, warm)
        if request.language == _bud.LANGUAGE_SHELL:
            return self._run_shell(request)
        if request.language == _bud.LANGUAGE_FILES:
            return self._run_file_op(request)
        return self._internal_failure(f"unknown job language {request.language}")

    # ---- Python jobs

    def _run_python(self, request, context, warm):
        source = request.code.decode("utf-8", "surrogateescape")
        args = [os.fsdecode(arg) for arg in request.args]
        sys.argv = ["-c", *args]
        sys.orig_argv = [sys.orig_argv[0] if sys.orig_argv else "python3", "-c", source, *args]
        sys.path.insert(0, "")
        for name, value in request.env:
            os.environb[name] = value
        sys.modules["__main__"] = context.main
        context.streams.install()
        outcome, code = _exec_main(source, context.main.__dict__)
        self._take_figures()  # before atexit: pyplot's handler closes every figure
        return self._finish_python(outcome, code, context, run_atexit=not warm)

    def _take_figures(self):
        try:
            self._figures = bud_session.take_figures()
        except BaseException as error:  # noqa: BLE001 - the outcome still goes out
            self.warn(f"figures: {type(error).__name__}: {error}")

    def _run_cell(self, request, context):
        """A session cell: the session's ``__main__`` (``context.main``, kept from cell to
        cell), a displayed final expression, no interpreter exit (bud_session docs)."""
        source = request.code.decode("utf-8", "surrogateescape")
        if request.reseed:  # the session's first request (or a fork's): python3's argv
            sys.argv = [""]
            if not sys.path or sys.path[0] != "":
                sys.path.insert(0, "")
        for name, value in request.env:
            os.environb[name] = value
        sys.modules["__main__"] = context.main
        context.streams.install()
        namespace = self._namespace(request, context)
        report = None
        if request.flags & _bud.JOB_FLAGS_ERROR_IN_DISPLAY:
            def report(error):
                self._error = bud_session.error_of(error)
        outcome, code, value = _exec_cell(source, namespace, report)
        if value is not None:
            self._display = bud_session.display_of(value)
        self._take_figures()
        self.areas.streaming = False
        self.capture.sync_all(self.areas)
        if not _flush_text(context) and outcome == _bud.OUTCOME_EXITED:
            code = 120
        return outcome, code

    def _namespace(self, request, context):
        """The globals a cell runs in (``job::NAMESPACE``): the session's ``__main__`` or a
        context's own dict, emptied first when the request says so."""
        if request.namespace == 0:
            namespace = context.main.__dict__
        else:
            namespace = self._namespaces.get(request.namespace)
            if namespace is None:
                namespace = self._namespaces[request.namespace] = {}
        if request.flags & _bud.JOB_FLAGS_RESET_NAMESPACE or not namespace:
            kept = {k: namespace[k] for k in ("__loader__", "__spec__") if k in namespace}
            namespace.clear()
            namespace.update(kept, __name__="__main__", __doc__=None, __builtins__=builtins,
                             __annotations__={})
        return namespace

    def _run_file_op(self, request):
        def write_out(data):
            self.areas.write(bud_io.STDOUT, data)

        try:
            return _bud.OUTCOME_EXITED, bud_session.file_op(
                request.file_op, request.code, request.stdin, write_out)
        except bud_session.FileError as error:
            self.areas.write(bud_io.STDERR, f"{error}\n".encode("utf-8", "backslashreplace"))
            return _bud.OUTCOME_EXITED, error.status

    def _finish_python(self, outcome, code, context, run_atexit):
        """Interpreter exit, in ``Py_FinalizeEx``'s order."""
        _join_threads()
        if run_atexit:
            atexit._run_exitfuncs()
        if self.areas.forked:
            _flush_text(context)
            bud_io._ORIGINAL["_exit"](code)
        self.areas.streaming = False
        self.capture.sync_all(self.areas)
        if not _flush_text(context) and outcome == _bud.OUTCOME_EXITED:
            code = 120  # as python3 when flushing stdout fails at exit
        return outcome, code

    # ---- shell jobs

    def _run_shell(self, request):
        if b"\0" in request.code:
            self.areas.write(bud_io.STDERR, b"sh: the script contains a NUL byte\n")
            return _bud.OUTCOME_EXITED, 2
        self.capture.materialize_stdin()
        self.capture.mark_sticky()
        result = waiter = None
        try:
            if self.shell.parked:
                seed = int.from_bytes(request.seed[:4], "little") & 0x7FFFFFFF
                script = bud_shell.job_script(request.code, request.args, request.env, seed)
                if request.mode == _bud.MODE_CELL:  # where the session's cells have gone
                    script = b"cd -- " + bud_shell.quote(os.getcwdb()) + b" || exit\n" + script
                result = self.shell.run(script, self.areas)
            if result is None:
                waiter = bud_shell.spawn_shell(self.shell_path, request.code, request.args,
                                               request.env)
                result = waiter.wait(self.areas)
        except KeyboardInterrupt:
            # The host's interrupt (past the timeout, or over the output cap): keep what the
            # shell wrote first (into the areas, which the host takes even if the grace runs
            # out), then, in a session, stop it (its exit costs ~0.1-0.3 s of guest kernel);
            # the host gives the status.
            self.areas.streaming = False
            self.capture.sync_all(self.areas)
            if request.mode == _bud.MODE_CELL:  # a one-shot job's VM is thrown away
                if waiter is None:
                    self.shell.retire()
                else:
                    bud_shell.kill(waiter)
            return _bud.OUTCOME_SIGNALED, signal.SIGINT
        self.areas.streaming = False
        self.capture.sync_all(self.areas)
        return result

    # ---- hooks

    def _audit(self, event, args):
        """sys.addaudithook: notices what may write below Python's level (bud_io docs).
        Must never raise: that would fail the job's own operation."""
        if not self.active:
            return
        try:
            if event in bud_io.STICKY_EVENTS:
                self.capture.mark_sticky()
                self.capture.materialize_stdin()
            elif event == "open":
                path = args[0]
                if isinstance(path, int) or (
                    isinstance(path, (str, bytes)) and path[:5] in ("/dev/", b"/dev/", "/proc",
                                                                     b"/proc")
                ):
                    self.capture.mark_sticky()
                    self.capture.materialize_stdin()
            elif event.startswith("ctypes."):
                self.capture.mark_sticky()
        except BaseException as error:  # noqa: BLE001 - see above
            self.warn(f"audit hook ({event}): {error!r}")

    def before_wait_any(self):
        """A Python job is about to wait for *any* child: the parked shell must not be one
        (see bud_shell). Called by the os wrappers of bud_io."""
        if not self.areas.forked:
            self.shell.retire()

    def on_sigint(self, signum, frame):
        """The worker's SIGINT handler while the interrupt watcher runs: ``KeyboardInterrupt``,
        unless the signal is the watcher's for a request that has ended since (the host
        already runs the next one): that one is dropped, so a late interrupt never hits the
        next cell (see ``interrupt.rs``). One for the current request that lands outside its
        run (a clone resumed past its deadline, at READY or DONE; a job that ended as its
        time ran out) is held: the request, if it has not run yet, ends before it starts. A
        SIGINT from anyone else raises as usual."""
        del signum, frame
        sent = _bud.take_interrupt()
        if sent and not self.areas.forked:
            if _SEQUENCE.unpack_from(self.view, _bud.JOB_SEQUENCE)[0] != sent:
                return
            if not self._interruptible:
                self._held = sent
                return
        raise KeyboardInterrupt

    def _after_fork_in_child(self):
        self.areas.after_fork_in_child()
        if self._current is not None:
            self._current.streams.reader.after_fork_in_child()


def _from_any_thread(ring):
    """``_bud.ring`` usable from threads a job starts: the kernel gives them the doorbell
    permission (ioperm is inherited by new threads), but ``_bud`` only knows the threads
    that called ``take_doorbell``, so a new thread's first ring takes it (one ioperm)."""

    def ring_here(code, a=0, b=0):
        try:
            return ring(code, a, b)
        except RuntimeError:
            _bud.take_doorbell()
            return ring(code, a, b)

    return ring_here


def _exec_main(source, namespace):
    """Compiles and runs the job's code in ``namespace``; returns (outcome, exit status).

    The ``try`` is in this frame, so the traceback of anything the job raises starts here:
    dropping this one frame leaves exactly what ``python3 -c`` prints."""
    try:
        code = compile(source, "<string>", "exec")
        MARKS["compiled"] = time.perf_counter()
        exec(code, namespace)
    except SystemExit as error:
        return _bud.OUTCOME_EXITED, _exit_status(error)
    except BaseException as error:  # noqa: BLE001 - every uncaught exception is reported
        error.__traceback__ = error.__traceback__.tb_next if error.__traceback__ else None
        _print_uncaught(error)
        if isinstance(error, MemoryError):
            return _bud.OUTCOME_OUT_OF_MEMORY, 1
        if isinstance(error, KeyboardInterrupt):
            return _bud.OUTCOME_SIGNALED, signal.SIGINT
        return _bud.OUTCOME_EXITED, 1
    return _bud.OUTCOME_EXITED, 0


def _exec_cell(source, namespace, report=None):
    """Runs a cell in ``namespace``: (outcome, exit status, the final expression's value or
    None). Errors are reported as :func:`_exec_main` reports them, or given to ``report``."""
    try:
        body, last = bud_session.compile_cell(source)
        MARKS["compiled"] = time.perf_counter()
        exec(body, namespace)
        value = None if last is None else eval(last, namespace)
    except SystemExit as error:
        return _bud.OUTCOME_EXITED, _exit_status(error), None
    except BaseException as error:  # noqa: BLE001 - every uncaught exception is reported
        error.__traceback__ = error.__traceback__.tb_next if error.__traceback__ else None
        if report is None:
            _print_uncaught(error)
        else:
            report(error)
        if isinstance(error, MemoryError):
            return _bud.OUTCOME_OUT_OF_MEMORY, 1, None
        if isinstance(error, KeyboardInterrupt):
            return _bud.OUTCOME_SIGNALED, signal.SIGINT, None
        return _bud.OUTCOME_EXITED, 1, None
    if value is not None:
        namespace["_"] = value
    return _bud.OUTCOME_EXITED, 0, value


def _print_uncaught(error):
    """``PyErr_Print``: ``sys.last_*``, then ``sys.excepthook``; if the hook fails, both
    tracebacks through the default hook."""
    kind, tb = type(error), error.__traceback__
    sys.last_type, sys.last_value, sys.last_traceback = kind, error, tb
    try:
        hook = sys.excepthook
        hook(kind, error, tb)
    except BaseException as hook_error:  # noqa: BLE001 - reported as CPython does
        try:
            if sys.stderr is not None:
                print("Error in sys.excepthook:", file=sys.stderr)
                sys.__excepthook__(type(hook_error), hook_error, hook_error.__traceback__)
                print("\nOriginal exception was:", file=sys.stderr)
                sys.__excepthook__(kind, error, tb)
        except BaseException:  # noqa: BLE001 - out of memory, closed stderr...
            pass


def _flush_text(context):
    """Flushes ``sys.stdout``/``sys.stderr`` and the job's own text layers (a job may have
    replaced the former); False if flushing stdout failed."""
    ok = True
    seen = set()
    for stream in (sys.stdout, sys.stderr, context.streams.stdout, context.streams.stderr):
        if stream is None or id(stream) in seen:
            continue
        seen.add(id(stream))
        try:
            if not getattr(stream, "closed", False):
                stream.flush()
        except Exception:  # noqa: BLE001 - as CPython: reported by the exit status only
            if stream is sys.stdout:
                ok = False
    return ok


def _save_interpreter_state():
    """What a job changes in the interpreter (warm-up jobs are undone afterwards)."""
    return (
        list(sys.argv),
        list(getattr(sys, "orig_argv", [])),
        list(sys.path),
        sys.modules.get("__main__"),
        (sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__),
        dict(os.environb),
    )


def _restore_interpreter_state(saved):
    argv, orig_argv, path, main, streams, environ = saved
    sys.argv = argv
    sys.orig_argv = orig_argv
    sys.path[:] = path
    sys.modules["__main__"] = main
    (sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__) = streams
    for name in set(os.environb) - set(environ):
        del os.environb[name]
    for name, value in environ.items():
        if os.environb.get(name) != value:
            os.environb[name] = value
    for name in ("last_type", "last_value", "last_traceback"):
        if hasattr(sys, name):
            delattr(sys, name)
