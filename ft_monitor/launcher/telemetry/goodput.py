"""Goodput and the time each incident cost (pure: no I/O, no clock).

Definitions (docs/observability.md says the same for the people who read the metrics):

* **step time** of a rank: the sum of its `step` sections' durations, as its monitor
  timed them (section_stats.py; with a progress record, as the rank summed them in it,
  every step counted), over the whole run;
* **redone work** of an incident: the iterations the job did again after restarting
  (the highest iteration reached before it, less the iteration the ranks resumed
  from), times the median step time before it;
* **productive time** of the node: the mean over its ranks of their step time, less
  the redone work of every incident;
* **goodput** = productive time / wall time since the launcher started (0..1);
* **time lost** to an incident: from the hung rank's last progress (its onset) to all
  ranks stepping again, plus its redone work.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Incident:
    """One hang or crash that restarted the processes, as far as it is known so far."""

    rank: int
    """The culprit: the rank that hung, or the root of the crash."""
    onset: float
    """Wall clock of the hung rank's last progress, or of the crash's detection."""
    iteration_before: int | None
    """The highest iteration any local rank had reached when the hang was handled."""
    step_median_s: float | None
    """The median step time before the hang (the mean of the ranks' recent medians)."""
    running_again: float | None = None
    """Wall clock when all ranks were stepping again (None until then)."""
    resumed_from: int | None = None
    """The iteration the ranks resumed from (None until they report it)."""

    @property
    def redone_iterations(self) -> int | None:
        if self.iteration_before is None or self.resumed_from is None:
            return None
        return max(0, self.iteration_before - self.resumed_from)

    @property
    def redone_s(self) -> float:
        n = self.redone_iterations
        return 0.0 if n is None or self.step_median_s is None else n * self.step_median_s

    @property
    def lost_s(self) -> float | None:
        """Onset to running again, plus the redone work; None until the ranks run again."""
        if self.running_again is None:
            return None
        return max(0.0, self.running_again - self.onset) + self.redone_s


@dataclass(frozen=True, slots=True)
class Goodput:
    wall_s: float
    productive_s: float | None
    """None when no rank's step section is timed (the monitors do not see `step`)."""
    lost_s: float

    @property
    def ratio(self) -> float | None:
        if self.productive_s is None or self.wall_s <= 0:
            return None
        return min(1.0, self.productive_s / self.wall_s)


def goodput(step_seconds: Mapping[int, float], incidents: Iterable[Incident], *, start: float,
            now: float) -> Goodput:
    """Goodput at ``now`` of a node whose launcher started at ``start``, from each local
    rank's total step seconds (ranks whose step section is not timed are left out)."""
    incidents = list(incidents)
    redone = sum(i.redone_s for i in incidents)
    lost = sum(i.lost_s or 0.0 for i in incidents)
    productive = None
    if step_seconds:
        productive = max(0.0, sum(step_seconds.values()) / len(step_seconds) - redone)
    return Goodput(wall_s=max(0.0, now - start), productive_s=productive, lost_s=lost)
