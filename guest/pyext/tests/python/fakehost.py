"""A fake bud host for running the guest's job runner on a development machine.

Mirrors ``vmm/src/job.rs``: ``write_request`` lays a job out in the mailbox exactly as the
host does, and ``ring`` serves the worker's doorbells: FLUSH drains both output areas and
zeroes their counters, DONE drains them once more and reads OUTCOME / EXIT_CODE. Nothing
here ships in the guest image (it lives beside the Rust tests, not in guest/python).
"""

import os
import struct
import time

import _bud


class Done(Exception):
    """Raised out of ``ring(DONE)``: the job is over (a real host throws the clone away)."""


class FakeHost:
    def __init__(self, view, dones_before_stop=1, on_done=None):
        self.view = view
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.flushes = 0
        self.dones = 0
        self.outcome = None
        self.exit_code = None
        self.dones_before_stop = dones_before_stop
        self.on_done = on_done

    def write_request(self, language, code, stdin=b"", args=(), env=(), wall_clock_ns=None,
                      seed=None):
        args_blob = b"".join(a + b"\0" for a in args)
        env_blob = b"".join(k + b"=" + v + b"\0" for k, v in env)
        view = self.view
        struct.pack_into(
            "<7I", view, _bud.JOB_LANGUAGE, language, len(code), len(stdin), len(args),
            len(args_blob), len(env), len(env_blob),
        )
        struct.pack_into("<Q", view, _bud.JOB_WALL_CLOCK_NS,
                         time.time_ns() if wall_clock_ns is None else wall_clock_ns)
        view[_bud.JOB_SEED:_bud.JOB_SEED + _bud.JOB_SEED_LEN] = (
            os.urandom(_bud.JOB_SEED_LEN) if seed is None else seed
        )
        struct.pack_into("<III", view, _bud.RESULT_STDOUT_LEN, 0, 0, 0)
        at = _bud.JOB_DATA
        for part in (code, stdin, args_blob, env_blob):
            view[at:at + len(part)] = part
            at += len(part)

    def _drain(self, reset):
        for sink, len_at, area, end in (
            (self.stdout, _bud.RESULT_STDOUT_LEN, _bud.RESULT_STDOUT_AREA,
             _bud.RESULT_STDOUT_AREA_END),
            (self.stderr, _bud.RESULT_STDERR_LEN, _bud.RESULT_STDERR_AREA,
             _bud.RESULT_STDERR_AREA_END),
        ):
            (n,) = struct.unpack_from("<I", self.view, len_at)
            n = min(n, end - area)
            sink += self.view[area:area + n]
            if reset:
                struct.pack_into("<I", self.view, len_at, 0)

    def ring(self, code, a=0, b=0):
        del a, b
        if code == _bud.FLUSH:
            self.flushes += 1
            self._drain(reset=True)
            return code
        if code == _bud.DONE:
            if self.on_done is not None and self.dones == 0:
                self.on_done()
            self.dones += 1
            if self.dones == 1:
                self._drain(reset=False)
                self.outcome, self.exit_code = struct.unpack_from(
                    "<Ii", self.view, _bud.RESULT_OUTCOME)
            if self.dones >= self.dones_before_stop:
                raise Done
            return code
        raise AssertionError(f"unexpected doorbell {code:#x}")

    def result(self):
        return {
            "stdout": self.stdout.hex(),
            "stderr": self.stderr.hex(),
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "flushes": self.flushes,
            "dones": self.dones,
        }
