"""End-to-end: a real daemon counts every step of a real rank, in both progress modes.

The record is read on a tick, so steps much shorter than the tick come and go between
two reads; the counts (steps, the step histogram, its sum) and the final iteration must
still be those of the socket, where every close is a message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.procs import Daemon, Rank, status, wait_until

pytestmark = pytest.mark.e2e

STEPS = 200
STEP_S = 0.0005
"""Far below the record's tick (25 ms at most): most steps open and close between two reads."""


@pytest.mark.parametrize("ending", ["clean", "exit3"])
def test_every_short_step_is_counted_and_the_final_iteration_is_the_last(workdir: Path, progress: tuple[str, ...],
                                                                         ending: str) -> None:
    """``clean``: the rank says GOODBYE; ``exit3``: it exits without it (the daemon reads
    the record once more when the connection closes)."""
    d = Daemon(workdir, "--ft-rank-section-timeouts", "step:30", *progress).wait_ready()
    rank = Rank(ending, d.socket, "--steps", str(STEPS), "--step-s", str(STEP_S))
    try:
        rank.wait_line("steps done", 60)
        assert rank.wait(30) == (0 if ending == "clean" else 3)

        def ended() -> dict[str, Any] | None:
            st = status(d.socket)
            return None if st["connected"] or st["sessions"] != 1 else st

        st = wait_until(ended, 10, "the rank's session to end")  # ended in the handler that saw it go
        step = st["section_stats"]["sections"]["step"]
        assert step["count"] == STEPS and sum(step["buckets"]) == STEPS, (progress, step)
        assert STEPS * STEP_S <= step["sum_s"] < STEPS * 0.05, step  # each step's sleep, and not a read's lag
        assert (st["iteration_high"], st.get("last_iteration")) == (STEPS, STEPS), st
    finally:
        rank.kill()
        d.stop()
