"""The monitor's side of a progress record's memory: make it, map it, copy it out.

`create_record` makes one record for a rank that asked for it at its HELLO: an
anonymous memory file (memfd: no name in any file system), one page, its header
written, sealed so that nobody can shrink or grow it (a shrunk file would make a
read of the mapping kill the monitor with SIGBUS, a store kill the rank), and
mapped here read-only: the monitor never writes into a rank's record. The
descriptor is passed to the rank with HELLO_OK (SCM_RIGHTS,
`connection.Connection.send_with_fd`) and then closed here, so the two processes
are the only holders. What cannot be done here (no memfd_create, no sealing, a
CPU that reorders memory accesses) raises RecordUnavailable with the reason, and
progress goes through the socket.

`RecordMap.read` is the seqlock's reader: three copies in a row (the sequence
words are taken from the first and the third, the data from the second; see
ft_client.record). Everything else about a read is pure (ft_client.record.read.decode,
record_sync.RecordSync).
"""

from __future__ import annotations

import fcntl
import mmap
import os
from typing import Protocol

from ft_client import record
from ft_client.errors import FtError


class RecordUnavailable(FtError):
    """No progress record can be made here; the reason is for the log."""


class RecordSource(Protocol):
    """Where a record's bytes are read from (the mapping; tests may give bytes)."""

    def read(self, words: int) -> tuple[bytes, bytes, bytes]: ...
    def close(self) -> None: ...


class RecordMap:
    """The monitor's read-only mapping of one rank's record."""

    __slots__ = ("_mm",)

    def __init__(self, mm: mmap.mmap) -> None:
        self._mm: mmap.mmap | None = mm

    def read(self, words: int) -> tuple[bytes, bytes, bytes]:
        mm = self._mm
        if mm is None:
            raise RecordUnavailable("the record's mapping is closed")
        n = 8 * words
        before = mm[:n]
        data = mm[:n]
        after = mm[:n]
        return before, data, after

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is not None:
            mm.close()


def unavailable() -> str | None:
    """Why no record can be made in this process, or None."""
    problem = record.supported()
    if problem is not None:
        return problem
    if not hasattr(os, "memfd_create") or not hasattr(fcntl, "F_ADD_SEALS"):
        return "this Python has no memfd_create or file sealing (Linux 3.17 or later is needed)"
    return None


def create_record(created_ns: int) -> tuple[int, RecordMap]:
    """A new record made at ``created_ns`` (the monitor's clock): its descriptor (the
    caller passes it to the rank, then closes it) and the monitor's mapping."""
    problem = unavailable()
    if problem is not None:
        raise RecordUnavailable(problem)
    try:
        fd = os.memfd_create("ft-progress-record", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as e:
        raise RecordUnavailable(f"memfd_create failed: {e.strerror or e}") from e
    try:
        os.ftruncate(fd, record.SIZE)
        header = record.initial_header(created_ns)
        written = os.pwrite(fd, header, 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        mm = mmap.mmap(fd, record.SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
    except OSError as e:
        os.close(fd)
        raise RecordUnavailable(f"cannot prepare the record: {e.strerror or e}") from e
    if written != len(header):
        mm.close()
        os.close(fd)
        raise RecordUnavailable(f"cannot prepare the record: {written} of its {len(header)} header bytes written")
    if hasattr(mmap, "MADV_DONTFORK"):
        try:
            mm.madvise(mmap.MADV_DONTFORK)  # a command the monitor starts (serve -- CMD) does not inherit it
        except OSError:
            pass
    return fd, RecordMap(mm)
