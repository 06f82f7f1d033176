"""The daemon in-process: no daemon process, no real time, no signal sent.

`MonitorDaemon` runs on a `ManualClock` (every timer it arms goes through it),
its connections get a fake transport over one end of a real socketpair (so the
kernel's peer credentials and FIONREAD are real), and its executor's process
operations are a recording fake. Time moves only when a test says so; each test
runs in milliseconds. The real-process tests (test_e2e_daemon.py, ...) stay on top.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from ft_client import wire
from ft_monitor.config import FaultToleranceConfig
from ft_monitor.core.policy import Hang, Reason
from ft_monitor.core.settings import Settings
from ft_monitor.core.state import Phase
from ft_monitor.core.status import InprocessRestart, MonitorStatus
from ft_monitor.daemon.clock import ManualClock
from ft_monitor.daemon.connection import Connection
from ft_monitor.daemon.deadline import DeadlineTimer
from ft_monitor.daemon.executor import HangCase, HangExecutor
from ft_monitor.daemon.monitor import MonitorDaemon
from ft_monitor.processes.escalation import terminate_then_kill
from ft_monitor.processes.procinfo import ProcessHandle


def settings(**kw: Any) -> Settings:
    return Settings.from_config(FaultToleranceConfig(**kw))


# -- fakes -------------------------------------------------------------------------
class FakeTransport:
    """What asyncio gives a protocol, over one end of a socketpair (for SO_PEERCRED)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.out = bytearray()
        self.closed = False
        self.protocol: Connection | None = None

    def get_extra_info(self, name: str) -> Any:
        return self.sock if name == "socket" else None

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def write(self, data: bytes) -> None:
        self.out += data

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            assert self.protocol is not None
            self.protocol.connection_lost(None)

    abort = close

    def replies(self) -> list[wire.Message]:
        dec = wire.FrameDecoder()
        return list(dec.feed(bytes(self.out)))


class FakeOps:
    """Process operations that record what would have been done."""

    def __init__(self, clock: ManualClock, *, exits_on: set[int] | None = None) -> None:
        self.clock = clock
        self.exits_on = exits_on if exits_on is not None else {signal.SIGTERM}
        self.sent: list[int] = []
        self.exited = False
        self.waits: list[float] = []
        self.gate: asyncio.Event | None = None
        """When set, wait_exit blocks on it (a hang task that is still running)."""

    def send(self, proc: ProcessHandle, sig: int) -> bool:
        if self.exited:
            return False
        self.sent.append(sig)
        if sig in self.exits_on or sig == signal.SIGKILL:
            self.exited = True
        return True

    def alive(self, proc: ProcessHandle) -> bool:
        return not self.exited

    def stop_target(self, proc: ProcessHandle) -> FakeTarget | None:
        return None if self.exited else FakeTarget(self)

    async def wait_exit(self, proc: ProcessHandle, timeout: float) -> bool:
        self.waits.append(timeout)
        if self.gate is not None:
            await self.gate.wait()
        if not self.exited:
            self.clock.advance(timeout)
        return self.exited

    async def sleep(self, seconds: float) -> None:
        self.clock.advance(seconds)
        await asyncio.sleep(0)

    def file_size(self, path: Path) -> int:
        return 0


class FakeTarget:
    """The rank's process group, as the fake sees it."""

    def __init__(self, ops: FakeOps) -> None:
        self.ops = ops

    def send(self, sig: int) -> bool:
        return self.ops.send(None, sig)  # type: ignore[arg-type]

    def any_left(self) -> bool:
        return not self.ops.exited

    def close(self) -> None:
        pass

    def __str__(self) -> str:
        return "the fake rank's group"


PEERS: list[Peer] = []


class Peer:
    """One client connection to the in-process daemon."""

    def __init__(self, daemon: MonitorDaemon) -> None:
        self.mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.theirs = theirs
        self.conn = Connection(daemon)
        self.transport = FakeTransport(theirs)
        self.transport.protocol = self.conn
        self.conn.connection_made(self.transport)  # type: ignore[arg-type]
        PEERS.append(self)

    def send(self, *msgs: wire.Message) -> None:
        self.conn.data_received(b"".join(wire.encode(m) for m in msgs))

    def hello_rank(self, rank: int = 0) -> wire.Message:
        self.send(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.RANK, rank, {}))
        return self.transport.replies()[-1]

    def close(self) -> None:
        if not self.transport.closed:
            self.transport.close()
        self.mine.close()
        self.theirs.close()


def run(body: Callable[[MonitorDaemon, ManualClock, FakeOps], Awaitable[None]], tmp_path: Path,
        **config: Any) -> None:
    async def main() -> None:
        clock = ManualClock()
        ops = FakeOps(clock)
        config.setdefault("report_dir", str(tmp_path / "reports"))
        (tmp_path / "reports").mkdir(mode=0o700, exist_ok=True)
        daemon = MonitorDaemon(settings(**config), tmp_path / "m.sock", clock=clock, ops=ops)
        try:
            await body(daemon, clock, ops)
        finally:
            while PEERS:
                PEERS.pop().close()
            await settle()
            for task in daemon._tasks:  # the fake clock never lets them finish: not waited for in real time
                task.cancel()
            await settle()
            await daemon.shutdown("the test is over")  # its descriptors (the rank's pidfd, the record) closed

    asyncio.run(main())


async def settle() -> None:
    """Let spawned tasks run until they wait on something."""
    for _ in range(20):
        await asyncio.sleep(0)


# -- timers --------------------------------------------------------------------------
def test_deadline_timer_keeps_the_earliest_deadline() -> None:
    clock = ManualClock()
    fired: list[float] = []
    t = DeadlineTimer(clock, lambda: fired.append(clock.now()))
    t.arm(clock.now() + 5)
    t.arm(clock.now() + 9)  # later: the earlier timer stays
    assert clock.pending() == [clock.now() + 5]
    t.arm(clock.now() + 2)  # earlier: replaces it
    assert clock.pending() == [clock.now() + 2]
    clock.advance(10)
    assert fired == [1002.0]
    assert t.at is None


def test_a_section_timeout_arms_the_timer_and_fires_exactly_at_the_deadline(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Peer(d)
        assert isinstance(p.hello_rank(), wire.HelloOk)
        p.send(wire.SectionOpen("step"))
        assert d.deadline.at == pytest.approx(clock.now() + 2.0)
        clock.advance(1.999)
        assert d.rank is not None and d.rank.session.phase is Phase.ACTIVE
        clock.advance(0.002)
        assert d.rank.session.phase is Phase.HUNG
        assert len(d.hangs) == 1 and d.hangs[0].message.startswith("section 'step'")
        await settle()
        assert ops.sent[:2] == [signal.SIGCONT, int(d.config.stack_dump_signal)]

    run(body, tmp_path, rank_section_timeouts={"step": 2.0}, rank_heartbeat_timeout=None,
        initial_rank_heartbeat_timeout=None, rank_out_of_section_timeout=None, stack_dump_timeout=0.05,
        termination_grace_time=1.0)


def test_progress_moves_the_deadline_and_a_closed_section_disarms_it(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Peer(d)
        p.hello_rank()
        for _ in range(5):  # a step every 1.5 s under a 2 s timeout: never hung
            p.send(wire.SectionOpen("step"))
            clock.advance(1.5)
            p.send(wire.SectionClose("step"))
        assert d.rank is not None and d.rank.session.phase is Phase.ACTIVE
        clock.advance(100)
        assert d.hangs == [] and d.deadline.at is None and clock.pending() == []

    run(body, tmp_path, rank_section_timeouts={"step": 2.0}, rank_heartbeat_timeout=None,
        initial_rank_heartbeat_timeout=None, rank_out_of_section_timeout=None)


def test_a_late_deadline_with_progress_waiting_in_the_socket_is_judged_after_reading_it(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Peer(d)
        p.hello_rank()
        p.send(wire.Heartbeat())
        p.mine.sendall(wire.encode(wire.Heartbeat()))  # sent by the rank, not read by the daemon yet
        clock.advance(3.0001)  # the daemon was stopped past the deadline; its timer fires first
        assert d.hangs == [], "judged before reading the pending heartbeat"
        assert d.deadline.at == pytest.approx(clock.now() + 0.001)  # judged again after reading
        p.conn.data_received(p.theirs.recv(1024))  # the loop reads it
        clock.advance(0.01)
        assert d.hangs == []
        clock.advance(3.0)
        assert len(d.hangs) == 1 and d.hangs[0].message.startswith("no heartbeat")

    run(body, tmp_path, rank_heartbeat_timeout=3.0, initial_rank_heartbeat_timeout=3.0,
        rank_section_timeouts={}, rank_out_of_section_timeout=None, stack_dump_timeout=0)


def test_a_connection_without_hello_is_closed_at_the_handshake_deadline(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Peer(d)
        assert p.conn in d.others
        clock.advance(d.config.handshake_timeout - 0.01)
        assert not p.transport.closed
        clock.advance(0.02)
        assert p.transport.closed and p.conn not in d.others
        (err,) = p.transport.replies()
        assert isinstance(err, wire.Error) and "no HELLO" in err.message

    run(body, tmp_path, handshake_timeout=2.0)


def test_an_idle_observer_is_closed_and_an_active_one_kept(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        idle, busy = Peer(d), Peer(d)
        for p in (idle, busy):
            p.send(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.OBSERVER, 0, {}))
        for _ in range(4):
            clock.advance(4)
            busy.send(wire.Ping())
        assert idle.transport.closed and not busy.transport.closed
        assert isinstance(busy.transport.replies()[-1], wire.Pong)

    run(body, tmp_path, observer_idle_timeout=10.0)


def test_at_the_connection_cap_the_oldest_unidentified_then_the_idlest_observer_is_closed(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        rank = Peer(d)
        assert isinstance(rank.hello_rank(), wire.HelloOk)
        o1, o2 = Peer(d), Peer(d)
        for p in (o1, o2):
            p.send(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.OBSERVER, 0, {}))
        o1.send(wire.Ping())  # o2 is now the least recently active
        silent = Peer(d)  # over the cap of 2: no one unidentified yet, so the idlest observer goes
        assert o2.transport.closed and not o1.transport.closed and not silent.transport.closed
        err = o2.transport.replies()[-1]
        assert isinstance(err, wire.Error) and err.code == wire.ErrorCode.BUSY, err
        newest = Peer(d)  # the one still in its handshake goes before any observer
        assert silent.transport.closed and not o1.transport.closed and not newest.transport.closed
        for _ in range(10):  # a flood never closes the rank's connection
            Peer(d)
        assert not rank.transport.closed and d.rank is not None

    run(body, tmp_path, max_connections=2)


# -- who closes the rank's resources ------------------------------------------------
def test_goodbye_frees_the_ranks_process_handle_at_once(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Peer(d)
        p.hello_rank()
        rank = d.rank
        assert rank is not None and rank.process.fd is not None
        p.send(wire.Goodbye())
        assert d.rank is None and d.no_rank.is_set()
        assert rank.process.fd is None, "pidfd still open after a clean goodbye"
        assert d.status().last_gone is None  # a clean goodbye is not a process gone
        assert isinstance(p.hello_rank(), wire.Error)  # that connection is an observer now

    run(body, tmp_path)


def test_a_hung_rank_that_disconnects_keeps_its_handle_until_the_hang_task_is_done(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        ops.gate = asyncio.Event()  # the hang task waits for the rank's exit
        p = Peer(d)
        p.hello_rank()
        p.send(wire.SectionOpen("step"))
        clock.advance(1.1)
        await settle()
        rank = d.rank
        assert rank is not None and rank.session.phase is Phase.HUNG
        p.close()  # the rank's socket closes (it is being killed)
        assert d.rank is None
        assert rank.process.fd is not None, "closed under the hang task that still signals it"
        ops.gate.set()
        await settle()
        assert rank.process.fd is None, "not closed once the hang task finished"
        assert ops.sent == [signal.SIGCONT, signal.SIGTERM]

    run(body, tmp_path, rank_section_timeouts={"step": 1.0}, rank_heartbeat_timeout=None,
        initial_rank_heartbeat_timeout=None, rank_out_of_section_timeout=None, stack_dump_timeout=0)


def test_a_rank_gone_without_goodbye_is_reported_then_freed_not_judged(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Peer(d)
        p.hello_rank()
        p.send(wire.SectionOpen("step"))
        rank = d.rank
        assert rank is not None
        p.close()
        assert rank.process.fd is not None  # the exit report still needs it
        gone_at = clock.now()
        clock.advance(10)
        assert d.hangs == [] and ops.sent == []
        # when it went, for the launcher's crash verdict (crash.py: the root is the rank that went first)
        assert d.status().last_gone is not None and d.status().last_gone.at == gone_at
        assert d.status().last_gone.pid == rank.session.pid and d.status().last_exit is None
        for _ in range(3):  # the report waits (bounded, real time) for the process to exit: it is us
            await asyncio.sleep(0.6)
        assert rank.process.fd is None

    run(body, tmp_path, rank_section_timeouts={"step": 1.0})


def test_shutdown_cancels_timers_and_closes_the_rank(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Peer(d)
        p.hello_rank()
        p.send(wire.SectionOpen("step"))
        rank = d.rank
        assert rank is not None and clock.pending()
        await d.shutdown("test")
        assert p.transport.closed and rank.process.fd is None and d.deadline.at is None

    run(body, tmp_path, rank_section_timeouts={"step": 5.0})


def test_a_second_rank_is_refused_while_one_is_connected(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        first, second = Peer(d), Peer(d)
        first.hello_rank()
        reply = second.hello_rank()
        assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.BUSY
        assert d.rank is not None and d.rank.conn is first.conn

    run(body, tmp_path)


def test_hello_ok_carries_the_config_and_status_reports_the_session(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Peer(d)
        ok = p.hello_rank(3)
        assert isinstance(ok, wire.HelloOk)
        from ft_client.session_info import SessionInfo

        info = SessionInfo.from_wire(ok.session)
        assert info.rank == 3 and info.pid == os.getpid() and info.on_monitor_lost == "raise"
        assert info.timeouts.rank_section_timeouts == {"step": 7.0}
        p.send(wire.SectionOpen("step"), wire.Iteration(12))
        clock.advance(2)
        p.send(wire.Status())
        st = p.transport.replies()[-1]
        assert isinstance(st, wire.StatusReply)
        assert st.status["iteration_high"] == 12 and st.status["open_sections"][0]["elapsed_s"] == 2.0
        assert st.status["next_deadline"]["in_s"] == pytest.approx(5.0)

    run(body, tmp_path, rank_section_timeouts={"step": 7.0}, on_monitor_lost="raise")


# -- acting on a hang ------------------------------------------------------------------
def _case(tmp_path: Path) -> HangCase:
    hang = Hang(rank=0, pid=os.getpid(), reason=Reason.SECTION, section="step", timeout=1.0, onset=999.0,
                detected_at=1000.0, last_heartbeat=None, open_sections=(("step", 1.0),), iteration=None)
    handle = ProcessHandle(os.getpid())
    handle.close()  # FakeOps acts on its pid alone; no descriptor left open after the test
    return HangCase(hang, handle, tmp_path / "r.json", tmp_path / "d.txt")


def _executor(clock: ManualClock, ops: FakeOps, handoff: Any = None) -> HangExecutor:
    return HangExecutor(clock=clock, stack_dump_signal=signal.SIGUSR1, stack_dump_timeout=0.5,
                        termination_signal=signal.SIGTERM, termination_grace_time=4.0, ops=ops, handoff=handoff,
                        launcher_response_timeout=2.0)


def test_a_rank_that_obeys_sigterm_is_not_killed(tmp_path: Path) -> None:
    clock = ManualClock()
    ops = FakeOps(clock)
    case = asyncio.run(_executor(clock, ops).handle(_case(tmp_path)))
    assert ops.sent == [signal.SIGCONT, signal.SIGUSR1, signal.SIGCONT, signal.SIGTERM]
    assert case.terminated_by == "SIGTERM" and ops.waits == [4.0]


def test_a_rank_that_ignores_sigterm_gets_sigkill_after_the_grace(tmp_path: Path) -> None:
    clock = ManualClock()
    ops = FakeOps(clock, exits_on=set())
    start = clock.now()
    case = asyncio.run(_executor(clock, ops).handle(_case(tmp_path)))
    assert ops.sent == [signal.SIGCONT, signal.SIGUSR1, signal.SIGCONT, signal.SIGTERM, signal.SIGKILL]
    assert case.terminated_by == "SIGKILL"
    assert ops.waits[0] == 4.0  # the grace, then SIGKILL
    assert clock.now() - start >= 4.5  # dump wait + grace passed on the fake clock only
    assert any("sent SIGKILL" in a for a in case.actions)


def test_a_launcher_that_acknowledges_stops_the_rank_and_no_signal_is_sent_here(tmp_path: Path) -> None:
    clock = ManualClock()
    ops = FakeOps(clock)

    class Launcher:
        notified: list[HangCase] = []

        async def notify(self, case: HangCase) -> bool:
            self.notified.append(case)
            ops.exited = True  # it stops the worker group
            return True

    launcher = Launcher()
    case = asyncio.run(_executor(clock, ops, launcher).handle(_case(tmp_path)))
    assert case.terminated_by == "launcher" and launcher.notified == [case]
    assert signal.SIGTERM not in ops.sent and ops.waits == [6.0]  # response timeout + grace


def test_a_launcher_that_acknowledges_but_never_acts_is_overridden(tmp_path: Path) -> None:
    clock = ManualClock()
    ops = FakeOps(clock)

    class Launcher:
        async def notify(self, case: HangCase) -> bool:
            return True

    case = asyncio.run(_executor(clock, ops, Launcher()).handle(_case(tmp_path)))
    assert case.terminated_by == "SIGTERM" and ops.sent[-1] == signal.SIGTERM
    assert any("did not stop the rank" in a for a in case.actions)


def test_terminate_then_kill_on_a_target_already_gone_sends_nothing_more() -> None:
    sent: list[int] = []

    class Gone:
        def send(self, sig: int) -> bool:
            sent.append(sig)
            return False

    async def never(timeout: float) -> bool:
        raise AssertionError("waited on a target that was gone")

    stopped = asyncio.run(terminate_then_kill(Gone(), signal.SIGTERM, 5.0, never))
    assert stopped.by == "already exited" and sent == [signal.SIGCONT, signal.SIGTERM]


# -- in-process restart (on_hang: inprocess) ----------------------------------------------
INPROCESS = dict(on_hang="inprocess", inprocess_restart_timeout=5.0, max_inprocess_restarts=2,
                 rank_section_timeouts={"step": 1.0}, rank_heartbeat_timeout=None, initial_rank_heartbeat_timeout=None,
                 rank_out_of_section_timeout=None, stack_dump_timeout=0)


def _reentered(iteration: int) -> wire.Reentered:
    return wire.Reentered(iteration, "rank 0: section 'step' open for 1.0 s, timeout 1.0 s", 0, "monitor",
                          {"fault": 1.0, "seen": 2.0})


def _rank_with_control(d: MonitorDaemon) -> tuple[Peer, Peer]:
    rank, control = Peer(d), Peer(d)
    ok = rank.hello_rank()
    assert isinstance(ok, wire.HelloOk) and ok.session["on_hang"] == "inprocess"
    control.send(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.CONTROL, 0, {}))
    assert isinstance(control.transport.replies()[-1], wire.HelloOk)
    assert d.rank is not None and d.rank.control is control.conn
    return rank, control


def test_a_hang_with_on_hang_inprocess_pushes_abort_and_the_rank_comes_back(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        rank, control = _rank_with_control(d)
        rank.send(wire.SectionOpen("step"), wire.Iteration(11))
        clock.advance(1.01)
        await settle()  # pushed by a task (after the stack dump, when there is one)
        (abort,) = control.transport.replies()[1:]
        assert isinstance(abort, wire.Abort) and abort.hung_rank == 0 and abort.iteration == 0
        assert "section 'step'" in abort.reason
        s = d.rank.session  # type: ignore[union-attr]
        assert s.phase is Phase.RESTARTING and d.deadline.at == pytest.approx(1001.0 + 5.0)  # from the verdict
        assert ops.sent == [], "a rank restarting in-process is not signalled"
        rank.send(wire.Restarting(1), wire.SectionClose("step"))  # the Wrapper saw the fault; unwinding
        assert s.phase is Phase.RESTARTING and s.open_sections == {}
        clock.advance(2.0)
        assert s.phase is Phase.RESTARTING and ops.sent == []
        rank.send(_reentered(1), wire.SectionOpen("step"))  # back, first progress made
        assert s.phase is Phase.ACTIVE and s.inprocess_restarts == 1 and list(s.open_sections) == ["step"]
        assert s.wrapper_iteration == 1 and d.status().last_restart == InprocessRestart(
            1, "rank 0: section 'step' open for 1.0 s, timeout 1.0 s", 0, "monitor", {"fault": 1.0, "seen": 2.0})
        clock.advance(0.5)
        rank.send(wire.SectionClose("step"))
        clock.advance(10)
        assert d.inprocess_restarts == 1 and ops.sent == []
        report = json.loads((tmp_path / "reports" / f"rank0-pid{os.getpid()}-inprocess1-hang.json").read_text())
        assert report["terminated_by"] == "inprocess"
        assert any("in-process restart requested" in a for a in report["actions"])

    run(body, tmp_path, **INPROCESS)


def test_a_rank_that_does_not_come_back_in_time_is_stopped(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        rank, control = _rank_with_control(d)
        rank.send(wire.SectionOpen("step"))
        clock.advance(1.01)
        rank.send(wire.Restarting(1))  # said it restarts, but never makes progress
        clock.advance(4.9)
        assert ops.sent == []
        clock.advance(0.2)
        await settle()
        assert d.hangs[-1].message.startswith("not back in the training function")
        assert ops.sent == [signal.SIGCONT, signal.SIGTERM]

    run(body, tmp_path, **INPROCESS)


def test_past_max_inprocess_restarts_a_hang_is_stopped(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        rank, control = _rank_with_control(d)
        for i in (1, 2):
            rank.send(wire.SectionOpen("step"))
            clock.advance(1.01)
            await settle()
            rank.send(wire.Restarting(i), _reentered(i), wire.Heartbeat())
        assert d.inprocess_restarts == 2 and ops.sent == []
        aborts = [m for m in control.transport.replies() if isinstance(m, wire.Abort)]
        assert [a.iteration for a in aborts] == [0, 1]  # the in-process iteration each fault belongs to
        rank.send(wire.SectionOpen("step"))
        clock.advance(1.01)
        await settle()
        assert ops.sent == [signal.SIGCONT, signal.SIGTERM]

    run(body, tmp_path, **INPROCESS)


def test_without_a_control_connection_on_hang_inprocess_falls_back_to_stopping(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        rank = Peer(d)
        rank.hello_rank()
        rank.send(wire.SectionOpen("step"))
        clock.advance(1.01)
        await settle()
        assert ops.sent == [signal.SIGCONT, signal.SIGTERM]

    run(body, tmp_path, **INPROCESS)


def test_a_victim_rank_saying_restarting_is_not_judged_while_it_restarts(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        rank, control = _rank_with_control(d)
        rank.send(wire.SectionOpen("step"))
        clock.advance(0.5)
        rank.send(wire.Restarting(1))  # a peer's fault reached it through the store
        clock.advance(0.9)  # its step deadline would have passed
        assert d.hangs == [] and d.rank.session.phase is Phase.RESTARTING  # type: ignore[union-attr]
        assert len(control.transport.replies()) == 1, "no ABORT pushed to a victim"
        rank.send(wire.Heartbeat())  # unwinding: progress does not count as back
        assert d.rank.session.phase is Phase.RESTARTING  # type: ignore[union-attr]
        rank.send(_reentered(1), wire.Heartbeat())
        assert d.rank.session.phase is Phase.ACTIVE  # type: ignore[union-attr]
        clock.advance(0.9)  # no section open after re-entry: nothing is due
        assert d.hangs == []

    run(body, tmp_path, **INPROCESS)


def test_reentered_without_restarting_is_ignored_and_counted(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        rank, _ = _rank_with_control(d)
        rank.send(_reentered(0))  # out of place: iteration 0 is not a restart
        s = d.rank.session  # type: ignore[union-attr]
        assert s.phase is Phase.ACTIVE and s.errors == 1 and d.status().last_restart is None

    run(body, tmp_path, **INPROCESS)


# -- the start-up deadline (startup_timeout) ---------------------------------------------
# The test process stands for the worker: announced by its pid, it connects through a Peer.
STARTUP = dict(startup_timeout=5.0, stack_dump_timeout=0.05, termination_grace_time=1.0)
ME = os.getpid()


def test_a_worker_that_never_connects_is_dumped_and_stopped_at_its_startup_deadline(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        d.startup_watch.catches = lambda pid, sig: True  # the start-up hook armed its dump
        assert d.startup_watch.worker_started(ME, 2) == "timed"
        clock.advance(4.999)
        assert d.hangs == [] and ops.sent == []
        ops.gate = asyncio.Event()  # the hang task waits for the worker to exit
        clock.advance(0.002)
        await settle()
        (hang,) = d.hangs
        assert hang.message == "not connected to its monitor 5.0 s after it started, startup timeout 5.0 s"
        assert ops.sent == [signal.SIGCONT, signal.SIGUSR2, signal.SIGCONT, signal.SIGTERM]
        late = Peer(d).hello_rank()  # it connects while being stopped: refused
        assert isinstance(late, wire.Error) and "missed its startup_timeout" in late.message and d.rank is None
        ops.gate.set()
        await settle()
        report = json.loads((tmp_path / "reports" / f"rank2-pid{ME}-hang.json").read_text())
        assert report["reason"] == "startup" and report["terminated_by"] == "SIGTERM"
        assert report["stack_dump"] == str(tmp_path / "reports" / f"rank2-pid{ME}-stack.txt")
        assert d.startup_watch.handling == {} and isinstance(Peer(d).hello_rank(), wire.HelloOk)

    run(body, tmp_path, **STARTUP)


def test_a_worker_that_connects_in_time_is_never_touched(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        d.startup_watch.worker_started(ME, 0)
        clock.advance(4.9)
        assert isinstance(Peer(d).hello_rank(), wire.HelloOk)
        assert d.startup_watch.watched is None
        clock.advance(100)
        assert d.hangs == [] and ops.sent == [] and clock.pending() == []

    run(body, tmp_path, **STARTUP)


def test_a_worker_without_a_handler_for_the_dump_signal_is_not_sent_it(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        d.startup_watch.catches = lambda pid, sig: False  # not Python yet, or started without the hook
        d.startup_watch.worker_started(ME, 0)
        clock.advance(5.0)
        await settle()
        assert ops.sent == [signal.SIGCONT, signal.SIGTERM]
        report = json.loads((tmp_path / "reports" / f"rank0-pid{ME}-hang.json").read_text())
        assert report["actions"][0].startswith(f"no stack dump: pid {ME} has no handler for SIGUSR2")

    run(body, tmp_path, **STARTUP)


def test_startup_until_first_step_times_the_session_from_the_workers_start(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        d.startup_watch.worker_started(ME, 0)
        clock.advance(2.0)
        p = Peer(d)
        p.hello_rank()  # connected, but no heartbeat or step yet
        clock.advance(2.999)
        assert d.hangs == []
        clock.advance(0.002)
        await settle()
        assert d.hangs[0].message == "no heartbeat or step 5.0 s after it started, startup timeout 5.0 s"
        assert ops.sent[-1] == signal.SIGTERM

    run(body, tmp_path, startup_until="first_step", **STARTUP)


def test_a_worker_that_connected_before_it_was_announced_is_timed_from_its_handshake(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        p = Peer(d)
        p.hello_rank()
        clock.advance(1.0)
        assert d.startup_watch.worker_started(ME, 0).startswith("connected already; timed")
        p.send(wire.SectionOpen("step"))  # the first step ends the start-up
        clock.advance(100)
        assert d.hangs == [] and d.startup_watch.watched is None

    run(body, tmp_path, startup_until="first_step", **STARTUP)


def test_a_worker_that_exits_before_connecting_is_let_go(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            d.startup_watch.worker_started(child.pid, 0)
            assert d.startup_watch.watched is not None
            child.communicate(b"", timeout=30)  # it exits (the launcher sees that exit)
            for _ in range(3000):  # its pidfd turns readable on the loop: bounded wait for that
                if d.startup_watch.watched is None:
                    break
                await asyncio.sleep(0.01)
            assert d.startup_watch.watched is None and clock.pending() == []
        finally:
            child.kill()
            child.wait(5)

    run(body, tmp_path, **STARTUP)


def test_only_the_daemons_own_launcher_may_announce_workers(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        stranger = Peer(d)
        stranger.send(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.LAUNCHER, 0, {}))
        (err,) = stranger.transport.replies()
        assert isinstance(err, wire.Error) and err.code == wire.ErrorCode.FORBIDDEN
        d.launcher_pid = ME  # as if this process had started the daemon
        launcher = Peer(d)
        launcher.send(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.LAUNCHER, 0, {}),
                      wire.WorkerStarted(ME, 3, "/nonexistent/attempt_0/0/error.json"))
        ok, ack = launcher.transport.replies()
        assert isinstance(ok, wire.HelloOk) and ack == wire.Ack({"startup": "timed"})
        assert d.startup_watch.watched is not None and d.startup_watch.watched.worker.rank == 3

    run(body, tmp_path, **STARTUP)


def test_without_startup_timeout_an_announced_worker_is_not_timed(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        assert d.startup_watch.worker_started(ME, 0) == "startup_timeout is off"
        clock.advance(1e6)
        assert d.hangs == [] and d.startup_watch.watched is None

    run(body, tmp_path)


def test_the_abort_is_pushed_once_the_hung_ranks_stack_is_dumped(tmp_path: Path) -> None:
    """faulthandler walks every thread's frames without the GIL: the ABORT, which sets the
    rank's threads running, waits until the dump file is written (a rank crashed when both
    came at once)."""
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        rank, control = _rank_with_control(d)
        seen: list[tuple[int, int]] = []  # (signal, ABORTs pushed by then)
        size = {"n": 0}

        def send(proc: ProcessHandle, sig: int) -> bool:
            seen.append((sig, len(control.transport.replies()) - 1))
            if sig == signal.SIGUSR2:
                size["n"] = 4096  # faulthandler writes at once
            return True

        ops.send = send  # type: ignore[method-assign]
        ops.file_size = lambda path: size["n"]  # type: ignore[method-assign]
        rank.send(wire.SectionOpen("step"))
        clock.advance(1.01)
        await settle()
        assert (signal.SIGUSR2, 0) in seen, seen  # the dump was asked for before any ABORT
        assert [type(m) for m in control.transport.replies()[1:]] == [wire.Abort]
        report = json.loads((tmp_path / "reports" / f"rank0-pid{os.getpid()}-inprocess1-hang.json").read_text())
        assert report["stack_dump_captured"] and report["terminated_by"] == "inprocess"

    run(body, tmp_path, **{**INPROCESS, "stack_dump_timeout": 1.0})


def test_the_first_progress_of_a_ranks_process_is_kept_after_its_session_ends(tmp_path: Path) -> None:
    """Issue 49: the launcher times a restart's first step from each monitor's record of when its
    worker first made progress, which must outlive the worker (it may finish before the
    launcher's next look). The step's time, then a heartbeat later: the first stays."""
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        assert d.status().first_progress is None
        p = Peer(d)
        p.hello_rank()
        clock.advance(2.0)
        assert d.status().first_progress is None  # connected, no progress yet
        first = clock.now()
        p.send(wire.SectionOpen("step"))
        clock.advance(1.0)
        p.send(wire.Heartbeat(), wire.SectionClose("step"))
        got = d.status().first_progress
        assert got is not None and (got.pid, got.at) == (os.getpid(), first)
        p.close()
        await settle()
        assert d.rank is None and d.status().first_progress == got  # the session ended: still said
        assert MonitorStatus.from_wire(d.status().to_wire()).first_progress == got  # and over the wire

    run(body, tmp_path, rank_section_timeouts={"step": 60.0}, rank_heartbeat_timeout=None,
        initial_rank_heartbeat_timeout=None, rank_out_of_section_timeout=None)
