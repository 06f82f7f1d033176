"""The launcher's restart bookkeeping: `RestartTiming`, one process restart of the worker
group and where its time went (the summary's row, the timing line once every rank steps
again), and the row of a restart that follows a failed attempt (which rank failed first,
and how each ended)."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ft_monitor.core.status import MonitorStatus
from ft_monitor.launcher.exit_codes import how

log = logging.getLogger("ft_monitor.launcher")


@dataclass
class RestartTiming:
    """One process restart of the worker group, whatever its cause, and where its time went
    between the failure's detection and all ranks running again."""

    rank: int
    detected: float  # wall clock, from the daemon (a hang) or the agent (a crash)
    notice_received: float
    stop_began: float | None = None
    stopped: float | None = None
    rendezvous_done: float | None = None
    workers_started: float | None = None
    first_step: float | None = None
    cause: str = "hang"
    """hang (the monitors' verdict), or failure (torch saw a worker exit: a crash, a kill)."""
    attempt: int = 0
    """The attempt that failed."""
    message: str = ""

    def row(self) -> dict[str, Any]:
        """The summary's row: cause, rank, attempt, message and the phases (`breakdown`)."""
        return {"cause": self.cause, "rank": self.rank, "attempt": self.attempt, "message": self.message,
                **self.breakdown()}

    def breakdown(self) -> dict[str, float | None]:
        def d(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(b - a, 3)

        return {
            "notify": d(self.detected, self.notice_received),
            "to_stop": d(self.notice_received, self.stop_began),
            "stop": d(self.stop_began, self.stopped),
            "rendezvous": d(self.stopped, self.rendezvous_done),
            "worker_start": d(self.rendezvous_done, self.workers_started),
            "first_step": d(self.workers_started, self.first_step),
            "total": d(self.detected, self.first_step),
        }


def failure_restart(failures: Mapping[int, ProcessFailure], statuses: Mapping[int, MonitorStatus | None],
                    attempt: int) -> RestartTiming:
    """The restart that follows a failed attempt, naming the rank that failed first."""
    # torch reports every failed worker at once, the ones it stopped itself (SIGTERM) among them,
    # and a rank whose peer raised may die of its own teardown (SIGABRT) before the one that
    # raised has exited. First: the ranks whose monitors heard them exit (EXITING), earliest
    # first; then one killed by a signal other than SIGTERM, one that exited, the earliest
    # error file, the rank
    exits = {r: e for r, f in failures.items() for st in [statuses.get(f.local_rank)]
             if st is not None for e in [st.last_exit] if e is not None and e.pid == f.pid}
    order = sorted(failures, key=lambda r: (r not in exits, exits[r].at if r in exits else 0.0,
                                            failures[r].exitcode == -signal.SIGTERM,
                                            failures[r].exitcode >= 0, failures[r].timestamp, r))
    what = [f"rank {r} (pid {failures[r].pid}) "
            + (f"raised {exits[r].reason[:200]} and " if r in exits else "") + how(failures[r].exitcode)
            for r in order]
    message = what[0] + (f" (then {', '.join(what[1:])})" if len(what) > 1 else "")
    now = time.time()
    return RestartTiming(order[0], now, now, cause="failure", attempt=attempt, message=message)


def all_stepping(timing: RestartTiming, statuses: Mapping[int, MonitorStatus | None]) -> bool:
    """Whether every rank steps again after ``timing``'s restart; if so, its first step is
    stamped and the timing line logged."""
    if not all(st is not None and st.rank is not None and (st.rank.steps_started or st.rank.heartbeats)
               for st in statuses.values()):
        return False
    timing.first_step = time.time()
    b = timing.breakdown()
    log.warning("ft-launcher: all ranks running again %.2fs after rank %d's %s was detected "
                "(notify %.3fs, to stop %.3fs, stop %.3fs, rendezvous %.3fs, worker start %.3fs, "
                "first step %.3fs)", b["total"] or 0, timing.rank, timing.cause, b["notify"] or 0,
                b["to_stop"] or 0, b["stop"] or 0, b["rendezvous"] or 0, b["worker_start"] or 0,
                b["first_step"] or 0)
    return True
