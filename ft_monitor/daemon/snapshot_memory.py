"""The rank's snapshot memory, held by its monitor: memfds made, grown, handed over, kept.

`ft_client.snapshot` saves a rank's training state into two memory files (double-buffered:
a crash in the middle of a write leaves the other buffer whole) that the rank's monitor
owns, so they outlive the rank's process; a new process of the same rank asks for them
again and maps them. A monitor holds at most two such pairs: the rank's own (kind
``own``) and the copy of another rank's snapshot it keeps for node loss (kind ``peer``).

A `snapshot` connection is one request (docs/protocol.md, "Snapshots (role snapshot)"):
HELLO with ``{"pid", "kind", "bytes"}``; the monitor makes the kind's pair, or grows both
of its buffers in place (their contents stay: the newest complete snapshot survives), never
shrinks it and never makes it anew, within the budget that `core.snapshot_budget.decide`
rules on (``snapshot_max_bytes``, and the host's ``MemAvailable`` less a reserve, read here
from /proc/meminfo); it answers HELLO_OK with the two descriptors attached (SCM_RIGHTS), or
ERROR ``bad_request`` saying why, and closes the connection once the reply is flushed. Any
process of the monitor's user may ask (the socket already admits no one else); no rank
connection is needed (a rank's new process restores before it starts monitoring).

Each buffer is ``memfd_create("ft-snapshot-<kind>-<i>", MFD_CLOEXEC | MFD_ALLOW_SEALING)``,
sized to whole pages and sealed ``F_SEAL_SHRINK`` only (a shrunk file under a mapping
would kill its reader with SIGBUS; growing stays possible). The monitor never maps them
and never reads the tensor bytes: STATUS reads at most each buffer's header
(`HEADER_SIZE` bytes at offset 0, ``pread``) for the newest complete step, through
`ft_client.snapshot.format.describe`, a reader that never raises. The descriptors live as
long as the daemon (closed at its shutdown), not as long as a rank's session or process:
that is the point.

A grant is reserved when it is made, not when the rank writes. ``ftruncate`` alone only sets
a size, and shmem pages come when first written: two monitors on a host could each be
granted most of its free memory, and their ranks learn it from the OOM killer mid-save.
So a buffer is made or grown by ``posix_fallocate(fd, 0, capacity)`` (`allocate_pages`, the
seam tests replace), which on a memfd allocates every page up to ``capacity`` at once (the
host's MemAvailable drops, and the next decision, this monitor's or another's, sees it) and
extends the size; then ``ftruncate(fd, capacity)``, a no-op after it (it sets the size where
an allocator did not). Allocating before sizing, not after, keeps a failure clean: a failed
fallocate leaves the size as it was and frees only the pages it allocated (those written
before stay), whereas a file grown by ``ftruncate`` first could never be brought back
(``F_SEAL_SHRINK``) and would keep a size with no pages behind it, the very state this
prevents. When the pages cannot be allocated (``ENOMEM``, ``ENOSPC``, ...) the grant is
refused with ERROR ``bad_request`` (`core.snapshot_budget.reservation_refusal`): a pair being
made is closed, nothing held; a pair held keeps its contents. Its two buffers are grown one
after the other: if the second fails, the first stays grown (it cannot shrink), allocated
and counted in what the monitor holds, the pair's capacity is the smaller one, and the next
request grows the other. The kernel does not always answer short memory with an error:
past what the host really has, the allocation may wake the OOM killer instead, as any
would; the budget's check of MemAvailable before allocating is what keeps a grant from
that. Allocating takes time (the kernel zeroes each page: several GiB/s, seconds for a pair
of many GiB) during which the daemon's loop waits; it happens only when a pair is made or
grows, not when a rank's new process asks again for what is held.

Two monitors may still decide at the same moment, both from the MemAvailable before either
allocated. So once a grant's pages are allocated, MemAvailable is read again, and if it is
now under the reserve the log says so (WARNING, `core.snapshot_budget.reserve_eaten`) and
the grant stands: its pages are allocated and the monitor's, the decision was right on the
numbers it had, and refusing now would throw away memory already reserved (a grown buffer
could not even give it back) and could leave both racing ranks without a snapshot where one
would have been refused. The reserve is a margin the budget keeps, not a limit the kernel
enforces.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ft_client import wire
from ft_client.errors import FtError
from ft_client.snapshot import format as snapshot_format
from ft_monitor.core.snapshot_budget import (
    BUFFERS,
    KINDS,
    Decision,
    decide,
    reservation_refusal,
    reserve_eaten,
    size_text,
)
from ft_monitor.core.status import SnapshotPair, SnapshotsStatus, newest_complete_step
from ft_monitor.daemon.connection import Connection

log = logging.getLogger("ft_monitor.server")

HEADER_SIZE = snapshot_format.HEADER_SIZE
"""The most the monitor reads of a buffer: its header."""
MEMINFO = "/proc/meminfo"

Describe = Callable[[bytes], Mapping[str, Any]]
"""What a buffer's header says (`ft_client.snapshot.format.describe`: keys ``state``, ``step``,
``rank``, ``generation``; never raises)."""


class SnapshotMemoryError(FtError):
    """The memory files could not be made or grown here; the reason is for the log and the ERROR."""


def read_meminfo(path: str = MEMINFO) -> tuple[int | None, int | None]:
    """The host's (MemAvailable, MemTotal) in bytes; None for what cannot be read."""
    try:
        with open(path, "rb") as f:
            text = f.read(64 * 1024).decode("ascii", "replace")
    except OSError:
        return None, None
    found: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if name in ("MemAvailable", "MemTotal") and parts and parts[0].isdigit():
            found[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return found.get("MemAvailable"), found.get("MemTotal")


Allocate = Callable[[int, int, int], None]
"""Allocates a file's pages from an offset for a length, growing it to offset + length;
raises OSError when it cannot (`allocate_pages`)."""


def allocate_pages(fd: int, offset: int, length: int) -> None:
    """``posix_fallocate``: on a memfd, every page of the range allocated now (MemAvailable
    drops), the size extended to ``offset + length`` only on success; a failure frees the
    pages it allocated and keeps those written before."""
    os.posix_fallocate(fd, offset, length)


class _NotReserved(FtError):
    """Allocating a buffer's pages failed (`allocate_pages`' OSError, as its cause)."""


class _Pair:
    """One kind's buffers: their descriptors and sizes (equal, unless a growth failed half-way)."""

    __slots__ = ("fds", "sizes")

    def __init__(self, fds: list[int], sizes: list[int]) -> None:
        self.fds = fds
        self.sizes = sizes

    @property
    def capacity(self) -> int:
        return min(self.sizes)

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)


class SnapshotMemory:
    """The snapshot memory one monitor holds, by kind."""

    def __init__(self, limit: int, *, meminfo: Callable[[], tuple[int | None, int | None]] = read_meminfo,
                 describe: Describe = snapshot_format.describe, allocate: Allocate = allocate_pages) -> None:
        self.limit = limit
        """snapshot_max_bytes."""
        self.meminfo = meminfo
        self.allocate = allocate
        """Allocates a buffer's pages as it is made or grown (`allocate_pages`)."""
        self.describe = describe
        """Reads a buffer's header for STATUS."""
        self.pairs: dict[str, _Pair] = {}

    @property
    def held(self) -> int:
        """Bytes of every memory file held, all kinds."""
        return sum(sum(p.sizes) for p in self.pairs.values())

    # -- the request ------------------------------------------------------------------
    def hello(self, conn: Connection, msg: wire.Hello) -> None:
        """A `snapshot` HELLO: grant (HELLO_OK with the descriptors) or refuse (ERROR), then close."""
        conn.hello_done(wire.Role.SNAPSHOT)
        conn.release_process()  # never signalled
        kind, asked = msg.info.get("kind"), msg.info.get("bytes")
        if kind not in KINDS:
            self._refuse(conn, f"kind must be one of {', '.join(map(repr, KINDS))}, not {kind!r:.40}")
            return
        if isinstance(asked, bool) or not isinstance(asked, int) or asked < 0:
            self._refuse(conn, f"bytes must be a whole number >= 0, not {asked!r:.40}")
            return
        try:
            decision, fds = self.grant(kind, asked)
        except SnapshotMemoryError as e:
            self._refuse(conn, str(e))
            return
        if not decision.ok:
            assert decision.refusal is not None
            self._refuse(conn, decision.refusal)
            return
        reply = wire.HelloOk(wire.PROTOCOL_VERSION, {"monitor_pid": os.getpid(), "snapshot": {
            "kind": kind, "buffers": len(fds), "bytes": decision.capacity, "held": self.held, "limit": self.limit}})
        if fds:
            if not conn.send_with_fd(reply, fds):
                self._refuse(conn, "the snapshot memory could not be passed over the socket (SCM_RIGHTS)")
                return
        else:
            conn.send(reply)
        log.info("snapshot memory (%s) handed to pid %d: %s; %s held of %s (%s)", kind, conn.pid,
                 f"{len(fds)} x {size_text(decision.capacity)}" if fds else "none held",
                 size_text(self.held), size_text(self.limit),
                 f"grown by {size_text(decision.growth)}, allocated" if decision.growth else "as held")
        conn.close()  # the transport sends what it still holds first

    def _refuse(self, conn: Connection, why: str) -> None:
        log.warning("refused snapshot memory to pid %d: %s", conn.pid, why)
        conn.fail(wire.ErrorCode.BAD_REQUEST, why)

    def grant(self, kind: str, asked: int) -> tuple[Decision, list[int]]:
        """Make or grow the ``kind`` pair to hold ``asked`` bytes per buffer, if the budget
        allows, its pages allocated: the decision, and the pair's descriptors (still the
        monitor's; none when refused or when nothing is held and nothing was asked). Raises
        SnapshotMemoryError when the memory cannot be made, grown or allocated."""
        pair = self.pairs.get(kind)
        held_capacity = pair.capacity if pair is not None else 0
        available, total = self.meminfo() if self.limit else (None, None)
        d = decide(kind=kind, asked=asked, held_capacity=held_capacity, held_total=self.held, limit=self.limit,
                   available=available, total=total)
        if not d.ok:
            return d, []
        try:
            if pair is None:
                if not d.capacity:
                    return d, []
                pair = self.pairs[kind] = self._make(kind, d.capacity)
            elif d.capacity > held_capacity:
                self._grow(kind, pair, d.capacity)
        except _NotReserved as e:
            cause = e.__cause__
            error = (cause.strerror if isinstance(cause, OSError) else None) or str(cause)
            raise SnapshotMemoryError(reservation_refusal(kind=kind, capacity=d.capacity,
                                                          held_capacity=held_capacity, error=error)) from cause
        if d.growth:
            available, total = self.meminfo()
            eaten = reserve_eaten(available=available, total=total)
            if eaten:
                log.warning("snapshot memory (%s), %d x %s: %s", kind, BUFFERS, size_text(d.capacity), eaten)
        return d, list(pair.fds)

    def _reserve(self, fd: int, capacity: int) -> None:
        """``fd``'s pages allocated up to ``capacity``, and its size that: all, or (raising
        _NotReserved) the file as it was."""
        try:
            self.allocate(fd, 0, capacity)
        except OSError as e:
            raise _NotReserved from e
        os.ftruncate(fd, capacity)  # a no-op: the allocation grew it (unless an allocator did not)

    def _make(self, kind: str, capacity: int) -> _Pair:
        if not hasattr(os, "memfd_create") or not hasattr(fcntl, "F_ADD_SEALS"):
            raise SnapshotMemoryError("this Python has no memfd_create or file sealing (Linux 3.17 or later is "
                                      "needed)")
        fds: list[int] = []
        try:
            for i in range(BUFFERS):
                fds.append(os.memfd_create(f"ft-snapshot-{kind}-{i}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING))
                self._reserve(fds[-1], capacity)
                fcntl.fcntl(fds[-1], fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        except (OSError, _NotReserved) as e:
            for fd in fds:  # nothing made is kept: the pages go with the files
                os.close(fd)
            if isinstance(e, _NotReserved):
                raise
            raise SnapshotMemoryError(f"cannot make the snapshot memory ({kind}, {BUFFERS} x "
                                      f"{size_text(capacity)}): {e.strerror or e}") from e
        return _Pair(fds, [capacity] * BUFFERS)

    def _grow(self, kind: str, pair: _Pair, capacity: int) -> None:
        """Both buffers to ``capacity`` in place, their pages allocated: their contents stay.
        One after the other: a buffer that could not be grown stays as it was (and the
        one grown before it stays grown, counted in `sizes`)."""
        for i, fd in enumerate(pair.fds):
            if pair.sizes[i] >= capacity:
                continue
            try:
                self._reserve(fd, capacity)
            except OSError as e:
                raise SnapshotMemoryError(f"cannot grow the snapshot memory ({kind}) to {BUFFERS} x "
                                          f"{size_text(capacity)}: {e.strerror or e}") from e
            pair.sizes[i] = capacity

    # -- what is held ---------------------------------------------------------------------
    def status(self) -> SnapshotsStatus:
        """For STATUS: sizes, and each kind's newest complete step from its buffers' headers."""
        pairs = {kind: SnapshotPair(p.capacity, len(p.fds), self._newest_step(p.fds))
                 for kind, p in self.pairs.items()}
        return SnapshotsStatus(self.held, self.limit, pairs.get("own"), pairs.get("peer"))

    def _newest_step(self, fds: Iterable[int]) -> int | None:
        found = []
        for fd in fds:
            try:
                header = os.pread(fd, HEADER_SIZE, 0)
            except OSError:
                continue
            found.append(self.describe(header))
        return newest_complete_step(found)

    def close(self) -> None:
        """At the daemon's shutdown: the memory goes with the monitor."""
        pairs, self.pairs = self.pairs, {}
        for p in pairs.values():
            p.close()
