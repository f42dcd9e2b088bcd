"""A code context's kernel: one Python process per E2B code context, as E2B runs a Jupyter
kernel per context, so that cells of different contexts run at the same time and each
context has its own interpreter (modules, working directory, environment).

The host starts it as one of the sandbox's processes (``server/src/service/kernels.rs``):
``python3 -m bud_kernel`` with a stdin pipe. In a template whose manifest asks for kernels
(``datascience``), the worker starts them before READY (``bud_procs.Table.prepare_kernels``,
with ``BUD_KERNEL_POOL`` set): such a kernel imports the template's modules, says ``ready``
on stdout and waits in the template for a context's first cell, which then costs no process
start.

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

# The template's manifest (``bud_worker.TEMPLATE_MANIFEST``).
TEMPLATE_MANIFEST = "/usr/lib/bud/template.json"


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


def _preload():
    """The template's modules (its manifest's ``preload``, as the worker imports them), so
    that a kernel waiting in the template has them, as the worker does."""
    try:
        with open(TEMPLATE_MANIFEST, "rb") as f:
            modules = json.load(f).get("preload", ())
    except (OSError, ValueError):
        return
    for module in modules:
        try:
            __import__(module)
        except Exception:  # noqa: BLE001 - a cell that needs it meets the ImportError
            pass


def main():
    pooled = os.environ.pop("BUD_KERNEL_POOL", None)
    if pooled:
        _preload()
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
    if pooled:
        os.write(1, b"ready\n")
    _serve(requests, main_module.__dict__)


if __name__ == "__main__":
    main()
