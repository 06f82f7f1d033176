"""The launcher's restart bookkeeping: `RestartTiming`, one process restart of the worker
group and where its time went (the summary's row, the timing line once every rank steps
again), and the row of a restart that follows a failed attempt (the root of the crash,
crash.py, from what torch and the monitors said of each failed rank)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ft_monitor.core.status import MonitorStatus
from ft_monitor.launcher.incident.crash import CrashVerdict, FailedRank

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
    crash: CrashVerdict | None = None
    """A failure's verdict: the root and the ranks that failed because of it (crash.py)."""
    error_file: str | None = None
    """A failure's root's error.json on this node (what it raised, with its traceback), if any."""
    pids: frozenset[int] = frozenset()
    """The workers started after it (set with ``workers_started``): whose first progress is its first step."""

    def row(self) -> dict[str, Any]:
        """The summary's row: cause, rank, attempt, message and the phases (`breakdown`); a
        failure's also whether its root was seen here, its victims and its error file."""
        extra: dict[str, Any] = {} if self.crash is None else {**self.crash.row(), "error_file": self.error_file}
        return {"cause": self.cause, "rank": self.named, "attempt": self.attempt, "message": self.message,
                **extra, **self.breakdown()}

    @property
    def named(self) -> int | None:
        """The rank the outputs name: the culprit; None for a failure whose root was not seen here."""
        return self.rank if self.crash is None else self.crash.named

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


def failed_ranks(failures: Mapping[int, ProcessFailure],
                 statuses: Mapping[int, MonitorStatus | None]) -> list[FailedRank]:
    """What torch and each failed rank's monitor said of it, for `crash.decide_crash`: what it
    raised (its EXITING, else its error file's message) and when it raised or went."""
    out = []
    for r, f in failures.items():
        st = statuses.get(f.local_rank)
        exit_ = st.last_exit if st is not None and st.last_exit is not None and st.last_exit.pid == f.pid else None
        gone = st.last_gone if st is not None and st.last_gone is not None and st.last_gone.pid == f.pid else None
        error = exit_.reason if exit_ is not None else _error_file_message(f)
        out.append(FailedRank(r, f.pid, f.exitcode, error, None if exit_ is None else exit_.at,
                              None if gone is None else gone.at, float(f.timestamp or 0)))
    return out


def _error_file_message(f: ProcessFailure) -> str | None:
    """The first line of the error file the worker wrote (torch's @record: ``{"message":
    {"message": ..., "extraInfo": ...}}``, or an older plain ``{"message": ...}``), if it wrote
    one; torch makes a message up for a worker that did not ("Signal 9 (SIGKILL) received by ...")."""
    if not isinstance(f.error_file, str) or not os.path.isfile(f.error_file):
        return None
    data = getattr(f, "error_file_data", None)
    message = data.get("message") if isinstance(data, Mapping) else None
    if isinstance(message, Mapping):
        message = message.get("message")
    text = str(message or "").strip()
    return text.splitlines()[0][:500] if text else None


def failure_restart(verdict: CrashVerdict, attempt: int, error_file: str | None = None) -> RestartTiming:
    """The restart that follows a failed attempt, naming the root of the crash (crash.py) and,
    where it is on this node, its error file."""
    now = time.time()
    return RestartTiming(verdict.root, now, now, cause="failure", attempt=attempt, message=verdict.message,
                         crash=verdict, error_file=error_file)


def running_again_at(statuses: Mapping[int, MonitorStatus | None], pids: frozenset[int], *, wall: float,
                     mono: float) -> float | None:
    """When every local rank was stepping again (wall clock), from what each monitor recorded of
    its worker's first progress (`MonitorStatus.first_progress`, monotonic, kept after the worker
    ended) among ``pids`` (the restart's workers): the latest of them; None until each has one.
    A monitor that records none (an older one) counts its connected rank once it steps, as of
    ``wall`` (any pid when ``pids`` is empty). Pure: ``wall`` and ``mono`` are the two clocks
    read at the same moment.

    Not whether each is stepping at the moment of a look: the agent looks once per monitor tick,
    and a tick waits for torch's look at the rendezvous (``num_nodes_waiting``), seconds on a slow
    store (a connection flood: 5-10 s): the ranks started and finished between two looks, and the
    restart's row never had its first step, its total nor the time lost (issue 49)."""
    starts = []
    for st in statuses.values():
        first, live = (st.first_progress, st.rank) if st is not None else (None, None)
        if first is not None and first.pid in pids:
            starts.append(wall - max(0.0, mono - first.at))
        elif first is None and live is not None and (live.steps_started or live.heartbeats) \
                and (not pids or live.pid in pids):
            starts.append(wall)
    return max(starts) if statuses and len(starts) == len(statuses) else None


def all_stepping(timing: RestartTiming, statuses: Mapping[int, MonitorStatus | None],
                 clocks: tuple[float, float] | None = None) -> bool:
    """Whether every rank steps again after ``timing``'s restart (`running_again_at`); if so, its
    first step is stamped and the timing line logged. ``clocks``: (wall, monotonic) now, read here
    when not given."""
    wall, mono = clocks if clocks is not None else (time.time(), time.monotonic())
    at = running_again_at(statuses, timing.pids, wall=wall, mono=mono)
    if at is None:
        return False
    timing.first_step = max(at, timing.workers_started or at)
    b = timing.breakdown()
    whose = "the" if timing.named is None else f"rank {timing.named}'s"
    log.warning("ft-launcher: all ranks running again %.2fs after %s %s was detected "
                "(notify %.3fs, to stop %.3fs, stop %.3fs, rendezvous %.3fs, worker start %.3fs, "
                "first step %.3fs)", b["total"] or 0, whose, timing.cause, b["notify"] or 0,
                b["to_stop"] or 0, b["stop"] or 0, b["rendezvous"] or 0, b["worker_start"] or 0,
                b["first_step"] or 0)
    return True
