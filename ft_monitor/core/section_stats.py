"""How long a rank's sections took: a histogram and the recent durations per section (pure).

Through the socket the daemon sees every section of its rank open and close (it
stamps both with its own clock); through the progress record it reads, on a tick,
how many sections of each slot the rank completed and their summed time, which the
rank counts itself (ft_client.record): closes that came and went between two reads
are counted all the same, at their mean duration (`record_many`), and a read that
finds one new close times it exactly. `SectionStats` keeps, per section name, for the whole
life of the daemon (across sessions, so the counts only grow, as Prometheus
counters must):

* a histogram over the fixed `BOUNDS` (seconds), its count and its sum;
* the last `RECENT` durations, for a median that follows the job as it is now
  (slow-rank detection, the live view).

It is sent in STATUS_REPLY (`to_wire` / `from_wire`) and read by ft-launcher,
which exports it (Prometheus), compares ranks (slow ranks) and derives goodput.
No I/O, no clock here: durations are handed in.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ft_client.errors import FtError

BOUNDS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                             30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
"""Upper bounds (seconds, inclusive) of the histogram's buckets; one more bucket holds the rest."""
RECENT = 32
"""Durations kept per section for the recent median."""
MAX_TRACKED_SECTIONS = 16
"""Section names tracked; later names are counted in `untracked`, not timed (STATUS must fit a frame)."""


class SectionStatsError(FtError, ValueError):
    """A section-stats map that does not have the shape this version sends."""


@dataclass(slots=True)
class SectionHistogram:
    """One section's durations: per-bucket counts (not cumulative), count, sum, recent."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(BOUNDS) + 1))
    count: int = 0
    sum_s: float = 0.0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))

    def record(self, seconds: float) -> None:
        self.buckets[bisect.bisect_left(BOUNDS, seconds)] += 1
        self.count += 1
        self.sum_s += seconds
        self.recent.append(seconds)

    def record_many(self, count: int, sum_s: float) -> None:
        """``count`` durations summing to ``sum_s`` whose values one by one are not known
        (closes between two reads of a record): counted and summed exactly, each filed at
        their mean (exact for one)."""
        if count <= 0:
            return
        mean = max(0.0, sum_s / count)
        self.buckets[bisect.bisect_left(BOUNDS, mean)] += count
        self.count += count
        self.sum_s += max(0.0, sum_s)
        self.recent.extend([mean] * min(count, RECENT))

    def median_recent(self) -> float | None:
        return median(self.recent)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= bound) pairs, ending with (inf, count): Prometheus's form."""
        out: list[tuple[float, int]] = []
        total = 0
        for bound, n in zip((*BOUNDS, math.inf), self.buckets):
            total += n
            out.append((bound, total))
        return out

    def to_wire(self) -> dict[str, Any]:
        return {"buckets": list(self.buckets), "count": self.count, "sum_s": self.sum_s,
                "recent_s": list(self.recent)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> SectionHistogram:
        try:
            buckets = [int(n) for n in data["buckets"]]
            recent = [float(x) for x in data["recent_s"]]
            h = cls(buckets, int(data["count"]), float(data["sum_s"]), deque(recent[-RECENT:], maxlen=RECENT))
        except (KeyError, TypeError, ValueError) as e:
            raise SectionStatsError(f"section histogram without the fields this version sends: {e}") from e
        if len(buckets) != len(BOUNDS) + 1 or sum(buckets) != h.count:
            raise SectionStatsError(f"section histogram has {len(buckets)} buckets holding {sum(buckets)} "
                                    f"observations; this version sends {len(BOUNDS) + 1} holding its count")
        return h


@dataclass(slots=True)
class SectionStats:
    """Every tracked section's `SectionHistogram`, by name."""

    sections: dict[str, SectionHistogram] = field(default_factory=dict)
    untracked: int = 0
    """Closes of sections past the first MAX_TRACKED_SECTIONS names (not timed)."""

    def record(self, name: str, seconds: float) -> None:
        h = self.sections.get(name)
        if h is None:
            if len(self.sections) >= MAX_TRACKED_SECTIONS:
                self.untracked += 1
                return
            h = self.sections[name] = SectionHistogram()
        h.record(max(0.0, seconds))

    def record_many(self, name: str, count: int, sum_s: float) -> None:
        """``count`` closes of ``name`` that took ``sum_s`` in all (`SectionHistogram.record_many`)."""
        h = self.sections.get(name)
        if h is None:
            if len(self.sections) >= MAX_TRACKED_SECTIONS:
                self.untracked += max(0, count)
                return
            h = self.sections[name] = SectionHistogram()
        h.record_many(count, sum_s)

    def get(self, name: str) -> SectionHistogram | None:
        return self.sections.get(name)

    def to_wire(self) -> dict[str, Any]:
        return {"sections": {name: h.to_wire() for name, h in self.sections.items()}, "untracked": self.untracked}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any] | None) -> SectionStats:
        if data is None:
            return cls()
        try:
            sections = {str(name): SectionHistogram.from_wire(h) for name, h in data["sections"].items()}
            return cls(sections, int(data.get("untracked", 0)))
        except (KeyError, TypeError, AttributeError) as e:
            raise SectionStatsError(f"section stats without the fields this version sends: {e}") from e


def median(values: Iterable[float]) -> float | None:
    """The median, None for none. `statistics` is imported here, when STATUS or the
    launcher first asks: at the daemon's start it cost about 2.5 ms of imports."""
    import statistics

    xs = list(values)
    return statistics.median(xs) if xs else None
