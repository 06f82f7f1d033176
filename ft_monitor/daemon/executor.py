"""Acting on a hang: report, stack dump, hand-off or terminate. Every wait is bounded.

The order is fixed: (1) one ERROR log line; (2) a JSON hang report (report.py);
(3) SIGCONT, then the stack-dump signal to the rank, and up to
stack_dump_timeout for its faulthandler dump to appear; (4) under ft-launcher,
the hang notice to the launcher (`Handoff`), which stops the whole worker group
itself when it acknowledges; (5) otherwise, or if the rank outlives the
launcher's answer, the termination signal to the rank's process group, up to
termination_grace_time, then SIGKILL (escalation.py).

Every process operation goes through `ProcessOps` (`RealProcessOps` on pidfds,
so a pid reused by another process is never hit), which is the seam the
in-process tests replace with a recording fake. This module performs effects;
it decides nothing about *whether* a rank hung (that is policy.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ft_client.safefiles import write_json_atomic
from ft_monitor.core.policy import Hang
from ft_monitor.core.report import REPORT_VERSION, HangReport
from ft_monitor.core.server_log import printable
from ft_monitor.daemon.clock import Clock, to_wall
from ft_monitor.forensics import dump_file
from ft_monitor.processes.escalation import terminate_then_kill
from ft_monitor.processes.exits import ExitWatch
from ft_monitor.processes.procinfo import PinnedGroup, ProcessHandle, descendants

_POLL = 0.01

log = logging.getLogger("ft_monitor.executor")


@dataclass
class HangCase:
    """One hang being handled: what was detected and where its files go."""

    hang: Hang
    process: ProcessHandle
    report_path: Path
    dump_path: Path | None
    error_file: str | None = None
    """The rank's torchelastic error file, passed on to the launcher."""
    action: str = "kill"
    """"kill"; "inprocess" when the rank was asked to restart in its own process; "dump"
    (``on_hang: dump``) when it is diagnosed and left running."""
    restart_iteration: int | None = None
    """With action "inprocess": the Wrapper iteration the ranks restart as."""
    actions: list[str] = field(default_factory=list)
    dump_captured: bool = False
    terminated_by: str | None = None


@dataclass(frozen=True)
class PendingDump:
    """A stack dump asked for and not yet seen: the file's size when the signal went out,
    and where its header is (taken back if no dump follows)."""

    before: int
    header: tuple[int, int] | None


class Handoff(Protocol):
    """Who may take over stopping the rank (the launcher, which restarts the group)."""

    def notify(self, case: HangCase) -> Awaitable[bool]:
        """True when it acknowledged and stops the rank itself."""
        ...


class StopTarget(Protocol):
    def send(self, sig: int) -> bool: ...
    def any_left(self) -> bool: ...
    def close(self) -> None: ...


class ProcessOps(Protocol):
    """Every process operation the executor performs: the seam tests fake."""

    def send(self, proc: ProcessHandle, sig: int) -> bool: ...
    def alive(self, proc: ProcessHandle) -> bool: ...
    def stop_target(self, proc: ProcessHandle) -> StopTarget | None:
        """What terminating ``proc`` signals (None if it has exited)."""
        ...
    def wait_exit(self, proc: ProcessHandle, timeout: float) -> Awaitable[bool]: ...
    def sleep(self, seconds: float) -> Awaitable[None]: ...
    def file_size(self, path: Path) -> int: ...


class RealProcessOps:
    def __init__(self, exits: ExitWatch) -> None:
        self.exits = exits

    def send(self, proc: ProcessHandle, sig: int) -> bool:
        return proc.send(sig)

    def alive(self, proc: ProcessHandle) -> bool:
        return proc.alive()

    def stop_target(self, proc: ProcessHandle) -> PinnedGroup | None:
        """A rank that leads its own process group (as launchers start ranks) is
        signalled with its whole group, while a member we pinned proves the group
        id is still its own; otherwise the rank and its descendants one by one, so a
        shell or launcher that shares the rank's group is never hit. Descendants
        that left the group (setsid) are pinned and signalled too. The daemon itself
        is never among them (a rank may start its own monitor, which is then its
        descendant)."""
        pgid = proc.pgid()
        if pgid is None:
            return None
        leads_group = pgid == proc.pid and pgid != os.getpgrp()
        target = PinnedGroup(pgid if leads_group else None, [proc], borrowed=(proc,))
        target.pin_members()
        pinned = {h.pid for h in target.members}
        for pid in descendants(proc.pid):
            if pid == os.getpid():
                continue
            h = ProcessHandle.open(pid) if pid not in pinned else None
            if h is not None:
                target.add(h)
        return target

    def wait_exit(self, proc: ProcessHandle, timeout: float) -> Awaitable[bool]:
        return self.exits.wait(proc, timeout)

    async def sleep(self, seconds: float) -> None:
        import asyncio

        await asyncio.sleep(seconds)

    def file_size(self, path: Path) -> int:
        try:
            return os.stat(path).st_size
        except OSError:
            return 0


class HangExecutor:
    def __init__(
        self,
        *,
        clock: Clock,
        stack_dump_signal: int,
        stack_dump_timeout: float,
        termination_signal: int,
        termination_grace_time: float,
        ops: ProcessOps,
        handoff: Handoff | None = None,
        launcher_response_timeout: float = 10.0,
    ) -> None:
        self.clock = clock
        self.ops = ops
        self.handoff = handoff
        self.launcher_response_timeout = launcher_response_timeout
        self.stack_dump_signal = stack_dump_signal
        self.stack_dump_timeout = stack_dump_timeout
        self.termination_signal = termination_signal
        self.termination_grace_time = termination_grace_time
        self.dump_lock = asyncio.Lock()
        """Held while a stack dump of the rank is being taken (here, or in a roll call:
        rank_snapshot.py), so nothing else is pushed to the rank while faulthandler reads
        its threads' frames."""

    async def handle(self, case: HangCase) -> HangCase:
        h = case.hang
        log.error(
            "hang detected: rank=%d pid=%d reason=%s section=%s elapsed=%.3fs timeout=%.3fs: %s; report %s",
            h.rank, h.pid, h.reason.value, printable(h.section), h.elapsed, h.timeout, h.describe(), case.report_path,
        )
        self.write_report(case)
        await self.dump_stack(case)
        self.write_report(case)
        if case.action == "dump":
            await self._keep_running(case)
            return case
        if self.handoff is not None and await self._handed_off(case):
            return case
        await self.terminate(case)
        self.write_report(case)
        return case

    async def _handed_off(self, case: HangCase) -> bool:
        """Tell the launcher; True when it stopped the rank itself."""
        assert self.handoff is not None
        rank = case.hang.rank
        try:
            launcher_acts = await self.handoff.notify(case)
        except Exception:  # the launcher being gone must not stop the kill
            log.exception("rank %d: telling the launcher failed; terminating the rank here", rank)
            return False
        if not launcher_acts:
            return False
        case.actions.append("launcher notified; it stops the worker group")
        self.write_report(case)
        wait = self.launcher_response_timeout + self.termination_grace_time
        if await self.ops.wait_exit(case.process, wait):
            case.terminated_by = "launcher"
            log.warning("rank %d: stopped by the launcher", rank)
            self.write_report(case)
            return True
        log.error("rank %d: still running %.1fs after the launcher was told; terminating it here", rank, wait)
        case.actions.append(f"launcher did not stop the rank within {wait:.1f}s")
        return False

    async def _keep_running(self, case: HangCase) -> None:
        """``on_hang: dump``: tell the launcher (it diagnoses the job: the roll call) and leave the rank running."""
        if self.handoff is not None:
            try:
                await self.handoff.notify(case)
            except Exception:  # noqa: BLE001 - the launcher being gone changes nothing here
                log.exception("rank %d: telling the launcher failed", case.hang.rank)
        case.terminated_by = "not stopped (on_hang: dump)"
        case.actions.append("left running (on_hang: dump)")
        log.warning("rank %d: left running (on_hang: dump); it is diagnosed again if it hangs again after progress",
                    case.hang.rank)
        self.write_report(case)

    # -- (2) report ------------------------------------------------------------
    def report(self, case: HangCase) -> HangReport:
        h = case.hang
        now = self.clock.now()
        return HangReport(
            version=REPORT_VERSION,
            rank=h.rank,
            pid=h.pid,
            hostname=socket.gethostname(),
            reason=h.reason.value,
            message=h.describe(),
            section=h.section,
            elapsed_s=round(h.elapsed, 6),
            timeout_s=h.timeout,
            onset_time=to_wall(self.clock, h.onset),
            detected_time=to_wall(self.clock, h.detected_at),
            last_heartbeat_age_s=None if h.last_heartbeat is None else round(now - h.last_heartbeat, 6),
            open_sections={name: round(secs, 6) for name, secs in h.open_sections},
            iteration=h.iteration,
            stack_dump=str(case.dump_path) if case.dump_path else None,
            stack_dump_captured=case.dump_captured,
            terminated_by=case.terminated_by,
            actions=tuple(case.actions),
            monitor_pid=os.getpid(),
        )

    def write_report(self, case: HangCase) -> None:
        try:
            write_json_atomic(case.report_path, self.report(case).to_wire())
        except OSError as e:
            log.error("rank %d: cannot write hang report %s: %s", case.hang.rank, case.report_path, e)

    # -- (3) stack dump --------------------------------------------------------
    async def dump_stack(self, case: HangCase) -> None:
        async with self.dump_lock:
            pending = self.request_dump(case)
            if pending is not None:
                await self.await_dump(case, pending)

    def request_dump(self, case: HangCase) -> PendingDump | None:
        """The dump's header (dump_file.py), then the dump signal (the rank's faulthandler
        writes at once, whatever its main thread is doing); None when no dump is coming."""
        path = case.dump_path
        if path is None or self.stack_dump_timeout <= 0:
            case.actions.append("stack dump skipped")
            return None
        self.ops.send(case.process, signal.SIGCONT)  # a stopped rank cannot dump
        why = case.hang.reason.value if case.action != "inprocess" else "in-process restart"
        header = dump_file.announce(path, dump_file.header(case.hang.pid, self.stack_dump_signal, why))
        before = self.ops.file_size(path)
        if not self.ops.send(case.process, self.stack_dump_signal):
            if header is not None:
                dump_file.take_back(path, header)
            case.actions.append("stack dump skipped: process gone")
            return None
        case.actions.append(f"sent {signal.Signals(self.stack_dump_signal).name} for a stack dump")
        return PendingDump(before, header)

    async def await_dump(self, case: HangCase, pending: PendingDump) -> None:
        """Wait (at most stack_dump_timeout) until the dump file grew and stopped growing."""
        ops, path = self.ops, case.dump_path
        assert path is not None
        case.dump_captured = await wait_for_dump(ops, self.clock, path, pending.before, self.stack_dump_timeout,
                                                 case.process)
        if not case.dump_captured and pending.header is not None:
            dump_file.take_back(path, pending.header)
        if case.dump_captured:
            case.actions.append(f"stack dump written to {path}")
            log.warning("rank %d: stack dump written to %s", case.hang.rank, path)
        else:
            case.actions.append(f"no stack dump within {self.stack_dump_timeout:.1f}s")
            log.warning("rank %d: no stack dump within %.1fs", case.hang.rank, self.stack_dump_timeout)

    # -- (5) terminate ---------------------------------------------------------
    async def terminate(self, case: HangCase) -> None:
        """The termination signal to the rank's group (see `RealProcessOps.stop_target`),
        bounded grace, then SIGKILL. After the rank itself exits, its children get the
        rest of the grace before SIGKILL reaches them."""
        ops, proc, rank = self.ops, case.process, case.hang.rank
        target = ops.stop_target(proc)
        if target is None:
            case.terminated_by = "already exited"
            case.actions.append("rank had already exited")
            return
        term = signal.Signals(self.termination_signal)
        grace = self.termination_grace_time
        rank_exited = False
        exited_in_grace = False

        async def wait_gone(timeout: float) -> bool:
            nonlocal rank_exited
            deadline = self.clock.now() + timeout
            rank_exited = rank_exited or await ops.wait_exit(proc, timeout)
            while rank_exited and target.any_left() and self.clock.now() < deadline:
                await ops.sleep(_POLL)  # the rank is gone; give its children the rest of the wait
            return rank_exited and not target.any_left()

        def sent(sig: int) -> None:
            nonlocal exited_in_grace
            if sig == signal.SIGKILL:
                exited_in_grace = rank_exited
                case.actions.append(f"sent SIGKILL to {target}")
                log.warning("rank %d: %s; sent SIGKILL to %s", rank,
                            "rank exited, other processes remained" if rank_exited else
                            f"still running after {grace:.1f}s", target)
            else:
                case.actions.append(f"sent SIGCONT+{term.name} to {target}")
                log.warning("rank %d: sent %s to %s, grace %.1fs", rank, term.name, target, grace)

        try:
            stopped = await terminate_then_kill(target, term, grace, wait_gone, sent=sent)
        finally:
            target.close()
        if stopped.by == "already exited":
            case.terminated_by = "already exited"
            case.actions.append("rank had already exited")
        elif stopped.killed:
            case.terminated_by = term.name if exited_in_grace else "SIGKILL"
        else:
            case.terminated_by = stopped.by


async def wait_for_dump(ops: ProcessOps, clock: Clock, path: Path, before: int, timeout: float,
                        proc: ProcessHandle) -> bool:
    """Wait (at most ``timeout``) until the dump file grew past ``before`` and stopped growing,
    or the process is gone; True when it grew."""
    deadline = clock.now() + timeout
    last = before
    stable = 0
    while clock.now() < deadline:
        await ops.sleep(_POLL)
        size = ops.file_size(path)
        if size > before:
            stable = stable + 1 if size == last else 0
            last = size
            if stable >= 2:  # written and no longer growing
                break
        if not ops.alive(proc):
            break
    return ops.file_size(path) > before
