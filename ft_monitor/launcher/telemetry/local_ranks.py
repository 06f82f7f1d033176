"""What the launcher knows of each local rank (`LocalRanks`): what its monitor's STATUS last
said (iteration, last progress, timeouts, sections, snapshot memory), kept while the rank is not
connected; the ``progress`` and ``timeouts`` events its changes make; and what the stats event,
goodput, the slow-rank watch and ``/metrics`` read of it. Told by telemetry.py at each poll.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ft_client.timeouts import STEP_SECTION
from ft_monitor.core.section_stats import SectionHistogram
from ft_monitor.core.status import MonitorStatus
from ft_monitor.launcher.telemetry.events import EventLog
from ft_monitor.launcher.telemetry.metrics import RankView
from ft_monitor.launcher.telemetry.slow_ranks import SlowVerdict
from ft_monitor.launcher.telemetry.telemetry_fields import recent_median, timeouts_changed

POLL_INTERVAL = 1.0
"""Seconds between STATUS polls of the local monitors (more often while a restart is pending)."""
PROGRESS_SAMPLES = 100.0
"""`progress` events: at most one per poll while an iteration changes, and no more often than
every ``run age / PROGRESS_SAMPLES`` seconds (a day-long run writes about a thousand, a
ten-second one a few per second); one more, whatever the interval, when a hang is handled
and when an attempt ends, so the report draws each rank's last progress before it."""


@dataclass
class RankMemory:
    """What the launcher last knew of a local rank (kept while it is not connected)."""

    rank: int
    last_progress: float | None = None
    iteration: int | None = None
    timeouts: dict[str, Any] = field(default_factory=dict)
    sections: dict[str, SectionHistogram] = field(default_factory=dict)
    snapshot_held: int | None = None
    snapshot_limit: int | None = None


class LocalRanks:
    """Local rank -> `RankMemory`, and the events of their changes; ``start``: the run's start
    (the interval between `progress` events grows with the run's age)."""

    def __init__(self, events: EventLog, start: float) -> None:
        self.events = events
        self.start = start
        self.ranks: dict[int, RankMemory] = {}
        self._progress_sent: dict[int, tuple[int | None, float | None]] = {}
        """rank -> (iteration, last progress) as the last `progress` event had them."""
        self._progress_at = -1e18

    def attempt_started(self, ranks: Mapping[int, int]) -> None:
        """Workers started with ``ranks`` local -> global: a local rank of another global rank
        starts a new memory."""
        for lr, rank in ranks.items():
            mem = self.ranks.get(lr)
            if mem is None or mem.rank != rank:
                self.ranks[lr] = RankMemory(rank)

    def seen(self, now: float, statuses: Mapping[int, MonitorStatus | None]) -> None:
        """The monitors' STATUS, just polled (local rank -> status; None: no answer)."""
        for lr, st in statuses.items():
            if st is None:
                continue
            rank = st.rank.rank if st.rank is not None else None
            mem = self.ranks.get(lr)
            if mem is None:
                mem = self.ranks[lr] = RankMemory(rank if rank is not None else lr)
            elif rank is not None:
                mem.rank = rank
            if st.rank is not None:
                if st.rank.since_last_progress_s is not None:
                    mem.last_progress = now - st.rank.since_last_progress_s
                if st.rank.iteration_now is not None:
                    mem.iteration = st.rank.iteration_now
            elif st.last_iteration is not None:  # gone: where its session ended, not where a poll last saw it
                mem.iteration = st.last_iteration
            self._timeouts_seen(now, mem, st.timeouts)
            mem.sections = dict(st.section_stats.sections)
            if st.snapshots is not None:
                mem.snapshot_held, mem.snapshot_limit = st.snapshots.held, st.snapshots.limit

    def progress(self, now: float, attempt: int, forced: bool = False) -> None:
        """A `progress` event (each local rank's iteration and last progress) when an iteration
        changed and the interval (`PROGRESS_SAMPLES`) has passed, or ``forced`` (a hang, an
        attempt's end) when anything changed."""
        seen = {m.rank: (m.iteration, m.last_progress) for m in self.ranks.values() if m.last_progress is not None}
        sent = self._progress_sent
        moved = any(sent.get(r, (None, None))[0] != it for r, (it, _) in seen.items())
        if forced:
            moved = moved or any(sent.get(r) != v for r, v in seen.items())
        elif now - self._progress_at < max(POLL_INTERVAL, (now - self.start) / PROGRESS_SAMPLES):
            return
        if not moved:
            return
        self._progress_at = now
        self._progress_sent = dict(seen)
        ranks = {str(m.rank): {"local_rank": lr, "iteration": m.iteration, "last_progress": m.last_progress}
                 for lr, m in sorted(self.ranks.items()) if m.last_progress is not None}
        self.events.emit("progress", now, attempt=attempt, ranks=ranks)

    def _timeouts_seen(self, now: float, mem: RankMemory, timeouts: dict[str, Any]) -> None:
        before = mem.timeouts
        mem.timeouts = timeouts
        if not before or before == timeouts:
            return
        self.events.emit("timeouts", now, rank=mem.rank, timeouts=timeouts, learned=list(timeouts.get("learned", [])),
                         changed=timeouts_changed(before, timeouts))

    # -- what the others read ------------------------------------------------------------
    def highest_iteration(self) -> int | None:
        return max((m.iteration for m in self.ranks.values() if m.iteration is not None), default=None)

    def step_sums(self) -> dict[int, float]:
        """rank -> seconds of its steps so far (goodput's productive time)."""
        return {mem.rank: h.sum_s for mem in self.ranks.values()
                for h in [mem.sections.get(STEP_SECTION)] if h is not None and h.count}

    def stats_rows(self) -> dict[str, Any]:
        """The `stats` event's ``ranks``."""
        return {str(mem.rank): {
            "local_rank": lr, "iteration": mem.iteration,
            "sections": {name: {"count": h.count, "sum_s": round(h.sum_s, 6),
                                "median_s": recent_median(h)} for name, h in sorted(mem.sections.items())},
        } for lr, mem in sorted(self.ranks.items())}

    def views(self, verdicts: Mapping[int, SlowVerdict], flagged: set[int]) -> tuple[RankView, ...]:
        """What ``/metrics`` shows of each local rank, with the slow-rank watch's word."""
        views = []
        for lr, mem in sorted(self.ranks.items()):
            v = verdicts.get(mem.rank)
            views.append(RankView(rank=mem.rank, local_rank=lr, last_progress=mem.last_progress,
                                  iteration=mem.iteration, sections=dict(mem.sections), timeouts=dict(mem.timeouts),
                                  slow=mem.rank in flagged, slow_ratio=None if v is None else v.ratio,
                                  snapshot_held=mem.snapshot_held, snapshot_limit=mem.snapshot_limit))
        return tuple(views)
