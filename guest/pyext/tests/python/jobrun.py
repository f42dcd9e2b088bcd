"""Runs one job through the guest's job runner in this process, against a fake host.

Reads a JSON spec on stdin (bytes as hex): language ("python"/"shell"), code, stdin, args,
env, and optionally: shell (a busybox to run as /bin/sh), park_shell, language_code (a raw
language number), full_warm (the worker's whole warm-up, as in the guest, instead of only
the job runner's), dones (how many DONEs to serve before stopping), markers (a marker
syscall right before serve() and first thing in ring(DONE), so that strace can cut out the
job path: see marker()). Writes a JSON result on the original stdout: stdout, stderr (hex),
outcome, exit_code, flushes, dones, minflt (page faults on the job path), warnings,
problems, worker_exit (the status if the job ended the worker with os._exit: the host then
still drains the areas).

The clock call of the clone identity is always skipped here (identity=False):
they need root inside a real guest and would change this host's clock and entropy pool.
"""

import json
import os
import resource
import sys

import _bud
import bud_io
import bud_jobs
import bud_worker
import fakehost

spec = json.loads(sys.stdin.buffer.read())
unhex = bytes.fromhex
markers = spec.get("markers", False)
faults = {}


def marker():
    """A syscall nothing else makes: sched_get_priority_max(7777) (EINVAL), for strace."""
    try:
        os.sched_get_priority_max(7777)
    except OSError:
        pass


def on_done():
    if markers:
        marker()
    faults["after"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt


host = fakehost.FakeHost(None, dones_before_stop=spec.get("dones", 1), on_done=on_done)
shell = spec.get("shell") or "/bin/sh"
if os.path.basename(shell) != "sh":
    # busybox picks its applet from the name it is run by: give it one ending in "sh".
    link = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sh")
    if not os.path.lexists(link):
        os.symlink(shell, link)
    shell = link
if spec.get("full_warm"):
    runner, steps, facts = bud_worker.warm(doorbell=False, ring=host.ring, shell=shell)
    problems = facts["job_problems"]
else:
    view = _bud.create_mailbox(doorbell=False)
    runner = bud_jobs.JobRunner(view, host.ring, identity=False, shell=shell)
    problems = runner.prepare(park_shell=spec.get("park_shell", True))
host.view = runner.view
harness_pid = os.getpid()
real_exit = bud_io._ORIGINAL["_exit"]


def emit(worker_exit=None):
    """Writes the result on the original stdout and ends the process (and the parked shell:
    a real host throws it away with the clone; here it would live on, maybe stopped)."""
    waiter = runner.shell.waiter
    if waiter is not None:
        try:
            os.kill(waiter.pid, 9)
        except ProcessLookupError:
            pass
    result = host.result()
    result["minflt"] = faults["after"] - faults["before"] if "after" in faults else None
    result["warnings"] = runner.warnings
    result["problems"] = problems
    result["worker_exit"] = worker_exit
    out = json.dumps(result).encode()
    while out:
        out = out[os.write(runner.capture.console_out, out):]
    real_exit(0)


def worker_exit(status):
    """os._exit of the job: what the agent's FAILED(WORKER_EXITED) lets the host see."""
    if os.getpid() != harness_pid:
        real_exit(status)
    host._drain(reset=False)
    emit(worker_exit=status)


bud_io._ORIGINAL["_exit"] = worker_exit
language = {"python": _bud.LANGUAGE_PYTHON, "shell": _bud.LANGUAGE_SHELL}[spec["language"]]
host.write_request(
    spec.get("language_code", language),
    unhex(spec["code"]),
    unhex(spec.get("stdin", "")),
    [unhex(a) for a in spec.get("args", [])],
    [(unhex(k), unhex(v)) for k, v in spec.get("env", [])],
)
faults["before"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
if markers:
    marker()
try:
    runner.serve()
except fakehost.Done:
    pass
emit()
