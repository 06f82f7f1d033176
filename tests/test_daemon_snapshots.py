"""The monitor's snapshot memory (role `snapshot`) against a real daemon on a real Unix socket.

The daemon runs on a loop in a thread of this process (`tests.test_client_states.ThreadDaemon`);
the client here is the few lines a `snapshot` connection takes (HELLO, one reply with the
descriptors, the monitor's close), written in this file: the real client is ft_client's.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ft_client import RankMonitorClient, wire
from ft_client.observer import status
from ft_client.snapshot import format as snapshot_format
from ft_monitor.core.status import MonitorStatus, format_status
from ft_monitor.daemon.snapshot_memory import HEADER_SIZE, SnapshotMemory, allocate_pages, read_meminfo
from tests.test_client_states import QUIET, ThreadDaemon

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class Reply:
    """What a `snapshot` HELLO got: the message, the descriptors that came with it, and
    whether the monitor closed the connection after it."""

    def __init__(self, msg: wire.Message, fds: list[int], closed: bool) -> None:
        self.msg, self.fds, self.closed = msg, fds, closed

    @property
    def session(self) -> dict[str, Any]:
        assert isinstance(self.msg, wire.HelloOk), self.msg
        assert self.msg.session["monitor_pid"] == os.getpid()  # the daemon runs in this process
        snap: dict[str, Any] = self.msg.session["snapshot"]
        return snap

    @property
    def error(self) -> wire.Error:
        assert isinstance(self.msg, wire.Error), self.msg
        assert not self.fds
        return self.msg

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def ask(path: Path, kind: str, nbytes: Any, *, info: dict[str, Any] | None = None) -> Reply:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5.0)
    try:
        s.connect(str(path))
        hello = {"pid": os.getpid(), "kind": kind, "bytes": nbytes} if info is None else info
        s.sendall(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.SNAPSHOT, 0, hello)))
        dec = wire.FrameDecoder()
        fds: list[int] = []
        msgs: list[wire.Message] = []
        while not msgs:
            data, got, _, _ = socket.recv_fds(s, 65536, 4)
            fds += got
            assert data, "closed before a reply"
            msgs += dec.feed(data)
        closed = s.recv(1) == b""
        return Reply(msgs[0], fds, closed)
    finally:
        s.close()


def seals(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS)


def name_of(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.fixture
def started(workdir: Path) -> Iterator[list[ThreadDaemon]]:
    daemons: list[ThreadDaemon] = []
    yield daemons
    for d in daemons:
        d.stop()


def serve(workdir: Path, started: list[ThreadDaemon], **config: Any) -> tuple[ThreadDaemon, Path]:
    sock = workdir / "m.sock"
    d = ThreadDaemon(sock, **{**QUIET, **config})
    started.append(d)
    return d, sock


def memory(d: ThreadDaemon) -> SnapshotMemory:
    assert d.daemon is not None
    return d.daemon.snapshot_memory


def test_a_pair_is_made_handed_over_kept_and_grown_in_place(workdir: Path, started: list[ThreadDaemon]) -> None:
    d, sock = serve(workdir, started)
    n = MiB + 1
    cap = MiB + 4096
    r = ask(sock, "own", n)
    assert r.closed and len(r.fds) == 2
    assert r.session == {"kind": "own", "buffers": 2, "bytes": cap, "held": 2 * cap, "limit": 16 * GiB}
    for i, fd in enumerate(r.fds):
        assert os.fstat(fd).st_size == cap >= n
        assert seals(fd) == fcntl.F_SEAL_SHRINK  # not grow, not seal: the monitor grows them later
        assert name_of(fd).startswith(f"/memfd:ft-snapshot-own-{i}")
    for fd in memory(d).pairs["own"].fds:  # the monitor's own: no program it starts inherits them
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    with mmap.mmap(r.fds[0], cap) as mm:
        mm[:5] = b"step1"
        mm[cap - 4:] = b"tail"
    r.close()  # the rank's process is gone: only the monitor holds the memory

    again = ask(sock, "own", 0)
    assert again.session == {"kind": "own", "buffers": 2, "bytes": cap, "held": 2 * cap, "limit": 16 * GiB}
    with mmap.mmap(again.fds[0], cap) as mm:
        assert mm[:5] == b"step1" and mm[cap - 4:] == b"tail"
    kept = again.fds[0]
    mapped = mmap.mmap(kept, cap)  # a mapping made before the growth stays good

    grown = ask(sock, "own", 2 * n)
    cap2 = 2 * MiB + 4096
    assert grown.session["bytes"] == cap2 and grown.session["held"] == 2 * cap2 and len(grown.fds) == 2
    assert [os.fstat(fd).st_size for fd in grown.fds] == [cap2, cap2]
    assert os.fstat(kept).st_size == cap2  # the same file, grown: not a new one
    assert os.fstat(kept).st_ino == os.fstat(grown.fds[0]).st_ino
    with mmap.mmap(grown.fds[0], cap2) as mm:
        assert mm[:5] == b"step1" and mm[cap - 4:cap] == b"tail" and mm[cap:cap2] == bytes(cap2 - cap)
    assert mapped[:5] == b"step1"
    mapped.close()
    # asking for less never shrinks
    smaller = ask(sock, "own", 4096)
    assert smaller.session["bytes"] == cap2 and [os.fstat(fd).st_size for fd in smaller.fds] == [cap2, cap2]
    for x in (again, grown, smaller):
        x.close()


def test_nothing_held_and_nothing_asked_is_an_empty_answer(workdir: Path, started: list[ThreadDaemon]) -> None:
    d, sock = serve(workdir, started)
    r = ask(sock, "peer", 0)
    assert r.session == {"kind": "peer", "buffers": 0, "bytes": 0, "held": 0, "limit": 16 * GiB}
    assert r.fds == [] and r.closed
    assert memory(d).pairs == {}


def test_own_and_peer_are_two_pairs_counted_together_and_shown_in_status(workdir: Path,
                                                                         started: list[ThreadDaemon]) -> None:
    d, sock = serve(workdir, started, snapshot_max_bytes=64 * MiB)
    st = MonitorStatus.from_wire(status(str(sock)))
    assert st.snapshots is not None and st.snapshots.held == 0 and st.snapshots.limit == 64 * MiB
    assert "snapshots: none held" in format_status(st).splitlines()
    own = ask(sock, "own", 8 * MiB)
    peer = ask(sock, "peer", 4 * MiB)
    assert peer.session["held"] == 24 * MiB
    assert os.fstat(own.fds[0]).st_ino != os.fstat(peer.fds[0]).st_ino
    assert name_of(peer.fds[1]).startswith("/memfd:ft-snapshot-peer-1")
    wire_status = status(str(sock))
    assert wire_status["snapshots"] == {"held": 24 * MiB, "limit": 64 * MiB,
                                        "own": {"bytes": 8 * MiB, "buffers": 2, "step": None},
                                        "peer": {"bytes": 4 * MiB, "buffers": 2, "step": None}}
    assert "snapshots: 2 x 8.0 MiB own, 2 x 4.0 MiB peer, 24.0 MiB held of 64.0 MiB" in \
        format_status(wire_status).splitlines()
    own.close()
    peer.close()


def test_status_names_the_newest_complete_step_reading_only_the_headers(workdir: Path,
                                                                       started: list[ThreadDaemon]) -> None:
    d, sock = serve(workdir, started)
    seen: list[bytes] = []

    def describe(header: bytes) -> dict[str, Any]:  # ft_client.snapshot.format.describe's keys
        seen.append(header)
        state = {b"C": "complete", b"W": "writing"}.get(header[:1], "empty")
        return {"state": state, "step": int(header[1:9]) if state != "empty" else None, "rank": 0,
                "generation": 1}

    memory(d).describe = describe
    r = ask(sock, "own", 3 * HEADER_SIZE)
    assert status(str(sock))["snapshots"]["own"]["step"] is None  # both empty
    os.pwrite(r.fds[0], b"C00000120", 0)
    os.pwrite(r.fds[1], b"W00000130", 0)
    os.pwrite(r.fds[1], b"tensor bytes", HEADER_SIZE)
    seen.clear()
    assert status(str(sock))["snapshots"]["own"]["step"] == 120  # buffer 1 is being written
    assert [len(h) for h in seen] == [HEADER_SIZE, HEADER_SIZE] and all(b"tensor" not in h for h in seen)
    os.pwrite(r.fds[1], b"C00000130", 0)
    assert status(str(sock))["snapshots"]["own"]["step"] == 130
    assert "snapshots: 2 x 12.0 KiB own (step 130), 24.0 KiB held of 16.0 GiB" in format_status(status(str(sock)))
    r.close()


def _header(state: int, step: int) -> bytes:
    return snapshot_format.Header(state=state, generation=step, step=step, rank=0, world=1, layout_len=0,
                                  data_offset=HEADER_SIZE, data_len=0, saved_at=0.0, job="j", checksum=0).pack()


def test_status_reads_the_step_from_headers_the_client_writes(workdir: Path, started: list[ThreadDaemon]) -> None:
    d, sock = serve(workdir, started)
    r = ask(sock, "peer", HEADER_SIZE)
    os.pwrite(r.fds[0], _header(snapshot_format.COMPLETE, 40), 0)
    os.pwrite(r.fds[1], _header(snapshot_format.WRITING, 50), 0)  # torn: a writer killed mid-save
    assert status(str(sock))["snapshots"]["peer"] == {"bytes": HEADER_SIZE, "buffers": 2, "step": 40}
    os.pwrite(r.fds[1], _header(snapshot_format.COMPLETE, 50), 0)
    assert status(str(sock))["snapshots"]["peer"]["step"] == 50
    os.pwrite(r.fds[1], b"garbage", 0)  # invalid: the other buffer's step, and no error
    assert status(str(sock))["snapshots"]["peer"]["step"] == 40
    r.close()


def test_over_the_limit_is_refused_and_the_daemon_keeps_serving(workdir: Path, started: list[ThreadDaemon],
                                                                caplog: pytest.LogCaptureFixture) -> None:
    d, sock = serve(workdir, started, snapshot_max_bytes=3 * GiB // 2)
    held = ask(sock, "peer", 256 * MiB)
    with caplog.at_level(logging.WARNING, "ft_monitor.server"):
        r = ask(sock, "own", GiB)
    assert r.closed
    assert (r.error.code, r.error.message) == (
        wire.ErrorCode.BAD_REQUEST,
        "2 x 1.0 GiB of snapshot memory asked (own), 512.0 MiB held; snapshot_max_bytes is 1.5 GiB")
    lines = [rec.getMessage() for rec in caplog.records if "snapshot memory" in rec.getMessage()]
    assert lines == [f"refused snapshot memory to pid {os.getpid()}: 2 x 1.0 GiB of snapshot memory asked (own), "
                     "512.0 MiB held; snapshot_max_bytes is 1.5 GiB"]
    st = status(str(sock))  # still serving, nothing changed
    assert st["snapshots"]["held"] == 512 * MiB and st["snapshots"]["own"] is None
    # growing the pair that is held is refused the same way, and leaves it as it was
    r = ask(sock, "peer", GiB)
    assert r.error.message == ("2 x 1.0 GiB of snapshot memory asked (peer), 512.0 MiB held; snapshot_max_bytes "
                               "is 1.5 GiB")
    assert [os.fstat(fd).st_size for fd in held.fds] == [256 * MiB, 256 * MiB]
    # what fits is still granted
    ok = ask(sock, "own", 256 * MiB)
    assert ok.session["held"] == GiB
    held.close()
    ok.close()


def test_more_than_the_host_has_is_refused_with_both_numbers(workdir: Path, started: list[ThreadDaemon]) -> None:
    d, sock = serve(workdir, started)
    memory(d).meminfo = lambda: (3 * GiB, 8 * GiB)  # 2 GiB over the 1 GiB reserve
    r = ask(sock, "own", 2 * GiB)
    assert r.error.code == wire.ErrorCode.BAD_REQUEST
    assert r.error.message == ("2 x 2.0 GiB of snapshot memory asked (own) needs 4.0 GiB more; the host has 3.0 GiB "
                               "available (MemAvailable) and keeps 1.0 GiB in reserve (the larger of 1 GiB and 5% "
                               "of MemTotal)")
    ok = ask(sock, "own", GiB)
    assert ok.session["bytes"] == GiB
    ok.close()


def test_snapshots_off_refuses_every_request(workdir: Path, started: list[ThreadDaemon]) -> None:
    d, sock = serve(workdir, started, snapshot_max_bytes=0)
    for kind, n in (("own", MiB), ("peer", 0)):
        r = ask(sock, kind, n)
        assert r.closed and r.error.code == wire.ErrorCode.BAD_REQUEST
        assert r.error.message == "snapshots are off on this monitor: snapshot_max_bytes is 0"
    assert "snapshots: off (snapshot_max_bytes is 0)" in format_status(status(str(sock))).splitlines()


@pytest.mark.parametrize("info, message", [
    ({"pid": 1, "kind": "mine", "bytes": 1}, "kind must be one of 'own', 'peer', not 'mine'"),
    ({"pid": 1, "bytes": 1}, "kind must be one of 'own', 'peer', not None"),
    ({"pid": 1, "kind": "own", "bytes": -1}, "bytes must be a whole number >= 0, not -1"),
    ({"pid": 1, "kind": "own", "bytes": True}, "bytes must be a whole number >= 0, not True"),
    ({"pid": 1, "kind": "own", "bytes": 1.5}, "bytes must be a whole number >= 0, not 1.5"),
    ({"pid": 1, "kind": "own"}, "bytes must be a whole number >= 0, not None"),
])
def test_a_bad_request_is_refused_and_closed(workdir: Path, started: list[ThreadDaemon], info: dict[str, Any],
                                             message: str) -> None:
    d, sock = serve(workdir, started)
    r = ask(sock, "", 0, info=info)
    assert r.closed and (r.error.code, r.error.message) == (wire.ErrorCode.BAD_REQUEST, message)
    assert status(str(sock))["snapshots"]["held"] == 0


def test_the_memory_outlives_rank_sessions_and_goes_with_the_daemon(workdir: Path,
                                                                   started: list[ThreadDaemon]) -> None:
    d, sock = serve(workdir, started)
    r = ask(sock, "own", MiB)
    os.pwrite(r.fds[0], b"kept", 0)
    r.close()
    for _ in range(2):  # a rank's sessions begin and end (its processes come and go)
        c = RankMonitorClient(str(sock))
        c.init_workload_monitoring()
        c.shutdown_workload_monitoring()
    again = ask(sock, "own", 0)
    assert os.pread(again.fds[0], 4, 0) == b"kept"
    again.close()
    held = [fd for p in memory(d).pairs.values() for fd in p.fds]
    assert len(held) == 2 and all(name_of(fd).startswith("/memfd:ft-snapshot-own") for fd in held)
    d.stop()
    for fd in held:  # closed (or the number reused by something else)
        try:
            assert not name_of(fd).startswith("/memfd:ft-snapshot-own")
        except FileNotFoundError:
            pass


def allocated(fd: int) -> int:
    """Bytes of the file's pages that exist (shmem: allocated, counted against the host's memory)."""
    return os.fstat(fd).st_blocks * 512


def memfds() -> list[str]:
    """The snapshot memory files this process has open (the daemon runs in it)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("/memfd:ft-snapshot-"):
            found.append(target)
    return found


def test_a_grant_allocates_its_pages_and_a_growth_keeps_the_snapshot(workdir: Path,
                                                                    started: list[ThreadDaemon]) -> None:
    """Reserved as granted (fallocate), not when the rank writes: the pages exist at once, on
    the real memfds, sealed against shrinking, grown in place."""
    d, sock = serve(workdir, started)
    r = ask(sock, "own", 64 * MiB)
    assert r.session["bytes"] == 64 * MiB and len(r.fds) == 2
    for fd in r.fds:
        assert os.fstat(fd).st_size == 64 * MiB
        assert allocated(fd) >= 64 * MiB  # allocated, not only sized
        assert seals(fd) == fcntl.F_SEAL_SHRINK
    for i, fd in enumerate(r.fds):  # a complete snapshot in each buffer, its last byte too
        os.pwrite(fd, f"step{i}".encode(), 0)
        os.pwrite(fd, f"tail{i}".encode(), 64 * MiB - 5)
    r.close()

    grown = ask(sock, "own", 96 * MiB)
    assert grown.session["bytes"] == 96 * MiB and grown.session["held"] == 2 * 96 * MiB
    for i, fd in enumerate(grown.fds):
        assert os.fstat(fd).st_size == 96 * MiB and allocated(fd) >= 96 * MiB
        assert os.pread(fd, 5, 0) == f"step{i}".encode() and os.pread(fd, 5, 64 * MiB - 5) == f"tail{i}".encode()
        assert os.pread(fd, 4096, 64 * MiB) == bytes(4096)
    grown.close()


def _no_memory(fd: int, offset: int, length: int) -> None:
    raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))


def test_pages_that_cannot_be_allocated_refuse_the_grant_and_keep_what_is_held(
        workdir: Path, started: list[ThreadDaemon], caplog: pytest.LogCaptureFixture) -> None:
    d, sock = serve(workdir, started)
    before = memfds()
    memory(d).allocate = _no_memory  # the seam: posix_fallocate by default
    with caplog.at_level(logging.WARNING, "ft_monitor.server"):
        r = ask(sock, "own", 8 * MiB)
    message = ("2 x 8.0 MiB of snapshot memory asked (own) could not be reserved: the host did not allocate its "
               "pages (fallocate: Cannot allocate memory); none was made")
    assert r.closed and (r.error.code, r.error.message) == (wire.ErrorCode.BAD_REQUEST, message)
    assert [rec.getMessage() for rec in caplog.records] == [f"refused snapshot memory to pid {os.getpid()}: {message}"]
    assert memory(d).pairs == {} and memfds() == before  # the files made for it are closed
    assert status(str(sock))["snapshots"] == {"held": 0, "limit": 16 * GiB, "own": None, "peer": None}

    # a pair held, with a snapshot in it: a growth that cannot be allocated leaves it as it was
    memory(d).allocate = allocate_pages
    held = ask(sock, "own", 4 * MiB)
    for fd in held.fds:
        os.pwrite(fd, b"step1", 0)
        os.pwrite(fd, b"tail", 4 * MiB - 4)
    memory(d).allocate = _no_memory
    r = ask(sock, "own", 8 * MiB)
    assert r.error.message == ("2 x 8.0 MiB of snapshot memory asked (own) could not be reserved: the host did not "
                               "allocate its pages (fallocate: Cannot allocate memory); the snapshot memory held is "
                               "kept, with its contents")
    for fd in held.fds:
        assert os.fstat(fd).st_size == 4 * MiB and allocated(fd) >= 4 * MiB
        assert os.pread(fd, 5, 0) == b"step1" and os.pread(fd, 4, 4 * MiB - 4) == b"tail"
    assert memory(d).pairs["own"].sizes == [4 * MiB, 4 * MiB]

    # half-way: the first buffer grows (allocated; it can never shrink), the second cannot
    calls: list[int] = []

    def first_only(fd: int, offset: int, length: int) -> None:
        calls.append(fd)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        allocate_pages(fd, offset, length)

    memory(d).allocate = first_only
    r = ask(sock, "own", 8 * MiB)
    assert r.error.message.endswith("(fallocate: No space left on device); the snapshot memory held is kept, with "
                                    "its contents")
    assert [os.fstat(fd).st_size for fd in held.fds] == [8 * MiB, 4 * MiB] and allocated(held.fds[0]) >= 8 * MiB
    for fd in held.fds:
        assert os.pread(fd, 5, 0) == b"step1" and os.pread(fd, 4, 4 * MiB - 4) == b"tail"
    # counted as held; the pair's capacity is the smaller buffer's
    assert status(str(sock))["snapshots"]["held"] == 12 * MiB
    assert status(str(sock))["snapshots"]["own"]["bytes"] == 4 * MiB
    # and the next request grows the other one only
    calls.clear()

    def counted(fd: int, offset: int, length: int) -> None:
        calls.append(fd)
        allocate_pages(fd, offset, length)

    memory(d).allocate = counted
    ok = ask(sock, "own", 8 * MiB)
    assert ok.session["bytes"] == 8 * MiB and ok.session["held"] == 16 * MiB
    assert calls == [memory(d).pairs["own"].fds[1]]
    assert [os.fstat(fd).st_size for fd in held.fds] == [8 * MiB, 8 * MiB] and allocated(held.fds[1]) >= 8 * MiB
    for x in (held, ok):
        x.close()


def test_a_reserve_eaten_meanwhile_is_logged_and_the_grant_stands(workdir: Path, started: list[ThreadDaemon],
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Two monitors deciding at the same moment: MemAvailable, read again once the pages are
    allocated, is under the reserve. The grant is kept, and the log says so."""
    d, sock = serve(workdir, started)
    readings = [(8 * GiB, 16 * GiB), (GiB // 2, 16 * GiB)]  # before the decision, after the allocation
    seen: list[tuple[int, int]] = []

    def meminfo() -> tuple[int, int]:
        seen.append(readings[min(len(seen), len(readings) - 1)])
        return seen[-1]

    memory(d).meminfo = meminfo
    with caplog.at_level(logging.INFO, "ft_monitor.server"):
        r = ask(sock, "own", 2 * MiB)
    assert r.session["bytes"] == 2 * MiB and len(r.fds) == 2 and len(seen) == 2
    lines = [(rec.levelno, rec.getMessage()) for rec in caplog.records if "snapshot memory" in rec.getMessage()]
    assert lines == [
        (logging.WARNING, "snapshot memory (own), 2 x 2.0 MiB: the host has 512.0 MiB available (MemAvailable) "
                          "once this grant's pages are allocated, under the 1.0 GiB it keeps in reserve: something "
                          "else took memory since the decision (another monitor granting at the same moment?); the "
                          "grant stands"),
        (logging.INFO, f"snapshot memory (own) handed to pid {os.getpid()}: 2 x 2.0 MiB; 4.0 MiB held of 16.0 GiB "
                       "(grown by 4.0 MiB, allocated)")]
    r.close()
    # asked again at the size held: nothing allocated, MemAvailable read once (the decision), nothing logged
    caplog.clear()
    with caplog.at_level(logging.WARNING, "ft_monitor.server"):
        again = ask(sock, "own", 2 * MiB)
    assert again.session["bytes"] == 2 * MiB and len(seen) == 3 and caplog.records == []
    again.close()


def test_meminfo_is_read_in_bytes(tmp_path: Path) -> None:
    p = tmp_path / "meminfo"
    p.write_text("MemTotal:       16384000 kB\nMemFree:         1000 kB\nMemAvailable:    8192000 kB\n")
    assert read_meminfo(str(p)) == (8192000 * KiB, 16384000 * KiB)
    p.write_text("MemTotal: lots\n")
    assert read_meminfo(str(p)) == (None, None)
    assert read_meminfo(str(tmp_path / "none")) == (None, None)
    available, total = read_meminfo()
    assert available is not None and total is not None and 0 < available <= total


def test_the_clients_snapshots_round_trip_through_the_real_daemon(workdir: Path, started: list[ThreadDaemon]) -> None:
    """ft_client.snapshot against this daemon (its own tests use a fake monitor)."""
    torch = pytest.importorskip("torch")
    from ft_client.errors import MemorySnapshotError
    from ft_client.snapshot import Snapshotter, open_pair

    d, sock = serve(workdir, started, snapshot_max_bytes=64 * MiB)
    state = {"w": torch.arange(1000, dtype=torch.float32), "step_seen": 3}
    s = Snapshotter(socket_path=str(sock), job="j", rank=0)
    assert s.save(3, state)
    s.wait()
    s.close()
    restarted = Snapshotter(socket_path=str(sock), job="j", rank=0)  # a restarted rank's process
    got = restarted.restore()
    restarted.close()
    assert got is not None and got[0] == 3 and torch.equal(got[1]["w"], state["w"])
    own = status(str(sock))["snapshots"]["own"]
    assert own["buffers"] == 2 and own["step"] == 3
    with pytest.raises(MemorySnapshotError, match=r"^the monitor refused: 2 x 1.0 GiB of snapshot memory asked "
                                                  r"\(peer\), .* held; snapshot_max_bytes is 64.0 MiB$"):
        open_pair(str(sock), "peer", GiB, 0)
    assert open_pair(str(sock), "peer", 0, 0) is None


def test_a_jobs_first_start_with_no_snapshot_is_one_quiet_line_not_a_warning(
        workdir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Attempt 0 holds no snapshot anywhere: the normal case, said once at INFO (a new user saw a
    per-rank WARNING at every fresh start); a restart that finds none still warns (previous test)."""
    pytest.importorskip("torch")
    from ft_client.snapshot import Snapshotter
    from tests.procs import Daemon

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    daemon = Daemon(workdir).wait_ready()
    try:
        lines: list[str] = []
        fresh = Snapshotter(socket_path=str(daemon.socket), job="j", rank=0, log_line=lines.append)
        with caplog.at_level(logging.INFO, logger="ft_client"):
            assert fresh.restore() is None
        assert lines == [] and fresh.why_not is not None
        said = [r for r in caplog.records if "no snapshot to restore" in r.getMessage()]
        assert [r.levelno for r in said] == [logging.INFO], caplog.text
    finally:
        daemon.stop()


def test_a_monitor_restart_loses_its_snapshots_and_says_so(workdir: Path) -> None:
    """The memory dies with the monitor: a new process finds nothing (one line, the file
    checkpoint next); a live rank notices the new monitor at its next save and saves there."""
    torch = pytest.importorskip("torch")
    from ft_client.snapshot import Snapshotter
    from tests.procs import Daemon

    first = Daemon(workdir).wait_ready()
    try:
        lines: list[str] = []
        s = Snapshotter(socket_path=str(first.socket), job="j", rank=0, log_line=lines.append)
        assert s.save(1, {"w": torch.ones(10)})
        s.wait()
    finally:
        first.stop()
        first.socket.unlink(missing_ok=True)
    second = Daemon(workdir).wait_ready()
    fresh = s
    try:
        fresh = Snapshotter(socket_path=str(second.socket), job="j", rank=0, log_line=lines.append)
        assert fresh.restore() is None
        assert lines[-1] == ("ft_client.snapshot: no snapshot to restore: the monitor holds no snapshot for this "
                             "rank (a first start, or a monitor that restarted); falling back to the file checkpoint")
        assert s.save(2, {"w": torch.full((10,), 2.0)})  # the live rank's next save
        s.wait()
        assert "the monitor restarted: the snapshots it held are gone" in lines[-1]
        restarted = Snapshotter(socket_path=str(second.socket), job="j", rank=0)
        got = restarted.restore()
        restarted.close()
        assert got is not None and got[0] == 2 and float(got[1]["w"][0]) == 2.0
    finally:
        for snapshotter in (s, fresh):
            snapshotter.close()
        second.stop()
