"""Learned timeouts: observe one rank's progress, compute new `Timeouts` from it.

Owns three things, all pure (no I/O, no clock reads, no torch):

* `TimeoutsRecorder` records what a rank does: time from `start(now)` to the first
  heartbeat, the largest gap between heartbeats, the longest run of each tracked
  section and the longest stretch with no tracked section open. Every method
  that needs a time takes ``now`` (monotonic seconds); the caller owns the clock.
  (``ft_client.TimeoutsCalc`` is nvidia-resiliency-ext's calculator API, built on
  this recorder in `ft_client.learning.compat`.)
* `Observations`, the maxima behind learned timeouts, and its fixed-layout
  float vector for a cross-rank element-wise MAX (`to_vector` / `from_vector`).
  The reduction itself lives in `ft_client.learning.sync`.
* `learn_hb_timeouts` / `learn_section_timeouts`: Timeouts in force + observations
  -> new Timeouts. timeout = largest observation x safety factor; when the
  previous value was itself learned, the result is the mean of old and new.
  `hb_not_ready` / `sections_not_ready` tell whether there is enough data.

It must not send anything, read a clock, or raise on the hot path
(`on_heartbeat`, `on_section_open`, `on_section_close`): misuse there (closing a
section that is not open, an untracked name) is ignored; the client detects it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ft_client.errors import RankMonitorClientError
from ft_client.timeouts import (
    LEARNED_HB,
    LEARNED_INITIAL_HB,
    LEARNED_OUT_OF_SECTION,
    STEP_SECTION,
    WARMUP_SECTION,
    Timeouts,
    TimeoutsError,
    learned_section_key,
)

DEFAULT_SAFETY_FACTOR = 5.0

MISSING = -1.0
"""Vector encoding of "not observed". Below every real duration (>= 0), so an
element-wise MAX keeps a real value from any rank, and stays MISSING only when
no rank observed it."""

_HEADER = 3  # initial heartbeat, heartbeat gap, out-of-section; then sections


class NotEnoughDataError(RankMonitorClientError, ValueError):
    """A learned timeout was asked for before anything it needs was observed."""


MAX_SAFETY_FACTOR = 100.0
"""The largest safety factor: a timeout 100 times the longest interval seen is already no
learning at all (docs/learned-timeouts.md, "Bounds")."""
SAFETY_FACTOR_RULE = ("must be a number >= 1.0 (a factor below 1 makes timeouts shorter than observed) "
                      "and <= 100 (a larger one learns nothing)")
"""The one safety-factor rule: the config, the settings and the checkpoint loader all use it
(a checkpoint cannot carry a factor the config refuses)."""
LEARNED_TIMEOUT_FLOOR = 0.001
"""No learned timeout is below 1 ms, whatever ``min_learned_timeout`` says (it may be 0): no
heartbeat gap or section a rank can keep to is shorter, and a checkpoint's value below it
(1e-300, which kills a healthy rank at once) is refused."""
LEARNED_TIMEOUT_CEILING = 7 * 24 * 3600.0
"""No learned timeout is above 7 days (docs/learned-timeouts.md, "Bounds"): a learned value is
the longest interval seen times the safety factor, and a week is longer than any scheduler's
job; a checkpoint's value above it (1e308, which turns detection off) is refused."""


def safety_factor_ok(value: object) -> bool:
    # compared, not converted: a 401-digit int has no float (OverflowError), NaN fails both tests
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 1.0 <= value <= MAX_SAFETY_FACTOR)


def check_safety_factor(value: object) -> float:
    """Validate a safety factor (SAFETY_FACTOR_RULE)."""
    if not safety_factor_ok(value) or not isinstance(value, (int, float)):
        raise TimeoutsError(f"safety_factor = {value!r}: {SAFETY_FACTOR_RULE}")
    return float(value)


@dataclass(frozen=True)
class Observations:
    """Largest observed durations (seconds); None = never observed.

    ``sections`` maps every tracked section name to its longest completed run.
    """

    initial_hb: float | None = None
    hb_gap: float | None = None
    out_of_section: float | None = None
    sections: Mapping[str, float | None] = field(default_factory=dict)

    def to_vector(self, section_names: Sequence[str]) -> list[float]:
        """Fixed layout: [initial_hb, hb_gap, out_of_section, *sections in `section_names` order].

        Every rank must pass the same `section_names` (the sorted configured
        names); a name without an observation is written as MISSING.
        """
        values = [self.initial_hb, self.hb_gap, self.out_of_section]
        values.extend(self.sections.get(name) for name in section_names)
        return [MISSING if v is None else float(v) for v in values]

    @classmethod
    def from_vector(cls, values: Sequence[float], section_names: Sequence[str]) -> Observations:
        """Inverse of `to_vector`; a negative entry reads as not observed."""
        expected = _HEADER + len(section_names)
        if len(values) != expected:
            raise TimeoutsError(
                f"observation vector has {len(values)} values: expected {expected} "
                f"({_HEADER} + one per section in {list(section_names)!r})"
            )
        decoded = [None if v < 0 else float(v) for v in values]
        return cls(
            initial_hb=decoded[0],
            hb_gap=decoded[1],
            out_of_section=decoded[2],
            sections=dict(zip(section_names, decoded[_HEADER:])),
        )


class TimeoutsRecorder:
    """Records one rank's heartbeat and section timings (pure, caller-supplied `now`).

    ``sections`` are the names to track (the client passes the names listed in
    rank_section_timeouts, minus `warmup`); events for other names are ignored
    and do not interrupt the out-of-section stretch. Sections may nest and
    overlap; the out-of-section stretch runs only while none is open. Opening a
    section that is already open keeps its first start; closing one that is not
    open does nothing.
    """

    __slots__ = (
        "safety_factor",
        "section_names",
        "warmup_steps",
        "_warmup_left",
        "_start",
        "_last_hb",
        "_max_initial",
        "_max_gap",
        "_max_oos",
        "_oos_since",
        "_max_section",
        "_open",
    )

    def __init__(self, sections: Iterable[str] = (), safety_factor: float = DEFAULT_SAFETY_FACTOR,
                 warmup_steps: int = 0) -> None:
        self.safety_factor = check_safety_factor(safety_factor)
        self.section_names: tuple[str, ...] = tuple(sorted(set(sections)))
        self.warmup_steps = warmup_steps
        """How many `step` sections after each `start` are not learned from: those the monitor
        times with the `warmup` entry (torch.compile's first steps, a restart's first steps)."""
        self._warmup_left = warmup_steps
        self._start: float | None = None
        self._last_hb: float | None = None
        self._max_initial = MISSING
        self._max_gap = MISSING
        self._max_oos = MISSING
        self._oos_since: float | None = None
        self._max_section: dict[str, float] = dict.fromkeys(self.section_names, MISSING)
        self._open: dict[str, float] = {}

    # -- events ---------------------------------------------------------------
    def start(self, now: float) -> None:
        """Monitoring starts: the next heartbeat is the initial one, an
        out-of-section stretch begins. Maxima recorded so far are kept."""
        self._start = now
        self._last_hb = None
        self._open.clear()
        self._oos_since = now
        self._warmup_left = self.warmup_steps

    def on_heartbeat(self, now: float) -> None:
        last = self._last_hb
        if last is not None:
            if now - last > self._max_gap:
                self._max_gap = now - last
        elif self._start is not None and now - self._start > self._max_initial:
            self._max_initial = now - self._start
        self._last_hb = now

    def on_section_open(self, name: str, now: float) -> None:
        if name not in self._max_section:
            return
        opened = self._open
        if not opened and self._oos_since is not None and now - self._oos_since > self._max_oos:
            self._max_oos = now - self._oos_since
        opened.setdefault(name, now)

    def on_section_close(self, name: str, now: float) -> None:
        began = self._open.pop(name, None)
        if began is None:
            return
        if self._warmup_left and name == STEP_SECTION:
            self._warmup_left -= 1  # timed by `warmup`, not learned from: compiling, warming caches
        elif now - began > self._max_section[name]:
            self._max_section[name] = now - began
        if not self._open:
            self._oos_since = now

    def on_close_all(self, now: float) -> None:
        """Close every open section at `now` (end_all_sections)."""
        for name in list(self._open):
            self.on_section_close(name, now)

    def set_start(self, now: float) -> None:
        """Time the initial heartbeat from `now` (if it has not been sent yet).
        Unlike `start`, nothing else changes: open sections, the out-of-section
        stretch and the last heartbeat are kept."""
        self._start = now

    def record_out_of_section(self, now: float) -> None:
        """Record the still-running out-of-section stretch (no section open) as if it
        ended at `now`; the stretch itself keeps running."""
        if not self._open and self._oos_since is not None and now - self._oos_since > self._max_oos:
            self._max_oos = now - self._oos_since

    # -- state ------------------------------------------------------------------
    @property
    def start_time(self) -> float | None:
        """When monitoring started (`start`, `set_start`); None before."""
        return self._start

    @property
    def open_sections(self) -> Mapping[str, float]:
        """Tracked sections open now, with the time each was opened (a copy)."""
        return dict(self._open)

    # -- results --------------------------------------------------------------
    def observations(self, now: float | None) -> Observations:
        """The maxima so far; the still-running out-of-section stretch (if no
        section is open) counts as if it ended at `now`. With ``now=None``, only
        what was recorded: stretches ended by a section opening, and
        `record_out_of_section`."""
        oos = self._max_oos
        if now is not None and not self._open and self._oos_since is not None:
            oos = max(oos, now - self._oos_since)
        return Observations.from_vector(
            [self._max_initial, self._max_gap, oos, *self._max_section.values()], self.section_names
        )

    def export_vector(self, now: float | None) -> list[float]:
        """`observations(now)` in the agreed layout, ready for a cross-rank MAX."""
        return self.observations(now).to_vector(self.section_names)

    def import_vector(self, values: Sequence[float]) -> Observations:
        """Adopt reduced maxima (from every rank) as this rank's own and return them.

        `values` must have the layout of `export_vector`. Values only grow: an
        entry below what this rank already holds is ignored.
        """
        obs = Observations.from_vector(values, self.section_names)
        self._max_initial = max(self._max_initial, values[0])
        self._max_gap = max(self._max_gap, values[1])
        self._max_oos = max(self._max_oos, values[2])
        for name, value in zip(self.section_names, values[_HEADER:]):
            self._max_section[name] = max(self._max_section[name], value)
        return obs


# -- calculation ---------------------------------------------------------------
def _merge(current: Timeouts, key: str, old: float | None, observed: float, safety_factor: float,
           floor: float) -> float:
    new = observed * safety_factor
    if key in current.learned and old is not None:
        new = (old + new) / 2.0
    return min(max(new, floor, LEARNED_TIMEOUT_FLOOR), LEARNED_TIMEOUT_CEILING)


def _zero_reason(what: str) -> str:
    return f"cannot learn the {what}: the longest observed interval is 0 s, and a timeout must be > 0"


def hb_not_ready(obs: Observations) -> str | None:
    """Why heartbeat timeouts cannot be learned from `obs`, or None if they can."""
    if obs.initial_hb is None:
        return "cannot learn the initial heartbeat timeout: no heartbeat has been sent since monitoring started"
    if obs.hb_gap is None:
        return (
            "cannot learn the heartbeat timeout: fewer than two heartbeats have been sent, "
            "so no interval between them is known"
        )
    if obs.initial_hb <= 0:
        return _zero_reason("initial heartbeat timeout")
    if obs.hb_gap <= 0:
        return _zero_reason("heartbeat timeout")
    return None


def _selected(current: Timeouts, selected_sections: Collection[str] | None) -> list[str]:
    if selected_sections is None:
        return sorted(n for n in current.rank_section_timeouts if n != WARMUP_SECTION)
    if isinstance(selected_sections, str):
        raise TimeoutsError(
            f"selected_sections = {selected_sections!r}: must be a collection of section names, not one string"
        )
    for name in selected_sections:
        if name == WARMUP_SECTION:
            raise TimeoutsError(
                f"selected_sections contains {WARMUP_SECTION!r}: it is not a section of its own "
                "(it replaces the 'step' timeout during warm-up) and cannot be learned"
            )
        if name not in current.rank_section_timeouts:
            raise TimeoutsError(
                f"selected_sections contains {name!r}: only sections listed in rank_section_timeouts "
                f"({sorted(current.rank_section_timeouts)!r}) are observed"
            )
    return sorted(set(selected_sections))


def sections_not_ready(
    current: Timeouts,
    obs: Observations,
    selected_sections: Collection[str] | None = None,
    calc_out_of_section: bool = True,
) -> str | None:
    """Why the chosen section timeouts cannot be learned from `obs`, or None if they can.

    Raises TimeoutsError (a ValueError, not NotEnoughDataError) for a selection that can never
    be learned: `warmup`, or a name not in current.rank_section_timeouts.
    """
    for name in _selected(current, selected_sections):
        value = obs.sections.get(name)
        if value is None:
            return f"cannot learn the {name!r} section timeout: no {name!r} section has been completed yet"
        if value <= 0:
            return _zero_reason(f"{name!r} section timeout")
    if calc_out_of_section:
        if obs.out_of_section is None:
            return "cannot learn the out-of-section timeout: no time outside sections has been observed yet"
        if obs.out_of_section <= 0:
            return _zero_reason("out-of-section timeout")
    return None


def learn_hb_timeouts(
    current: Timeouts, obs: Observations, safety_factor: float = DEFAULT_SAFETY_FACTOR, floor: float = 0.0
) -> Timeouts:
    """New initial and subsequent heartbeat timeouts, none below ``floor`` seconds;
    raises NotEnoughDataError."""
    reason = hb_not_ready(obs)
    if reason is not None:
        raise NotEnoughDataError(reason)
    assert obs.initial_hb is not None and obs.hb_gap is not None
    factor = check_safety_factor(safety_factor)
    return current.with_updates(
        initial_rank_heartbeat_timeout=_merge(
            current, LEARNED_INITIAL_HB, current.initial_rank_heartbeat_timeout, obs.initial_hb, factor, floor
        ),
        rank_heartbeat_timeout=_merge(
            current, LEARNED_HB, current.rank_heartbeat_timeout, obs.hb_gap, factor, floor
        ),
        learned=current.learned | {LEARNED_INITIAL_HB, LEARNED_HB},
    )


def learn_section_timeouts(
    current: Timeouts,
    obs: Observations,
    safety_factor: float = DEFAULT_SAFETY_FACTOR,
    selected_sections: Collection[str] | None = None,
    calc_out_of_section: bool = True,
    floor: float = 0.0,
) -> Timeouts:
    """New timeouts for the selected sections (None: every configured one but
    `warmup`) and, if `calc_out_of_section`, the out-of-section timeout, none
    below ``floor`` seconds. Others are kept. Raises NotEnoughDataError."""
    reason = sections_not_ready(current, obs, selected_sections, calc_out_of_section)
    if reason is not None:
        raise NotEnoughDataError(reason)
    factor = check_safety_factor(safety_factor)
    sections = dict(current.rank_section_timeouts)
    learned = set(current.learned)
    for name in _selected(current, selected_sections):
        observed = obs.sections[name]
        assert observed is not None
        key = learned_section_key(name)
        sections[name] = _merge(current, key, sections[name], observed, factor, floor)
        learned.add(key)
    oos = current.rank_out_of_section_timeout
    if calc_out_of_section:
        assert obs.out_of_section is not None
        oos = _merge(current, LEARNED_OUT_OF_SECTION, oos, obs.out_of_section, factor, floor)
        learned.add(LEARNED_OUT_OF_SECTION)
    return current.with_updates(
        rank_section_timeouts=sections, rank_out_of_section_timeout=oos, learned=frozenset(learned)
    )
