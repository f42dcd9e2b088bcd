"""A user template's layers in the worker: at its first boot (:func:`apply_user_layers`,
from ``bud_worker.warm``), or applied in a clone of its parent template instead of a first
boot (:func:`apply`, the LAYER request, ``vmm/src/template/derive.rs``).

A layer request names an archive the host wrote into the clone: a ``newc`` cpio of the files
the child's image has and the parent's does not (the image builder allows nothing else, so
no file a running process of the parent loaded changes). :func:`apply` unpacks it, applies
the child's part of the worker manifest (its ``template.json``, in the archive) with the
warm-up code the parent did not run, makes what the warm-up built template state as the
first boot does (collected, frozen, locked), waits for the guest's other tasks to settle and
rings READY (:func:`ready`): the host snapshots the child there, and each of its clones
resumes here. Whatever the worker set up before READY from the environment or the working
directory is set up again in between (the parked shell: ``bud_jobs``).
"""

import contextlib
import gc
import io
import json
import os
import stat

import _bud

# The guest's non-root user (etc/passwd), who owns the work directory.
USER_UID = USER_GID = 1000

# The `newc` header: magic, then 13 fields of 8 hex digits.
CPIO_MAGIC = b"070701"
CPIO_HEADER = 110
CPIO_TRAILER = "TRAILER!!!"


class UserWarmFailed(Exception):
    """A user template's warm-up code raised: the template must not come up."""


class LayerError(Exception):
    """The layer's archive is not one the image builder writes."""


def apply_user_layers(path, warm_from=0):
    """A user template's part of the manifest at ``path`` (guest/src/image/user_layer.rs):
    its environment (the worker's, so every job and child process inherits it), its files
    under the work directory (staged elsewhere, since /tmp and /home/user are mounted over
    the image), its working directory, then its warm-up code, each layer's in order from the
    ``warm_from``-th. Unlike a built-in template's warm-up, a failure here is fatal: raises
    UserWarmFailed with the traceback, which fails the template's build."""
    import shutil
    import traceback

    try:
        with open(path, "rb") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return
    for key, value in (manifest.get("env") or {}).items():
        os.environ[key] = value
    for staged, dest in manifest.get("home_files") or ():
        _make_user_dirs(os.path.dirname(dest))
        shutil.copy(staged, dest)  # with its mode: an archive's executables stay so
        os.chown(dest, USER_UID, USER_GID)
    workdir = manifest.get("workdir")
    if workdir:
        _make_user_dirs(workdir)
        os.chdir(workdir)
    for code_path in (manifest.get("user_warm") or ())[warm_from:]:
        with open(code_path, "rb") as f:
            source = f.read()
        try:
            exec(compile(source, code_path, "exec"), {"__name__": "__bud_warm__"})
        except BaseException as error:  # noqa: BLE001 - SystemExit too: the build fails
            # From the warm-up's own frames on (the first one is this function's exec).
            tb = error.__traceback__.tb_next if error.__traceback__ else None
            text = "".join(traceback.format_exception(type(error), error, tb))
            raise UserWarmFailed(f"warm-up {code_path} failed:\n{text}") from None


def _make_user_dirs(path):
    """Makes ``path`` and its missing parents; those under the work directory belong to
    the guest's user, as the work directory does."""
    missing = []
    while path and path != "/" and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        os.mkdir(directory)
        if directory.startswith(("/tmp/", "/home/user/")):
            os.chown(directory, USER_UID, USER_GID)


def unpack(data, root="/"):
    """Writes the entries of the ``newc`` archive ``data`` under ``root``: directories,
    regular files and symbolic links, with their permission bits, owned by root (as the
    image's). Returns how many entries it wrote. Anything else (a device, a path leaving
    ``root``, a torn archive) is a LayerError."""
    at = count = 0
    while True:
        header = data[at:at + CPIO_HEADER]
        if len(header) < CPIO_HEADER or header[:6] != CPIO_MAGIC:
            raise LayerError(f"no cpio header at byte {at}")
        fields = [int(header[6 + 8 * i:14 + 8 * i], 16) for i in range(13)]
        mode, size, name_size = fields[1], fields[6], fields[11]
        name = data[at + CPIO_HEADER:at + CPIO_HEADER + name_size - 1].decode()
        at = (at + CPIO_HEADER + name_size + 3) & ~3
        body = data[at:at + size]
        if len(body) != size:
            raise LayerError(f"{name}: the archive ends inside its data")
        at = (at + size + 3) & ~3
        if name == CPIO_TRAILER:
            return count
        parts = name.split("/")
        if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise LayerError(f"{name!r}: not a path inside the image")
        dest = os.path.join(root, name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        kind, perm = stat.S_IFMT(mode), stat.S_IMODE(mode)
        if kind == stat.S_IFDIR:
            os.makedirs(dest, exist_ok=True)
            os.chmod(dest, perm)
        elif kind == stat.S_IFLNK:
            if os.path.lexists(dest):
                os.unlink(dest)
            os.symlink(body.decode(), dest)
        elif kind == stat.S_IFREG:
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, perm)
            try:
                view = memoryview(body)
                while view:
                    view = view[os.write(fd, view):]
                os.fchmod(fd, perm)
            finally:
                os.close(fd)
        else:
            raise LayerError(f"{name}: mode {mode:o} is not a file, directory or link")
        count += 1


class _Console(io.TextIOBase):
    """Text written straight to a console descriptor, unbuffered."""

    def __init__(self, fd):
        super().__init__()
        self.fd = fd

    def writable(self):
        return True

    def write(self, text):
        data = text.encode("utf-8", "backslashreplace")
        while data:
            data = data[os.write(self.fd, data):]
        return len(text)


def apply(code, manifest_path, console):
    """The LAYER request's files and manifest (module docs): ``code`` its JSON,
    ``manifest_path`` the worker manifest, ``console`` the console's (stdout, stderr)
    descriptors, where the warm-up's output goes as at a first boot (the request's own
    streams would hand it to every clone's first job). Raises UserWarmFailed, LayerError or
    OSError if the layer fails (the host then gets DONE and no template)."""
    import importlib

    request = json.loads(code)
    archive = request["archive"]
    with open(archive, "rb") as f:
        data = f.read()
    os.unlink(archive)
    unpack(data)
    del data
    # Directories the import system listed before the new packages were there.
    importlib.invalidate_caches()
    out, err = (_Console(fd) for fd in console)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        apply_user_layers(manifest_path, int(request["warm_from"]))


def ready(settle):
    """The end of a layer, as of a first boot (``bud_worker.warm`` and ``main``): what the
    warm-up made is template state, kept out of collections; every page mapped now present
    in each clone (but the reserved arena region, which mlockall would make resident whole);
    the guest's other tasks settled (``settle``); then READY. Returns in each clone of the
    new template."""
    gc.collect()
    gc.freeze()
    _bud.lock_memory_again()
    settle()
    _bud.ready()
