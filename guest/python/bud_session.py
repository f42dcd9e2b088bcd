"""Sessions, guest side: cells that share one ``__main__``, their displayed results, and the
file operations of the work directory.

A session is one clone kept alive by the host between requests (``vmm/src/session.rs``).
The worker serves it request after request (``bud_jobs.JobRunner.serve``); what differs
from a one-shot job is here:

- **Cells** (``mode::CELL``): Python runs in the session's own ``__main__``, which persists,
  so variables, imports, functions and the working directory carry from cell to cell. As
  in Jupyter, when the last statement of a cell is an expression its value is *displayed*:
  assigned to ``_`` and reported as ``text/plain`` (``repr``), plus ``text/html`` and
  ``image/png`` when the object has ``_repr_html_`` / ``_repr_png_``. The display data go
  back as JSON over the request area (``result::DISPLAY_LEN``). An exception prints its
  traceback on stderr (exit status 1), ``SystemExit`` gives its status; neither ends the
  session. With ``job_flags::ERROR_IN_DISPLAY`` the exception goes back in the display
  data instead (``"error"``: name, value, traceback), as Jupyter reports it.
- **Namespaces** (``job::NAMESPACE``): 0 is ``__main__``; other numbers are independent
  globals dicts made on first use (a client's "contexts"); ``RESET_NAMESPACE`` empties one.
- **Figures** (a job's or a cell's): every matplotlib figure shown with ``plt.show()``
  (which, as Jupyter's inline backend, renders and closes the open figures) or left open at
  the end is rendered to PNG and goes back with the display data, in order
  (:func:`take_figures`); the host returns them as the request's ``results``. Threads a
  cell started keep running in later cells; ``atexit`` handlers never run (the interpreter
  never exits).
- **What E2B's code interpreter shows** (``server/src/compat/jupyter.rs``): a DataFrame
  value's columns as JSON (MIME_DATA), each figure's ``repr`` and chart (MIME_CHART, from
  :mod:`bud_display`), a dict or list value as ``application/json``, and what the builtin
  :func:`display` (IPython's, given to every cell when there is none) displays: all that a
  request displayed besides its value goes back in order as one MIME_OUTPUTS item of the
  value (:func:`write_display`). pandas and matplotlib are never imported here.
- **Interrupts**: the host's interrupt byte on the console becomes SIGINT for this thread
  (``_bud.start_interrupt_watcher``), so a cell past its time gets ``KeyboardInterrupt``.
- **Files** (``language::FILES``): write, append, read, list, delete, glob, stat, mkdir and
  move in the work directory (:data:`WORKDIR`, also mounted at :data:`HOME`), confined to
  it after resolving symlinks. They run as root; with ``FILE_OP_AS_USER`` what they write
  or make belongs to the guest's user ``user`` (E2B's). Listings and stats give each
  entry's owner and group (ids, and names from the guest's passwd: ``bud_users``). They
  never run user code and never touch ``__main__``.
"""

import ast
import base64
import builtins
import errno
import glob
import io
import json
import linecache
import os
import re
import shutil
import stat
import sys
import traceback

import _bud
import bud_users

# Where session files live: the worker's own working directory (the tmpfs; also HOME).
WORKDIR = "/tmp"
# The same directory mounted again as the home of the guest's user ``user``: a path through
# it is a path in WORKDIR.
HOME = "/home/user"
# Whom a file operation with FILE_OP_AS_USER makes its files for.
AS_USER = "user"

# Display data larger than this is left out (the rest of the display still goes back).
_DISPLAY_ROOM = _bud.JOB_DATA_END - _bud.JOB_DATA
# What E2B's code interpreter adds to display data (server/src/compat/jupyter.rs reads
# them): a DataFrame's columns and a figure's chart (JSON text, bud_display), and
# everything a request displayed besides its value (write_display); in those, the key that
# names a figure's PNG.
MIME_DATA = "application/vnd.bud.dataframe+json"
MIME_CHART = "application/vnd.bud.chart+json"
MIME_OUTPUTS = "application/vnd.bud.outputs+json"
FIGURE_KEY = "bud/figure"
# A reported exception's text is cut to this many characters (its end kept).
_ERROR_ROOM = 64 << 10


# Cells compiled so far in this session: each gets its own file name, ``<cell N>``.
_cells = 0


_INDENT = re.compile(r"[ \t]+")


def ipython_cleanup(source):
    """A cell's source after IPython's first two input transformations
    (``leading_empty_lines`` and ``leading_indent`` of ``IPython.core.inputtransformer2``),
    which E2B's and Jupyter's clients rely on: blank lines before the code are dropped, and
    if the first line is indented, that indent comes off every line that starts with it, so
    code pasted from an indented block (or an indented triple-quoted string) runs as it
    reads. Nothing else of IPython's syntax (magics, ``!cmd``, prompts) is taken."""
    lines = source.splitlines(True)
    start = next((i for i, line in enumerate(lines) if line and not line.isspace()), 0)
    lines = lines[start:]
    indent = _INDENT.match(lines[0]) if lines else None
    if indent is None:
        return "".join(lines)
    prefix = indent.group(0)
    return "".join(line[len(prefix):] if line.startswith(prefix) else line for line in lines)


def set_cell_env(environ, pairs):
    """Sets a cell's environment (``pairs``: (name, value), in ``environ``'s own type:
    ``os.environ`` takes str, ``os.environb`` bytes) and returns what :func:`restore_env`
    needs to give the names back their values from before the cell. E2B's rule: an
    execution's environment variables hold for that execution only."""
    saved = []
    for name, value in pairs:
        saved.append((name, environ.get(name)))
        environ[name] = value
    return saved


def restore_env(environ, saved):
    """Gives the names :func:`set_cell_env` set the values they had before it (unset if
    they had none), whatever the cell did with them meanwhile."""
    for name, old in reversed(saved):
        if old is None:
            environ.pop(name, None)
        else:
            environ[name] = old


def compile_cell(source):
    """(body code, last-expression code or None) of a cell, after IPython's cleanup
    (:func:`ipython_cleanup`); raises SyntaxError as ``compile`` does. The cell's source goes
    into ``linecache`` under its own name, so tracebacks show its lines, those of functions
    it defines too, as Jupyter's do."""
    global _cells
    source = ipython_cleanup(source)
    _cells += 1
    name = f"<cell {_cells}>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    tree = ast.parse(source, name, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    body = compile(tree, name, "exec")
    return body, (compile(last, name, "eval") if last is not None else None)


# IPython's rich-display methods and the MIME type each gives; binary ones in base64,
# application/json as JSON text.
_REPR_METHODS = (
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
    ("application/javascript", "_repr_javascript_"),
    ("application/pdf", "_repr_pdf_"),
)


def _display_item(mime, data):
    """One display item from a renderer's result, or None if it gives nothing usable."""
    if isinstance(data, tuple) and data:  # IPython allows (data, metadata)
        data = data[0]
    if mime == "application/json":
        try:
            return {"type": mime, "data": json.dumps(data)}
        except (TypeError, ValueError):
            return None
    if isinstance(data, (bytes, bytearray)) and mime in ("image/png", "image/jpeg",
                                                         "application/pdf"):
        return {"type": mime, "data": base64.b64encode(data).decode("ascii")}
    if isinstance(data, str):
        return {"type": mime, "data": data}
    return None


def display_of(value):
    """The display data of a cell's value, Jupyter-style: a list of {type, data}: its
    ``repr`` as text/plain, then what each of IPython's ``_repr_*_`` methods it has gives,
    then what E2B's code interpreter adds (:func:`_e2b_items`)."""
    shown = []
    for mime, method in _REPR_METHODS:
        render = getattr(type(value), method, None)
        if render is None:
            continue
        try:
            item = _display_item(mime, render(value))
        except Exception:  # noqa: BLE001 - a broken renderer only loses that format
            continue
        if item is not None and _new_type(shown, item):
            shown.append(item)
    for item in _e2b_items(value):
        if _new_type(shown, item):
            shown.append(item)
    try:
        text = repr(value)
    except Exception as error:  # noqa: BLE001 - shown instead of the value
        text = f"<repr failed: {type(error).__name__}: {error}>"
    shown.insert(0, {"type": "text/plain", "data": text})
    return shown


def _e2b_items(value):
    """What E2B's interpreter shows of a value beside its ``_repr_*_`` formats: a dict or
    list as ``application/json`` (when it is JSON), a pandas DataFrame's columns as
    MIME_DATA, a matplotlib figure as a PNG and its chart (MIME_CHART). pandas and
    matplotlib are looked up in ``sys.modules``, never imported: a value can only be
    theirs if the cell imported them."""
    if type(value) in (dict, list):
        try:
            text = json.dumps(value, allow_nan=False, default=_json_scalar)
        except (TypeError, ValueError, RecursionError):
            return []
        return [{"type": "application/json", "data": text}] if len(text) < _DISPLAY_ROOM else []
    pandas = sys.modules.get("pandas")
    if pandas is not None and isinstance(value, pandas.DataFrame):
        import bud_display

        try:
            data = bud_display.frame_data(value)
        except Exception:  # noqa: BLE001 - a frame that cannot be read only loses its data
            return []
        return [] if data is None else [{"type": MIME_DATA, "data": json.dumps(data)}]
    figure = sys.modules.get("matplotlib.figure")
    if figure is not None and isinstance(value, figure.Figure):
        rendered = _render_figure(value)
        if rendered is None:
            return []
        png, extras = rendered
        return [png] + [{"type": k, "data": v} for k, v in extras.items() if k != "text/plain"]
    return []


def _json_scalar(value):
    """numpy's scalars as JSON numbers (as E2B's orjson serializer takes them)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic):
        value = value.item()
        if isinstance(value, (bool, int, float, str)) or value is None:
            return value
    raise TypeError(type(value).__name__)


def _new_type(shown, item):
    """Whether ``shown`` has no item of ``item``'s type yet."""
    return all(x["type"] != item["type"] for x in shown)


# What the current request displayed besides its value, in order: ("figure", PNG item,
# the figure's other formats) for each figure plt.show() rendered, ("display", formats) for
# each display() call.
_outputs = []


def _render_figure(figure):
    """A figure as (PNG display item, {MIME: text} of its other formats: ``text/plain`` and
    its chart), or None if it cannot be rendered (said on stderr). Leaves it open."""
    buffer = io.BytesIO()
    try:
        figure.savefig(buffer, format="png")
    except Exception as error:  # noqa: BLE001 - the user's figure; the rest still goes
        print(f"figure {figure.number if hasattr(figure, 'number') else ''} could not be "
              f"rendered: {error!r}", file=sys.stderr)
        return None
    png = {"type": "image/png", "data": base64.b64encode(buffer.getvalue()).decode()}
    extras = {"text/plain": repr(figure)}
    try:  # drawn now, so its tick labels are set
        import bud_display

        chart = bud_display.figure_chart(figure)
        if chart is not None:
            extras[MIME_CHART] = json.dumps(chart, allow_nan=False)
    except Exception:  # noqa: BLE001 - a chart we cannot read is left out, the PNG stays
        pass
    return png, extras


def _render_open_figures(pyplot):
    """Every open figure of ``pyplot`` as a ("figure", PNG item, other formats) output, in
    figure-number order; closes them."""
    shown = []
    for number in pyplot.get_fignums():
        rendered = _render_figure(pyplot.figure(number))
        if rendered is not None:
            shown.append(("figure", *rendered))
    pyplot.close("all")
    return shown


def capture_figures_from(pyplot):
    """Makes ``pyplot.show`` render the open figures into the request's results and close
    them (what Jupyter's inline backend does; with Agg it would do nothing)."""
    def show(*args, **kwargs):
        del args, kwargs
        _outputs.extend(_render_open_figures(pyplot))

    pyplot.show = show


def display(*objs, include=None, exclude=None, raw=False, **kwargs):
    """IPython's ``display``: each object's display data (:func:`display_of`) becomes a
    result of the request beside its value, in call order (Jupyter's ``display_data``).
    ``raw=True``: each object is already a {MIME: data} dict. ``include`` / ``exclude``
    keep or drop MIME types. Other IPython arguments (``display_id``, ``metadata``...) are
    accepted and ignored."""
    del kwargs
    for obj in objs:
        if raw:
            formats = {str(k): v if isinstance(v, str) else json.dumps(v, default=str)
                       for k, v in dict(obj).items()}
        else:
            formats = {item["type"]: item["data"] for item in display_of(obj)}
        formats = {k: v for k, v in formats.items()
                   if (include is None or k in include) and (exclude is None or k not in exclude)}
        if formats:
            _outputs.append(("display", formats))


if not hasattr(builtins, "display"):  # as IPython's kernel, a builtin in every cell
    builtins.display = display


class Figures(list):
    """The PNGs of a request's figures (the host's ``figures``, its native ``results``),
    carrying everything the request displayed besides its value (``outputs``: figures with
    their charts, display() calls, in order) to :func:`write_display`. True when either has
    something: a request that only called display() still has display data."""

    def __init__(self, pngs=(), outputs=None):
        super().__init__(pngs)
        self.outputs = outputs

    def __bool__(self):
        return len(self) > 0 or self.outputs is not None


def take_figures():
    """The current request's figures and other outputs: those displayed while it ran, then
    the figures still open (rendered now, after the value as Jupyter shows them)."""
    during = list(_outputs)
    _outputs.clear()
    pyplot = sys.modules.get("matplotlib.pyplot")
    after = _render_open_figures(pyplot) if pyplot is not None else []
    pngs = []

    def entry(output):
        kind, *rest = output
        if kind == "display":
            return rest[0]
        png, extras = rest
        pngs.append(png)
        return {**extras, FIGURE_KEY: len(pngs) - 1}

    outputs = {"before": [entry(o) for o in during], "after": [entry(o) for o in after]}
    return Figures(pngs, outputs if during or after else None)


def error_of(error):
    """A cell's uncaught exception as Jupyter reports it: ``{"name", "value", "traceback"}``
    (the traceback formatted as ``sys.excepthook`` would print it)."""
    try:
        value = str(error)
    except Exception as failure:  # noqa: BLE001 - the user's __str__
        value = f"<str failed: {type(failure).__name__}>"
    try:
        text = "".join(traceback.format_exception(error))
    except Exception:  # noqa: BLE001 - out of memory, broken __str__ inside...
        text = f"{type(error).__name__}: {value}\n"
    if len(text) > _ERROR_ROOM:
        text = "...\n" + text[-_ERROR_ROOM:]
    return {"name": type(error).__name__, "value": value[:_ERROR_ROOM], "traceback": text}


def display_json(shown, figures=(), error=None):
    """The display JSON, ``{"value": [...], "figures": [...], "error": {...}}``, as bytes of
    at most the display area's room. ``figures`` from :func:`take_figures` adds its
    outputs to the value as one MIME_OUTPUTS item (JSON ``{"before": [...], "after":
    [...]}``: what was displayed before and after the value, each a {MIME: data} dict, a
    figure's naming its PNG by index in ``figures`` under FIGURE_KEY). Items that do not
    fit are dropped, figures first (last first), then the value's (last first: the
    outputs, then a DataFrame's data...)."""
    shown, outputs = list(shown), getattr(figures, "outputs", None)
    figures = list(figures)
    if outputs is not None:
        shown.append({"type": MIME_OUTPUTS, "data": json.dumps(outputs, ensure_ascii=False)})
    while True:
        blob = {"value": shown, "figures": figures}
        if error is not None:
            blob["error"] = error
        data = json.dumps(blob, ensure_ascii=False).encode("utf-8", "surrogateescape")
        if len(data) <= _DISPLAY_ROOM or not (shown or figures):
            break
        if figures:
            figures.pop()
        else:
            shown.pop()
    return data if len(data) <= _DISPLAY_ROOM else b"{}"


def write_display(view, shown, figures=(), error=None):
    """Writes :func:`display_json` over the request area and its length."""
    data = display_json(shown, figures, error)
    view[_bud.JOB_DATA : _bud.JOB_DATA + len(data)] = data
    view[_bud.RESULT_DISPLAY_LEN : _bud.RESULT_DISPLAY_LEN + 4] = len(data).to_bytes(4, "little")


class FileError(Exception):
    """A refused file operation: ``status`` is a ``FILE_STATUS_*`` code."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def resolve(relative, must_exist=False):
    """The absolute path of ``relative`` inside WORKDIR, symlinks resolved; FileError if it
    is malformed or leaves WORKDIR."""
    if not relative or "\0" in relative or relative.startswith("/"):
        raise FileError(_bud.FILE_STATUS_BAD_PATH, f"bad path {relative!r}")
    full = _in_workdir(os.path.realpath(os.path.join(WORKDIR, relative)))
    if full != WORKDIR and not full.startswith(WORKDIR + "/"):
        raise FileError(_bud.FILE_STATUS_BAD_PATH, f"{relative!r} leaves the work directory")
    if must_exist and not os.path.lexists(full):
        raise FileError(_bud.FILE_STATUS_NOT_FOUND, f"{relative!r} does not exist")
    return full


# The work directory, held open for ``_bud.open_beneath`` (made before READY, so it is in
# the template). A read or write opens its path under it in one ``openat2`` that cannot
# leave it; a path it cannot open so (a missing parent, a link that names the work
# directory by its absolute path or its other name, anything unusual) takes the resolving
# path, which decides it exactly as before. ~1.6 ms of emulated guest kernel per path
# walk saved is most of such an operation: docs/measurements.md "File operations".
try:
    _WORKDIR_FD = os.open(WORKDIR, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
except OSError:  # no work directory (a host without one): always the resolving path
    _WORKDIR_FD = None
# What the one-call open may answer for a path that the resolving path must decide.
_RESOLVE_AGAIN = frozenset({errno.ENOENT, errno.EXDEV, errno.ELOOP, errno.ENXIO, errno.EACCES,
                            errno.ENOTDIR, errno.EAGAIN})


def _open_fast(relative, flags):
    """``relative`` opened under the work directory in one system call, or None where the
    resolving path must decide (see ``_RESOLVE_AGAIN``). A directory opened for writing is
    WRONG_KIND at once."""
    if _WORKDIR_FD is None or "\0" in relative:
        return None  # (an empty or absolute path fails the open: ENOENT, EXDEV)
    try:
        # openat2 takes a mode only with O_CREAT.
        return _bud.open_beneath(_WORKDIR_FD, os.fsencode(relative),
                                 flags | os.O_NONBLOCK | os.O_CLOEXEC,
                                 0o666 if flags & os.O_CREAT else 0)
    except OSError as error:
        if error.errno == errno.EISDIR:
            raise FileError(_bud.FILE_STATUS_WRONG_KIND, f"{relative!r} is a directory") from None
        if error.errno in _RESOLVE_AGAIN:
            return None
        raise


def _write_flags(op):
    """open(2) flags of a WRITE (truncates) or an APPEND."""
    return os.O_WRONLY | os.O_CREAT | (os.O_APPEND if op == _bud.FILE_OP_APPEND else os.O_TRUNC)


def _read_from(fd, relative, write_out):
    """Sends what regular file ``fd`` holds (as much as it held when opened), then closes
    it; anything else is WRONG_KIND."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileError(_bud.FILE_STATUS_WRONG_KIND, f"{relative!r} is not a file")
        left = st.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            write_out(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)


def _write_to(fd, relative, op, data, owner, metadata):
    """Writes ``data`` into regular file ``fd`` (a FIFO or a device is refused before
    anything is written), gives a WRITE's file to ``owner`` and sets its metadata, then
    closes it."""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FileError(_bud.FILE_STATUS_WRONG_KIND, f"{relative!r} is not a regular file")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        # The file written is the user's (an upload of an existing file too, as envd
        # does); later chunks of it are appends to the user's file.
        if owner is not None and op == _bud.FILE_OP_WRITE:
            os.fchown(fd, *owner)
        if metadata is not None:
            _set_metadata(fd, metadata)
    finally:
        os.close(fd)


def _in_workdir(full):
    """``full`` named through WORKDIR when it is under HOME (a link's absolute target may
    name the work directory's other mount)."""
    if full == HOME or full.startswith(HOME + "/"):
        return WORKDIR + full[len(HOME):]
    return full


def _make_dirs(path, owner):
    """Makes directory ``path`` and its missing parents (an existing directory is fine), and
    gives the ones it made to ``owner`` (``(uid, gid)``, or None: root's)."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
            continue
        if owner is not None:
            os.chown(d, *owner)


def _owner(as_user):
    """``(uid, gid)`` of AS_USER for an operation with FILE_OP_AS_USER, else None."""
    if not as_user:
        return None
    u = bud_users.TABLE.user(AS_USER)
    if u is None:
        raise FileError(_bud.FILE_STATUS_BAD_PATH, f"the guest has no user {AS_USER!r}")
    return u.uid, u.gid


def _entry(name, st):
    """The JSON entry of ``name`` with ``lstat`` result ``st`` (owner and group by id; see
    :func:`_named`)."""
    return {"name": name, "type": _kind(st.st_mode), "size": st.st_size, "mode": st.st_mode,
            "mtime_ns": st.st_mtime_ns, "uid": st.st_uid, "gid": st.st_gid}


# E2B's file metadata: user.e2b.<key> extended attributes (envd 0.6.2's namespace).
METADATA_PREFIX = "user.e2b."


def metadata_of(path):
    """``{key: value}`` of ``path``'s ``user.e2b.*`` attributes (a final symlink's own, not
    followed); ``{}`` where there are none or the file system keeps none. A key or value
    that is not UTF-8 (set inside the sandbox) is left out, as envd does."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    found = {}
    for name in names:
        if not name.startswith(METADATA_PREFIX):
            continue
        try:
            key = name[len(METADATA_PREFIX):]
            key.encode("utf-8")  # a name that was not UTF-8 holds surrogates
            found[key] = os.getxattr(path, name, follow_symlinks=False).decode("utf-8")
        except (OSError, UnicodeError):
            continue
    return found


def _set_metadata(fd, metadata):
    """Makes open file ``fd``'s ``user.e2b.*`` attributes exactly ``metadata``."""
    for name in os.listxattr(fd):
        if name.startswith(METADATA_PREFIX) and name[len(METADATA_PREFIX):] not in metadata:
            os.removexattr(fd, name)
    for key, value in metadata.items():
        os.setxattr(fd, METADATA_PREFIX + key, value.encode("utf-8"))


def _metadata_request(data):
    """The metadata object of a WRITE with FILE_OP_METADATA (the part of its path after
    the NUL)."""
    try:
        metadata = json.loads(data)
    except ValueError as error:
        raise FileError(_bud.FILE_STATUS_BAD_PATH, f"bad metadata: {error}") from None
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and k and "\0" not in k and isinstance(v, str)
            for k, v in metadata.items()):
        raise FileError(_bud.FILE_STATUS_BAD_PATH,
                        "metadata is an object of non-empty keys and strings")
    return metadata


def entry_of(full, with_metadata):
    """The STAT entry of absolute path ``full`` (a final symlink not followed), owner and
    group named, with the link's target and, if asked, its metadata."""
    st = os.lstat(full)
    entry = _named([_entry(os.path.basename(full), st)])[0]
    entry["target"] = os.readlink(full) if stat.S_ISLNK(st.st_mode) else None
    if with_metadata:
        entry["metadata"] = metadata_of(full)
    return entry


def _named(entries):
    """Adds ``owner`` and ``group`` names to ``entries`` (from the guest's passwd)."""
    users, groups = bud_users.TABLE.names({e["uid"] for e in entries},
                                          {e["gid"] for e in entries})
    for e in entries:
        e["owner"] = users[e["uid"]]
        e["group"] = groups[e["gid"]]
    return entries


def _resolve_parent(relative):
    """Like :func:`resolve`, but a final symlink is the entry itself, not its target (what
    stat, move and delete act on)."""
    head, _, name = relative.rstrip("/").rpartition("/")
    if name in ("", ".", ".."):
        return resolve(relative)
    parent = resolve(head) if head else WORKDIR
    return os.path.join(parent, name)


def _kind(mode):
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def _listing(fd, full, with_metadata):
    """The JSON listing of open directory ``fd`` (closed after; each entry stat'ed
    relative to it, a one-component path walk), ``full`` its path (for the metadata, which
    is read by path)."""
    entries = []
    try:
        with os.scandir(fd) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                item = _entry(entry.name, st)
                if stat.S_ISLNK(st.st_mode):
                    try:
                        item["target"] = os.readlink(entry.name, dir_fd=fd)
                    except OSError:
                        pass
                if with_metadata:
                    item["metadata"] = metadata_of(os.path.join(full, entry.name))
                entries.append(item)
    finally:
        os.close(fd)
    entries.sort(key=lambda e: e["name"])
    return json.dumps(_named(entries)).encode()


def file_op(op, path, data, write_out):
    """Runs one file operation; returns a FILE_STATUS_* code (and says why on failure with
    FileError). ``write_out(bytes)`` sends stdout. With ``FILE_OP_AS_USER`` in ``op`` what
    it writes or makes belongs to the guest's user AS_USER (the write itself runs as root).
    With ``FILE_OP_METADATA`` entries carry their metadata, and a write sets the file's."""
    relative = path.decode("utf-8", "surrogateescape")
    owner = _owner(op & _bud.FILE_OP_AS_USER)
    with_metadata = bool(op & _bud.FILE_OP_METADATA)
    op &= ~(_bud.FILE_OP_AS_USER | _bud.FILE_OP_METADATA)
    metadata = None
    if with_metadata and op == _bud.FILE_OP_WRITE:
        relative, _, data_of_metadata = relative.partition("\0")
        metadata = _metadata_request(data_of_metadata)
    try:
        if op in (_bud.FILE_OP_WRITE, _bud.FILE_OP_APPEND):
            fd = _open_fast(relative, _write_flags(op))
            if fd is None:
                full = resolve(relative)
                if os.path.isdir(full):
                    raise FileError(_bud.FILE_STATUS_WRONG_KIND, f"{relative!r} is a directory")
                if os.path.exists(full) and not os.path.isfile(full):
                    # A FIFO or a device would block or never end the write.
                    raise FileError(_bud.FILE_STATUS_WRONG_KIND,
                                    f"{relative!r} is not a regular file")
                _make_dirs(os.path.dirname(full), owner)
                fd = os.open(full, _write_flags(op) | os.O_CLOEXEC, 0o666)
            _write_to(fd, relative, op, data, owner, metadata)
        elif op == _bud.FILE_OP_READ:
            fd = _open_fast(relative, os.O_RDONLY)
            if fd is None:
                full = resolve(relative, must_exist=True)
                if not os.path.isfile(full):
                    raise FileError(_bud.FILE_STATUS_WRONG_KIND, f"{relative!r} is not a file")
                fd = os.open(full, os.O_RDONLY | os.O_CLOEXEC)
            _read_from(fd, relative, write_out)
        elif op == _bud.FILE_OP_LIST:
            top = relative in ("", ".")
            fd = _open_fast("." if top else relative, os.O_RDONLY | os.O_DIRECTORY)
            full = WORKDIR if top else None
            if fd is None:
                full = full or resolve(relative, must_exist=True)
                if not os.path.isdir(full):
                    raise FileError(_bud.FILE_STATUS_WRONG_KIND,
                                    f"{relative!r} is not a directory")
                fd = os.open(full, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            elif with_metadata and full is None:
                full = resolve(relative)  # metadata is read by path
            write_out(_listing(fd, full, with_metadata))
        elif op == _bud.FILE_OP_DELETE:
            full = resolve(relative, must_exist=True)
            if full == WORKDIR:
                raise FileError(_bud.FILE_STATUS_BAD_PATH, "cannot delete the work directory")
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)
            else:
                os.unlink(full)
        elif op == _bud.FILE_OP_GLOB:
            if relative.startswith("/") or ".." in relative.split("/"):
                raise FileError(_bud.FILE_STATUS_BAD_PATH, f"bad pattern {relative!r}")
            names = []
            for name in sorted(glob.glob(relative, root_dir=WORKDIR, recursive=True)):
                try:
                    full = resolve(name)
                except FileError:
                    continue
                if os.path.isfile(full):
                    names.append(name.encode("utf-8", "surrogateescape"))
            write_out(b"\0".join(names))
        elif op == _bud.FILE_OP_STAT:
            full = WORKDIR if relative in ("", ".") else _resolve_parent(relative)
            entry = entry_of(full, with_metadata)
            write_out(json.dumps(entry).encode("utf-8", "surrogateescape"))
        elif op == _bud.FILE_OP_MKDIR:
            full = resolve(relative)
            if os.path.lexists(full) and not os.path.isdir(full):
                raise FileError(_bud.FILE_STATUS_WRONG_KIND, f"{relative!r} is not a directory")
            _make_dirs(full, owner)
        elif op == _bud.FILE_OP_MOVE:
            source = _resolve_parent(relative)
            if source == WORKDIR:
                raise FileError(_bud.FILE_STATUS_BAD_PATH, "cannot move the work directory")
            if not os.path.lexists(source):
                raise FileError(_bud.FILE_STATUS_NOT_FOUND, f"{relative!r} does not exist")
            destination = resolve(bytes(data).decode("utf-8", "surrogateescape"))
            _make_dirs(os.path.dirname(destination), owner)
            os.rename(source, destination)
        else:
            raise FileError(_bud.FILE_STATUS_BAD_PATH, f"unknown file operation {op}")
    except OSError as error:
        if error.errno == errno.ENOENT:
            raise FileError(_bud.FILE_STATUS_NOT_FOUND, str(error)) from None
        if error.errno in (errno.EISDIR, errno.ENOTDIR):
            raise FileError(_bud.FILE_STATUS_WRONG_KIND, str(error)) from None
        raise FileError(_bud.FILE_STATUS_OS_ERROR, str(error)) from None
    return _bud.FILE_STATUS_OK
