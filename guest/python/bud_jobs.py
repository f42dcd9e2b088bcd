"""The job protocol, guest side: from ``ready()`` returning in a clone to the DONE doorbell.

The layout is ``vmm/src/protocol.rs`` (``job``, ``result``, ``outcome``), read through the
constants ``_bud`` exports; the host side is ``vmm/src/job/``. :meth:`JobRunner.serve` reads
each request from the mailbox (``bud_request``), gives the clone its own identity, runs the
request, writes ``OUTCOME`` / ``EXIT_CODE`` and rings DONE; resumed without a new request, it
rings DONE again without running anything.

Per-clone identity (``bud_request.Identity``): the host has done the expensive part before
the clone resumes, by writing guest memory (``vmm/src/identity.rs``): the guest kernel's CRNG
keys, input pool and batched entropy replaced with host randomness, and CLOCK_REALTIME moved
to the host's wall clock (the clone keeps its template's monotonic clock, so the kernel has
no elapsed time to account). Here, with no syscall: Python's global ``random`` is seeded
from ``job::SEED`` (a secret of its own, not the kernel's), and the clock is checked against
``job::WALL_CLOCK_NS``; only if it is off by more than its tolerance (a host that did not set
it) does the worker call ``clock_settime`` (milliseconds of emulated kernel work under
kvm_pvm). Clones of one template still share CPython's hash seed (``PYTHONHASHSEED`` is
fixed at interpreter start): set and dict iteration orders of str keys are the same in
every clone.

Python jobs (:meth:`JobRunner._run_python`) get ``python3 -c CODE ARG...`` semantics in
this very process (``bud_exec``): a fresh ``__main__``, ``sys.argv == ['-c', *args]``,
``''`` at the front of ``sys.path``, the job's environment in ``os.environ``, std streams
from ``bud_io`` (the mailbox areas, no syscalls), ``SystemExit`` / uncaught-exception
handling and exit codes as CPython's ``pymain``/``PyErr_Print`` do (the traceback printed by
``sys.excepthook``, without the worker's own frames), then interpreter-exit order:
non-daemon threads joined, ``atexit`` handlers, fd-level output collected, text layers
flushed. An uncaught ``MemoryError`` is ``OUT_OF_MEMORY`` (exit code 1); an uncaught
``KeyboardInterrupt`` is SIGNALED(SIGINT), as python3 re-raises it as a signal. Not
reproduced: ``sys.flags`` (the worker runs with ``-s -P``), and ``os.exec*`` from a job (it
replaces the worker: the job ends as the agent's FAILED(WORKER_EXITED), and its fd-level
output is not collected).

The host's interrupt (SIGINT from the watcher, ``interrupt.rs``) raises ``KeyboardInterrupt``
only while a request runs (:meth:`JobRunner.on_sigint`); one that lands outside is held for
the request it names, which then ends before it runs.

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
import select
import signal
import sys
import time
import types

import _bud
import bud_capture
import bud_exec
import bud_io
import bud_layer
import bud_procs
import bud_program
import bud_request
import bud_session
import bud_shell

# The job's outcome when the worker itself failed to run it (its stderr says why).
EXIT_INTERNAL = 70

MARKS = bud_io.MARKS  # timing marks of the job path (see bud_io)

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
        self.capture = bud_capture.FdCapture(capture_dir, clock,
                                        bounded=capture_dir == bud_capture.CAPTURE_DIR)
        self.areas.capture = self.capture
        self.identity = bud_request.Identity(identity)
        self.text_settings = bud_io.python_text_settings()
        self.shell = bud_shell.ParkedShell(shell)
        self.shell_path = shell
        self.active = False
        # The host's interrupt is raised as KeyboardInterrupt only while a request runs
        # (``_interruptible``); one that lands before (the clone resumed past its deadline)
        # or after (the job ended as its time ran out) is held for the request it names.
        self._interruptible = False
        self._held = None  # the sequence number of the request an interrupt is held for
        self.warnings = []
        self._context = None
        self._current = None
        self._display = None  # display data of the last cell (bud_session.display_of)
        self._figures = []  # the figures of the last Python request (bud_session.take_figures)
        self._error = None  # the last cell's exception, when asked for in the display
        self._namespaces = {}  # a session's namespaces other than __main__, by number
        self._cwds = {}  # each namespace's working directory, kept while another's runs
        # For a template layer (bud_layer.apply): the worker manifest's path and the
        # worker's wait for a settled run queue before READY, set by bud_worker.
        self.manifest_path = None
        self.settle = None
        self._cwd_of = 0  # the namespace whose working directory the process has
        self._started = set()  # namespaces that have entered their start directory
        self.beside = None  # the lane beside (bud_beside.Beside), in a guest
        self.kernel = None  # the image's kernel runtime (bud_runtime), started
        self.programs = []  # the template's program runtimes (bud_program), by number
        self._kernel_reseed = False  # its next request must give it the clone's identity

    # ---- before READY

    def prepare(self, park_shell=True):
        """Everything before READY: hooks, the parked shell, warm-up jobs, and the objects
        the clone's job will use. Returns the warm-up problems (empty when all went well)."""
        faulthandler.enable(file=self.capture.console_err)
        bud_capture.install_os_wrappers(self)
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
        bud_request.Request.read(self.view)  # an all-zero request: exercises the reader
        real_ring = self.areas.ring
        self.areas.ring = self._warm_ring
        problems = []
        try:
            for code, stdin, args, env in WARM_JOBS:
                request = bud_request.Request(_bud.LANGUAGE_PYTHON, code, stdin, args, env, 0,
                                              bytes(32))
                saved = bud_exec.save_interpreter_state()
                try:
                    random.seed(int.from_bytes(request.seed, "little"))
                    self._run(request, _Context(self.areas, self.text_settings), warm=True)
                except BaseException as error:  # noqa: BLE001 - reported, not fatal
                    problems.append(f"warm job {code[:20]!r}: {error!r}")
                finally:
                    self.active = False
                    bud_exec.restore_interpreter_state(saved)
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
                request = bud_request.Request.read(self.view)
            except BaseException as error:  # noqa: BLE001 - see below
                failure = f"{type(error).__name__}: {error}"
            if (request is not None and request.language == _bud.LANGUAGE_KERNEL
                    and self.kernel is not None):
                # The kernel runtime's request: it runs it and rings DONE (bud_runtime). A
                # clone's (or fork's) first request that the worker served carried the
                # RESEED the kernel must see too.
                self.kernel.hand_over(reseed=self._kernel_reseed)
                self._kernel_reseed = False
                continue
            if request is not None and request.reseed:
                self._kernel_reseed = True
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
                    raise bud_request.ProtocolError(failure)
                failure = self.identity.apply(request, self.warn)
                MARKS["identity"] = time.perf_counter()
                if failure is None and request.language == _bud.LANGUAGE_LAYER:
                    failure = self._apply_layer(request)
                    if failure is None:
                        # A clone of the template this layer made: the host wrote its
                        # first request before resuming it.
                        done = None
                        continue
                    outcome, code = self._internal_failure(failure)
                elif failure is None:
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

    def _apply_layer(self, request):
        """A template layer (``bud_layer.apply``): returns None in each clone of the template
        it made (READY returned), or why it failed."""
        if self.kernel is not None or self.settle is None:
            return "a layer needs a worker without a kernel runtime, started by bud_worker"
        try:
            bud_layer.apply(request.code.decode("utf-8"), self.manifest_path,
                            (self.capture.console_out, self.capture.console_err))
            self.programs = bud_program.load(self.manifest_path)
            # The parked shell has the parent's environment and working directory: park
            # one with the layer's, as a first boot parks it after the layers.
            if self.shell.parked:
                self.shell.retire()
                self.shell = bud_shell.ParkedShell(self.shell_path)
                self.shell.start()
        except bud_layer.UserWarmFailed as error:
            return str(error)
        except Exception as error:  # noqa: BLE001 - the build reports it, the VM is dropped
            return f"the layer failed: {type(error).__name__}: {error}"
        # Empty areas and capture files, as after the first boot's warm-up jobs: what the
        # layer's requests and processes left there (a sticky capture: every job would read
        # its files, ~1 250 emulated instructions) is no clone's.
        self.areas.reset()
        self.capture.reset()
        bud_layer.ready(self.settle)
        return None

    def _run_interruptible(self, request):
        """Runs ``request`` with the host's interrupt armed; one held for it (sent before it
        started) ends it before it runs anything."""
        self._interruptible = True  # first: an interrupt from here on raises
        try:
            if self._held is not None and self._held == request.sequence:
                self._held = None
                return _bud.OUTCOME_SIGNALED, signal.SIGINT
            return self._run(request, self._context)
        finally:
            self._interruptible = False

    def _ring_done(self, sequence):
        """DONE, even if a SIGINT that raises lands now (one not from the watcher: the
        watcher's are held outside a run, see ``on_sigint``), whose KeyboardInterrupt would
        otherwise escape serve and end the worker. If it lands as ``ring`` returns, the host
        has resumed the VM with a new request: serve it. The lane beside is held across it
        (``bud_beside``)."""
        beside = self.beside
        try:
            while True:
                try:
                    if beside is not None:
                        beside.before_done()  # no lane request is served across DONE
                    self.ring(_bud.DONE, 0, 0)
                    return
                except KeyboardInterrupt:
                    if bud_request.SEQUENCE.unpack_from(self.view,
                                                        _bud.JOB_SEQUENCE)[0] != sequence:
                        return
        finally:
            if beside is not None:
                beside.after_done()

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
        if request.mode == _bud.MODE_CELL:
            self._enter_cwd(request)
        if request.language == _bud.LANGUAGE_PYTHON and request.mode == _bud.MODE_CELL:
            return self._run_cell(request, context)
        if request.language == _bud.LANGUAGE_PYTHON:
            return self._run_python(request, context, warm)
        if request.language == _bud.LANGUAGE_SHELL:
            return self._run_shell(request)
        if request.language in (_bud.LANGUAGE_FILES, _bud.LANGUAGE_PROCESS):
            return self._run_operation(request)
        if request.language == _bud.LANGUAGE_PROGRAM:
            return self._run_program(request)
        if request.language == _bud.LANGUAGE_KERNEL:
            return self._internal_failure("this template has no kernel runtime")
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
        outcome, code = bud_exec.exec_main(source, context.main.__dict__)
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
        saved_env = bud_session.set_cell_env(os.environb, request.env)
        sys.modules["__main__"] = context.main
        context.streams.install()
        namespace = self._namespace(request, context)
        report = None
        if request.flags & _bud.JOB_FLAGS_ERROR_IN_DISPLAY:
            def report(error):
                self._error = bud_session.error_of(error)
        try:
            outcome, code, value = bud_exec.exec_cell(source, namespace, report)
        finally:
            bud_session.restore_env(os.environb, saved_env)
        if value is not None:
            self._display = bud_session.display_of(value)
        self._take_figures()
        self.areas.streaming = False
        self.capture.sync_all(self.areas)
        if not bud_exec.flush_text(context) and outcome == _bud.OUTCOME_EXITED:
            code = 120
        return outcome, code

    def _enter_cwd(self, request):
        """Gives the process the working directory of the cell's namespace (E2B's contexts:
        each its own kernel, with a directory of its own that its cells may change). The
        one leaving keeps the directory it was in. Only a switch between namespaces costs
        anything (a ``getcwd`` and a ``chdir``); a session that uses one namespace pays
        nothing. With ``JOB_FLAGS_START_DIRECTORY``, ``args[0]`` (taken off the cell's
        args) is where the namespace starts: entered before its first cell and again after
        a reset. Without one, or one that cannot be entered, a namespace starts where the
        process is."""
        number = request.namespace
        start = None
        if request.flags & _bud.JOB_FLAGS_START_DIRECTORY and request.args:
            start = request.args.pop(0)
        if request.flags & _bud.JOB_FLAGS_RESET_NAMESPACE:
            self._started.discard(number)
        if number != self._cwd_of:
            leaving, self._cwd_of = self._cwd_of, number
            try:
                self._cwds[leaving] = os.getcwd()
            except OSError:  # removed under it: back, it stays where the process is
                self._cwds.pop(leaving, None)
            try:
                if number in self._cwds:
                    os.chdir(self._cwds[number])
            except OSError:
                pass  # its directory is gone: it stays where the process is
        if start is not None and number not in self._started:
            self._started.add(number)
            try:
                os.chdir(start)
            except OSError:
                pass  # as IPython's %cd, which only prints the error

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

    def _run_operation(self, request):
        """A file request, or a request about the sandbox's background processes
        (``bud_procs.run_operation``)."""
        def write_out(data):
            self.areas.write(bud_io.STDOUT, data)

        def write_err(data):
            self.areas.write(bud_io.STDERR, data)

        def wait(fds, timeout):
            # The interrupt is held (on_sigint) everywhere else in the request.
            self._interruptible = True
            try:
                if self._held == request.sequence:
                    self._held = None
                    return False
                select.select(fds, (), (), timeout)
                return True
            except KeyboardInterrupt:
                return False
            finally:
                self._interruptible = False

        if request.language == _bud.LANGUAGE_PROCESS:
            # Only a poll's wait may be interrupted (it could lose an event it has taken
            # anywhere else); a file request stays interruptible throughout, so one past its
            # deadline or its output cap ends.
            self._interruptible = False
        return _bud.OUTCOME_EXITED, bud_procs.run_operation(request, write_out, write_err, wait)

    def _finish_python(self, outcome, code, context, run_atexit):
        """Interpreter exit, in ``Py_FinalizeEx``'s order."""
        bud_exec.join_threads()
        if run_atexit:
            atexit._run_exitfuncs()
        if self.areas.forked:
            bud_exec.flush_text(context)
            bud_io._ORIGINAL["_exit"](code)
        self.areas.streaming = False
        self.capture.sync_all(self.areas)
        if not bud_exec.flush_text(context) and outcome == _bud.OUTCOME_EXITED:
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

    # ---- program jobs

    def _run_program(self, request):
        """A program runtime's job (``bud_program``): its code in a file, and a shell job
        that execs the interpreter on it."""
        if request.dialect >= len(self.programs):
            return self._internal_failure(f"this template has no program runtime "
                                          f"{request.dialect}")
        try:
            request.code = bud_program.script(self.programs[request.dialect], request.code)
        except OSError as error:
            return self._internal_failure(f"cannot write the code file: {error}")
        return self._run_shell(request)

    # ---- hooks

    def _audit(self, event, args):
        """sys.addaudithook: notices what may write below Python's level (bud_capture docs).
        Must never raise (that would fail the job's own operation), except the host's
        interrupt."""
        if not self.active:
            return
        try:
            if event in bud_capture.STICKY_EVENTS:
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
        except KeyboardInterrupt:
            # The host's interrupt, landed in this hook (an audit event at the job's start,
            # compile or exec, or in a loop of open() calls): the job's, as anywhere in its
            # code. Swallowed here, the job ran on past its timeout until the grace ended.
            raise
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
            if bud_request.SEQUENCE.unpack_from(self.view, _bud.JOB_SEQUENCE)[0] != sent:
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


# The frame on_sigint adds to a KeyboardInterrupt is not the job's (bud_exec).
bud_exec.HANDLER_CODES.add(JobRunner.on_sigint.__code__)
