"""The daemon's one clock. Everything else takes ``now`` as an argument.

`now()` is monotonic seconds (CLOCK_MONOTONIC, the same base as the event loop
and as time.monotonic() in the rank); `wall()` is for what a person reads.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...
    def wall(self) -> float: ...


class SystemClock:
    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


def to_wall(clock: Clock, monotonic: float) -> float:
    """Convert a monotonic timestamp of this clock into wall-clock seconds."""
    return clock.wall() - (clock.now() - monotonic)
