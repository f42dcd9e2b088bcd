"""Running a job's or a cell's code with ``python3 -c`` semantics, in this process:
compiling and executing it, ``SystemExit`` and uncaught exceptions as CPython's
``pymain``/``PyErr_Print`` handle them (the traceback without the worker's own frames),
interpreter-exit order (threads, flushing), and saving the interpreter state the warm-up
jobs change. Used by :class:`bud_jobs.JobRunner`.
"""

import os
import signal
import sys
import threading
import time

import _bud
import bud_io
import bud_session

MARKS = bud_io.MARKS  # timing marks of the job path (see bud_io)

# Code objects of the worker's SIGINT handlers: the frame they add to a KeyboardInterrupt
# raised for the host's interrupt is not the job's (python3's own handler is C, no frame).
HANDLER_CODES = set()


def _job_traceback(tb):
    """``tb`` from the job's first frame on (the worker's ``exec`` frame dropped), without a
    last frame of a worker SIGINT handler."""
    tb = tb.tb_next if tb is not None else None
    if tb is None:
        return None
    prev, node = None, tb
    while node.tb_next is not None:
        prev, node = node, node.tb_next
    if node.tb_frame.f_code in HANDLER_CODES:
        if prev is None:
            return None
        prev.tb_next = None
    return tb


def exit_status(error):
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


def join_threads():
    """Joins non-daemon threads until none is left (``threading._shutdown`` without
    stopping the main thread, so that it can also run before READY)."""
    me = threading.current_thread()
    while True:
        others = [t for t in threading.enumerate() if t is not me and not t.daemon]
        if not others:
            return
        for thread in others:
            thread.join()


def exec_main(source, namespace):
    """Compiles and runs the job's code in ``namespace``; returns (outcome, exit status).

    The ``try`` is in this frame, so the traceback of anything the job raises starts here:
    dropping this one frame leaves exactly what ``python3 -c`` prints."""
    try:
        code = compile(source, "<string>", "exec")
        MARKS["compiled"] = time.perf_counter()
        exec(code, namespace)
    except SystemExit as error:
        return _bud.OUTCOME_EXITED, exit_status(error)
    except BaseException as error:  # noqa: BLE001 - every uncaught exception is reported
        error.__traceback__ = _job_traceback(error.__traceback__)
        print_uncaught(error)
        if isinstance(error, MemoryError):
            return _bud.OUTCOME_OUT_OF_MEMORY, 1
        if isinstance(error, KeyboardInterrupt):
            return _bud.OUTCOME_SIGNALED, signal.SIGINT
        return _bud.OUTCOME_EXITED, 1
    return _bud.OUTCOME_EXITED, 0


def exec_cell(source, namespace, report=None):
    """Runs a cell in ``namespace``: (outcome, exit status, the final expression's value or
    None). Errors are reported as :func:`exec_main` reports them, or given to ``report``."""
    try:
        body, last = bud_session.compile_cell(source)
        MARKS["compiled"] = time.perf_counter()
        exec(body, namespace)
        value = None if last is None else eval(last, namespace)
    except SystemExit as error:
        return _bud.OUTCOME_EXITED, exit_status(error), None
    except BaseException as error:  # noqa: BLE001 - every uncaught exception is reported
        error.__traceback__ = _job_traceback(error.__traceback__)
        if report is None:
            print_uncaught(error)
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


def print_uncaught(error):
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


def flush_text(context):
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


def save_interpreter_state():
    """What a job changes in the interpreter (warm-up jobs are undone afterwards)."""
    return (
        list(sys.argv),
        list(getattr(sys, "orig_argv", [])),
        list(sys.path),
        sys.modules.get("__main__"),
        (sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__),
        dict(os.environb),
    )


def restore_interpreter_state(saved):
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
