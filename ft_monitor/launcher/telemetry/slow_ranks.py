"""Which ranks are slow (pure: no I/O, no clock).

A rank is slow when the median of its recent durations of one section
(``slow_rank_section``, default `step`) exceeds the median of the other ranks'
medians by more than ``slow_rank_ratio`` and by at least `MIN_EXCESS_S` (timer noise
on millisecond sections is not a slow rank). It stops being slow when its ratio
falls below the midpoint between 1 and the threshold, so a rank near the threshold
does not flap. Ranks with fewer than `MIN_SAMPLES` recent durations are not judged.

The medians come from every node: each launcher publishes its local ranks' medians
in the rendezvous store (store_auth.StepTimes) and reads the others'; each flags
only its own ranks (one event and one log line per rank, from the node that runs it).

Which section to compare matters. In data-parallel training every rank's step waits
for the slowest in its gradient all-reduce, so the step times of all ranks are the
same and only a section that holds a rank's own work (data loading, the forward
pass) tells them apart; docs/observability.md shows how.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

MIN_SAMPLES = 5
MIN_EXCESS_S = 0.005


@dataclass(frozen=True, slots=True)
class SlowVerdict:
    rank: int
    median_s: float
    others_median_s: float
    ratio: float
    slow: bool


def judge(medians: Mapping[int, float], threshold: float, flagged: frozenset[int] = frozenset(),
          min_excess: float = MIN_EXCESS_S) -> dict[int, SlowVerdict]:
    """A verdict for every rank of ``medians`` (rank -> median seconds), given the ranks
    ``flagged`` slow so far; empty with fewer than two ranks."""
    out: dict[int, SlowVerdict] = {}
    if len(medians) < 2:
        return out
    release = 1.0 + (threshold - 1.0) / 2
    for rank, mine in medians.items():
        others = statistics.median(v for r, v in medians.items() if r != rank)
        ratio = mine / others if others > 0 else (1.0 if mine <= 0 else float("inf"))
        if rank in flagged:
            slow = ratio >= release and mine - others >= min_excess / 2
        else:
            slow = ratio > threshold and mine - others >= min_excess
        out[rank] = SlowVerdict(rank, mine, others, ratio, slow)
    return out
