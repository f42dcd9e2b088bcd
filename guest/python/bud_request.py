"""The job request, guest side: reading it from the mailbox (:class:`Request`) and the
per-clone identity it carries (:class:`Identity`). The layout is ``vmm/src/protocol.rs``
(``job``), read through the constants ``_bud`` exports.

Per-clone identity: the host has done the expensive part before the clone resumes, by
writing guest memory (``vmm/src/identity.rs``): the guest kernel's CRNG keys, input pool and
batched entropy replaced with host randomness, and CLOCK_REALTIME moved to the host's wall
clock. Here, with no syscall: Python's global ``random`` is seeded from ``job::SEED``, and
the clock is checked against ``job::WALL_CLOCK_NS`` (module docs of ``bud_jobs``).
"""

import hashlib
import random
import struct
import sys
import tempfile
import time

import _bud
import bud_io

MARKS = bud_io.MARKS  # timing marks of the job path (see bud_io)

# The clock is set only when it is off by more than these: bud's host sets the guest's clock
# itself before the clone resumes, which saves the clone a clock_settime (1-3 ms of emulated
# kernel here). WALL_CLOCK_NS is the host's time when it wrote the request, so a right clock
# reads it plus the time from then to this check: never less, and more by however long the
# host took to resume the vCPU (milliseconds, more on a loaded host). Behind it is wrong at
# once; ahead of it only by more than any plausible resume delay.
CLOCK_BEHIND_TOLERANCE_NS = 20_000_000
CLOCK_AHEAD_TOLERANCE_NS = 10_000_000_000

# LANGUAGE, CODE_LEN, STDIN_LEN, ARGC, ARGS_LEN, ENVC, ENV_LEN: seven adjacent u32s.
_REQUEST_HEADER = struct.Struct("<7I")
assert _bud.JOB_ENV_LEN == _bud.JOB_LANGUAGE + 6 * 4
_WALL_CLOCK = struct.Struct("<Q")  # also the output limit's u64
# MODE, FLAGS, SEQUENCE, FILE_OP: four adjacent u32s.
_REQUEST_KIND = struct.Struct("<4I")
_U32 = struct.Struct("<I")
SEQUENCE = struct.Struct("<I")  # the request's sequence number (also JOB_INTERRUPT's)
assert _bud.JOB_FILE_OP == _bud.JOB_MODE + 3 * 4


class ProtocolError(Exception):
    """The request in the mailbox does not fit the protocol."""


def _split(blob, count):
    """``count`` NUL-terminated byte strings from ``blob``."""
    parts = bytes(blob).split(b"\0")
    if len(parts) != count + 1 or parts[-1]:
        raise ProtocolError(f"expected {count} NUL-terminated strings")
    return parts[:count]


class Request:
    """One job request, read from the mailbox. ``stdin`` is a memoryview on the mailbox
    (not copied); the rest are bytes, args and env as lists."""

    __slots__ = ("language", "code", "stdin", "args", "env", "wall_clock_ns", "seed", "mode",
                 "flags", "sequence", "file_op", "namespace", "output_limit", "dialect")

    def __init__(self, language, code, stdin=b"", args=(), env=(), wall_clock_ns=0, seed=b"",
                 mode=_bud.MODE_JOB, flags=0, sequence=0, file_op=0, namespace=0,
                 output_limit=0, dialect=0):
        self.language = language
        self.code = code
        self.stdin = memoryview(stdin)
        self.args = list(args)
        self.env = list(env)
        self.wall_clock_ns = wall_clock_ns
        self.seed = seed
        self.mode = mode
        self.flags = flags
        self.sequence = sequence
        self.file_op = file_op
        self.namespace = namespace
        self.output_limit = output_limit  # 0: not given (the capture keeps its size)
        self.dialect = dialect  # which program runtime a LANGUAGE_PROGRAM request is

    @property
    def reseed(self):
        """Whether Python's ``random`` takes this request's seed (a one-shot job always; a
        session when it starts or forks, so its own random state carries between cells)."""
        return self.mode == _bud.MODE_JOB or bool(self.flags & _bud.JOB_FLAGS_RESEED)

    @classmethod
    def read(cls, view):
        language, code_len, stdin_len, argc, args_len, envc, env_len = (
            _REQUEST_HEADER.unpack_from(view, _bud.JOB_LANGUAGE)
        )
        if code_len + stdin_len + args_len + env_len > _bud.JOB_DATA_END - _bud.JOB_DATA:
            raise ProtocolError("request data larger than its area")
        at = _bud.JOB_DATA
        code = bytes(view[at : at + code_len])
        at += code_len
        stdin = view[at : at + stdin_len]
        at += stdin_len
        args = _split(view[at : at + args_len], argc)
        at += args_len
        env = [entry.partition(b"=")[::2] for entry in _split(view[at : at + env_len], envc)]
        (wall_clock_ns,) = _WALL_CLOCK.unpack_from(view, _bud.JOB_WALL_CLOCK_NS)
        seed = bytes(view[_bud.JOB_SEED : _bud.JOB_SEED + _bud.JOB_SEED_LEN])
        mode, flags, sequence, file_op = _REQUEST_KIND.unpack_from(view, _bud.JOB_MODE)
        (namespace,) = _U32.unpack_from(view, _bud.JOB_NAMESPACE)
        (output_limit,) = _WALL_CLOCK.unpack_from(view, _bud.JOB_OUTPUT_LIMIT)
        (dialect,) = _U32.unpack_from(view, _bud.JOB_DIALECT)
        return cls(language, code, stdin, args, env, wall_clock_ns, seed, mode, flags,
                   sequence, file_op, namespace, output_limit, dialect)


class Identity:
    """Makes a clone distinct on the Python side: ``random`` (and numpy's global random state
    when numpy is loaded) and a clock check (module docs).

    ``enabled=False`` (host tests: setting the clock needs root and would change the *host's*
    clock) skips the clock; ``random`` is still reseeded."""

    def __init__(self, enabled):
        self.enabled = enabled
        self.clock_set = False  # whether the last apply() had to set the clock

    def apply(self, request, warn):
        """Returns None, or why the clone must not run the job. A failed clock is only a
        warning (``warn``): the job runs with the template's."""
        if request.reseed:
            random.seed(int.from_bytes(request.seed, "little"))
            tempfile._name_sequence = None  # its own Random, seeded before READY
            # A template that imported numpy (datascience) holds numpy's global RandomState
            # as seeded before READY: every clone would draw the same numbers.
            # (default_rng() and SeedSequence() take fresh entropy from the reseeded CRNG.)
            # Its key is derived from the seed, not the seed itself: both generators are
            # Mersenne Twisters seeded by key array, so the same words would make numpy's
            # draws repeat random's, number for number.
            numpy_random = sys.modules.get("numpy.random")
            if numpy_random is not None:
                key = hashlib.blake2b(request.seed, digest_size=32, person=b"bud numpy").digest()
                numpy_random.seed([int.from_bytes(key[i : i + 4], "little")
                                   for i in range(0, len(key), 4)])
        if not self.enabled:
            return None
        ahead = time.time_ns() - request.wall_clock_ns
        self.clock_set = not -CLOCK_BEHIND_TOLERANCE_NS <= ahead <= CLOCK_AHEAD_TOLERANCE_NS
        if self.clock_set:
            try:
                time.clock_settime_ns(time.CLOCK_REALTIME, request.wall_clock_ns)
            except OSError as error:
                warn(f"clock_settime: {error}")
        MARKS["clock"] = time.perf_counter()
        return None
