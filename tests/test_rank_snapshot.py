"""The monitor's part of a roll call, in-process (the fakes of test_daemon_inprocess.py):
the order of the dump and the pushes, the bounds, native stacks through a fake py-spy,
``on_hang: dump``, and the iteration a hang report names."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ft_client import wire
from ft_monitor.core.snapshot import MonitorSnapshot
from ft_monitor.core.state import Phase
from ft_monitor.daemon.clock import ManualClock
from ft_monitor.daemon.monitor import MonitorDaemon
from ft_monitor.forensics.native_stacks import PySpy
from ft_monitor.processes.procinfo import ProcessHandle
from tests.test_daemon_inprocess import FakeOps, Peer, run, settle

ME = os.getpid()
FR = dict(flight_recorder_entries=100, rank_section_timeouts={"step": 1.0}, stack_dump_timeout=1.0)


class FakeNative:
    def __init__(self) -> None:
        self.calls: list[tuple[int, float]] = []

    async def dump(self, pid: int, timeout: float) -> tuple[str | None, str | None]:
        self.calls.append((pid, timeout))
        return f"Thread {pid} (idle): \"MainThread\"\n    sleep (libc.so.6)\n", None


def _rank_with_control(d: MonitorDaemon) -> tuple[Peer, Peer, Peer]:
    rank, control, launcher = Peer(d), Peer(d), Peer(d)
    ok = rank.hello_rank(1)
    assert isinstance(ok, wire.HelloOk) and ok.session["flight_recorder"] is True
    control.send(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.CONTROL, 1, {}))
    d.launcher_pid = ME  # as if this process had started the daemon
    launcher.send(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.LAUNCHER, 1, {}))
    return rank, control, launcher


def _reply(launcher: Peer) -> MonitorSnapshot:
    msg = launcher.transport.replies()[-1]
    assert isinstance(msg, wire.DumpReply), msg
    return MonitorSnapshot.from_wire(msg.snapshot)


def _fake_rank(ops: FakeOps, control: Peer, *, writes_trace: bool) -> list[str]:
    """The rank: faulthandler appends 4 KiB on the dump signal; its control thread writes the
    trace once FR_DUMP arrives (unless its main thread holds the GIL). Returns the order of events."""
    order: list[str] = []
    size = {"stack": 100}

    def send(proc: ProcessHandle, sig: int) -> bool:
        order.append(signal.Signals(sig).name)
        if sig == signal.SIGUSR2:
            size["stack"] += 4096
        return True

    def file_size(path: Path) -> int:
        if str(path).endswith("-stack.txt"):
            return size["stack"]
        pushed = [m for m in control.transport.replies() if isinstance(m, wire.FrDump)]
        if pushed and "FR_DUMP" not in order:
            order.append("FR_DUMP")
        return 50 if pushed and writes_trace and str(path) == pushed[-1].path else 0

    ops.send = send  # type: ignore[method-assign]
    ops.file_size = file_size  # type: ignore[method-assign]
    return order


def test_the_roll_call_dumps_first_then_asks_for_the_trace_and_names_the_bytes(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        native = FakeNative()
        d.snapshots.native, d.snapshots.catches = native, lambda pid, sig: True
        rank, control, launcher = _rank_with_control(d)
        order = _fake_rank(ops, control, writes_trace=True)
        rank.send(wire.SectionOpen("step"), wire.Iteration(7), wire.SectionClose("step"), wire.SectionOpen("step"))
        launcher.send(wire.DumpRequest(3, 4.0, True))
        await settle()
        snap = _reply(launcher)
        assert order == ["SIGUSR2", "FR_DUMP"], order  # never a push while faulthandler reads the frames
        assert snap.connected and snap.alive and snap.rank == 1 and snap.pid == ME and snap.phase == "active"
        assert snap.iteration == 8  # the first report (7) plus the step closed since
        assert (snap.stack_from, snap.stack_to, snap.stack_captured) == (100, 4196, True)
        assert snap.flight_recorder is not None and snap.flight_recorder.endswith(f"rank1-pid{ME}-fr3.json")
        assert native.calls and native.calls[0][0] == ME and 0 < native.calls[0][1] <= 4.0
        assert snap.native_stack is not None and "sleep (libc.so.6)" in Path(snap.native_stack).read_text()
        assert ops.sent == [] and d.rank is not None and d.rank.session.phase is Phase.ACTIVE

    run(body, tmp_path, native_stacks=True, **FR)


def test_a_rank_that_never_writes_its_trace_is_answered_for_within_the_bound(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        d.snapshots.catches = lambda pid, sig: True
        rank, control, launcher = _rank_with_control(d)
        _fake_rank(ops, control, writes_trace=False)  # its main thread holds the GIL
        start = clock.now()
        launcher.send(wire.DumpRequest(1, 2.0, True))
        for _ in range(50):
            await settle()
            if len(launcher.transport.replies()) > 1:
                break
        snap = _reply(launcher)
        assert snap.stack_captured and snap.flight_recorder is None
        assert any(n.startswith("Flight Recorder: not written in time") for n in snap.notes), snap.notes
        assert clock.now() - start <= 2.0 + 0.05

    run(body, tmp_path, **FR)


def test_no_rank_no_handler_and_no_control_connection_are_answered_not_waited_for(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        d.launcher_pid = ME
        launcher = Peer(d)
        launcher.send(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.LAUNCHER, 0, {}), wire.DumpRequest(1, 2.0, True))
        await settle()
        assert _reply(launcher) == MonitorSnapshot(connected=False, notes=["no rank is connected to this monitor"])
        rank = Peer(d)
        rank.hello_rank(0)
        d.snapshots.catches = lambda pid, sig: False  # a worker that would die of the signal
        launcher.send(wire.DumpRequest(2, 2.0, True))
        await settle()
        snap = _reply(launcher)
        assert ops.sent == [] and not snap.stack_captured
        assert any("no handler" in n for n in snap.notes) and any("no control connection" in n for n in snap.notes)

    run(body, tmp_path, **FR)


def test_only_the_daemons_launcher_may_ask_for_a_dump(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        observer = Peer(d)
        observer.send(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.OBSERVER, 0, {}), wire.DumpRequest(1, 1.0, False))
        assert isinstance(observer.transport.replies()[-1], wire.Error) and ops.sent == []

    run(body, tmp_path, **FR)


def test_on_hang_dump_reports_once_and_leaves_the_rank_running(tmp_path: Path) -> None:
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        rank = Peer(d)
        rank.hello_rank(0)
        rank.send(wire.SectionOpen("step"), wire.Iteration(19), wire.SectionClose("step"), wire.SectionOpen("step"))
        clock.advance(1.01)
        await settle()
        assert ops.sent == [signal.SIGCONT, signal.SIGUSR2]  # dumped, never stopped
        s = d.rank.session  # type: ignore[union-attr]
        assert s.phase is Phase.ACTIVE and len(d.hangs) == 1
        (path,) = (tmp_path / "reports").glob("*-dump1-hang.json")
        report = json.loads(path.read_text())
        assert report["terminated_by"] == "not stopped (on_hang: dump)" and report["iteration"] == 20
        rank.send(wire.Heartbeat())  # input, but no progress on the step: not a second hang
        clock.advance(5.0)
        await settle()
        assert len(d.hangs) == 1
        rank.send(wire.SectionClose("step"), wire.SectionOpen("step"))  # progress, then stuck again
        clock.advance(1.01)
        await settle()
        assert len(d.hangs) == 2 and signal.SIGTERM not in ops.sent and signal.SIGKILL not in ops.sent

    run(body, tmp_path, on_hang="dump", rank_section_timeouts={"step": 1.0}, stack_dump_timeout=0.05)


def test_py_spy_absent_or_failing_is_a_note_not_an_error(tmp_path: Path) -> None:
    missing = PySpy(str(tmp_path / "no-py-spy"))
    text, why = asyncio.run(missing.dump(ME, 1.0))
    assert text is None and why is not None and why.startswith("cannot run")
    failing = tmp_path / "py-spy"
    failing.write_text("#!/bin/sh\necho 'Permission denied (os error 1)' >&2\nexit 1\n")
    failing.chmod(0o700)
    text, why = asyncio.run(PySpy(str(failing)).dump(ME, 5.0))
    assert text is None and why == "py-spy failed (1): Permission denied (os error 1)"
    assert asyncio.run(PySpy(str(failing)).dump(ME, 0.0))[1] == "no time left in the roll call for py-spy"


@pytest.mark.skipif(PySpy().find() is None, reason="py-spy is not installed (optional)")
def test_real_py_spy_reads_a_process_it_may_attach_to() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        text, why = asyncio.run(PySpy().dump(child.pid, 20.0))
        assert text is not None or (why is not None and "py-spy failed" in why), why  # ptrace may be refused
    finally:
        child.kill()
        child.wait()


def test_a_worker_not_connected_yet_is_dumped_through_its_start_up_hook(tmp_path: Path) -> None:
    # before: "no rank is connected to this monitor", and a rank waiting in init_process_group for
    # a peer that never came had no stack to tell it from the peer (the verdict blamed the waiting one)
    async def body(d: MonitorDaemon, clock: ManualClock, ops: FakeOps) -> None:
        d.startup_watch.catches = d.snapshots.catches = lambda pid, sig: True  # the start-up hook armed it
        assert d.startup_watch.worker_started(ME, 2) == "timed"
        d.launcher_pid = ME
        launcher = Peer(d)
        launcher.send(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.LAUNCHER, 1, {}))
        size = {"stack": 0}

        def send(proc: ProcessHandle, sig: int) -> bool:
            size["stack"] += 2048 if sig == signal.SIGUSR2 else 0
            return True

        ops.send = send  # type: ignore[method-assign]
        ops.file_size = lambda path: size["stack"] if str(path).endswith("-stack.txt") else 0  # type: ignore[method-assign]
        launcher.send(wire.DumpRequest(1, 2.0, False))
        await settle()
        snap = _reply(launcher)
        assert (snap.connected, snap.phase, snap.rank, snap.pid, snap.alive) == (False, "starting", 2, ME, True)
        assert snap.stack_captured and snap.stack_dump == str(tmp_path / "reports" / f"rank2-pid{ME}-stack.txt")
        assert snap.stack_to > snap.stack_from
        assert d.hangs == []  # a roll call is no verdict: the start-up deadline still runs

    run(body, tmp_path, startup_timeout=5.0, stack_dump_timeout=0.05, termination_grace_time=1.0)
