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
from ft_client import wire
from ft_monitor.notices import HangNotice

log = logging.getLogger("ft_monitor.launcher_link")


async def _read(reader: asyncio.StreamReader) -> wire.Message:
    header = await reader.readexactly(wire.HEADER_SIZE)
    size = int.from_bytes(header, "big")
    if size == 0 or size > wire.MAX_FRAME:
        raise wire.ProtocolError(f"frame length {size} outside 1..{wire.MAX_FRAME}")
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
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, wire.ProtocolError) as e:
        log.error("rank %d: cannot reach the launcher at %s (%s); terminating the rank here",
                  rank, path, e or type(e).__name__)
        return False
    if isinstance(reply, wire.Ack):
        log.warning("rank %d: launcher acknowledged the hang and stops the worker group", rank)
        return True
    log.error("rank %d: launcher refused the hang notice (%r); terminating the rank here", rank, reply)
    return False
