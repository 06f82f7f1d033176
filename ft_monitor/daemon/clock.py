"""The daemon's one clock, and the timers that run on it.

`now()` is monotonic seconds (CLOCK_MONOTONIC, the same base as the event loop
and as time.monotonic() in the rank); `wall()` is for what a person reads.
`call_later()` arms a timer on the same clock: every timer the daemon uses
(handshake, observer idle, deadline, socket-file check) goes through it, so a
test that replaces the clock (`ManualClock`) moves time and timers together and
never desynchronises a deadline from the loop that fires it. Pure code does not
use this module: it takes ``now`` as an argument.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float: ...
    def wall(self) -> float: ...
    def call_later(self, delay: float, callback: Callable[[], object]) -> Timer: ...


class SystemClock:
    """Real time; timers on the running event loop (whose clock is time.monotonic)."""

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def call_later(self, delay: float, callback: Callable[[], object]) -> Timer:
        return asyncio.get_running_loop().call_later(delay, callback)


class _ManualTimer:
    __slots__ = ("at", "callback", "cancelled")

    def __init__(self, at: float, callback: Callable[[], object]) -> None:
        self.at = at
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """A clock that moves only when told to (`advance`), firing the timers that come
    due in order, each with `now()` at its due time. For tests and simulations."""

    def __init__(self, start: float = 1000.0, wall_offset: float = 1.7e9) -> None:
        self._now = start
        self._wall_offset = wall_offset
        self._timers: list[tuple[float, int, _ManualTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._wall_offset

    def call_later(self, delay: float, callback: Callable[[], object]) -> Timer:
        t = _ManualTimer(self._now + max(0.0, delay), callback)
        heapq.heappush(self._timers, (t.at, next(self._seq), t))
        return t

    def pending(self) -> list[float]:
        """Due times of the timers still armed, earliest first."""
        return sorted(t.at for _, _, t in self._timers if not t.cancelled)

    def advance(self, seconds: float) -> None:
        end = self._now + seconds
        while self._timers and self._timers[0][0] <= end:
            at, _, t = heapq.heappop(self._timers)
            if t.cancelled:
                continue
            self._now = max(self._now, at)
            t.callback()
        self._now = end


def to_wall(clock: Clock, monotonic: float) -> float:
    """Convert a monotonic timestamp of this clock into wall-clock seconds."""
    return clock.wall() - (clock.now() - monotonic)
