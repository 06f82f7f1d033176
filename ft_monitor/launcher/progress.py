"""Does restarting help? (pure: no I/O, no clock)

After every attempt the launcher records the highest training iteration any
local rank reported. An attempt makes progress when that high-water mark rose
by at least ``min_progress_iterations``. After ``max_no_progress_cycles``
consecutive attempts without progress (the first attempt included), restarting
is pointless and the launcher stops with its own exit code instead of spending
the whole restart budget. Until some rank has reported an iteration at all,
nothing is judged (the workload may not report iterations).
"""

from __future__ import annotations


class ProgressTracker:
    def __init__(self, max_no_progress_cycles: int, min_progress_iterations: int = 1) -> None:
        self.max_no_progress_cycles = max_no_progress_cycles
        self.min_progress_iterations = max(1, min_progress_iterations)
        self.best: int | None = None
        self.no_progress = 0

    def attempt_ended(self, iteration: int | None) -> bool:
        """Record an attempt's high-water iteration; True when restarting should stop."""
        if iteration is not None and (self.best is None or iteration >= self.best + self.min_progress_iterations):
            self.best = iteration
            self.no_progress = 0
            return False
        self.no_progress += 1
        return (
            self.max_no_progress_cycles > 0
            and self.best is not None
            and self.no_progress >= self.max_no_progress_cycles
        )

    def describe(self) -> str:
        return (f"the training iteration did not advance past {self.best} in {self.no_progress} consecutive "
                f"attempt(s) (max_no_progress_cycles={self.max_no_progress_cycles})")
