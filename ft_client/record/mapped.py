"""The rank's side of the progress record's handover: check the descriptor, map it.

The monitor passes a sealed memfd with HELLO_OK (docs/protocol.md, "The progress
record"). Before the client stores anything into it, `open_record` checks that it
is what the handshake said: one page, sealed against shrinking (nobody can cut
the mapping from under a store, which would kill the rank with SIGBUS), a header
of this layout, and a creation time on this process's own CLOCK_MONOTONIC taken
between the HELLO and its reply (a rank in another time namespace reads another
clock, and its times would mean nothing to the monitor). Anything else raises
RecordError with the reason; the client then reports through the socket.

The mapping is shared with the monitor only: the descriptor is closed once
mapped (Python's mmap keeps a close-on-exec duplicate: no program the rank executes
inherits it), and MADV_DONTFORK keeps the mapping out of forked children (data-loader
workers cannot write the rank's progress).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
from collections.abc import Callable

from ft_client import record
from ft_client.record import RecordError, RecordWriter
from ft_client.session_info import RecordInfo


def open_record(fd: int, info: RecordInfo, asked_ns: int, answered_ns: int) -> RecordWriter:
    """Map the record passed as ``fd`` (always closed here) for writing; ``asked_ns`` and
    ``answered_ns`` bracket the handshake on this process's monotonic clock."""
    try:
        return _open(fd, info, asked_ns, answered_ns)
    finally:
        os.close(fd)


def map_sealed(fd: int, *, what: str, size: str, size_ok: Callable[[int], bool],
               error: Callable[[str], Exception]) -> mmap.mmap:
    """Map the monitor's memory file ``fd`` shared, read-write, whole, kept out of forked
    children; ``error(why)`` is raised when it is not a ``size`` memory file sealed against
    shrinking (a store into a mapping cut from under it would kill this process)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or not size_ok(st.st_size):
        raise error(f"the descriptor passed is not a {size} memory file (mode {st.st_mode:o}, {st.st_size} bytes)")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        raise error(f"the descriptor passed cannot be sealed ({e.strerror}): not a memfd") from e
    if not seals & fcntl.F_SEAL_SHRINK:
        raise error(f"{what} is not sealed against shrinking: a store into it could crash this process")
    try:
        mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        raise error(f"cannot map {what}: {e.strerror or e}") from e
    if hasattr(mmap, "MADV_DONTFORK"):
        try:
            mm.madvise(mmap.MADV_DONTFORK)
        except OSError:
            pass
    return mm


def _open(fd: int, info: RecordInfo, asked_ns: int, answered_ns: int) -> RecordWriter:
    if (info.version, info.size, info.slots) != (record.VERSION, record.SIZE, record.SLOTS):
        raise RecordError(f"the monitor describes a record of version {info.version}, {info.size} bytes, "
                          f"{info.slots} slots; this client writes version {record.VERSION}, {record.SIZE} bytes, "
                          f"{record.SLOTS} slots")
    mm = map_sealed(fd, what="the record", size=f"{record.SIZE}-byte", size_ok=lambda n: n == record.SIZE,
                    error=RecordError)
    words = memoryview(mm).cast("q")
    head = tuple(words[:8])
    if head[record.W_MAGIC] != record.MAGIC or head[record.W_VERSION] != record.VERSION \
            or head[record.W_SLOTS] != record.SLOTS:
        raise RecordError(f"the record's header {head[:3]} is not that of layout version {record.VERSION}")
    created = head[record.W_CREATED]
    if not asked_ns <= created <= answered_ns:
        raise RecordError(f"the monitor's clock differs from this process's: the record was made at {created} ns, "
                          f"outside this process's handshake ({asked_ns}..{answered_ns} ns; another time "
                          "namespace?)")
    return RecordWriter(words, mm)
