"""The lane beside the running request, guest side: file and process operations served
while a cell runs (``protocol.rs``, ``lane``; the host side is ``vmm/src/beside.rs``).

The host and the worker's main thread exchange one request at a time (lane 0 of the
mailbox): while a cell runs, the main thread is in it, and the host's other requests for the
sandbox would wait for its end. The lane beside (lane 1, its own request and output areas)
lets them through: the host writes one request there while the vCPU is stopped at any exit
of the main request, and puts the lane byte on the console; the interrupt watcher
(``interrupt.rs``) writes a byte to this thread's pipe; this thread (a daemon, started and
parked in ``os.read`` before READY, so it costs nothing until used) reads the request,
serves it with the same code as the main thread (``bud_procs.run_operation``), writes its
output and outcome into the lane, and rings FLUSH and DONE with the lane's doorbell bit.
Python's GIL lets it run between the cell's bytecodes (every 5 ms at most) and whenever the
cell blocks.

Which requests come here is the host's choice: file operations beside any request, process
operations only beside a cell (the main thread's process requests use ``bud_procs.TABLE``
too). A poll here waits like the main thread's, until the pipe wakes it: the host's next lane
request, or the main thread about to end its request.

**The hand-back at DONE.** The main thread takes :attr:`Beside.lock` before it rings DONE
and holds it until it is resumed (:meth:`Beside.before_done`, :meth:`Beside.after_done`);
this thread holds it while it serves. So when the host sees DONE no lane request is being
served, and one it sent but has not had answered was never started: the host takes it back
(writes 0 over its sequence number) and runs it as a main request later. Before it takes the lock the
main thread wakes a lane poll (which would otherwise hold the lock for its whole wait).
The lane thread claims a request by writing 0 over its sequence number before it serves it,
so a second wakeup never serves it twice.

What a lane request cannot do: be interrupted (a file operation that would block on a FIFO
or a device is refused instead; output is cut at the request's output cap).
"""

import os
import select
import threading

import _bud
import bud_io
import bud_procs
import bud_request

STACK_SIZE = 256 << 10  # the lane thread's stack: file and process code, no deep recursion
EXIT_INTERNAL = 70  # as bud_jobs': the worker failed to run the request


class _OverCap(Exception):
    """The lane request's output passed its cap."""


class Beside:
    """Serves lane 1 of ``view`` (the whole mailbox) on a thread of its own. ``ring``: the
    worker's ``_bud.ring`` (usable from any thread)."""

    def __init__(self, view, ring):
        self.view = view[_bud.LANE_BESIDE : _bud.LANE_BESIDE + _bud.LANE_SIZE]
        bit = _bud.LANE_DOORBELL_BIT
        self.ring = lambda code, a=0, b=0: ring(code | bit, a, b)
        self.areas = bud_io.Areas(self.view, self.ring)
        # Re-entrant only so that the main thread can tell whether it holds it (a SIGINT of
        # a job's own may land between taking it and ringing DONE, and DONE is rung again).
        self.lock = threading.RLock()
        # The watcher's end of the pipe (handed to it) and the main thread's own.
        self.pipe_r, self.watcher_fd = os.pipe()
        self.wake_fd = os.dup(self.watcher_fd)
        # A lane poll waits; the main thread wants to ring DONE (see the module docs).
        self.waiting = False
        self.closing = False
        self.thread = None

    def start(self):
        """Starts the lane thread (before READY), which takes its own doorbell permission.
        Hand :attr:`watcher_fd` to ``_bud.start_interrupt_watcher``, which owns it from
        then on."""
        started = threading.Event()
        failure = []

        def body():
            try:
                _bud.take_doorbell()
            except BaseException as error:  # noqa: BLE001 - reported to start's caller
                failure.append(error)
                return
            finally:
                started.set()
            self._serve()

        size = threading.stack_size(STACK_SIZE)
        try:
            self.thread = threading.Thread(target=body, name="bud-beside", daemon=True)
            self.thread.start()
        finally:
            threading.stack_size(size)
        started.wait()
        if failure:
            raise OSError(f"lane thread: {failure[0]}")

    # ---- the main thread

    def before_done(self):
        """The main thread, before it rings DONE: ends a lane poll's wait, then takes the
        lock (waiting for a lane request being served to end)."""
        self.closing = True
        if self.waiting:
            os.write(self.wake_fd, b"\1")
        if not self.lock._is_owned():
            self.lock.acquire()

    def after_done(self):
        """The main thread, resumed after DONE with its next request."""
        self.closing = False
        if self.lock._is_owned():
            self.lock.release()

    # ---- the lane thread

    def _serve(self):
        while True:
            try:
                os.read(self.pipe_r, 64)
            except InterruptedError:
                continue
            with self.lock:
                self._serve_one()

    def _serve_one(self):
        (sequence,) = bud_request.SEQUENCE.unpack_from(self.view, _bud.JOB_SEQUENCE)
        if sequence == 0:
            return  # a wakeup for one already served, or one the host took back
        # Claimed: a later wakeup must not serve it again.
        bud_request.SEQUENCE.pack_into(self.view, _bud.JOB_SEQUENCE, 0)
        request = bud_request.Request.read(self.view)
        self.areas.reset()
        self.areas.start()
        room = request.output_limit or _bud.DEFAULT_OUTPUT_LIMIT
        written = 0

        def write_out(data):
            nonlocal written
            self.areas.write(bud_io.STDOUT, data)
            written += len(data)
            if written > room:
                raise _OverCap()  # the host has seen the cap crossed

        try:
            code = bud_procs.run_operation(request, write_out,
                                           lambda b: self.areas.write(bud_io.STDERR, b),
                                           self._wait)
        except _OverCap:
            code = _bud.FILE_STATUS_OK  # the host answers "too large" itself
        except BaseException as error:  # noqa: BLE001 - a bug of ours: answer, never die
            message = f"bud-worker: beside: {type(error).__name__}: {error}\n"
            self.areas.write(bud_io.STDERR, message.encode("utf-8", "backslashreplace"))
            code = EXIT_INTERNAL
        self._answer(_bud.OUTCOME_EXITED, code)

    def _answer(self, outcome, code):
        self.areas.streaming = False
        bud_io.write_u32_pair(self.view, _bud.RESULT_OUTCOME, outcome, code)
        self.ring(_bud.DONE, 0, 0)

    def _wait(self, fds, timeout):
        """A lane poll's wait: a ``select`` that the pipe ends early (False: woken). The host
        asks for the lane by setting the lane's ``JOB_INTERRUPT`` before it sends the byte
        (which the lane thread may have read already, with the one that sent the poll),
        the main thread by setting :attr:`closing` before it writes one."""
        self.waiting = True
        try:
            if self.closing or bud_request.SEQUENCE.unpack_from(self.view, _bud.JOB_INTERRUPT)[0]:
                return False
            ready, _, _ = select.select([*fds, self.pipe_r], (), (), timeout)
            return self.pipe_r not in ready
        finally:
            self.waiting = False

