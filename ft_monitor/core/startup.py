"""The start-up deadline of a worker that has not connected yet (pure: no I/O, no clock).

ft-launcher tells each daemon the pid of the worker it just started (WORKER_STARTED);
`ft-monitor serve -- CMD` knows it as its own child. From then on the daemon times the
worker's start-up, before any handshake: a `Spawned` is that worker, `deadline` its one
deadline, `check` the verdict at ``now`` (a `policy.Hang` with reason STARTUP and
``connected=False``). What happens after the handshake (with ``startup_until:
first_step``) is the session's deadline, in policy.py. startup_watch.py holds the
`Spawned`, arms its timer and acts; the functions here take ``now`` and read no clock.

Life of a `Spawned`::

    announced --the worker (or a process it started) connects--> gone (start-up over,
                                                                   or timed on in its session)
    announced --the worker exits------------------------------> gone (its launcher sees the exit)
    announced --deadline passed (check)------------------------> a start-up hang
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ft_client.startup import StartupDump
from ft_monitor.core.policy import Deadline, Hang, Reason
from ft_monitor.core.settings import Settings

STARTUP_UNTIL = ("handshake", "first_step")
"""Where a worker's start-up ends: its handshake with the monitor, or its first heartbeat
or `step` section after it."""


@dataclass(frozen=True, slots=True)
class Spawned:
    """A worker started and announced to the daemon, not connected yet."""

    rank: int
    pid: int
    since: float
    """When the daemon heard of it (monotonic seconds): the start-up clock starts there."""
    timeout: float
    error_file: str | None = None
    """Its torchelastic error file, when its launcher gave one (its attempt directory)."""


def deadline(w: Spawned) -> Deadline:
    return Deadline(w.since + w.timeout, Reason.STARTUP, w.since, w.timeout)


def check(w: Spawned, now: float) -> Hang | None:
    """The start-up hang at ``now``, or None while the deadline has not passed."""
    d = deadline(w)
    if d.at > now:
        return None
    return Hang(rank=w.rank, pid=w.pid, reason=Reason.STARTUP, section=None, onset=w.since, detected_at=now,
                timeout=w.timeout, last_heartbeat=None, open_sections=(), iteration=None, connected=False)



def dump_spec(config: Settings, report_dir: str | os.PathLike[str]) -> StartupDump:
    """Where the workers of a daemon with ``config`` and ``report_dir`` put their start-up
    stack dumps (the attempt directory first unless report_dir is configured, as the
    daemon's reports), and on which signal."""
    return StartupDump(int(config.stack_dump_signal), os.fspath(report_dir),
                       attempt_dir_first=config.report_dir is None)
