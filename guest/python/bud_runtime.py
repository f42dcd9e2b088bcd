"""A kernel runtime: the image's warm program that runs another language's jobs (JavaScript
in the ``node`` template), and who of it and the worker holds the doorbell.

The template's worker manifest (``/usr/lib/bud/template.json``, written by the image
builder from the recipe's ``[site.runtime]``) names the runtime: its name, interpreter and
kernel arguments, e.g. ``/usr/bin/node --single-threaded-gc /usr/lib/bud/node/kernel.js``.
:meth:`KernelRuntime.start` starts it before READY with

    fd 0  its stdin file (read-write, on the capture file system: a job's stdin goes there)
    fd 1, 2  its own capture files (what its child processes write)
    fd 3  the mailbox's memfd (``_bud.mailbox_fd``): it maps the same pages as the worker
    fd 4  tokens to it (read end), fd 5  tokens from it (write end)

and ``BUD_PROTOCOL``: the protocol's constants as JSON (from ``_bud``, which has them from
``protocol.rs``); ``BUD_DIALECTS``: the names of the runtime's dialects as a JSON list, the
languages a request with ``job::DIALECT`` 1, 2, ... is written in (``["typescript"]``). The
kernel warms up and writes ``W<ms>\\n`` on fd 5.

Who rings: the template's *default* runtime holds the doorbell at READY, so that its jobs
resume in the process that runs them, with no hand-off (a hand-off is a pipe wake-up and
two context switches: ~10-20 ms of emulated guest-kernel work under kvm_pvm; the trivial
job is ~1 ms). When the kernel runtime is the default (``[site.runtime] default = true``),
the worker gives it the word to ring READY (:meth:`ring_ready`) and waits. From then on,
whoever is resumed with a request that is not its own hands the doorbell over with one byte
and blocks until it gets it back: the worker with :meth:`hand_over` (a kernel request), the
kernel likewise (any other request), and the one that ran the request rings DONE. Only one
of them runs at a time.

What this module must never do: hand over while it holds output the other one would
overwrite (the worker hands over before it touches the areas), or leave the kernel able to
ring while the worker runs (it is blocked in ``read``).
"""

import json
import os

import _bud
import bud_capture

# Token bytes: to the kernel ("it is your request"; "it is, and give the clone its own
# identity first": the worker served this clone's or fork's first request, whose RESEED the
# kernel never saw; "ring READY"), to the worker.
TOKEN_KERNEL = b"K"
TOKEN_KERNEL_RESEED = b"S"
TOKEN_READY = b"R"
TOKEN_WORKER = b"J"
# How long the kernel's warm-up may take before the template's boot gives up on it.
WARM_TIMEOUT_S = 600


def protocol_constants():
    """The protocol's constants the kernel reads (every upper-case int of ``_bud``)."""
    return {
        name: value for name, value in vars(_bud).items()
        if name.isupper() and isinstance(value, int)
    }


class KernelRuntime:
    """The image's kernel runtime (see the module docs). ``spec``: the worker manifest's
    ``runtime`` object."""

    def __init__(self, spec, capture_dir):
        self.name = spec["name"]
        self.argv = [spec["interpreter"], *spec["kernel"]]
        self.default = bool(spec.get("default"))
        # The other languages it runs, dialect 1, 2, ... on the wire (TypeScript).
        self.dialects = list(spec.get("dialects") or [])
        self.capture_dir = capture_dir
        self.pid = None
        self._to_kernel = None
        self._from_kernel = None

    def start(self):
        """Starts the kernel and waits for its warm-up; returns its warm-up time in ms.
        Raises OSError (with the kernel's own words where it said any) if it fails."""
        to_read, to_write = os.pipe2(os.O_CLOEXEC)
        from_read, from_write = os.pipe2(os.O_CLOEXEC)
        flags = os.O_RDWR | os.O_CLOEXEC
        stdin = bud_capture._open_tmpfile(self.capture_dir, flags)
        out = bud_capture._open_tmpfile(self.capture_dir, flags | os.O_APPEND)
        err = bud_capture._open_tmpfile(self.capture_dir, flags | os.O_APPEND)
        env = dict(os.environ)
        env["BUD_PROTOCOL"] = json.dumps(protocol_constants())
        env["BUD_DIALECTS"] = json.dumps(self.dialects)
        # posix_spawn with dup2 file actions: the child gets exactly fds 0-5.
        actions = [
            (os.POSIX_SPAWN_DUP2, stdin, 0),
            (os.POSIX_SPAWN_DUP2, out, 1),
            (os.POSIX_SPAWN_DUP2, err, 2),
            (os.POSIX_SPAWN_DUP2, _bud.mailbox_fd(), 3),
            (os.POSIX_SPAWN_DUP2, to_read, 4),
            (os.POSIX_SPAWN_DUP2, from_write, 5),
        ]
        try:
            self.pid = os.posix_spawn(self.argv[0], self.argv, env, file_actions=actions)
        finally:
            for fd in (stdin, out, to_read, from_write):
                os.close(fd)
        self._to_kernel, self._from_kernel = to_write, from_read
        # The host's interrupt of a kernel request goes to the kernel (interrupt.rs).
        _bud.set_kernel_pid(self.pid)
        try:
            line = self._read_line()
        except OSError:
            line = b""
        if not line.startswith(b"W"):
            words = self._kernel_words(err)
            os.close(err)
            raise OSError(f"the {self.name} kernel ({' '.join(self.argv)}) did not warm up"
                          f"{': ' + words if words else ''}")
        os.close(err)
        return int(line[1:] or b"0")

    def _read_line(self):
        line = b""
        while not line.endswith(b"\n"):
            chunk = os.read(self._from_kernel, 64)
            if not chunk:
                break
            line += chunk
        return line

    @staticmethod
    def _kernel_words(err):
        try:
            return os.pread(err, 4096, 0).decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def ring_ready(self):
        """The kernel rings READY (the template is snapshotted with the vCPU in it); returns
        when the kernel hands the doorbell to the worker: a clone's request for it."""
        os.write(self._to_kernel, TOKEN_READY)
        self._wait()

    def hand_over(self, reseed=False):
        """Hands the doorbell to the kernel for the request in the mailbox (``reseed``: the
        kernel takes the request's seed as the clone's identity first); returns when the
        kernel hands it back (a later request for the worker)."""
        os.write(self._to_kernel, TOKEN_KERNEL_RESEED if reseed else TOKEN_KERNEL)
        self._wait()

    def _wait(self):
        while True:
            token = os.read(self._from_kernel, 1)
            if token == TOKEN_WORKER:
                return
            if not token:
                raise OSError(f"the {self.name} kernel is gone")


def load(manifest_path, capture_dir):
    """The image's kernel runtime (not started), or None when it has none."""
    try:
        with open(manifest_path, "rb") as f:
            spec = json.load(f).get("runtime")
    except (OSError, ValueError):
        return None
    if not spec:
        return None
    return KernelRuntime(spec, capture_dir)
