"""The daemon's side of the launcher socket: report a hang before any kill.

Under ft-launcher every daemon knows the launcher's socket. On a hang the daemon
sends one HANG_NOTICE (request/reply) and, when the launcher acknowledges it,
leaves stopping the rank to the launcher, which stops and restarts the whole
worker group. Every step is bounded by ``timeout``; any failure returns False
and the daemon kills the rank itself.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ft_client import wire
from ft_monitor.core.notices import HangNotice
from ft_monitor.daemon.clock import to_wall

if TYPE_CHECKING:
    from ft_monitor.daemon.clock import Clock
    from ft_monitor.daemon.executor import HangCase

log = logging.getLogger("ft_monitor.launcher_link")


async def _read(reader: asyncio.StreamReader) -> wire.Message:
    size = wire.frame_length(await reader.readexactly(wire.HEADER_SIZE))
    return wire.decode_body(await reader.readexactly(size))


async def _exchange(path: str, rank: int, notice: HangNotice) -> wire.Message:
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        writer.write(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.MONITOR, rank, {})))
        hello = await _read(reader)
        if not isinstance(hello, wire.HelloOk):
            return hello
        writer.write(wire.encode(wire.HangNotice(notice.to_wire())))
        return await _read(reader)
    finally:
        writer.close()


async def notify_launcher(path: str, rank: int, notice: HangNotice, timeout: float) -> bool:
    """True when the launcher acknowledged the hang and will stop the worker group."""
    try:
        reply = await asyncio.wait_for(_exchange(path, rank, notice), timeout)
    except (TimeoutError, OSError, asyncio.IncompleteReadError, wire.ProtocolError) as e:
        log.error("rank %d: cannot reach the launcher at %s (%s); terminating the rank here",
                  rank, path, e or type(e).__name__)
        return False
    if isinstance(reply, wire.Ack):
        if notice.action == "inprocess":
            log.info("rank %d: launcher recorded the in-process restart", rank)
        elif notice.action == "dump":
            log.info("rank %d: launcher diagnoses the hang (on_hang: dump); the rank keeps running", rank)
        else:
            log.warning("rank %d: launcher acknowledged the hang and stops the worker group", rank)
        return True
    log.error("rank %d: launcher refused the hang notice (%r); terminating the rank here", rank, reply)
    return False


class LauncherHandoff:
    """The executor's `Handoff` under ft-launcher: a hang case becomes one HANG_NOTICE."""

    def __init__(self, path: str, clock: Clock, timeout: float) -> None:
        self.path = path
        self.clock = clock
        self.timeout = timeout

    def notice(self, case: HangCase) -> HangNotice:
        h = case.hang
        return HangNotice(
            rank=h.rank,
            pid=h.pid,
            reason=h.reason.value,
            section=h.section,
            message=h.describe(),
            elapsed_s=h.elapsed,
            timeout_s=h.timeout,
            onset_time=to_wall(self.clock, h.onset),
            detected_time=to_wall(self.clock, h.detected_at),
            iteration=h.iteration,
            report=str(case.report_path),
            stack_dump=str(case.dump_path) if case.dump_path else None,
            stack_dump_captured=case.dump_captured,
            error_file=case.error_file,
            action=case.action,
            restart_iteration=case.restart_iteration,
        )

    async def notify(self, case: HangCase) -> bool:
        return await notify_launcher(self.path, case.hang.rank, self.notice(case), self.timeout)
