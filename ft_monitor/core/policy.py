"""Hang detection policy (pure): which deadlines a session has, and which passed.

Every timeout that is set yields a `Deadline`: the start-up deadline (from the
worker's start to its first heartbeat or step, with ``startup_until: first_step``;
the part before the handshake is startup.py's), the initial heartbeat (measured
from the handshake), the subsequent heartbeat (from the last one), each open
section on its own (nested and overlapping sections are all checked; no
section's state hides another's), and out-of-section time while no section is
open. `next_deadline()` is what the server arms its timer on; `check()` is what
it calls when the timer fires. Both take ``now`` and read no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ft_monitor.core.state import Phase, Session


class Reason(Enum):
    INITIAL_HEARTBEAT = "initial_heartbeat"
    HEARTBEAT = "heartbeat"
    SECTION = "section"
    OUT_OF_SECTION = "out_of_section"
    INPROCESS_RESTART = "inprocess_restart"
    STARTUP = "startup"


@dataclass(frozen=True, slots=True)
class Deadline:
    at: float
    reason: Reason
    since: float
    """The moment the timeout started counting: the last progress (the hang onset),
    or when the timeout was set, if later."""
    timeout: float
    section: str | None = None


@dataclass(frozen=True, slots=True)
class Hang:
    """A passed deadline, with what a person needs to know about it."""

    rank: int
    pid: int
    reason: Reason
    section: str | None
    onset: float
    detected_at: float
    timeout: float
    last_heartbeat: float | None
    open_sections: tuple[tuple[str, float], ...]
    """(name, seconds open) for every section open at detection."""
    iteration: int | None
    """The iteration the rank was in (`iteration_now`): completed `step` sections, counted on
    from its checkpoint, so the index of the step it hung in."""
    connected: bool = True
    """False for a worker that never connected to its monitor (a start-up hang)."""
    record_refused: str | None = None
    """Why the rank's progress record was refused, when the deadline ran from that refusal
    (nothing came over the socket since)."""

    @property
    def elapsed(self) -> float:
        return self.detected_at - self.onset

    def describe(self) -> str:
        """One line saying what hung, e.g. "section 'step' open for 12.3 s, timeout 10.0 s"."""
        e, t = self.elapsed, self.timeout
        if self.record_refused is not None:
            return (f"record refused ({self.record_refused}); nothing over the socket in the {e:.1f} s since, "
                    f"{self.reason.value.replace('_', ' ')} timeout {t:.1f} s")
        if self.reason is Reason.SECTION:
            return f"section {self.section!r} open for {e:.1f} s, timeout {t:.1f} s"
        if self.reason is Reason.OUT_OF_SECTION:
            return f"no section open for {e:.1f} s, out-of-section timeout {t:.1f} s"
        if self.reason is Reason.INPROCESS_RESTART:
            return f"not back in the training function {e:.1f} s after an in-process restart, timeout {t:.1f} s"
        if self.reason is Reason.STARTUP:
            if not self.connected:
                return f"not connected to its monitor {e:.1f} s after it started, startup timeout {t:.1f} s"
            return f"no heartbeat or step {e:.1f} s after it started, startup timeout {t:.1f} s"
        if self.reason is Reason.INITIAL_HEARTBEAT:
            return f"no first heartbeat {e:.1f} s after connecting, initial heartbeat timeout {t:.1f} s"
        return f"no heartbeat for {e:.1f} s, heartbeat timeout {t:.1f} s"


def deadlines(s: Session) -> list[Deadline]:
    """Every deadline the session is under now (empty unless ACTIVE or RESTARTING)."""
    if s.phase is Phase.RESTARTING and s.restart_deadline is not None and s.restart_since is not None:
        return [Deadline(s.restart_deadline, Reason.INPROCESS_RESTART, s.restart_since,
                         s.restart_deadline - s.restart_since)]
    if s.phase is not Phase.ACTIVE:
        return []
    out: list[Deadline] = []
    t = s.timeouts
    floor = s.timeouts_since if s.record_refused_at is None else max(s.timeouts_since, s.record_refused_at)
    if s.startup_since is not None and s.startup_timeout is not None and not s.started_training:
        out.append(Deadline(s.startup_since + s.startup_timeout, Reason.STARTUP, s.startup_since, s.startup_timeout))
    if s.last_heartbeat is None:
        if t.initial_rank_heartbeat_timeout is not None:
            since = max(s.started_at, floor)
            out.append(Deadline(since + t.initial_rank_heartbeat_timeout, Reason.INITIAL_HEARTBEAT, since,
                                t.initial_rank_heartbeat_timeout))
    elif t.rank_heartbeat_timeout is not None:
        since = max(s.last_heartbeat, floor)
        out.append(Deadline(since + t.rank_heartbeat_timeout, Reason.HEARTBEAT, since, t.rank_heartbeat_timeout))
    for sec in s.open_sections.values():
        if sec.timeout is not None:
            out.append(Deadline(sec.counted_from + sec.timeout, Reason.SECTION, sec.counted_from, sec.timeout,
                                sec.name))
    if s.out_of_section_since is not None and t.rank_out_of_section_timeout is not None:
        since = max(s.out_of_section_since, floor)
        out.append(Deadline(since + t.rank_out_of_section_timeout, Reason.OUT_OF_SECTION, since,
                            t.rank_out_of_section_timeout))
    return out


def deadline_inputs(s: Session) -> tuple[object, ...]:
    """What `deadlines` depends on, besides constants: equal before and after a change
    means the deadlines did not change (every progress event counts in ``events``)."""
    return (s.events, s.phase, s.timeouts_since, s.timeouts, s.startup_since, s.restart_deadline,
            s.record_refused_at)


def next_deadline(s: Session) -> Deadline | None:
    """The earliest deadline, or None when nothing is being timed."""
    ds = deadlines(s)
    return min(ds, key=_at) if ds else None


def _at(d: Deadline) -> float:
    return d.at


def check(s: Session, now: float) -> Hang | None:
    """The hang at ``now``: the earliest passed deadline, or None if none passed."""
    first = next_deadline(s)
    if first is None or first.at > now:
        return None
    return Hang(
        rank=s.rank,
        pid=s.pid,
        reason=first.reason,
        section=first.section,
        onset=first.since,
        detected_at=now,
        timeout=first.timeout,
        last_heartbeat=s.last_heartbeat,
        open_sections=tuple((sec.name, now - sec.opened_at) for sec in s.open_sections.values()),
        iteration=iteration_now(s),
        record_refused=s.record_refused if s.record_refused_at is not None and first.since <= s.record_refused_at
        and first.reason in _FLOORED else None,
    )


_FLOORED = (Reason.INITIAL_HEARTBEAT, Reason.HEARTBEAT, Reason.OUT_OF_SECTION)
"""The deadlines timed from no earlier than a record's refusal (see `deadlines`)."""


def iteration_now(s: Session) -> int | None:
    """The iteration the rank is in: where its session started (its first ITERATION report
    less the steps closed before it) plus the `step` sections the monitor saw it close since.
    ITERATION reports are throttled (at most 5/s), so the last one can lag several steps;
    the monitor's own count does not. The last report when the start is not known yet."""
    if s.iteration_base is None:
        return s.iteration
    return s.iteration_base + s.steps_closed
