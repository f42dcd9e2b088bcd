"""Program runtimes: an interpreter of the image run on a file that holds the job's code.

A template's manifest may declare runtimes that are neither the worker's Python nor its
shell nor a warm kernel: ``lua``, ``perl``, ``ruby``, an ``awk``... (a user template's
``runtimes``, guest/src/definition.rs). The image builder writes them, in order, as the
worker manifest's ``programs``::

    "programs": [{"name": "lua", "command": ["lua5.4"], "extension": ".lua"}]

A request of language ``LANGUAGE_PROGRAM`` names one by its number (``JOB_DIALECT``). The
worker writes the code to :data:`CODE_DIR`/``code<extension>`` (a new file per request, mode
0644) and runs it as a shell job whose script is::

    exec 'lua5.4' '/tmp/.bud-code/code.lua' "$@"

so everything a shell job has, a program job has too, with no code of its own: the job's
args after the file, its environment, stdin, output capture and streaming, the working
directory of a session's cells, interrupts and timeouts. ``exec`` replaces the shell, so
the interpreter's exit status (or the signal that killed it) is the job's.

The cost is the interpreter's start, a process per job or cell (a warm kernel is what
avoids it: ``bud_runtime``). State between a session's cells is only what the program
leaves on disk.
"""

import json
import os

import bud_shell

# Where the code of a program job is written: tmpfs, readable by the job whoever it runs as.
CODE_DIR = "/tmp/.bud-code"


def load(manifest_path):
    """The worker manifest's program runtimes, in their wire order (``[]`` without any, or
    without a manifest: a worker on a host)."""
    if manifest_path is None:
        return []
    try:
        with open(manifest_path, "rb") as f:
            manifest = json.load(f)
    except OSError:
        return []
    return list(manifest.get("programs") or ())


def script(program, code):
    """Writes ``code`` (bytes) where ``program`` reads it and returns the shell code that
    runs it (module docs). Raises OSError when the file cannot be written."""
    os.makedirs(CODE_DIR, mode=0o755, exist_ok=True)
    path = os.path.join(CODE_DIR, "code" + (program.get("extension") or ""))
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(code)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    words = [word.encode() for word in program["command"]] + [path.encode()]
    return b"exec " + b" ".join(bud_shell.quote(w) for w in words) + b' "$@"'
