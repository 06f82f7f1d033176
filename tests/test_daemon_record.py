"""The daemon in-process with a progress record: the handover, the tick, the deadline's
read, a corrupt record, the fallbacks. Same fakes as test_daemon_inprocess.py (a
`ManualClock`, a recording `FakeOps`, connections over real socketpairs); the record is
a real memfd, written here as the rank would, with times on the daemon's fake clock.

The detection tests of test_daemon_inprocess.py that matter for the record run here
in both modes: `Progress` reports through the socket or stores into the record.
"""

from __future__ import annotations

import logging
import mmap
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ft_client import record, wire
from ft_client.record import RecordWriter
from ft_client.session_info import SessionInfo
from ft_client.timeouts import Timeouts
from ft_monitor.core.record_sync import MAX_TICK
from ft_monitor.core.state import Phase, Session
from ft_monitor.daemon import record_watch
from ft_monitor.daemon.clock import ManualClock
from ft_monitor.daemon.monitor import MonitorDaemon
from ft_monitor.daemon.record_map import RecordUnavailable, create_record
from tests.test_daemon_inprocess import INPROCESS, FakeOps, Peer, _reentered, run, settle

pytestmark = pytest.mark.compat  # also run on the oldest and newest torch (scripts/test-compat)

MODES = ["record", "socket"]


class Progress:
    """One rank: its connection (a `Peer`) and how it reports progress, the mode's way."""

    made: list[Progress] = []
    """Every rank of the running test, its mapping of the record unmapped after it (`unmap_all`)."""

    def __init__(self, d: MonitorDaemon, clock: ManualClock, mode: str) -> None:
        self.d, self.clock, self.mode = d, clock, mode
        self.peer = Peer(d)
        self.writer: RecordWriter | None = None
        self.mm: mmap.mmap | None = None
        self.slots: dict[str, int] = {}
        self.info: SessionInfo | None = None
        Progress.made.append(self)

    def unmap(self) -> None:
        self.writer = None
        if self.mm is not None:
            self.mm.close()
            self.mm = None


    def hello(self, rank: int = 0) -> SessionInfo:
        """HELLO asking for a record in record mode; HELLO_OK read from the socket (where the
        descriptor comes with it) or from the fake transport."""
        info: dict[str, Any] = {"record": record.VERSION} if self.mode == "record" else {}
        self.peer.send(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.RANK, rank, info))
        if self.mode == "record":
            data, fds, _, _ = socket.recv_fds(self.peer.mine, 65536, 1)
            ok = next(iter(wire.FrameDecoder().feed(data)))
            assert isinstance(ok, wire.HelloOk) and len(fds) == 1, (ok, fds)
            mm = self.mm = mmap.mmap(fds[0], record.SIZE)
            os.close(fds[0])
            self.writer = RecordWriter(memoryview(mm).cast("q"), mm)
        else:
            ok = self.peer.transport.replies()[-1]
            assert isinstance(ok, wire.HelloOk)
        self.info = SessionInfo.from_wire(ok.session)
        assert (self.info.record is not None) == (self.mode == "record")
        return self.info

    def now_ns(self) -> int:
        return round(self.clock.now() * 1e9)

    def heartbeat(self) -> None:
        if self.writer is None:
            self.peer.send(wire.Heartbeat())
        else:
            self.writer.heartbeat(self.now_ns())

    def open(self, name: str) -> None:
        if self.writer is None:
            self.peer.send(wire.SectionOpen(name))
            return
        if name not in self.slots:
            self.slots[name] = len(self.slots)
            self.peer.send(wire.SectionSlot(name, self.slots[name]))
        self.writer.open(self.slots[name], self.now_ns())

    def close(self, name: str) -> None:
        if self.writer is None:
            self.peer.send(wire.SectionClose(name))
        else:
            self.writer.close(self.slots[name], self.now_ns())


QUIET: dict[str, Any] = dict(rank_heartbeat_timeout=None, initial_rank_heartbeat_timeout=None,
                             rank_out_of_section_timeout=None)


# -- detection, in both modes -----------------------------------------------------------


@pytest.fixture(autouse=True)
def unmap_all() -> Iterator[None]:
    """The records the test's ranks mapped are unmapped after it (a mapping holds a descriptor)."""
    yield
    while Progress.made:
        Progress.made.pop().unmap()


@pytest.mark.parametrize("mode", MODES)
def test_a_section_past_its_timeout_is_a_hang_exactly_at_the_deadline(tmp_path: Path, mode: str) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Progress(d, clock, mode)
        p.hello()
        p.open("step")
        clock.advance(1.999)
        assert d.rank is not None and d.rank.session.phase is Phase.ACTIVE
        assert list(d.rank.session.open_sections) == ["step"]
        clock.advance(0.002)
        assert d.rank.session.phase is Phase.HUNG and d.hangs[0].message.startswith("section 'step'")
        await settle()
        assert ops.sent[:2] == [signal.SIGCONT, int(d.config.stack_dump_signal)]

    run(body, tmp_path, rank_section_timeouts={"step": 2.0}, stack_dump_timeout=0.05, termination_grace_time=1.0,
        **QUIET)


@pytest.mark.parametrize("mode", MODES)
def test_steps_within_their_timeout_are_never_a_hang_and_a_closed_section_is_not_timed(tmp_path: Path,
                                                                                        mode: str) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Progress(d, clock, mode)
        p.hello()
        for _ in range(5):  # a step every 1.5 s under a 2 s timeout
            p.open("step")
            clock.advance(1.5)
            p.close("step")
            p.heartbeat()
        clock.advance(20)
        assert d.hangs == [] and d.rank is not None and d.rank.session.steps_closed == 5
        assert d.rank.session.heartbeats == 5

    run(body, tmp_path, rank_section_timeouts={"step": 2.0}, rank_heartbeat_timeout=30.0,
        initial_rank_heartbeat_timeout=None, rank_out_of_section_timeout=None)


@pytest.mark.parametrize("mode", MODES)
def test_every_step_is_counted_and_the_rank_ends_at_its_last_iteration_in_both_modes(tmp_path: Path,
                                                                                     mode: str) -> None:
    """200 steps of 1 ms, far shorter than the record's tick: the step histogram counts all
    of them with their time, and a rank gone without GOODBYE (its last ITERATION report
    throttled away over the socket, its last stores not yet read from the record) is
    reported at its real last iteration."""
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Progress(d, clock, mode)
        p.hello()
        reported = -1.0
        for i in range(200):
            p.open("step")
            clock.advance(0.001)
            p.close("step")
            if p.writer is not None:
                p.writer.iteration(i + 1)
            elif clock.now() - reported >= 0.2:  # the client's throttle (ITERATION_REPORT_INTERVAL)
                reported = clock.now()
                p.peer.send(wire.Iteration(i + 1))
            p.heartbeat()
            clock.advance(0.001)
        if mode == "socket":
            assert d.rank is not None and d.rank.session.steps_closed == 200
        else:  # the last steps are in the record, not read yet: the connection's end reads them
            assert d.rank is not None and d.rank.session.steps_closed < 200
        p.peer.close()  # gone without GOODBYE
        await settle()
        step = d.section_stats.get("step")
        assert step is not None and step.count == 200 and sum(step.buckets) == 200
        assert step.sum_s == pytest.approx(0.2, abs=1e-6)
        st = d.status()
        assert not st.connected and st.last_iteration == 200 and st.iteration_high == 200

    run(body, tmp_path, rank_section_timeouts={"step": 30.0}, **QUIET)


@pytest.mark.parametrize("mode", MODES)
def test_heartbeats_and_out_of_section_time_are_judged_in_both_modes(tmp_path: Path, mode: str) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Progress(d, clock, mode)
        p.hello()
        p.open("step")
        for _ in range(3):
            clock.advance(0.9)
            p.heartbeat()
        clock.advance(0.5)
        p.close("step")  # out of section from now: 2 s
        p.heartbeat()
        clock.advance(1.0)
        p.heartbeat()
        clock.advance(0.999)
        assert d.hangs == []
        clock.advance(0.002)
        assert len(d.hangs) == 1 and d.hangs[0].message.startswith("no section open for 2.0 s")

    run(body, tmp_path, rank_section_timeouts={"step": 5.0}, rank_heartbeat_timeout=1.5,
        initial_rank_heartbeat_timeout=3.0, rank_out_of_section_timeout=2.0, stack_dump_timeout=0)


@pytest.mark.parametrize("mode", MODES)
def test_progress_reported_while_the_daemon_was_stopped_is_read_before_judging(tmp_path: Path, mode: str) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Progress(d, clock, mode)
        p.hello()
        p.heartbeat()
        clock.advance(2.0)
        clock._now += 1.5  # the daemon is stopped: no timer runs, the rank goes on
        if mode == "record":
            p.heartbeat()  # stored while the daemon cannot read
        else:
            p.peer.mine.sendall(wire.encode(wire.Heartbeat()))  # waits unread in the socket
        clock._now += 0.2
        d._deadline_due()  # the daemon runs again: its timer, past the deadline, fires first
        if mode == "socket":
            p.peer.conn.data_received(p.peer.theirs.recv(1024))  # the loop reads the socket
            clock.advance(0.01)
        assert d.hangs == [], "judged before reading the progress the rank reported"
        clock.advance(3.0)
        assert len(d.hangs) == 1 and d.hangs[0].message.startswith("no heartbeat")

    run(body, tmp_path, rank_heartbeat_timeout=3.0, initial_rank_heartbeat_timeout=3.0, rank_section_timeouts={},
        rank_out_of_section_timeout=None, stack_dump_timeout=0)


@pytest.mark.parametrize("mode", MODES)
def test_an_in_process_restart_leaves_no_stale_open_section(tmp_path: Path, mode: str) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Progress(d, clock, mode)
        p.hello()
        control = Peer(d)
        control.send(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.CONTROL, 0, {}))
        p.open("step")
        clock.advance(1.01)
        await settle()
        s = d.rank.session  # type: ignore[union-attr]
        assert s.phase is Phase.RESTARTING and isinstance(control.transport.replies()[-1], wire.Abort)
        p.peer.send(wire.Restarting(1))  # the rank unwinds: it reports nothing (the client's gate)
        clock.advance(0.5)
        if p.writer is not None:
            p.writer.reset(p.now_ns())  # re-entry: a new epoch, what was left open is closed
        p.peer.send(_reentered(1))  # with its first progress call
        p.open("data")
        clock.advance(0.2)
        assert s.phase is Phase.ACTIVE and list(s.open_sections) == ["data"]
        clock.advance(5.0)  # the step abandoned at the fault is never judged
        assert len(d.hangs) == 1 and ops.sent == []

    run(body, tmp_path, **{**INPROCESS, "rank_section_timeouts": {"step": 1.0, "data": None}})


# -- the record itself ---------------------------------------------------------------------
def test_the_record_is_read_on_a_tick_only_while_something_is_timed(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Progress(d, clock, "record")
        p.hello()
        assert d.rank is not None and d.rank.record is not None
        assert clock.pending() and clock.pending()[0] == pytest.approx(clock.now() + MAX_TICK)
        p.open("step")  # a step of 600 s: the tick finds it; the deadline is far
        clock.advance(MAX_TICK)
        assert "step" in d.rank.session.open_sections
        reads = d.rank.record.reads
        clock.advance(1.0)  # nothing changes: the ticks read, find the same bytes, decode nothing
        assert d.rank.record.reads == reads

    run(body, tmp_path, rank_section_timeouts={"step": 600.0}, **QUIET)


def test_a_ping_is_answered_after_what_the_rank_stored_before_it_is_applied(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Progress(d, clock, "record")
        p.hello()
        p.open("step")
        p.peer.send(wire.Ping())  # skip_section_response: false confirms with a PING
        assert d.rank is not None and "step" in d.rank.session.open_sections

    run(body, tmp_path, rank_section_timeouts={"step": 600.0}, **QUIET)


def _refused(p: Progress) -> list[str]:
    return [m.reason for m in p.peer.transport.replies() if isinstance(m, wire.RecordRefused)]


HB3: dict[str, Any] = dict(rank_heartbeat_timeout=3.0, initial_rank_heartbeat_timeout=None,
                           rank_section_timeouts={"step": 600.0}, rank_out_of_section_timeout=None,
                           stack_dump_timeout=0)


def test_a_refused_record_is_told_to_the_rank_which_is_judged_on_the_socket_from_then_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 24 item 6 (on main the rank was never told, and was hung 3 s after its last
    valid heartbeat however often it heartbeated)."""
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Progress(d, clock, "record")
        p.hello()
        p.open("step")
        p.heartbeat()
        clock.advance(2.5)  # the record's last valid heartbeat is 2.5 s old when it is refused
        assert p.writer is not None
        p.writer.words[record.W_ITERATION] = -7  # one word, as a stray native write could
        with caplog.at_level(logging.ERROR, "ft_monitor.server"):
            clock.advance(MAX_TICK)
        assert d.rank is not None and d.rank.record is None
        (line,) = [r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()]
        assert line.startswith(f"rank 0 pid {os.getpid()}: its progress record is corrupt (iteration -7 is below -1)")
        assert "the rank is told and reports through the socket from now on" in line
        assert _refused(p) == ["iteration -7 is below -1"]
        s = d.rank.session
        assert "step" not in s.open_sections  # the record's sections: the rank opens them on the socket
        for _ in range(40):  # 10 s of heartbeats every 250 ms over the socket: healthy
            clock.advance(0.25)
            p.peer.send(wire.Heartbeat())
        p.peer.send(wire.SectionOpen("step"))
        assert not d.hangs and s.phase is Phase.ACTIVE and list(s.open_sections) == ["step"]
        clock.advance(3.01)  # then silence: judged on the socket, an ordinary heartbeat hang
        assert len(d.hangs) == 1 and d.hangs[0].message.startswith("no heartbeat for 3.0 s"), d.hangs

    run(body, tmp_path, **HB3)


def test_a_rank_silent_after_its_record_is_refused_is_reported_as_record_refused(tmp_path: Path) -> None:
    """Its heartbeat interval runs from the refusal (not from the record's last valid
    heartbeat), and the report says "record refused", not "no heartbeat"."""
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Progress(d, clock, "record")
        p.hello()
        p.heartbeat()
        clock.advance(2.5)
        assert p.writer is not None
        p.writer.words[: record.words_for(1)] = memoryview(os.urandom(8 * record.words_for(1))).cast("q")
        clock.advance(MAX_TICK)
        assert d.rank is not None and d.rank.record is None and len(_refused(p)) == 1
        clock.advance(2.9)
        assert not d.hangs  # 5.4 s after the last valid heartbeat, 2.9 s after the refusal
        clock.advance(0.2)
        assert len(d.hangs) == 1
        h = d.hangs[0]
        assert h.message.startswith("record refused (") and "heartbeat timeout 3.0 s" in h.message, h.message
        assert "no heartbeat" not in h.message
        assert "nothing over the socket in the 3.0 s since" in h.message, h.message

    run(body, tmp_path, **HB3)


def test_the_future_check_reads_the_monitors_clock_after_the_copy() -> None:
    """Issue 24 item 7: the monitor read its clock before copying the record, so a heartbeat
    the rank stored while the monitor was preempted between the two (5 ms here, past the
    1 ms slack) was refused as "stamped in the future" (main: RankRecord.apply took that
    early reading as a number, and raised RecordError on this read)."""
    now = [100.0]
    fd, mapping = create_record(round(now[0] * 1e9))
    mm = mmap.mmap(fd, record.SIZE)
    os.close(fd)
    writer = RecordWriter(memoryview(mm).cast("q"), mm)

    class Preempted:
        def read(self, words: int) -> tuple[bytes, bytes, bytes]:
            now[0] += 0.005  # the monitor is preempted between its clock reading and the copy...
            writer.heartbeat(round(now[0] * 1e9))  # ...while the rank stores a heartbeat, stamped then
            return mapping.read(words)

        def close(self) -> None:
            mapping.close()

    rr = record_watch.RankRecord(Preempted(), round(100.0 * 1e9))
    session = Session(rank=0, pid=1, started_at=100.0, timeouts=Timeouts())
    assert rr.apply(session, lambda: now[0]) is not None
    assert session.heartbeats == 1 and session.last_heartbeat == pytest.approx(100.005)
    rr.close()


def test_slot_registrations_that_break_the_rules_are_ignored_and_counted(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Progress(d, clock, "record")
        p.hello()
        p.peer.send(wire.SectionSlot("step", 0), wire.SectionSlot("data", 0), wire.SectionSlot("x", 999))
        assert d.rank is not None and d.rank.session.errors == 2 and d.rank.record is not None
        assert d.rank.record.sync.names == {0: "step"}

    run(body, tmp_path)


def test_a_rank_that_declines_its_record_reports_through_the_socket(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Progress(d, clock, "record")
        p.hello()
        with caplog.at_level(logging.WARNING, "ft_monitor.server"):
            p.peer.send(wire.RecordDeclined("the monitor's clock differs from this process's"))
        assert d.rank is not None and d.rank.record is None and clock.pending() == []
        assert "cannot use its progress record (the monitor's clock differs" in caplog.text
        p.peer.send(wire.SectionOpen("step"))
        clock.advance(2.0)
        assert len(d.hangs) == 1

    run(body, tmp_path, rank_section_timeouts={"step": 2.0}, stack_dump_timeout=0, **QUIET)


def test_without_memfd_the_rank_gets_no_record_and_reports_through_the_socket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def unavailable(created_ns: int) -> Any:
        raise RecordUnavailable("memfd_create failed: Function not implemented")

    monkeypatch.setattr(record_watch, "create_record", unavailable)
    monkeypatch.setattr(record_watch, "_logged", set())

    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Progress(d, clock, "socket")
        p.peer.send(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.RANK, 0, {"record": record.VERSION}))
        ok = p.peer.transport.replies()[-1]  # sent through the transport: no descriptor
        assert isinstance(ok, wire.HelloOk) and ok.session["record"] is None
        assert "no progress record for the ranks of this monitor (memfd_create failed" in caplog.text
        p.open("step")
        clock.advance(2.0)
        assert len(d.hangs) == 1

    with caplog.at_level(logging.WARNING, "ft_monitor.server"):
        run(body, tmp_path, rank_section_timeouts={"step": 2.0}, stack_dump_timeout=0, **QUIET)


def test_progress_record_off_and_clients_that_do_not_ask_get_none(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Progress(d, clock, "socket")
        p.peer.send(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.RANK, 0, {"record": record.VERSION}))
        ok = p.peer.transport.replies()[-1]
        assert isinstance(ok, wire.HelloOk) and ok.session["record"] is None and d.rank is not None
        assert d.rank.record is None and clock.pending() == []

    run(body, tmp_path, progress_record=False)

    async def unasked(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        for info in ({}, {"record": True}, {"record": 1}):  # an older client (or layout), or nonsense
            p = Peer(d)
            p.send(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.RANK, 0, info))
            ok = p.transport.replies()[-1]
            assert isinstance(ok, wire.HelloOk) and ok.session["record"] is None
            p.send(wire.Goodbye())

    run(unasked, tmp_path)


@pytest.mark.parametrize("mode", MODES)
def test_on_hang_dump_keeps_watching_and_finds_the_next_hang(tmp_path: Path, mode: str) -> None:
    """``on_hang: dump``: after a hang is diagnosed the rank runs on; progress past it, then a
    second stop, is a second hang, whether the progress came by the socket or by the record
    (which sends nothing that would re-arm the daemon's timer)."""

    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Progress(d, clock, mode)
        p.hello()
        p.open("step")
        clock.advance(1.01)
        await settle()
        assert len(d.hangs) == 1 and signal.SIGTERM not in ops.sent
        clock.advance(5.0)  # still stuck in the same step: not a second hang
        await settle()
        assert len(d.hangs) == 1
        p.close("step")  # progress, then stuck again
        p.open("step")
        clock.advance(0.5)
        clock.advance(0.6)
        await settle()
        assert len(d.hangs) == 2 and signal.SIGTERM not in ops.sent and signal.SIGKILL not in ops.sent

    run(body, tmp_path, on_hang="dump", rank_section_timeouts={"step": 1.0}, stack_dump_timeout=0.05, **QUIET)
