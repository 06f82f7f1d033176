"""Stopping processes: the termination signal, a bounded grace, then SIGKILL.

The one place that sequence is written; the daemon uses it for a hung rank
(executor.py) and for `serve -- CMD`'s command (server.py), the launcher for
its monitors. What is signalled and how its exit is awaited come in through
two small seams (`Target`, ``wait_gone``), so the sequence is tested with a
recording fake and no process or real time (tests/test_daemon_inprocess.py).
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

KILL_WAIT = 5.0
"""Seconds to wait for the kernel to finish a SIGKILLed process off."""


class Target(Protocol):
    """What is being stopped: one process, a group, a set of pinned processes."""

    def send(self, sig: int) -> bool:
        """Deliver ``sig``; False when nothing was left to receive it."""
        ...


WaitGone = Callable[[float], Awaitable[bool]]
"""Wait up to the given seconds for the target to be gone; True if it is."""


@dataclass(frozen=True)
class Stopped:
    """How a stop ended."""

    by: str
    """The signal that ended it (e.g. "SIGTERM"), "SIGKILL", or "already exited"."""
    killed: bool
    """SIGKILL was sent (the grace ran out, or something outlived the target's leader)."""
    gone: bool
    """Nothing was left afterwards (False only if even SIGKILL left something behind)."""


async def terminate_then_kill(target: Target, term: int, grace: float, wait_gone: WaitGone, *,
                              cont: bool = True, kill_wait: float = KILL_WAIT,
                              sent: Callable[[int], None] | None = None) -> Stopped:
    """SIGCONT (a stopped process cannot act on the signal) and ``term``; up to
    ``grace`` seconds for the target to be gone; then SIGKILL and up to ``kill_wait``.
    ``sent`` is told of each signal delivered (``term``, then SIGKILL), e.g. to log it."""
    if cont:
        target.send(signal.SIGCONT)
    if not target.send(term):
        return Stopped("already exited", killed=False, gone=True)
    if sent is not None:
        sent(term)
    name = signal.Signals(term).name
    if await wait_gone(grace):
        return Stopped(name, killed=False, gone=True)
    target.send(signal.SIGKILL)
    if sent is not None:
        sent(signal.SIGKILL)
    gone = await wait_gone(kill_wait)
    return Stopped("SIGKILL", killed=True, gone=gone)
