"""One rank's progress record as the daemon holds it: where it is read from, what was applied.

Below both `rank` (a rank's resources hold its record and close it) and `record_watch`
(which offers, reads and refuses records), so neither imports the other back.
"""

from __future__ import annotations

from collections.abc import Callable

from ft_client.record import words_for
from ft_client.record.read import decode
from ft_monitor.core.record_sync import Applied, RecordSync
from ft_monitor.core.state import Phase, Session
from ft_monitor.daemon.record_map import RecordSource

MAX_TRIES = 3
"""Reads in a row while a group is being written, before the torn groups keep their old state."""


class RankRecord:
    """One rank's record as the daemon holds it: where it is read from, what was applied."""

    __slots__ = ("source", "sync", "_key", "reads", "torn_reads", "_tick")

    def __init__(self, source: RecordSource, created_ns: int) -> None:
        self.source = source
        self.sync = RecordSync(created_ns)
        self._key: tuple[bytes, Phase, int] | None = None
        self.reads = 0
        self.torn_reads = 0
        self._tick: tuple[object, float | None, float | None] | None = None
        """(timeouts, startup timeout) -> the tick, computed once per change of timeouts."""

    def apply(self, session: Session, clock: Callable[[], float]) -> Applied | None:
        """Read the record and apply what is new to ``session``; None when nothing changed
        since the last read (same bytes, same session). Raises RecordError. The monitor's
        clock is read after the copy: a rank may store a time up to the copy, and a clock
        read before it (a preemption between the two) would refuse a healthy rank's record
        as stamped in the future."""
        slots = self.sync.slots_in_use
        words = words_for(slots)
        for _ in range(MAX_TRIES):
            before, data, after = self.source.read(words)
            if self._key == (data, session.phase, session.events):
                return None
            self.reads += 1
            view = decode(before, data, after, slots)
            if not view.torn:
                break
            self.torn_reads += 1
        applied = self.sync.apply(session, view, clock())
        self._key = None if view.torn else (data, session.phase, session.events)
        return applied

    def close(self) -> None:
        self.source.close()
