"""bud's warm Python worker: the process that is snapshotted and that runs the jobs.

The agent <-> Python arrangement
--------------------------------
PID 1 (``bud-agent``, Rust) is a tiny supervisor: it mounts the file systems, starts this
worker once (``python3.11 -s -P -m bud_worker --guest``, environment in
``guest/agent/src/worker.rs``) and then only reaps children; if this process ever exits it
rings FAILED(WORKER_EXITED, wait status). It never sees a job.

This worker does all the slow things once, before the snapshot: it imports the standard
library a job is likely to use, exercises the interpreter's code paths, reserves and
populates heap and stack, creates the mailbox (``_bud``: locked, every page touched) and then
rings READY *itself* with ``_bud.ready()``. The host snapshots at that exit. Every clone
resumes the vCPU right after the ``out`` instruction, so ``ready()`` simply returns, in this
process, on this thread, and the job runs here.

Why this needs the fewest guest syscalls and fresh pages: under kvm_pvm every guest-kernel
entry is emulated (a syscall costs 0.2-0.7 ms, the first touch of a page 1.3 ms) while user
mode runs natively. The parked process *is* the one that runs the job, so resuming it wakes
nothing in the guest kernel: no scheduler, no pipe, no second process. The job arrives in the
mailbox (already mapped), its output goes into the mailbox (already mapped), and the next
doorbell is one ``out``. Python-level work in between runs on pages that were mapped before
the snapshot (imports done, pymalloc arenas and malloc heap reserved, stack touched, and
finally ``mlockall(MCL_CURRENT)`` so that every page mapped at READY is present).

The job protocol is ``bud_jobs`` (the serve loop, Python jobs), ``bud_request`` (the request
and the clone's identity), ``bud_exec`` (``python3 -c`` semantics), ``bud_io`` (output into
the mailbox areas), ``bud_capture`` (fd-level capture) and ``bud_shell`` (shell jobs through
a shell parked before READY); :func:`warm` prepares it (``JobRunner.prepare``) and :func:`main` hands the
clone to ``JobRunner.serve``. Syscalls from ``ready()`` returning to DONE, for a pure
Python job: the three identity calls (``clock_settime``, RNDADDENTROPY, RNDRESEEDCRNG) and
nothing else: the job is read from the memoryview, compiled and run, its stdout and stderr
go into the mailbox's areas through in-memory writers, and DONE is one ``out``. No clock
syscalls (``time.*`` reads the vDSO), no fresh pages unless the job outgrows the reserves.
Shell jobs pay a pipe write and a status read to a shell parked before READY instead of a
process spawn and exit (~0.5 s here).
The mailbox is MADV_DONTFORK, so a fork never write-protects it and the worker's next
write into it is not a copy-on-write fault; processes are spawned with vfork semantics
(``posix_spawn``, ``subprocess`` without ``preexec_fn``) so the rest of the worker's pages
are not write-protected either.

After :func:`warm`, fds 0-2 of the worker are the job capture files (``bud_io``): the
worker's own diagnostics go to the console through a saved descriptor (:func:`log`).

Run ``python3 -m bud_worker --dry-run`` anywhere (with ``_bud`` importable) to time the
warm-up natively: everything up to, not including, the doorbell.
"""

import gc
import os
import posix
import resource
import signal
import sys
import time

import _bud
import bud_beside
import bud_capture
import bud_io
import bud_jobs
import bud_layer
import bud_procs
import bud_program
import bud_runtime

# Exit statuses (the agent forwards the wait status in FAILED(WORKER_EXITED, status)).
# 1 stays Python's own "uncaught exception" (a bug here; the traceback is on the console).
EXIT_USAGE = 64  # not started as `-m bud_worker --guest` or `--dry-run`
EXIT_SETUP_FAILED = 70  # an OS call of the warm-up failed (doorbell, mailbox, mlockall)
EXIT_USER_WARM_FAILED = 71  # a user template's warm-up code raised (traceback on the console)

# Standard-library modules imported before the snapshot, so that jobs find them in
# sys.modules. A cold import costs ~0.1-0.5 s in the guest (each file is several syscalls),
# so each entry earns its place by how often code-interpreter jobs use it; imports they
# pull in (re, enum, inspect, ast, urllib.parse, platform, bz2, lzma...) come along.
# Measured natively: ~160 modules in sys.modules afterwards, ~90 files, ~70 ms.
# Left out on purpose: multiprocessing, concurrent.futures, asyncio, unittest, email/http/
# urllib.request/socket (no network in the guest), sqlite3, zoneinfo (no tz database).
WARM_MODULES = (
    # text and data formats
    "json", "re", "string", "textwrap", "struct", "base64", "binascii", "csv",
    "unicodedata", "pprint", "shlex", "zlib",
    # numbers
    "math", "cmath", "random", "statistics", "decimal", "fractions", "numbers", "array",
    # data structures and functional tools
    "collections", "collections.abc", "itertools", "functools", "operator", "heapq",
    "bisect", "copy", "dataclasses", "enum", "typing", "types", "weakref", "abc",
    "contextlib", "__future__",
    # dates and times (_strptime is imported lazily by strptime: do it now)
    "datetime", "time", "calendar", "_strptime", "timeit",
    # hashing and identifiers
    "hashlib", "hmac", "secrets", "uuid",
    # the process, files and the shell (subprocess is also how shell jobs will run)
    "os", "sys", "io", "subprocess", "signal", "shutil", "tempfile", "glob", "fnmatch",
    "pathlib", "locale", "argparse", "logging", "threading", "warnings",
    # the worker's own needs: error reporting and the job protocol (bud_jobs, bud_io,
    # bud_shell import the rest: atexit, fcntl, select, posix...)
    "traceback", "linecache", "tokenize", "faulthandler",
)

# A small job run once before the snapshot: it drives compile(), exec(), printing, f-string
# and number formatting, exceptions and traceback formatting, and first use of the lazily
# initialised parts of common modules (OpenSSL, strptime's locale tables, localtime's zone
# file) so that the first job in a clone does not do that work, or fault in those code pages.
WARM_JOB = '''
import json, re, math, decimal, fractions, statistics, datetime, hashlib, random, textwrap, time
from collections import Counter, defaultdict
from dataclasses import dataclass

@dataclass
class Point:
    x: float
    y: float

data = {"points": [Point(i, i * 0.5).__dict__ for i in range(50)], "name": "warm\u00e9"}
text = json.dumps(data, indent=2, sort_keys=True)
assert json.loads(text) == data
words = re.findall(r"[a-z]+", "the quick brown fox jumps over the lazy dog " * 10)
counts = Counter(words).most_common(3)
groups = defaultdict(list)
for w in words:
    groups[len(w)].append(w)
total = sum(i * i for i in range(10_000)) + 2 ** 200 % 97
stats = statistics.mean([1.5, 2.5, 3.5]), statistics.median(range(11))
money = decimal.Decimal("1.10") * 3, fractions.Fraction(1, 3) + fractions.Fraction(1, 6)
when = datetime.datetime.strptime("2024-01-02 03:04:05", "%Y-%m-%d %H:%M:%S")
stamp = datetime.datetime.now().isoformat(), when.strftime("%A %d %B %Y"), time.localtime()
digest = hashlib.sha256(text.encode()).hexdigest(), hashlib.md5(b"x").hexdigest()
ordered = sorted(words, key=lambda w: (-len(w), w))[:5]
print(f"{total:,} {math.pi:.6f} {money} {stats} {counts} {ordered}")
print(textwrap.fill(" ".join(words[:30]), width=40), random.random() < 2, digest[0][:8], stamp[1])
try:
    {}["missing"]
except KeyError as e:
    print(repr(e))
'''

# pymalloc (objects up to 512 bytes) takes 1 MiB arenas straight from mmap and gives an arena
# back to the kernel as soon as all its pools are empty, so allocating and freeing alone
# would leave nothing behind. PYMALLOC_RESERVE bytes of small objects are allocated, and one
# object per PIN_SPAN of address space is kept alive: every arena keeps a live object, stays
# mapped, and its emptied pools serve any size class in later jobs.
PYMALLOC_RESERVE = 4 << 20
PIN_SPAN = 256 << 10
SMALL_OBJECT = 512  # the largest pymalloc size class: fewest objects for the same bytes

# glibc malloc (objects over 512 bytes: list and dict storage, big strings, the compiler's
# arenas). By default it serves blocks of 128 KiB and up with fresh mmaps, unmapped on free,
# and trims the heap top on free: every big allocation in a job would be fresh pages. So:
# one arena for all threads (the GIL serialises them anyway, and it is the arena with the
# reserve), blocks up to 32 MiB (glibc's maximum) from the heap, never trim, and grow the heap
# by MALLOC_RESERVE now, left free for jobs. The heap grows M_TOP_PAD past each request:
# a fresh 2 MiB-aligned range inside it is one huge-page fault in the guest (see
# guest/agent/src/hugepages.rs), where growth by the default 128 KiB gets 4 KiB pages.
MALLOC_RESERVE = 8 << 20
MALLOC_SETTINGS = (
    ("M_ARENA_MAX", 1),
    ("M_MMAP_THRESHOLD", 32 << 20),
    ("M_TRIM_THRESHOLD", 2**31 - 1),
    ("M_TOP_PAD", 4 << 20),
)

# The same for every process a job starts (a `python3`, pip, a shell's programs), through
# their environment: set in the worker's own after it started (PYTHONMALLOC and
# GLIBC_TUNABLES are read when a process starts, so the worker keeps pymalloc and its own
# settings above), before anything is spawned. Python's small objects from glibc's heap
# instead of pymalloc's 1 MiB arenas, which a short-lived interpreter maps and unmaps by the
# hundred; blocks up to 32 MiB from the heap; no trim; the heap grown 16 MiB past each
# request. Measured on kvm_pvm (session 26, a session's shell cell): `pip --version` 40.7 M
# emulated guest-kernel instructions before, 22.8 M after; `python3 -c pass` 4.50 M and
# 3.26 M; `python3 -c 'import json,re,collections'` 5.77 M and 3.24 M; busybox `ls` the
# same. Either half alone saved less than a fifth. A job can still set its own.
CHILD_MALLOC_TUNABLES = (
    "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=2147483647"
    ":glibc.malloc.top_pad=16777216"
)

# pymalloc's arenas come from one region of this much address space (no memory until used),
# aligned to 2 MiB, so that fresh small objects fill huge pages and freed arenas are reused
# (see guest/pyext/src/arenas.rs). Reserved after the memory lock, which would populate it.
ARENA_REGION = 8 << 30

# The template manifest the image builder writes (guest/src/site.rs): the template's name,
# the modules to import before READY, its warm-up code and its packages.
TEMPLATE_MANIFEST = "/usr/lib/bud/template.json"

# Set before a template's modules are imported: matplotlib draws with the non-interactive
# Agg backend (there is no display) and keeps its font cache outside the job's work
# directory (/tmp, which a session's file API lists).
TEMPLATE_ENV = (("MPLBACKEND", "Agg"), ("MPLCONFIGDIR", "/var/cache/matplotlib"))

# The idle moment right before READY (see main).
READY_IDLE_S = 0.002
# How long the worker waits, before READY, for the guest's other tasks to stop being
# runnable (see settle_run_queue).
READY_SETTLE_LIMIT_S = 10.0

# C stack touched below the worker's frame, for deep C recursion in jobs.
STACK_RESERVE = 512 << 10

_heap_pins = []  # keeps one object per PIN_SPAN alive (see PYMALLOC_RESERVE)

# Where the worker's own lines go: the console. fds 1 and 2 until the job runner redirects
# them to its capture files; then the descriptors it saved.
_console = {"out": 1, "err": 2}


def _say(fd, text):
    data = text.encode("utf-8", "backslashreplace")
    while data:
        data = data[posix.write(fd, data) :]


def log(message):
    """One short line on the console (the worker's stderr). Each byte costs a port exit."""
    _say(_console["err"], f"bud-worker: {message}\n")


def warm_imports():
    """Imports WARM_MODULES; returns the names that are missing from this image."""
    missing = []
    for name in WARM_MODULES:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    return missing


def warm_code_paths():
    """Runs WARM_JOB once the way a job will run (compiled from a string, output captured in
    memory), then formats a runtime error and a syntax error as a job's stderr would.

    Returns None, or what went wrong: a failure only makes the first jobs slower (a module
    missing from the image, say), so it is reported, not fatal.
    """
    import contextlib
    import io
    import traceback

    out = io.StringIO()
    failure = None
    for source in (WARM_JOB, "1 / 0", "def broken(:"):
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(source, "<string>", "exec"), {"__name__": "__main__"})
        except Exception as error:  # noqa: BLE001 - every job error is formatted alike
            traceback.print_exception(error, file=out)
            if source is WARM_JOB:
                failure = f"{type(error).__name__}: {error}"
    return failure


def warm_template(path=TEMPLATE_MANIFEST):
    """Imports the template's modules and runs its warm-up code (both from the manifest),
    so that no job pays for them. Returns (template name, problem or None). A base image has
    nothing to do; a missing module or a failing warm-up is a broken template: reported, and
    the template still comes up (jobs that need the module fail with its ImportError)."""
    import json

    try:
        with open(path, "rb") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return "python", None
    name = manifest.get("name", "?")
    if not manifest.get("preload") and not manifest.get("warm"):
        return name, None
    for key, value in TEMPLATE_ENV:
        os.environ[key] = value
    os.makedirs(dict(TEMPLATE_ENV)["MPLCONFIGDIR"], exist_ok=True)
    try:
        for module in manifest.get("preload", ()):
            __import__(module)
        if manifest.get("warm"):
            with open(manifest["warm"], "rb") as f:
                source = f.read()
            exec(compile(source, manifest["warm"], "exec"), {"__name__": "__bud_warm__"})
        if "matplotlib.pyplot" in sys.modules:
            bud_jobs.bud_session.capture_figures_from(sys.modules["matplotlib.pyplot"])
    except Exception as error:  # noqa: BLE001 - reported on the console, see above
        return name, f"{type(error).__name__}: {error}"
    return name, None


def template_kernels(path=TEMPLATE_MANIFEST):
    """How many code-context kernels the template holds (its manifest's ``kernels``; see
    ``bud_procs.Table.prepare_kernels``)."""
    import json

    try:
        with open(path, "rb") as f:
            return int(json.load(f).get("kernels", 0))
    except (OSError, ValueError, TypeError):
        return 0


def reserve_memory():
    """Tunes malloc and leaves pymalloc arenas and malloc heap mapped and free for jobs."""
    for name, value in MALLOC_SETTINGS:
        _bud.mallopt(getattr(_bud, name), value)
    payload = SMALL_OBJECT - sys.getsizeof(b"")  # a bytes object of SMALL_OBJECT bytes
    objects = [bytes(payload) for _ in range(PYMALLOC_RESERVE // SMALL_OBJECT)]
    pins = {}
    for obj in objects:
        pins.setdefault(id(obj) // PIN_SPAN, obj)
    _heap_pins.extend(pins.values())
    del objects, pins
    _bud.reserve_heap(MALLOC_RESERVE)
    _bud.prefault_stack(STACK_RESERVE)


def rss_mib():
    """Resident memory of this process in MiB (from /proc; boot-time diagnostics only)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _bud.PAGE_SIZE / (1 << 20)
    except OSError:
        return -1.0


def _minor_faults():
    """Page faults of this process so far (one getrusage; boot-time diagnostics only)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def child_allocator_env(environ):
    """Gives the processes jobs start Python's malloc allocator and glibc's settings of
    CHILD_MALLOC_TUNABLES (added to the GLIBC_TUNABLES the agent set, if any)."""
    environ["PYTHONMALLOC"] = "malloc"
    tunables = environ.get("GLIBC_TUNABLES")
    environ["GLIBC_TUNABLES"] = (
        f"{tunables}:{CHILD_MALLOC_TUNABLES}" if tunables else CHILD_MALLOC_TUNABLES
    )


def warm(doorbell=True, ring=_bud.ring, shell=bud_jobs.bud_shell.SHELL):
    """Everything before READY. Returns (job runner, steps, facts for the log line);
    each step is (name, seconds, page faults). ``doorbell=False`` (dry runs on a host) also
    keeps the job runner from touching the clock and the entropy pool; ``ring`` and
    ``shell`` let host tests put a fake host and a busybox in place."""
    import faulthandler

    # A crash of the worker (a job's ctypes mischief...) dumps the Python stack on fd 2.
    faulthandler.enable()
    child_allocator_env(os.environ)
    marks = [("start", time.monotonic(), _minor_faults())]

    def mark(name):
        marks.append((name, time.monotonic(), _minor_faults()))

    missing = warm_imports()
    mark("imports")
    code_failure = warm_code_paths()
    mark("code")
    template, template_failure = warm_template()
    bud_layer.apply_user_layers(TEMPLATE_MANIFEST)
    kernels = template_kernels()
    mark("template")
    # Forks of the worker as it stands now: before its memory reserve, threads and mailbox.
    kernel_problems = []
    if doorbell and kernels:
        kernel_problems = bud_procs.TABLE.prepare_kernels(kernels)
        mark("kernels")
    reserve_memory()
    mailbox = _bud.create_mailbox(_bud.MAILBOX_DEFAULT_SIZE, doorbell=doorbell)
    mark("memory")
    interrupts = None
    beside = None
    if doorbell:
        beside = bud_beside.Beside(mailbox, _bud.ring)
        try:
            _bud.start_interrupt_watcher(lane_fd=beside.watcher_fd)
        except OSError as error:
            interrupts = f"no interrupt watcher ({error}); session cells cannot be interrupted"
            beside = None
        if beside is not None:
            try:
                beside.start()
            except OSError as error:
                interrupts = f"no lane beside ({error}); requests wait for a running cell"
                beside = None
    # In a guest the capture files live on their own bounded tmpfs (the agent mounts it).
    capture_dir = bud_capture.CAPTURE_DIR if doorbell else "/tmp"
    runner = bud_jobs.JobRunner(mailbox, ring, identity=doorbell, shell=shell,
                                capture_dir=capture_dir)
    runner.beside = beside
    runner.manifest_path = TEMPLATE_MANIFEST
    runner.programs = bud_program.load(TEMPLATE_MANIFEST)
    runner.settle = settle_run_queue
    _console["out"], _console["err"] = runner.capture.console_out, runner.capture.console_err
    if doorbell and not interrupts:
        signal.signal(signal.SIGINT, runner.on_sigint)
    job_problems = runner.prepare()
    kernel = bud_runtime.load(TEMPLATE_MANIFEST, capture_dir) if doorbell else None
    if kernel is not None:
        # A template whose kernel runtime does not come up is broken: the OSError fails
        # its boot (main), with the kernel's own words.
        warm_ms = kernel.start()
        runner.kernel = kernel
        mark(f"{kernel.name} ({warm_ms} ms warm-up)")
    job_problems += kernel_problems
    if interrupts:
        job_problems.append(interrupts)
    mark("jobs")
    # Everything alive now is template state: keep it out of every future collection, so
    # the collector neither spends time on it nor writes to its pages.
    gc.collect()
    gc.freeze()
    rss_before = rss_mib()
    _bud.lock_memory()
    _bud.use_arena_region(ARENA_REGION)
    mark("lock")
    facts = {
        "template": template,
        "template_failure": template_failure,
        "modules": len(sys.modules),
        "missing": missing,
        "code_failure": code_failure,
        "job_problems": job_problems,
        "rss_before_lock": rss_before,
        "rss": rss_mib(),
        "faults_at_start": marks[0][2],
    }
    steps = [
        (name, t - marks[i][1], faults - marks[i][2])
        for i, (name, t, faults) in enumerate(marks[1:])
    ]
    return runner, steps, facts


def describe(steps, facts):
    """The one-line boot summary: where the warm-up's time and page faults went."""
    parts = ", ".join(f"{name} {secs:.2f} s/{faults} pf" for name, secs, faults in steps)
    text = (
        f"template {facts['template']}: {parts} (startup {facts['faults_at_start']} pf); {facts['modules']} modules; "
        f"rss {facts['rss_before_lock']:.0f} -> {facts['rss']:.0f} MiB; "
        f"mailbox {_bud.mailbox_size() >> 10} KiB at {_bud.mailbox_address():#x}"
    )
    if facts["missing"]:
        text += f"; missing {','.join(facts['missing'])}"
    if facts["code_failure"]:
        text += f"; warm job failed: {facts['code_failure']}"
    if facts["template_failure"]:
        text += f"; template {facts['template']} warm-up failed: {facts['template_failure']}"
    if facts["job_problems"]:
        text += f"; jobs: {'; '.join(facts['job_problems'])}"
    return text


def runnable_others():
    """The other tasks the guest kernel has on its run queue now (``/proc/loadavg`` counts
    the caller too), named from ``/proc`` when there are any."""
    with open("/proc/loadavg", "rb") as f:
        running = int(f.read().split()[3].split(b"/")[0])
    if running <= 1:
        return []
    me = os.getpid()
    names = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        name = stat[stat.index(b"(") + 1:stat.rindex(b")")]
        if stat[stat.rindex(b")") + 2:][:1] == b"R":
            names.append(f"{name.decode(errors='replace')} ({entry})")
    return names or [f"{running - 1} unnamed"]


def settle_run_queue(limit_s=None):
    """Idles (``READY_IDLE_S`` at a time) until no other task is runnable, at most
    ``limit_s``; returns what is still runnable then (empty when settled).

    Every clone starts with the template's run queue. A task left on it at the snapshot
    keeps its place in the scheduler's virtual time, and EEVDF (Linux 6.6+) places every
    task that wakes at the weighted average of the queue's virtual times, so a task far
    ahead (khugepaged at nice 19 had used 1.3 s of CPU, 87 s of its virtual time) pulls
    every wakeup as far behind a busy thread: measured, a job's thread that woke from a
    10 ms sleep, and the interrupt watcher at a timeout, waited ~1 s while the job's main
    thread spun. Idle moments let such a task finish its work and leave the queue."""
    limit_s = READY_SETTLE_LIMIT_S if limit_s is None else limit_s
    deadline = time.monotonic() + limit_s
    while True:
        time.sleep(READY_IDLE_S)
        waiting = runnable_others()
        if not waiting or time.monotonic() >= deadline:
            return waiting


def main(argv):
    """``--guest``: warm up, ring READY, serve (what the agent runs; rings bud's doorbell, so
    inside a bud guest only). ``--dry-run``: warm up and report, no doorbell."""
    mode = argv[1] if len(argv) == 2 else None
    if mode not in ("--guest", "--dry-run"):
        log("usage: python3 -m bud_worker --guest | --dry-run")
        return EXIT_USAGE
    dry_run = mode == "--dry-run"
    try:
        runner, steps, facts = warm(doorbell=not dry_run)
    except bud_layer.UserWarmFailed as failure:
        log(str(failure))
        return EXIT_USER_WARM_FAILED
    except OSError as error:
        log(f"warm-up failed: {error}")
        return EXIT_SETUP_FAILED
    if dry_run:
        _say(_console["out"], f"dry run: {describe(steps, facts)}\n")
        return 0
    log(f"ready at {time.monotonic():.3f} s: {describe(steps, facts)}")
    # Ring READY just after a timer tick, not with one overdue: the warm-up keeps the vCPU
    # busy, so by now the next tick is due and would be the first thing every clone does
    # (about 1 800 emulated guest-kernel instructions, ~0.5 ms under kvm_pvm). A short sleep
    # idles the CPU; waking from it restarts the tick a full period ahead. The last such
    # sleep is the one settle_run_queue returns from.
    waiting = settle_run_queue()
    if waiting:
        log(f"still runnable at READY after {READY_SETTLE_LIMIT_S:.0f} s: {', '.join(waiting)}")
    if runner.kernel is not None and runner.kernel.default:
        # The kernel runtime is the default one: it rings READY and holds the doorbell; the
        # worker waits here for a request of its own (bud_runtime).
        runner.kernel.ring_ready()
    else:
        _bud.ready()
    # ---- A clone resumes here, and serve() never returns (DONE, then DONE again).
    runner.serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
