"""The deadline timer: one timer on the session's earliest deadline.

`arm(at)` keeps the timer on the earliest deadline asked for; a later deadline
leaves an earlier timer armed (it fires, the daemon finds nothing due and arms
again). It runs on the daemon's clock seam (`Clock.call_later`), so in-process
tests move time with a `ManualClock`.
"""

from __future__ import annotations

from collections.abc import Callable

from ft_monitor.daemon.clock import Clock, Timer


class DeadlineTimer:
    def __init__(self, clock: Clock, on_due: Callable[[], None]) -> None:
        self.clock = clock
        self.on_due = on_due
        self._timer: Timer | None = None
        self.at: float | None = None
        """When the armed timer fires (monotonic seconds), or None."""

    def arm(self, at: float) -> None:
        if self.at is not None and self.at <= at:
            return
        self.cancel()
        self.at = at
        self._timer = self.clock.call_later(max(0.0, at - self.clock.now()), self._fire)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self.at = None

    def _fire(self) -> None:
        self._timer = None
        self.at = None
        self.on_due()
