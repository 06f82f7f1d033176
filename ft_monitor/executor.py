"""Acting on a hang: report, stack dump, terminate. Every wait is bounded.

The order is fixed: (1) one ERROR log line; (2) a JSON hang report in
report_dir; (3) SIGCONT, then the stack-dump signal to the rank, and up to
stack_dump_timeout for its faulthandler dump to appear; (4) SIGCONT + the
termination signal to the rank's process group, up to termination_grace_time
for the rank to exit, then SIGKILL to the group. Signals to the rank go through
a pidfd (`ProcessHandle`), so a pid reused by another process is never hit.

This module performs effects; it decides nothing about *whether* a rank hung
(that is policy.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from ft_client.safefiles import write_json_atomic
from ft_monitor.clock import Clock, to_wall
from ft_monitor.policy import Hang
from ft_monitor.procinfo import PinnedGroup, ProcessHandle, descendants
from ft_monitor.server_log import printable

REPORT_VERSION = 1
_POLL = 0.01

log = logging.getLogger("ft_monitor.executor")


@dataclass
class HangCase:
    """One hang being handled: what was detected and where its files go."""

    hang: Hang
    process: ProcessHandle
    report_path: Path
    dump_path: Path | None
    actions: list[str] = field(default_factory=list)
    dump_captured: bool = False
    terminated_by: str | None = None


# A hook run before any signal, e.g. telling a launcher (returns True when the
# launcher took charge of stopping the rank).
BeforeKill = Callable[[HangCase], Awaitable[bool]]


class HangExecutor:
    def __init__(
        self,
        *,
        clock: Clock,
        stack_dump_signal: int,
        stack_dump_timeout: float,
        termination_signal: int,
        termination_grace_time: float,
        before_kill: BeforeKill | None = None,
        launcher_response_timeout: float = 10.0,
        exits: "ExitWatch | None" = None,
    ) -> None:
        self.clock = clock
        self.exits = exits or ExitWatch()
        self.launcher_response_timeout = launcher_response_timeout
        self.stack_dump_signal = stack_dump_signal
        self.stack_dump_timeout = stack_dump_timeout
        self.termination_signal = termination_signal
        self.termination_grace_time = termination_grace_time
        self.before_kill = before_kill

    async def handle(self, case: HangCase) -> HangCase:
        h = case.hang
        log.error(
            "hang detected: rank=%d pid=%d reason=%s section=%s elapsed=%.3fs timeout=%.3fs: %s; report %s",
            h.rank, h.pid, h.reason.value, printable(h.section), h.elapsed, h.timeout, h.describe(), case.report_path,
        )
        self.write_report(case)
        await self.dump_stack(case)
        self.write_report(case)
        if self.before_kill is not None:
            try:
                launcher_acts = await self.before_kill(case)
            except Exception:  # the launcher being gone must not stop the kill
                log.exception("rank %d: telling the launcher failed; terminating the rank here", h.rank)
                launcher_acts = False
            if launcher_acts:
                case.actions.append("launcher notified; it stops the worker group")
                self.write_report(case)
                wait = self.launcher_response_timeout + self.termination_grace_time
                if await self.exits.wait(case.process, wait):
                    case.terminated_by = "launcher"
                    log.warning("rank %d: stopped by the launcher", h.rank)
                    self.write_report(case)
                    return case
                log.error("rank %d: still running %.1fs after the launcher was told; terminating it here",
                          h.rank, wait)
                case.actions.append(f"launcher did not stop the rank within {wait:.1f}s")
        await self.terminate(case)
        self.write_report(case)
        return case

    # -- (2) report ------------------------------------------------------------
    def report(self, case: HangCase) -> dict[str, Any]:
        h = case.hang
        now = self.clock.now()
        return {
            "version": REPORT_VERSION,
            "rank": h.rank,
            "pid": h.pid,
            "hostname": socket.gethostname(),
            "reason": h.reason.value,
            "message": h.describe(),
            "section": h.section,
            "elapsed_s": round(h.elapsed, 6),
            "timeout_s": h.timeout,
            "onset_time": to_wall(self.clock, h.onset),
            "detected_time": to_wall(self.clock, h.detected_at),
            "last_heartbeat_age_s": None if h.last_heartbeat is None else round(now - h.last_heartbeat, 6),
            "open_sections": {name: round(secs, 6) for name, secs in h.open_sections},
            "iteration": h.iteration,
            "stack_dump": str(case.dump_path) if case.dump_path else None,
            "stack_dump_captured": case.dump_captured,
            "terminated_by": case.terminated_by,
            "actions": list(case.actions),
            "monitor_pid": os.getpid(),
        }

    def write_report(self, case: HangCase) -> None:
        try:
            write_json_atomic(case.report_path, self.report(case))
        except OSError as e:
            log.error("rank %d: cannot write hang report %s: %s", case.hang.rank, case.report_path, e)

    # -- (3) stack dump --------------------------------------------------------
    async def dump_stack(self, case: HangCase) -> None:
        if case.dump_path is None or self.stack_dump_timeout <= 0:
            case.actions.append("stack dump skipped")
            return
        before = _size(case.dump_path)
        case.process.send(signal.SIGCONT)  # a stopped rank cannot dump
        if not case.process.send(self.stack_dump_signal):
            case.actions.append("stack dump skipped: process gone")
            return
        case.actions.append(f"sent {signal.Signals(self.stack_dump_signal).name} for a stack dump")
        deadline = self.clock.now() + self.stack_dump_timeout
        last = before
        stable = 0
        while self.clock.now() < deadline:
            await asyncio.sleep(_POLL)
            size = _size(case.dump_path)
            if size > before:
                stable = stable + 1 if size == last else 0
                last = size
                if stable >= 2:  # written and no longer growing
                    break
            if not case.process.alive():
                break
        case.dump_captured = _size(case.dump_path) > before
        if case.dump_captured:
            case.actions.append(f"stack dump written to {case.dump_path}")
            log.warning("rank %d: stack dump written to %s", case.hang.rank, case.dump_path)
        else:
            case.actions.append(f"no stack dump within {self.stack_dump_timeout:.1f}s")
            log.warning("rank %d: no stack dump within %.1fs", case.hang.rank, self.stack_dump_timeout)

    # -- (4) terminate ---------------------------------------------------------
    async def terminate(self, case: HangCase) -> None:
        """SIGCONT + the termination signal, bounded grace, then SIGKILL.

        A rank that leads its own process group (as launchers start ranks) is
        signalled with its whole group, while a member we pinned proves the group
        id is still its own; otherwise the rank and its descendants are signalled
        one by one, so a shell or launcher that shares the rank's group is never hit.
        Descendants that left the group (setsid) are pinned and signalled too.
        """
        proc, rank = case.process, case.hang.rank
        pgid = proc.pgid()
        if pgid is None:
            case.terminated_by = "already exited"
            case.actions.append("rank had already exited")
            return
        term = signal.Signals(self.termination_signal)
        leads_group = pgid == proc.pid and pgid != os.getpgrp()
        target = PinnedGroup(pgid if leads_group else None, [proc], borrowed=(proc,))
        target.pin_members()
        pinned = {h.pid for h in target.members}
        for pid in descendants(proc.pid):
            h = ProcessHandle.open(pid) if pid not in pinned else None
            if h is not None:
                target.add(h)
        try:
            target.send(signal.SIGCONT)
            target.send(term)
            case.actions.append(f"sent SIGCONT+{term.name} to {target}")
            log.warning("rank %d: sent %s to %s, grace %.1fs", rank, term.name, target, self.termination_grace_time)
            deadline = self.clock.now() + self.termination_grace_time
            exited = await self.exits.wait(proc, self.termination_grace_time)
            while exited and target.any_left() and self.clock.now() < deadline:
                await asyncio.sleep(_POLL)  # the rank is gone; give its children the rest of the grace
            if exited and not target.any_left():
                case.terminated_by = term.name
                return
            target.send(signal.SIGKILL)
            case.terminated_by = term.name if exited else "SIGKILL"
            case.actions.append(f"sent SIGKILL to {target}")
            log.warning("rank %d: %s; sent SIGKILL to %s", rank,
                        "rank exited, other processes remained" if exited else
                        f"still running after {self.termination_grace_time:.1f}s", target)
            await self.exits.wait(proc, 5.0)
        finally:
            target.close()


class ExitWatch:
    """Waiting for processes to exit, through their pidfds: one event-loop reader per
    process however many wait on it (the daemon's session and a hang task may wait at
    once). `forget()` must come before the handle is closed."""

    def __init__(self) -> None:
        self._futures: dict[int, asyncio.Future[None]] = {}

    def exited(self, proc: ProcessHandle) -> asyncio.Future[None] | None:
        """A future done when ``proc`` exits; None where there is no pidfd to watch."""
        fd = proc.fd
        if fd is None:
            return None
        fut = self._futures.get(fd)
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = self._futures[fd] = loop.create_future()
            if not proc.alive():
                fut.set_result(None)
            else:
                def ready() -> None:
                    loop.remove_reader(fd)
                    if not fut.done():
                        fut.set_result(None)

                loop.add_reader(fd, ready)
        return fut

    def forget(self, proc: ProcessHandle) -> None:
        fd = proc.fd
        fut = self._futures.pop(fd, None) if fd is not None else None
        if fut is not None:
            if not fut.done():
                asyncio.get_running_loop().remove_reader(fd)  # type: ignore[arg-type]
                fut.cancel()

    async def wait(self, proc: ProcessHandle, timeout: float) -> bool:
        """Wait (bounded) until the process has exited; True if it did."""
        if not proc.alive():
            return True
        fut = self.exited(proc)
        if fut is not None:
            try:
                await asyncio.wait_for(asyncio.shield(fut), timeout)
            except asyncio.TimeoutError:
                pass
            except asyncio.CancelledError:
                if not fut.cancelled():  # this task was cancelled, not the watch (forget())
                    raise
            return not proc.alive()
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            await asyncio.sleep(_POLL)
            if not proc.alive():
                return True
        return not proc.alive()


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0
