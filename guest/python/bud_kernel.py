"""A code context's kernel: one Python process per E2B code context, as E2B runs a Jupyter
kernel per context, so that cells of different contexts run at the same time and each
context has its own interpreter (modules, working directory, environment).

The host starts it as one of the sandbox's processes (``server/src/service/kernels.rs``):
``python3 -m bud_kernel`` with a stdin pipe. In a template whose manifest asks for kernels
(``datascience``), the worker makes them before READY by forking itself after the template's
imports and warm-up (``bud_procs.Table.prepare_kernels``, then :func:`held` here): such a
kernel has the template's modules, says ``ready`` on stdout and waits in the template for a
context's first cell, which then costs no process start. Its random state is the template's
until its first request reseeds it (:func:`_reseed`).

**The wire.** Each request is one line of JSON on stdin, ``{"seq": N, "code": SOURCE,
"env": {NAME: VALUE}, "mark": MARK, "cwd": DIR}``. The kernel enters ``cwd`` at its first
request (one it cannot enter leaves it where it is, as IPython's ``%cd`` only prints) and
sets ``env``. The cell runs as a session cell does in the worker (``bud_exec.exec_cell`` in
the kernel's own ``__main__``; its displayed value, figures, ``display()`` outputs and
exception as ``bud_session`` makes them); its output goes to the process's stdout and
stderr as it is written. Then, after flushing both, the kernel writes one frame to stderr:
``MARK``, then ``{"seq": N, "outcome": O, "status": S, "count": C, "display": {...}}`` and
a newline, where ``display`` is the worker's display JSON (``bud_session.display_json``)
and ``count`` the context's execution count. The host cuts the frame out of stderr; the
mark is the host's fresh random token for this kernel.

**Interrupts.** SIGINT is ``KeyboardInterrupt`` while a cell runs and ignored while the
kernel waits for the next request, so a late interrupt never stops a cell it was not
meant for (the host sends the next request only after the frame of the last).

Cells cannot read stdin (it carries the requests; as in Jupyter without ``allow_stdin``,
``input()`` meets end of file). The kernel ends at end of file on stdin.
"""

import gc
import importlib.abc
import importlib.util
import json
import os
import signal
import sys
import types

import _bud
import bud_exec
import bud_session


class _PyplotHook(importlib.abc.MetaPathFinder):
    """Gives ``matplotlib.pyplot`` bud's ``show`` (``bud_session.capture_figures_from``)
    as soon as a cell imports it, as the worker's template does before its snapshot."""

    def find_spec(self, name, path, target=None):
        if name != "matplotlib.pyplot":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            bud_session.capture_figures_from(module)

        spec.loader.exec_module = exec_module
        return spec


def _serve(requests, namespace):
    count = 0
    while True:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        line = requests.readline()
        if not line:
            return
        request = json.loads(line)
        mark = request["mark"].encode()
        if count == 0:
            _reseed()
        if count == 0 and request.get("cwd"):
            try:
                os.chdir(request["cwd"])
            except OSError:
                pass
        saved_env = bud_session.set_cell_env(os.environ, request.get("env", {}).items())
        count += 1
        error = []
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            outcome, status, value = bud_exec.exec_cell(request["code"], namespace, error.append)
            shown = [] if value is None else bud_session.display_of(value)
        except KeyboardInterrupt as late:  # after the cell, before the handler went back
            outcome, status, shown, error = _bud.OUTCOME_SIGNALED, signal.SIGINT, [], [late]
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        bud_session.restore_env(os.environ, saved_env)
        figures = bud_session.take_figures()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass  # closed or broken by the cell: its output is lost, the frame is not
        display = bud_session.display_json(
            shown, figures, bud_session.error_of(error[0]) if error else None)
        head = json.dumps({"seq": request["seq"], "outcome": outcome, "status": status,
                           "count": count})
        frame = mark + head[:-1].encode() + b', "display": ' + display + b"}\n"
        view = memoryview(frame)
        while view:
            view = view[os.write(2, view):]


def _reseed():
    """Random state of this sandbox's own, at the kernel's first request. A kernel held by
    the template was seeded before READY, like every clone's copy of it, so ``random``,
    ``tempfile``'s names and numpy's global state would repeat across sandboxes; the guest's
    entropy pool is the clone's own by now (the host gives each clone its identity before it
    runs), so seeding from it makes them distinct. A kernel started after READY loses
    nothing by it. (Modules not imported yet seed themselves when they are.)"""
    random = sys.modules.get("random")
    if random is not None:
        random.seed()
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:
        tempfile._name_sequence = None  # its own Random, made at its next name
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def held():
    """A kernel the template holds: the worker forked right after its template's imports
    and warm-up, with the pipes on fds 0-2 and nothing else open
    (``bud_procs.Table.prepare_kernels``). Makes its memory its own (``mlockall`` breaks the
    copy-on-write it shares with the worker, so neither pays those faults in a clone), says
    ``ready`` on stdout and serves; it never returns (the worker's code is behind it)."""
    sys.argv = [__file__]
    gc.collect()
    gc.freeze()  # the template's objects: never traversed, their pages never written for it
    _bud.own_writable_pages()
    try:
        _serve_on_stdin(ready=True)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(0)


def main():
    _serve_on_stdin(ready=False)


def _serve_on_stdin(ready):
    """Takes requests from stdin (which cells then see empty) and serves them; says
    ``ready`` first if asked."""
    # The requests come on a descriptor of their own; a cell's stdin is empty.
    requests = os.fdopen(os.dup(0), "rb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout.reconfigure(line_buffering=True, write_through=True)
    sys.stderr.reconfigure(line_buffering=True, write_through=True)
    # As ``python3 -c`` and ipykernel: the working directory first on the import path
    # (``-m`` put the one the kernel started in there).
    sys.path[0] = ""
    # Cells get a ``__main__`` of their own, not this module's.
    main_module = types.ModuleType("__main__")
    main_module.__annotations__ = {}
    sys.modules["__main__"] = main_module
    if "matplotlib.pyplot" in sys.modules:
        bud_session.capture_figures_from(sys.modules["matplotlib.pyplot"])
    else:
        sys.meta_path.insert(0, _PyplotHook())
    if ready:
        os.write(1, b"ready\n")
    _serve(requests, main_module.__dict__)


if __name__ == "__main__":
    main()
