"""Does restarting help? (pure: no I/O, no clock)

After every attempt the launcher records the highest training iteration any
local rank reported. An attempt makes progress when that high-water mark rose
by at least ``min_progress_iterations``. After ``max_no_progress_cycles``
consecutive attempts without progress (the first attempt included), restarting
is pointless and the launcher stops with its own exit code instead of spending
the whole restart budget. Until some rank has reported an iteration at all,
nothing is judged (the workload may not report iterations).

`Progress` is the record as a value (`after_attempt` returns the next one), for
the launcher's pure decisions (decide.py); `ProgressTracker` holds the current
one for the agent.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProgressPolicy:
    max_no_progress_cycles: int
    """Consecutive attempts without progress before restarting stops; 0: never stop for that."""
    min_progress_iterations: int = 1
    """How far the high-water iteration must rise to count as progress (at least 1)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_progress_iterations", max(1, self.min_progress_iterations))


@dataclass(frozen=True)
class Progress:
    best: int | None = None
    """The highest iteration reported in any attempt so far; None until one is reported."""
    no_progress: int = 0
    """Consecutive attempts, up to the last, that did not advance ``best``."""

    def after_attempt(self, iteration: int | None, policy: ProgressPolicy) -> tuple[Progress, bool]:
        """The record after an attempt whose high-water iteration was ``iteration``, and
        whether restarting should stop."""
        if iteration is not None and (self.best is None or iteration >= self.best + policy.min_progress_iterations):
            return Progress(iteration, 0), False
        after = Progress(self.best, self.no_progress + 1)
        stop = policy.max_no_progress_cycles > 0 and after.best is not None and \
            after.no_progress >= policy.max_no_progress_cycles
        return after, stop

    def describe(self, policy: ProgressPolicy) -> str:
        return (f"the training iteration did not advance past {self.best} in {self.no_progress} consecutive "
                f"attempt(s) (max_no_progress_cycles={policy.max_no_progress_cycles})")


class ProgressTracker:
    """The current `Progress` of a launcher, under its policy."""

    def __init__(self, max_no_progress_cycles: int, min_progress_iterations: int = 1) -> None:
        self.policy = ProgressPolicy(max_no_progress_cycles, min_progress_iterations)
        self.state = Progress()

    @property
    def max_no_progress_cycles(self) -> int:
        return self.policy.max_no_progress_cycles

    @property
    def min_progress_iterations(self) -> int:
        return self.policy.min_progress_iterations

    @property
    def best(self) -> int | None:
        return self.state.best

    @property
    def no_progress(self) -> int:
        return self.state.no_progress

    def attempt_ended(self, iteration: int | None) -> bool:
        """Record an attempt's high-water iteration; True when restarting should stop."""
        self.state, stop = self.state.after_attempt(iteration, self.policy)
        return stop

    def describe(self) -> str:
        return self.state.describe(self.policy)
