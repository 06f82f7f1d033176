"""Checkpoint form of the client's learned state (pure: dicts in, dicts out).

Owns the `state_dict` layout and its reading, including the dict written by
nvidia-resiliency-ext's ``RankMonitorClient.state_dict()``. Layout, version 1::

    {
      "format_version": 1,
      "safety_factor": 5.0,
      "timeouts": {...Timeouts.to_wire()...},       # in force, with "learned"
      "observations": {"initial_hb": 12.5, "hb_gap": 2.0, "out_of_section": 0.4,
                       "sections": {"ckpt": 30.1, "step": 1.9}},   # null = not observed
      "iteration": 1200,                            # completed `step` sections
    }

Plain JSON types only, keys sorted where order could differ, so ranks that
reduced the same observations write identical dicts. `with_nvrx_state` adds the
reference's ``current_timeouts`` entry beside ours (the Lightning classes under the
reference's names write that file; either client reads it). `overlay_learned` lays
the learned values of a loaded checkpoint over the configured timeouts.
Must not talk to the daemon, read files or import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ft_client.errors import FtError
from ft_client.learning.calc import (
    DEFAULT_SAFETY_FACTOR,
    LEARNED_TIMEOUT_CEILING,
    LEARNED_TIMEOUT_FLOOR,
    Observations,
    check_safety_factor,
)
from ft_client.timeouts import (
    LEARNED_HB,
    LEARNED_INITIAL_HB,
    LEARNED_OUT_OF_SECTION,
    Timeouts,
    TimeoutsError,
    check_timeout,
    learned_section_key,
)

FORMAT_VERSION = 1
NVRX_STATE_KEY = "current_timeouts"
_NVRX = "nvidia-resiliency-ext"
_SECTION_PREFIX = learned_section_key("")
_KEYS = ("format_version", "safety_factor", "timeouts", "observations", "iteration")
_OBS_KEYS = ("initial_hb", "hb_gap", "out_of_section", "sections")


class StateDictError(FtError, ValueError):
    """A checkpoint dict this client cannot load: unknown version, key or value."""


@dataclass(frozen=True)
class LoadedState:
    """What a checkpoint holds. Only `timeouts` values named in `timeouts.learned` matter
    for the next run; the rest is the record of how they were obtained."""

    timeouts: Timeouts = field(default_factory=Timeouts)
    observations: Observations = field(default_factory=Observations)
    safety_factor: float = DEFAULT_SAFETY_FACTOR
    iteration: int = 0
    """Training iterations (completed `step` sections) as of the checkpoint."""


def to_state_dict(
    timeouts: Timeouts, observations: Observations, safety_factor: float, iteration: int = 0
) -> dict[str, Any]:
    """The version-1 checkpoint dict for the timeouts in force, the observations behind
    them, and the training iteration (completed `step` sections) reached."""
    wire = timeouts.to_wire()
    wire["rank_section_timeouts"] = dict(sorted(wire["rank_section_timeouts"].items()))
    return {
        "format_version": FORMAT_VERSION,
        "safety_factor": check_safety_factor(safety_factor),
        "timeouts": wire,
        "observations": {
            "initial_hb": observations.initial_hb,
            "hb_gap": observations.hb_gap,
            "out_of_section": observations.out_of_section,
            "sections": dict(sorted(observations.sections.items())),
        },
        "iteration": iteration,
    }


def from_state_dict(state: Mapping[str, Any], *, floor: float = 0.0) -> LoadedState:
    """Read a checkpoint dict: ours (format_version 1; missing keys take defaults,
    so ``{}`` is an empty state), nvidia-resiliency-ext's ``{"current_timeouts": ...}``,
    or both in one dict (`with_nvrx_state`'s file): then ours is read, the other ignored
    (it says the same, with less).

    Every learned timeout must lie in the bounds a learned one obeys (`check_bounds`: at
    least ``floor``, the monitor's ``min_learned_timeout`` where it is known, and 1 ms; at
    most 7 days), every observation at most 7 days, the safety factor from 1 to 100: a
    value outside refuses the whole dict (docs/learned-timeouts.md, "Bounds"). Raises
    nothing but StateDictError."""
    try:
        loaded = _from_state_dict(state)
    except StateDictError:
        raise
    except (ValueError, OverflowError) as e:  # a number no float holds, an int too long to show
        raise StateDictError(f"ft state_dict: {str(e)[:200]}") from e
    check_bounds(loaded.timeouts, floor)
    return loaded


def check_bounds(timeouts: Timeouts, floor: float = 0.0) -> None:
    """Refuse (StateDictError, naming the value and the bounds) a learned timeout below
    ``floor`` or `LEARNED_TIMEOUT_FLOOR`, or above `LEARNED_TIMEOUT_CEILING`: the bounds every
    learned value obeys (`calc`), so a checkpoint cannot put one in force that learning
    could not have made."""
    low = max(floor, LEARNED_TIMEOUT_FLOOR)
    for key in sorted(timeouts.learned):
        if key.startswith(_SECTION_PREFIX):
            value = timeouts.rank_section_timeouts.get(key[len(_SECTION_PREFIX) :])
        else:
            value = getattr(timeouts, key, None)
        if value is not None and not low <= value <= LEARNED_TIMEOUT_CEILING:
            raise StateDictError(
                f"ft state_dict learned {key} = {value!r}: must be from {low:g} s (the least a learned "
                f"timeout may be: min_learned_timeout, and 1 ms) to {LEARNED_TIMEOUT_CEILING:g} s (7 days)")


def _from_state_dict(state: Mapping[str, Any]) -> LoadedState:
    if not isinstance(state, Mapping):
        raise StateDictError(f"ft state_dict = {state!r}: must be a dict")
    if NVRX_STATE_KEY in state:
        if "format_version" not in state:
            return _from_nvrx(state)
        state = {k: v for k, v in state.items() if k != NVRX_STATE_KEY}
    unknown = sorted(map(str, set(state) - set(_KEYS)))
    if unknown:
        raise StateDictError(f"ft state_dict has unknown key(s) {', '.join(unknown)}: expected only {', '.join(_KEYS)}")
    version = state.get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise StateDictError(
            f"ft state_dict format_version = {version!r}: this ft_client reads format_version "
            f"{FORMAT_VERSION} only; load it with the ft_client version that wrote it"
        )
    wire = state.get("timeouts") or {}
    if not isinstance(wire, Mapping):
        raise StateDictError(f"ft state_dict timeouts = {wire!r:.100}: must be a dict")
    try:
        timeouts = Timeouts.from_wire(wire)
        safety_factor = check_safety_factor(state.get("safety_factor", DEFAULT_SAFETY_FACTOR))
    except ValueError as e:
        raise StateDictError(f"ft state_dict: {e}") from e
    _check_learned(timeouts)
    iteration = state.get("iteration", 0)
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise StateDictError(f"ft state_dict iteration = {iteration!r}: must be a whole number >= 0")
    return LoadedState(timeouts, _observations(state.get("observations") or {}), safety_factor, iteration)


def to_nvrx_state(timeouts: Timeouts) -> dict[str, Any]:
    """nvidia-resiliency-ext's ``{"current_timeouts": ...}`` for ``timeouts``, as its
    ``RankMonitorClient.state_dict()`` lays it out (heartbeat timeouts only where both are set
    and learned, section timeouts only where one was learned; names sorted), so that its
    client, and its tests, can read a file ours wrote."""
    current: dict[str, Any] = {}
    hb = timeouts.hb
    if hb.are_valid and hb.were_calculated:
        current["heartbeat"] = {"initial": hb.initial, "subsequent": hb.subsequent, "were_calculated": True}
    sec = timeouts.sections
    if sec.calculated_sections or sec.is_out_of_section_calculated:
        current["section"] = {
            "section": dict(sorted(sec.section.items())),
            "out_of_section": sec.out_of_section,
            "calculated_sections": sorted(sec.calculated_sections),
            "is_out_of_section_calculated": sec.is_out_of_section_calculated,
        }
    return {NVRX_STATE_KEY: current}


def with_nvrx_state(state: Mapping[str, Any], timeouts: Timeouts) -> dict[str, Any]:
    """Our state dict with the reference's entry beside it: one file both clients read."""
    return {**state, **to_nvrx_state(timeouts)}


def overlay_learned(configured: Timeouts, loaded: Timeouts) -> Timeouts:
    """`configured` with every learned value of `loaded` laid over it, marks kept.

    Learned values win over configured ones (the next calculation averages with
    them). A learned section that is not in `configured` is dropped: the config
    decides which sections exist, the checkpoint only their timeouts.
    """
    sections = dict(configured.rank_section_timeouts)
    learned = set(configured.learned)
    changes: dict[str, Any] = {}
    for key in loaded.learned:
        if key.startswith(_SECTION_PREFIX):
            name = key[len(_SECTION_PREFIX) :]
            if name in sections:
                sections[name] = loaded.rank_section_timeouts.get(name)
                learned.add(key)
        elif key in (LEARNED_INITIAL_HB, LEARNED_HB, LEARNED_OUT_OF_SECTION):
            changes[key] = getattr(loaded, key)
            learned.add(key)
    return configured.with_updates(rank_section_timeouts=sections, learned=frozenset(learned), **changes)


# -- helpers ---------------------------------------------------------------------
def _duration(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= LEARNED_TIMEOUT_CEILING:
        raise StateDictError(f"ft state_dict {what} = {value!r:.100}: must be a number of seconds from 0 to "
                             f"{LEARNED_TIMEOUT_CEILING:g} (7 days), or null")
    return float(value)


def _check_learned(timeouts: Timeouts) -> None:
    """Every learned mark must name a timeout kind that has a value."""
    for key in sorted(timeouts.learned):
        if key.startswith(_SECTION_PREFIX):
            value = timeouts.rank_section_timeouts.get(key[len(_SECTION_PREFIX) :])
        elif key in (LEARNED_INITIAL_HB, LEARNED_HB, LEARNED_OUT_OF_SECTION):
            value = getattr(timeouts, key)
        else:
            raise StateDictError(
                f"ft state_dict timeouts.learned has {key!r}: expected {LEARNED_INITIAL_HB}, {LEARNED_HB}, "
                f"{LEARNED_OUT_OF_SECTION} or {_SECTION_PREFIX}<name>"
            )
        if value is None:
            raise StateDictError(f"ft state_dict timeouts.learned has {key!r}, but that timeout has no value")


def _mapping(value: Any, what: str, source: str = "ft") -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise StateDictError(f"{source} state_dict {what} = {value!r}: must be a dict")
    return value


def _observations(data: Any) -> Observations:
    data = _mapping(data, "observations")
    unknown = sorted(map(str, set(data) - set(_OBS_KEYS)))
    if unknown:
        raise StateDictError(
            f"ft state_dict observations has unknown key(s) {', '.join(unknown)}: expected only {', '.join(_OBS_KEYS)}"
        )
    sections = _mapping(data.get("sections") or {}, "observations.sections")
    return Observations(
        initial_hb=_duration(data.get("initial_hb"), "observations.initial_hb"),
        hb_gap=_duration(data.get("hb_gap"), "observations.hb_gap"),
        out_of_section=_duration(data.get("out_of_section"), "observations.out_of_section"),
        sections={str(k): _duration(v, f"observations.sections[{k!r}]") for k, v in sections.items()},
    )


def _from_nvrx(state: Mapping[str, Any]) -> LoadedState:
    """nvidia-resiliency-ext: {"current_timeouts": {"heartbeat": {...}, "section": {...}}};
    releases before sections had the heartbeat fields directly under "current_timeouts"."""
    extra = sorted(map(str, set(state) - {NVRX_STATE_KEY}))
    if extra:
        raise StateDictError(
            f"nvidia-resiliency-ext state_dict has unknown key(s) {', '.join(extra)}: expected only {NVRX_STATE_KEY}"
        )
    current = _mapping(state[NVRX_STATE_KEY], NVRX_STATE_KEY, _NVRX)
    if set(current) & {"initial", "subsequent", "were_calculated"}:
        current = {"heartbeat": current}
    unknown = sorted(map(str, set(current) - {"heartbeat", "section"}))
    if unknown:
        raise StateDictError(
            f"nvidia-resiliency-ext state_dict {NVRX_STATE_KEY} has unknown key(s) {', '.join(unknown)}: "
            "expected heartbeat, section"
        )
    changes: dict[str, Any] = {}
    learned: set[str] = set()
    try:
        for kind, convert in (("heartbeat", _nvrx_heartbeat), ("section", _nvrx_section)):
            if kind in current:
                changes.update(convert(_mapping(current[kind], f"{NVRX_STATE_KEY}.{kind}", _NVRX), learned))
    except TimeoutsError as e:
        raise StateDictError(f"nvidia-resiliency-ext state_dict: {e}") from e
    return LoadedState(timeouts=Timeouts(learned=frozenset(learned), **changes))


def _check_keys(data: Mapping[str, Any], allowed: tuple[str, ...], what: str) -> None:
    unknown = sorted(map(str, set(data) - set(allowed)))
    if unknown:
        raise StateDictError(
            f"nvidia-resiliency-ext state_dict {what} has unknown key(s) {', '.join(unknown)}: "
            f"expected {', '.join(allowed)}"
        )


def _nvrx_heartbeat(hb: Mapping[str, Any], learned: set[str]) -> dict[str, Any]:
    _check_keys(hb, ("initial", "subsequent", "were_calculated"), f"{NVRX_STATE_KEY}.heartbeat")
    initial = check_timeout(hb.get("initial"), "current_timeouts.heartbeat.initial")
    subsequent = check_timeout(hb.get("subsequent"), "current_timeouts.heartbeat.subsequent")
    if hb.get("were_calculated"):
        if initial is not None:
            learned.add(LEARNED_INITIAL_HB)
        if subsequent is not None:
            learned.add(LEARNED_HB)
    return {"initial_rank_heartbeat_timeout": initial, "rank_heartbeat_timeout": subsequent}


def _nvrx_section(sec: Mapping[str, Any], learned: set[str]) -> dict[str, Any]:
    what = f"{NVRX_STATE_KEY}.section"
    _check_keys(sec, ("section", "out_of_section", "calculated_sections", "is_out_of_section_calculated"), what)
    raw = _mapping(sec.get("section") or {}, f"{what}.section", _NVRX)
    sections = {str(k): check_timeout(v, f"{what}.section[{k!r}]") for k, v in raw.items()}
    calculated = sec.get("calculated_sections") or []
    if not isinstance(calculated, (list, tuple, set, frozenset)) or not all(isinstance(n, str) for n in calculated):
        raise StateDictError(
            f"nvidia-resiliency-ext state_dict {what}.calculated_sections = {calculated!r}: must be a list of names"
        )
    for name in calculated:
        if sections.get(name) is None:
            raise StateDictError(
                f"nvidia-resiliency-ext state_dict {what}.calculated_sections names {name!r}, "
                f"but {what}.section has no timeout for it"
            )
        learned.add(learned_section_key(name))
    oos = check_timeout(sec.get("out_of_section"), f"{what}.out_of_section")
    if sec.get("is_out_of_section_calculated") and oos is not None:
        learned.add(LEARNED_OUT_OF_SECTION)
    return {"rank_section_timeouts": sections, "rank_out_of_section_timeout": oos}
