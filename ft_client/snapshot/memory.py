"""The monitor's memory, as a rank's process holds it (docs/snapshots.md).

A rank's monitor owns two pairs of memory files: the rank's own snapshots (`OWN`) and the
copies it keeps of a partner rank's (`PEER`). `open_pair` asks the monitor for one over its
socket (the `snapshot` role of docs/protocol.md) and maps the descriptors it passes;
`Pair` says, from the headers alone, which buffer holds the newest complete snapshot and
which one a new save goes to; `MonitorMemory` holds both pairs for a `Snapshotter`, asks
again when a state outgrows them, and drops them when the monitor restarts.
"""

from __future__ import annotations

import os
import select
import socket
from collections.abc import Callable
from dataclasses import dataclass

from ft_client import env, wire
from ft_client.errors import MemorySnapshotError
from ft_client.record.mapped import map_sealed
from ft_client.snapshot import format as fmt
from ft_client.snapshot.format import HEADER_SIZE, Header, SnapshotFormatError

CONNECT_TIMEOUT = 10.0
"""Seconds to reach the monitor and get its reply."""
HEADROOM = 1 / 8
"""Buffers are asked for this much more than the state needs, so a state that grows a little
(an optimizer's first step) does not ask again."""
OWN, PEER = "own", "peer"
_MAX_INT = 2**63 - 1


class Buffer:
    """One mapped memory file of the monitor's."""

    def __init__(self, fd: int) -> None:
        self.mm = map_sealed(fd, what="the monitor's snapshot memory", size=f"{HEADER_SIZE}+ byte",
                             size_ok=lambda n: n >= HEADER_SIZE, error=MemorySnapshotError)
        self.size = len(self.mm)

    def header(self) -> Header | None:
        try:
            return fmt.parse_header(self.mm[:fmt.HEAD_BYTES])
        except SnapshotFormatError:
            return None

    def write_header(self, h: Header) -> None:
        self.mm[:fmt.HEAD_BYTES] = h.pack()

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # a tensor still views it: the mapping goes with that tensor
            pass


@dataclass
class Pair:
    kind: str
    buffers: list[Buffer]
    capacity: int
    monitor_pid: int | None = None

    def newest(self, *, job: str, rank: int | None = None) -> tuple[int, Header] | None:
        """The buffer holding the newest complete snapshot (by its header only) of ``job``."""
        best: tuple[int, Header] | None = None
        for i, b in enumerate(self.buffers):
            h = b.header()
            if h is None or h.state != fmt.COMPLETE or h.job != job or (rank is not None and h.rank != rank):
                continue
            if best is None or h.generation > best[1].generation:
                best = (i, h)
        return best

    def target(self, *, job: str) -> int:
        """The buffer a new save goes to: never the one holding the newest complete snapshot."""
        newest = self.newest(job=job)
        return 0 if newest is None else 1 - newest[0]

    def next_generation(self) -> int:
        gens = [h.generation for b in self.buffers if (h := b.header()) is not None]
        return max(gens, default=0) + 1

    def forget_later_steps(self, written: Buffer, head: Header) -> None:
        """After ``head`` is complete in ``written``: a snapshot of a later step (of the same rank)
        in the pair's other buffer is from before a rollback (the job went back to an earlier
        checkpoint); emptied, so that the newest save, not the highest step, is restored."""
        for b in self.buffers:
            if b is written:
                continue
            h = b.header()
            if h is not None and h.rank == head.rank and h.step > head.step:
                b.write_header(Header(**{**h.__dict__, "state": fmt.EMPTY}))

    def close(self) -> None:
        for b in self.buffers:
            b.close()
        self.buffers = []


def _recv_reply(sock: socket.socket) -> tuple[wire.Message, list[int]]:
    """One frame, with the descriptors attached to its first byte."""
    fds: list[int] = []
    data = b""
    first = True
    while True:
        want = wire.HEADER_SIZE if len(data) < wire.HEADER_SIZE else wire.HEADER_SIZE + wire.frame_length(data)
        if len(data) >= want and len(data) >= wire.HEADER_SIZE + 1:
            break
        if first:
            chunk, got, _, _ = socket.recv_fds(sock, want - len(data), 2)
            fds.extend(got)
            first = False
        else:
            chunk = sock.recv(want - len(data))
        if not chunk:
            for fd in fds:
                os.close(fd)
            raise MemorySnapshotError("the monitor closed the connection without a reply")
        data += chunk
    try:
        return wire.decode_body(data[wire.HEADER_SIZE:]), fds
    except wire.ProtocolError as e:
        for fd in fds:
            os.close(fd)
        raise MemorySnapshotError(f"the monitor's reply is malformed: {e}") from e


def open_pair(path: str, kind: str, nbytes: int, rank: int) -> Pair | None:
    """Ask the monitor at ``path`` for its ``kind`` pair, at least ``nbytes`` each (0: as held);
    None when it holds none. MemorySnapshotError when it refuses (the message is its reason)."""
    hello = wire.Hello(wire.PROTOCOL_VERSION, wire.Role.SNAPSHOT, rank,
                       {"pid": os.getpid(), "kind": kind, "bytes": nbytes})
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(CONNECT_TIMEOUT)
    try:
        try:
            sock.connect(path)
            sock.sendall(wire.encode(hello))
            reply, fds = _recv_reply(sock)
        except OSError as e:
            raise MemorySnapshotError(f"cannot reach the monitor at {path}: {e.strerror or e}") from e
    finally:
        sock.close()
    try:
        if isinstance(reply, wire.Error):
            raise MemorySnapshotError(f"the monitor refused: {reply.message}")
        if not isinstance(reply, wire.HelloOk) or not isinstance(reply.session.get("snapshot"), dict):
            raise MemorySnapshotError(f"the monitor answered {type(reply).__name__}, not a snapshot handover "
                                      "(a monitor older than snapshots?)")
        info = reply.session["snapshot"]
        count, capacity = info.get("buffers"), info.get("bytes")
        if count == 0:
            return None
        if count != 2 or len(fds) != 2 or type(capacity) is not int or capacity < HEADER_SIZE:
            raise MemorySnapshotError(f"the monitor passed {len(fds)} descriptors for {count!r} buffers of "
                                      f"{capacity!r} bytes")
        buffers = [Buffer(fd) for fd in fds]
        pid = reply.session.get("monitor_pid")
        return Pair(kind, buffers, min(b.size for b in buffers), pid if type(pid) is int and pid > 0 else None)
    finally:
        for fd in fds:
            os.close(fd)


class MonitorMemory:
    """The monitor's pairs this process has mapped: ``own`` and ``peer``, asked for at first need,
    asked for again (larger) when a state outgrows them, dropped when the monitor that passed
    them is gone (its pidfd is readable: a restarted monitor holds new, empty memory)."""

    def __init__(self, socket_path: str | None, *, rank: Callable[[], int], say: Callable[[str], None]) -> None:
        self.socket_path = socket_path
        self._rank = rank  # asked when a pair is asked for: the rank may change (an in-process restart)
        self._say = say
        self.own: Pair | None = None
        self.peer: Pair | None = None
        self._pidfd: int | None = None

    def _monitor_gone(self) -> bool:
        if self._pidfd is None:
            return False
        readable, _, _ = select.select([self._pidfd], [], [], 0)
        return bool(readable)

    def pair(self, kind: str, nbytes: int) -> Pair | None:
        """The ``kind`` pair of at least ``nbytes`` per buffer (0: whatever the monitor holds; None
        when it holds none); MemorySnapshotError when there is no monitor or it refuses."""
        if self.socket_path is None:
            raise MemorySnapshotError(f"no monitor to keep snapshots: ${env.RANK_MONITOR_SOCKET} is not set "
                                      "(run under ft-launcher, or ft-monitor serve)")
        if self._monitor_gone():
            self._say("ft_client.snapshot: the monitor restarted: the snapshots it held are gone; new ones go to "
                      "the new monitor")
            self.drop()
        have = self.own if kind == OWN else self.peer
        if have is not None and have.capacity >= nbytes:
            return have
        ask = 0 if nbytes == 0 else min(fmt.aligned(int(nbytes * (1 + HEADROOM)), 4096), _MAX_INT)
        pair = open_pair(self.socket_path, kind, ask, self._rank())
        if have is not None:
            have.close()
        if kind == OWN:
            self.own = pair
        else:
            self.peer = pair
        if pair is not None and pair.monitor_pid is not None and self._pidfd is None:
            try:
                self._pidfd = os.pidfd_open(pair.monitor_pid)
            except OSError:
                self._pidfd = None
        return pair

    def slot(self, slot: int) -> Buffer:
        """A buffer by its slot in `agreement.Holdings`: 0 and 1 the own pair's, 2 and 3 the peer pair's."""
        pair = self.own if slot < 2 else self.peer
        if pair is None:
            raise MemorySnapshotError(f"slot {slot} is gone")
        return pair.buffers[slot % 2]

    def drop(self) -> None:
        for p in (self.own, self.peer):
            if p is not None:
                p.close()
        self.own = self.peer = None
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
