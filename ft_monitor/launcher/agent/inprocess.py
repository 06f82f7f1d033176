"""In-process restarts as ft-launcher records them (pure: no I/O, no clock).

An in-process restart leaves every worker running: torch's agent sees nothing,
and ft-launcher's budget (--max-restarts) is untouched. The launcher learns of it
twice: from the hang notice of the monitor whose verdict started it (action
"inprocess", only for hangs), and from every local monitor's STATUS, whose
``last_restart`` is what its rank reported on re-entry (`InprocessRestart`: the
fault and the wall-clock end of each phase). `InprocessLedger` merges both into
one summary row per restart, keyed by the Wrapper iteration the ranks restarted
as, and completes the row with the job-wide phase breakdown
(`ft_client.inprocess.timeline.breakdown`) once every local rank is back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ft_client.inprocess import timeline
from ft_monitor.core.notices import HangNotice
from ft_monitor.core.status import InprocessRestart


@dataclass
class Row:
    iteration: int
    attempt: int
    rank: int | None = None
    """The rank at fault (the hung one, or the one that raised)."""
    pid: int | None = None
    reason: str | None = None
    """The hang reason (section, heartbeat, ...) or the fault's source (exception, timeout, ...)."""
    message: str | None = None
    detected_time: float | None = None
    """Wall clock: the monitor's verdict, or when the fault was recorded."""
    report: str | None = None
    ranks: dict[int, dict[str, float]] = field(default_factory=dict)
    """local rank -> its phase stamps."""
    phases: dict[str, float | None] | None = None
    """Set once every local rank is back."""
    onset: float | None = None
    """The onset of the hang notice the row names (the earliest one: see `on_notice`)."""
    fault_rank: int | None = None
    """The rank at fault as the ranks' re-entry says (the first fault recorded in the
    job's store: job-wide, so it may be a rank of another node)."""
    reported_by: dict[str, Any] | None = None
    """The rank whose monitor reported first when that was not the rank at fault (it waited for
    it): rank, pid, message and its hang report, kept as the incident's evidence."""

    def to_json(self) -> dict[str, Any]:
        return {"kind": "inprocess", "attempt": self.attempt, "iteration": self.iteration, "rank": self.rank,
                "pid": self.pid, "reason": self.reason, "message": self.message,
                "detected_time": self.detected_time, "report": self.report, "phases": self.phases,
                "ranks_back": sorted(self.ranks), "reported_by": self.reported_by}


@dataclass
class InprocessLedger:
    rows: dict[tuple[int, int], Row] = field(default_factory=dict)
    """(attempt, Wrapper iteration) -> row: each process-level attempt counts iterations anew."""

    def _row(self, iteration: int, attempt: int) -> Row:
        row = self.rows.get((attempt, iteration))
        if row is None:
            row = self.rows[attempt, iteration] = Row(iteration, attempt)
        return row

    def on_notice(self, notice: HangNotice, attempt: int) -> Row:
        """A monitor's hang verdict started an in-process restart. Ranks waiting in a collective
        for the hung one may time out too before the restart reaches them, and their notices
        can arrive later or earlier: the row names the earliest onset (the hung rank), as the
        process restart's attribution does, whatever order the notices come in."""
        row = self._row(notice.restart_iteration or 0, attempt)
        if row.onset is not None and row.onset <= notice.onset_time:
            return row
        if row.fault_rank is not None and notice.rank != row.fault_rank:
            return row  # a rank that waited for the one at fault (see on_statuses)
        row.onset = notice.onset_time
        row.rank, row.pid, row.reason, row.message = notice.rank, notice.pid, notice.reason, notice.message
        row.detected_time, row.report = notice.detected_time, notice.report
        return row

    def on_statuses(self, restarts: Mapping[int, InprocessRestart | None], nproc: int,
                    attempt: int, pids: Mapping[int, int] | None = None) -> list[Row]:
        """Take each local rank's last re-entry; return the rows completed by it. ``pids``:
        global rank -> pid of this node's ranks (the rank at fault's, when a waiting rank's
        monitor reported first)."""
        done = []
        for local_rank, r in restarts.items():
            if r is None:
                continue
            row = self._row(r.iteration, attempt)
            if row.phases is not None or local_rank in row.ranks:
                continue
            row.ranks[local_rank] = dict(r.times)
            if row.fault_rank is None and r.fault_rank is not None:
                row.fault_rank = r.fault_rank
                if row.rank is not None and row.rank != r.fault_rank:
                    # the notice was of a rank that waited for the one at fault, which may be on
                    # another node: the job-wide fault record names it; the reporter is kept
                    row.reported_by = {"rank": row.rank, "pid": row.pid, "message": row.message,
                                       "report": row.report}
                    row.rank, row.pid, row.report, row.detected_time, row.message = None, None, None, None, None
            if row.message is None:  # no hang notice of the rank at fault: an exception, a ping timeout, a
                # peer's exit, or a hang on another node
                row.rank, row.reason, row.message = r.fault_rank, r.source, r.reason
                if row.pid is None and row.rank is not None:
                    row.pid = (pids or {}).get(row.rank)
            if row.detected_time is None and timeline.FAULT in r.times:
                row.detected_time = r.times[timeline.FAULT]
            if len(row.ranks) >= nproc:
                origin = row.detected_time if row.detected_time is not None else min(
                    t.get(timeline.FAULT, t.get("seen", 0.0)) for t in row.ranks.values())
                row.phases = timeline.breakdown(origin, row.ranks.values())
                done.append(row)
        return done

    def summary(self) -> list[dict[str, Any]]:
        return [self.rows[k].to_json() for k in sorted(self.rows)]
