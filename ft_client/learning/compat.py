"""nvidia-resiliency-ext's ``TimeoutsCalc`` API, on top of our recorder and learning math.

Code written against the reference's calculator (``fault_tolerance.timeouts_calc``) runs
against this one after an import change (``from ft_client import TimeoutsCalc,
TimeoutsCalcError, SectionAction``)::

    tc = TimeoutsCalc(sections=["step", "ckpt"], start_time=0, safety_factor=2.0)
    tc.update_on_heartbeat(hb_time=10)                     # times default to time.monotonic()
    tc.update_on_section_event("step", SectionAction.OPEN, event_time=12)
    tc.update_on_section_event("step", SectionAction.CLOSE, event_time=15)
    tc.synchronize_all()                                   # element-wise MAX over ranks (collective)
    if tc.can_get_section_timeouts(selected_sections=["step"], calc_out_of_section=False):
        st = tc.get_section_timeouts(["step"], False, current=client.section_timeouts)

This module only adapts: it owns the clock default, the reference's strict checks on
section events (`TimeoutsCalcError`), and the conversion between the reference's result
types (`HeartbeatTimeouts`, `SectionTimeouts`, merged with ``current``) and ours. What is
recorded is `timeouts_calc.TimeoutsRecorder`'s, what is computed is
`timeouts_calc.learn_hb_timeouts` / `learn_section_timeouts` (largest observation x
safety factor; averaged with ``current`` where ``current`` was itself calculated), and
the cross-rank MAX is `sync.max_across_ranks`. It must not talk to a monitor.

Where the reference is unsound we differ, on purpose (docs/migration.md lists each):
``selected_sections=[]`` selects no section in every call (the reference's readiness check
reads it as "all" while its calculation reads it as "none"); `synchronize_all` reduces in
float64 on whatever device the backend serves (the reference: float32, NCCL or Gloo only);
a ``current`` that claims calculated values it does not have is refused with a sentence,
not an assertion; an action that is not a `SectionAction` is refused, not ignored. A
section named ``warmup`` is ours (it stands in for ``step`` during warm-up): it is
recorded, but no timeout is learned for it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from enum import Enum

from ft_client.errors import FtError
from ft_client.learning.calc import (
    DEFAULT_SAFETY_FACTOR,
    MISSING,
    NotEnoughDataError,
    Observations,
    TimeoutsRecorder,
    hb_not_ready,
    learn_hb_timeouts,
    learn_section_timeouts,
    sections_not_ready,
)
from ft_client.timeouts import (
    LEARNED_HB,
    LEARNED_INITIAL_HB,
    LEARNED_OUT_OF_SECTION,
    HeartbeatTimeouts,
    SectionTimeouts,
    Timeouts,
    learned_section_key,
)

__all__ = ["SectionAction", "TimeoutsCalc", "TimeoutsCalcError", "TimeoutsCalcNotReadyError"]


class TimeoutsCalcError(FtError, ValueError):
    """`TimeoutsCalc` cannot do what was asked: a section event out of order, an unknown
    section, a bad argument, no process group for `synchronize_all`, or not enough data.
    A `ValueError` too, as every bad value given to our public functions is."""


class TimeoutsCalcNotReadyError(TimeoutsCalcError, NotEnoughDataError):
    """Timeouts were asked for before enough was observed. Both a `TimeoutsCalcError` (as the
    reference raises) and a `NotEnoughDataError` (as RankMonitorClient raises)."""


class SectionAction(Enum):
    """What happened to a section (the reference's ``data.SectionAction``)."""

    OPEN = 1
    CLOSE = 2
    CLOSE_ALL = 3


def _seconds(value: float | None) -> float:
    return MISSING if value is None else value


class TimeoutsCalc:
    """Learns timeouts from heartbeat and section events, with nvidia-resiliency-ext's API.

    ``sections``: the section names events may name (others are refused). ``start_time``:
    when monitoring started (the initial heartbeat and the first out-of-section stretch are
    timed from it); None means now. ``safety_factor``: timeout = largest observed interval
    x this factor (>= 1). ``clock`` (monotonic seconds) serves every time argument left
    as None; tests inject one.
    """

    def __init__(
        self,
        sections: Iterable[str] | None = None,
        start_time: float | None = None,
        safety_factor: float = DEFAULT_SAFETY_FACTOR,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(sections, str):
            raise TimeoutsCalcError(f"sections = {sections!r}: must be a collection of section names, not one string")
        self._clock = clock
        self._order: tuple[str, ...] = tuple(dict.fromkeys(sections or ()))
        try:
            self._rec = TimeoutsRecorder(self._order, safety_factor)
        except ValueError as e:
            raise TimeoutsCalcError(str(e)) from e
        self._rec.start(clock() if start_time is None else start_time)

    # -- recording ----------------------------------------------------------------
    def reset_start_time(self) -> None:
        """Time the initial heartbeat from now (if it has not been sent yet)."""
        self._rec.set_start(self._clock())

    def update_on_heartbeat(self, hb_time: float | None = None) -> None:
        """A heartbeat at ``hb_time`` (default: now)."""
        self._rec.on_heartbeat(self._now(hb_time))

    def update_on_section_event(
        self, section: str | None, action: SectionAction, event_time: float | None = None
    ) -> None:
        """``section`` opened or closed at ``event_time`` (default: now); CLOSE_ALL (with
        ``section=None``) closes every open section. Opening an open section, closing one
        that is not open, or naming a section not given to the constructor raises
        TimeoutsCalcError and records nothing."""
        if not isinstance(action, SectionAction):
            raise TimeoutsCalcError(f"action = {action!r}: must be SectionAction.OPEN, CLOSE or CLOSE_ALL")
        now = self._now(event_time)
        if action is SectionAction.CLOSE_ALL:
            self._rec.on_close_all(now)
            return
        if section not in self._rec.section_names:
            raise TimeoutsCalcError(
                f"unknown section {section!r}: this calculator tracks {list(self._order)!r} "
                "(the sections listed in rank_section_timeouts)"
            )
        is_open = section in self._rec.open_sections
        if action is SectionAction.OPEN:
            if is_open:
                raise TimeoutsCalcError(f"section {section!r} is already open: close it before opening it again")
            self._rec.on_section_open(section, now)
        else:
            if not is_open:
                raise TimeoutsCalcError(f"section {section!r} is not open: open it before closing it")
            self._rec.on_section_close(section, now)

    def maybe_bump_oos_time(self, curr_time: float | None = None) -> None:
        """If no section is open, count the out-of-section stretch so far (until
        ``curr_time``, default now) as observed. Useful right before computing timeouts:
        the last stretch may be the longest."""
        self._rec.record_out_of_section(self._now(curr_time))

    def synchronize_all(self) -> None:
        """Adopt the element-wise maximum of every rank's observations (one all_reduce MAX
        over the default process group, float64, on the device its backend serves).
        Collective: every rank must call it. Raises TimeoutsCalcError without an
        initialized torch.distributed process group."""
        dist = sys.modules.get("torch.distributed")  # never imported: no process group can exist
        if dist is None or not (dist.is_available() and dist.is_initialized()):
            raise TimeoutsCalcError(
                "synchronize_all() needs an initialized torch.distributed process group: "
                "call torch.distributed.init_process_group() first"
            )
        from ft_client.learning.sync import max_across_ranks

        self._rec.import_vector(max_across_ranks(self._rec.export_vector(None)))

    # -- what was recorded ----------------------------------------------------------
    @property
    def safety_factor(self) -> float:
        return self._rec.safety_factor

    @property
    def start_time(self) -> float:
        start = self._rec.start_time
        assert start is not None  # started in __init__
        return start

    @property
    def open_sections(self) -> Mapping[str, float]:
        """Open sections and when each was opened (a copy)."""
        return self._rec.open_sections

    @property
    def is_out_of_section(self) -> bool:
        return not self._rec.open_sections

    @property
    def initial_max_time(self) -> float:
        """Start to first heartbeat, seconds; -1 until observed."""
        return _seconds(self._recorded().initial_hb)

    @property
    def subsequent_max_time(self) -> float:
        """Longest interval between heartbeats, seconds; -1 until observed."""
        return _seconds(self._recorded().hb_gap)

    @property
    def out_of_section_max_time(self) -> float:
        """Longest recorded stretch with no section open, seconds; -1 until observed."""
        return _seconds(self._recorded().out_of_section)

    @property
    def section_to_max_time(self) -> dict[str, float]:
        """Longest completed run of each section, seconds; -1 until observed (a copy)."""
        sections = self._recorded().sections
        return {name: _seconds(sections.get(name)) for name in self._order}

    # -- heartbeat timeouts ---------------------------------------------------------
    def can_get_hb_timeouts(self) -> bool:
        """Whether a first heartbeat and an interval between two heartbeats were observed."""
        return hb_not_ready(self._recorded()) is None

    def get_hb_timeouts(self, current: HeartbeatTimeouts | None = None) -> HeartbeatTimeouts:
        """Largest observed intervals x safety factor. When ``current`` was itself calculated,
        the result is the mean of it and the new values."""
        obs = self._recorded()
        reason = hb_not_ready(obs)
        if reason is not None:
            raise TimeoutsCalcNotReadyError(f"not enough data to return the timeouts: {reason}")
        learned = learn_hb_timeouts(_hb_in_force(current), obs, self.safety_factor)
        return HeartbeatTimeouts(
            initial=learned.initial_rank_heartbeat_timeout, subsequent=learned.rank_heartbeat_timeout,
            were_calculated=True,
        )

    # -- section timeouts -----------------------------------------------------------
    def can_get_section_timeouts(
        self, selected_sections: Collection[str] | None = None, calc_out_of_section: bool = True
    ) -> bool:
        """Whether every selected section (None: all) completed at least once and, with
        ``calc_out_of_section``, an out-of-section stretch was recorded."""
        return self._sections_not_ready(selected_sections, calc_out_of_section) is None

    def get_section_timeouts(
        self,
        selected_sections: Collection[str] | None = None,
        calc_out_of_section: bool = True,
        current: SectionTimeouts | None = None,
    ) -> SectionTimeouts:
        """Timeouts for the selected sections (None: all) and, with ``calc_out_of_section``,
        the out-of-section timeout: largest observation x safety factor, averaged with the
        value in ``current`` where that one was calculated too. Values not computed come from
        ``current`` (None without it). Every section of this calculator is in the result."""
        reason = self._sections_not_ready(selected_sections, calc_out_of_section)
        if reason is not None:
            raise TimeoutsCalcNotReadyError(f"not enough data to return the timeouts: {reason}")
        in_force = _sections_in_force(self._order, current)
        learned = learn_section_timeouts(
            in_force, self._recorded(), self.safety_factor, _names(selected_sections), calc_out_of_section
        )
        views = learned.sections
        return SectionTimeouts(
            section={name: learned.rank_section_timeouts.get(name) for name in self._order},
            out_of_section=learned.rank_out_of_section_timeout,
            calculated_sections=views.calculated_sections,
            is_out_of_section_calculated=views.is_out_of_section_calculated,
        )

    # -- internals ------------------------------------------------------------------
    def _now(self, given: float | None) -> float:
        return self._clock() if given is None else given

    def _recorded(self) -> Observations:
        """What was recorded; the out-of-section stretch still running is not (the reference's
        rule: it counts once a section opens or maybe_bump_oos_time() is called)."""
        return self._rec.observations(None)

    def _sections_not_ready(self, selected: Collection[str] | None, calc_out_of_section: bool) -> str | None:
        try:
            return sections_not_ready(
                _sections_in_force(self._order, None), self._recorded(), _names(selected), calc_out_of_section
            )
        except ValueError as e:  # a name this calculator does not track
            raise TimeoutsCalcError(str(e)) from e


def _names(selected: Collection[str] | None) -> Collection[str] | None:
    if isinstance(selected, str):
        raise TimeoutsCalcError(
            f"selected_sections = {selected!r}: must be a collection of section names, not one string"
        )
    return None if selected is None else list(selected)


def _hb_in_force(current: HeartbeatTimeouts | None) -> Timeouts:
    """The reference's ``current`` heartbeat timeouts as ours: learned iff were_calculated."""
    if current is None:
        return Timeouts()
    if current.were_calculated and not current.are_valid:
        raise TimeoutsCalcError(
            f"current = {current!r}: says were_calculated but a timeout is None; "
            "calculated heartbeat timeouts always have both values"
        )
    return Timeouts(
        initial_rank_heartbeat_timeout=current.initial,
        rank_heartbeat_timeout=current.subsequent,
        learned=frozenset({LEARNED_INITIAL_HB, LEARNED_HB}) if current.were_calculated else frozenset(),
    )


def _sections_in_force(order: tuple[str, ...], current: SectionTimeouts | None) -> Timeouts:
    """The reference's ``current`` section timeouts as ours, restricted to this calculator's
    sections; without ``current``, every section off and nothing learned."""
    if current is None:
        return Timeouts(rank_section_timeouts=dict.fromkeys(order))
    learned = {learned_section_key(name) for name in current.calculated_sections}
    if current.is_out_of_section_calculated:
        learned.add(LEARNED_OUT_OF_SECTION)
    return Timeouts(
        rank_section_timeouts={name: current.section.get(name) for name in order},
        rank_out_of_section_timeout=current.out_of_section,
        learned=frozenset(learned),
    )
