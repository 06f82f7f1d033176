"""Each escalation step reaches every process once (issue 23, item 1).

`PinnedGroup.send` used to `killpg` the group and then signal every pinned member
through its pidfd, the group's leader (the rank) included: two deliveries. A rank whose
handler exits (nvidia-resiliency-ext's test pattern, or a SIGTERM handler that saves an
emergency checkpoint) ran its handler on the first and was killed by the default action,
or re-entered, on the second. Real processes, real signals; every wait is on a line.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from ft_monitor.core.policy import Hang, Reason
from ft_monitor.daemon.clock import SystemClock
from ft_monitor.daemon.executor import HangCase, HangExecutor, RealProcessOps
from ft_monitor.processes.exits import ExitWatch
from ft_monitor.processes.procinfo import PinnedGroup, ProcessHandle
from tests.procs import Rank

pytestmark = pytest.mark.e2e

NO_SOCKET = Path("/nonexistent/ft.sock")  # the workers never connect


def _counts(rank: Rank, pids: list[int]) -> dict[int, int]:
    """Tell the counters to count; how many deliveries each process took."""
    assert rank.proc.stdin is not None
    rank.proc.stdin.write("\n")
    rank.proc.stdin.flush()
    return {pid: int(rank.wait_line(f"count {pid} ").split()[2]) for pid in pids}


@pytest.mark.parametrize("path", ["executor", "launcher"])
def test_one_send_is_one_delivery_to_each_process(path: str) -> None:
    """A real-time signal queues every delivery, so a second one is counted, not merged.
    The executor's target holds the rank, a child in its group and a child that left it
    (setsid); the launcher's holds the group's members only."""
    rank = Rank("count", NO_SOCKET, "SIGRTMIN", "tree", stdin=True, worker="signals.py")
    try:
        leader, member, own_session = (int(p) for p in rank.wait_line("ready pids=").split("=")[1].split(","))
        handle = ProcessHandle(leader)
        if path == "executor":
            target = RealProcessOps(ExitWatch()).stop_target(handle)
            assert target is not None
        else:  # launcher/agent/groups.py: WorkerGroups.track + pin_members
            group = PinnedGroup.of_leader(handle)
            assert group is not None
            group.pin_members()
            target = group
        assert target.send(signal.SIGRTMIN)
        target.close()
        counts = _counts(rank, [leader, member, own_session])
        outside = 1 if path == "executor" else 0  # the launcher's torch kills the worker, not its setsid child
        assert counts == {leader: 1, member: 1, own_session: outside}  # before: the leader took 2
        assert rank.wait(10) == 0
    finally:
        rank.kill()
        handle.close()


def _hang(pid: int) -> Hang:
    return Hang(rank=0, pid=pid, reason=Reason.SECTION, section="step", timeout=1.0, onset=0.0, detected_at=1.0,
                last_heartbeat=None, open_sections=(("step", 1.0),), iteration=None)


@pytest.mark.parametrize("run", range(20))
@pytest.mark.parametrize("term", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_handler_that_exits_runs_once_and_its_exit_status_stands(run: int, term: signal.Signals,
                                                                   tmp_path: Path) -> None:
    """The daemon's own escalation (SIGCONT, the termination signal, grace) against a rank
    whose handler exits 123. Before: a third of the runs here died of the signal instead."""
    rank = Rank("exit-123", NO_SOCKET, term.name, worker="signals.py")
    proc = ProcessHandle(rank.proc.pid)
    try:
        rank.wait_line("ready pids=")
        executor = HangExecutor(clock=SystemClock(), stack_dump_signal=signal.SIGUSR2, stack_dump_timeout=0.0,
                                termination_signal=term, termination_grace_time=10.0,
                                ops=RealProcessOps(ExitWatch()))
        case = HangCase(_hang(proc.pid), proc, tmp_path / "report.json", None)
        asyncio.run(executor.terminate(case))
        assert rank.wait(10) == 123, f"run {run}: the rank died of {case.actions}"
        assert case.terminated_by == term.name
    finally:
        rank.kill()
        proc.close()
