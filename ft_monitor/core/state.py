"""The state of one rank's monitoring session (pure: no I/O, no clock).

A `Session` is created when a rank completes its handshake and dropped when its
connection closes. Every mutating method takes the daemon's ``now`` (monotonic
seconds) as an argument; nothing here reads a clock, a socket or a signal, so
the whole life of a session is tested with plain numbers.

Session phases (`Phase`) and their transitions::

    ACTIVE --deadline passed (policy.check)--> HUNG --connection closed--> ENDED
    ACTIVE --GOODBYE------------------------> CLOSING --connection closed--> ENDED
    ACTIVE --connection closed without GOODBYE--------------------------> ENDED (exited)

    ACTIVE --deadline passed, on_hang: inprocess (begin_restart)--> RESTARTING
    ACTIVE --the rank says RESTARTING (its Wrapper saw a fault)---> RESTARTING
    RESTARTING --REENTERED (back in the function, progress made)--> ACTIVE
    RESTARTING --not re-entered by restart_deadline--------------> HUNG (policy.check)

A HUNG session accepts no further progress: the hang is being acted upon. A
RESTARTING session times nothing but its restart deadline and ignores progress:
the rank is aborting its collectives and re-entering its training function in
the same process. Re-entered, it is timed as a new session is (the initial
heartbeat counts from re-entry, no section open).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ft_client.errors import FtError
from ft_client.timeouts import STEP_SECTION, WARMUP_SECTION, Timeouts

MAX_OPEN_SECTIONS = 1024
"""Open sections a rank may hold at once; more is a client bug or an attack."""


class Phase(Enum):
    ACTIVE = "active"
    RESTARTING = "restarting"
    HUNG = "hung"
    CLOSING = "closing"
    ENDED = "ended"


class SessionError(FtError, ValueError):
    """A well-formed message that makes no sense in the session's state."""


@dataclass(slots=True)
class OpenSection:
    name: str
    opened_at: float
    timeout: float | None
    """The timeout that applies to this opening (for `step`: maybe the warm-up one)."""
    warmup: bool = False
    counted_from: float = 0.0
    """When the timeout started counting: the opening, or the moment a timeout was
    first set for a section opened without one."""

    def __post_init__(self) -> None:
        self.counted_from = max(self.counted_from, self.opened_at)


@dataclass(slots=True)
class Session:
    rank: int
    pid: int
    started_at: float
    timeouts: Timeouts
    num_warmup_iterations: int = 0
    phase: Phase = Phase.ACTIVE
    last_heartbeat: float | None = None
    heartbeats: int = 0
    open_sections: dict[str, OpenSection] = field(default_factory=dict)
    out_of_section_since: float | None = None
    steps_started: int = 0
    iteration: int | None = None
    events: int = 0
    errors: int = 0
    """Messages ignored because they made no sense in the session's state."""
    timeouts_since: float = 0.0
    """When the timeouts in force were set. A running heartbeat or out-of-section
    interval is timed from no earlier than this, so a tighter timeout learned
    mid-run never fires for time spent before it existed."""
    inprocess_restarts: int = 0
    """In-process restarts this session went through (RESTARTING -> ACTIVE)."""
    last_progress: float | None = None
    """When the rank last sent a heartbeat or opened or closed a section (while ACTIVE)."""
    trained_at: float | None = None
    """When the rank first sent a heartbeat or opened a `step` section (`started_training`): the
    launcher's "running again" after a restart is the latest of its ranks' (issue 49)."""
    steps_closed: int = 0
    """`step` sections closed in this session."""
    iteration_base: int | None = None
    """The iteration this session started from: the first ITERATION report less the steps
    closed before it (the client reports completed steps, counted on from its checkpoint),
    so ``iteration_base + steps_closed`` is the rank's iteration now, without the report's lag.
    With a progress record, set again from each read that changes the record's iteration or
    step count (record_sync.py), which come from the same read."""
    restart_since: float | None = None
    """While RESTARTING: when the restart began."""
    restart_deadline: float | None = None
    """While RESTARTING: by when the rank must have re-entered its training function."""
    restart_iteration: int | None = None
    """The Wrapper iteration the rank said it restarts as (RESTARTING), None until it does."""
    wrapper_iteration: int = 0
    """The in-process (Wrapper) iteration the rank runs, as its REENTERED messages said."""
    startup_since: float | None = None
    """With ``startup_until: first_step``: when the worker started (its launcher's notice),
    so its start-up is timed until its first heartbeat or step; None: not timed here."""
    startup_timeout: float | None = None
    record_refused: str | None = None
    """Why the monitor refused the rank's progress record, once it did (record_watch.py)."""
    record_refused_at: float | None = None
    """When it did: the rank was told and reports through the socket from then on; its
    heartbeat and out-of-section intervals are timed from no earlier than this."""

    def __post_init__(self) -> None:
        # out-of-section time is judged from the end of the rank's first section, not from the
        # handshake: init, loading and the time to the first step are the startup and heartbeat
        # timeouts' business; with a `warmup` section timeout it is judged from the handshake,
        # as nvidia-resiliency-ext does (`judged_from_start`)
        self.timeouts_since = max(self.timeouts_since, self.started_at)
        if self.judged_from_start():
            self.out_of_section_since = self.started_at

    def judged_from_start(self) -> bool:
        """Whether out-of-section time runs from the handshake (or an in-process re-entry) before
        the rank's first section: when ``warmup`` is among the section timeouts, as in
        nvidia-resiliency-ext (its monitor skips the out-of-section check before the first
        ``step`` only when section timeouts are set and ``warmup`` is not one of them)."""
        return WARMUP_SECTION in self.timeouts.rank_section_timeouts

    @property
    def started_training(self) -> bool:
        """The rank sent a heartbeat or opened a `step` section: its start-up is over."""
        return self.heartbeats > 0 or self.steps_started > 0

    # -- events ------------------------------------------------------------
    def heartbeat(self, now: float) -> None:
        self.events += 1
        if self.phase is not Phase.ACTIVE:
            return
        self.last_heartbeat = self.last_progress = now
        self.heartbeats += 1
        if self.trained_at is None:
            self.trained_at = now

    def open_section(self, name: str, now: float) -> None:
        self.events += 1
        if self.phase is not Phase.ACTIVE:
            return
        if name in self.open_sections:
            raise SessionError(f"section {name!r} opened while already open")
        if len(self.open_sections) >= MAX_OPEN_SECTIONS:
            raise SessionError(f"more than {MAX_OPEN_SECTIONS} sections open at once")
        warmup = False
        timeout = self.timeouts.rank_section_timeouts.get(name)
        if name == STEP_SECTION:
            self.steps_started += 1
            if self.trained_at is None:
                self.trained_at = now
            if (
                WARMUP_SECTION in self.timeouts.rank_section_timeouts
                and self.steps_started <= self.num_warmup_iterations
            ):
                timeout = self.timeouts.rank_section_timeouts[WARMUP_SECTION]
                warmup = True
        self.open_sections[name] = OpenSection(name, now, timeout, warmup)
        self.out_of_section_since = None
        self.last_progress = now

    def close_section(self, name: str, now: float, *, count: bool = True) -> float | None:
        """Close ``name``; returns how long it was open (None when the session ignores it).
        ``count=False``: the close is counted elsewhere (a progress record's counters,
        record_sync.py), not in `steps_closed`."""
        self.events += 1
        if self.phase is not Phase.ACTIVE:
            return None
        sec = self.open_sections.pop(name, None)
        if sec is None:
            raise SessionError(f"section {name!r} closed while not open")
        if not self.open_sections:
            self.out_of_section_since = now
        if count and name == STEP_SECTION:
            self.steps_closed += 1
        self.last_progress = now
        return now - sec.opened_at

    def close_all_sections(self, now: float) -> None:
        self.events += 1
        if self.phase is not Phase.ACTIVE:
            return
        if self.open_sections:
            self.open_sections.clear()
            self.out_of_section_since = now
        self.last_progress = now

    def refuse_record(self, reason: str, now: float, record_sections: set[str]) -> None:
        """The rank's progress record was refused at ``now``: the rank is told and reports
        through the socket from then on, where it is judged on what it sends. The sections
        the record held open are forgotten (the rank opens them again on the socket)."""
        self.events += 1
        self.record_refused = reason
        self.record_refused_at = now
        had = bool(self.open_sections)
        for name in record_sections:
            self.open_sections.pop(name, None)
        if had and not self.open_sections:
            self.out_of_section_since = now

    def set_iteration(self, iteration: int) -> None:
        """An ITERATION report. The first sets where the session's count starts; one below the
        monitor's own count re-bases it: the rank's word wins (a step left by an exception is
        closed but not completed: the client then reports the count it kept)."""
        self.events += 1
        self.iteration = iteration
        if self.iteration_base is None or iteration < self.iteration_base + self.steps_closed:
            self.iteration_base = iteration - self.steps_closed

    def set_timeouts(self, timeouts: Timeouts, now: float) -> None:
        """New timeouts apply to sections opened from now on, and to the running
        heartbeat and out-of-section intervals counted from ``now`` at the
        earliest. Open sections keep the timeout they were opened with, except
        that one opened without a timeout picks up the new one, counted from now.
        Timeouts equal to those in force change nothing."""
        if timeouts == self.timeouts:
            return
        self.timeouts = timeouts
        self.timeouts_since = now
        if self.out_of_section_since is None and not self.open_sections and not self.steps_started \
                and self.phase is Phase.ACTIVE and self.judged_from_start():
            self.out_of_section_since = now  # a warmup timeout that arrives before the first section
        for sec in self.open_sections.values():
            if sec.timeout is None and not sec.warmup:
                sec.timeout = timeouts.rank_section_timeouts.get(sec.name)
                sec.counted_from = now

    def goodbye(self) -> None:
        if self.phase is Phase.ACTIVE:
            self.phase = Phase.CLOSING

    def mark_hung(self) -> None:
        self.phase = Phase.HUNG

    # -- in-process restart --------------------------------------------------
    def begin_restart(self, now: float, timeout: float) -> None:
        """The monitor asked the rank to restart in-process (its own hang, or a peer's):
        nothing is timed but re-entry within ``timeout``. Open sections are dropped:
        the rank is unwinding out of them."""
        if self.phase is Phase.RESTARTING:
            return
        if self.phase is not Phase.ACTIVE:
            raise SessionError(f"in-process restart in phase {self.phase.value}")
        self.phase = Phase.RESTARTING
        self.restart_since = now
        self.restart_deadline = now + timeout
        self.restart_iteration = None
        self.open_sections.clear()
        self.out_of_section_since = None

    def restarting(self, iteration: int, now: float, timeout: float) -> None:
        """The rank leaves its training function to restart it in-process as ``iteration``
        (RESTARTING). From a rank whose monitor did not ask (a peer's fault, or an exception),
        this starts the restart."""
        self.events += 1
        if self.phase is Phase.ACTIVE:
            self.begin_restart(now, timeout)
        if self.phase is not Phase.RESTARTING:
            raise SessionError(f"RESTARTING in phase {self.phase.value}")
        self.restart_iteration = iteration

    def reentered(self, iteration: int, now: float) -> None:
        """The rank is back in its training function as ``iteration`` and made progress
        (REENTERED): timed again from ``now`` as a new session is."""
        self.events += 1
        if self.phase is Phase.ACTIVE and iteration > self.wrapper_iteration:
            self.wrapper_iteration = iteration  # the RESTARTING went to a monitor we replaced
            return
        if self.phase is not Phase.RESTARTING:
            raise SessionError(f"REENTERED in phase {self.phase.value}")
        self.phase = Phase.ACTIVE
        self.wrapper_iteration = iteration
        self.inprocess_restarts += 1
        self.restart_since = self.restart_deadline = None
        self.last_heartbeat = None
        # as at the handshake: judged again after the first section (from now, with a warmup timeout)
        self.out_of_section_since = now if self.judged_from_start() else None
        self.timeouts_since = max(self.timeouts_since, now)

    def end(self) -> None:
        self.phase = Phase.ENDED
