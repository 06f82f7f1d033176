"""Timeout value types shared by client and daemon (pure: no I/O, no clock).

`Timeouts` is the full set of timeouts a daemon enforces for one rank, with a
record of which values were learned from observation rather than configured.
It crosses the wire as a plain map (`to_wire` / `from_wire`), in the HELLO_OK
reply and in UPDATE_CONFIG / CONFIG_OK.

`HeartbeatTimeouts` and `SectionTimeouts` are the views the client exposes as
``client.hb_timeouts`` / ``client.section_timeouts``; their names and fields
follow nvidia-resiliency-ext so code written for it keeps working.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ft_client.errors import FtError
from ft_client.names import section_name_problem

STEP_SECTION = "step"
WARMUP_SECTION = "warmup"
"""A `warmup` entry in rank_section_timeouts replaces the `step` timeout for the
first `num_warmup_iterations` step sections; it is not a section of its own."""

# Keys of `Timeouts.learned` for the non-section timeouts; sections use "section:<name>".
LEARNED_INITIAL_HB = "initial_rank_heartbeat_timeout"
LEARNED_HB = "rank_heartbeat_timeout"
LEARNED_OUT_OF_SECTION = "rank_out_of_section_timeout"
_SECTION_PREFIX = "section:"


def learned_section_key(name: str) -> str:
    return _SECTION_PREFIX + name


MAX_SECTIONS = 256
"""Configured sections at most (the timeouts map must fit in one 64 KiB frame)."""
MAX_WIRE_BYTES = 24 * 1024
"""The timeouts map, encoded, at most: it travels inside HELLO_OK, CONFIG_OK and
STATUS_REPLY, which must stay under the 64 KiB frame cap with everything else."""


class TimeoutsError(FtError, ValueError):
    """A timeouts map that does not follow the rules (bad type or value)."""


def check_timeout(value: Any, what: str) -> float | None:
    """Validate one timeout: a finite number > 0 (seconds), or None for off."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TimeoutsError(f"{what} = {value!r}: must be a number of seconds > 0, or null to disable")
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float (a 401-digit number)
        seconds = math.inf
    if not math.isfinite(seconds) or seconds <= 0:
        raise TimeoutsError(f"{what} = {value!r:.100}: must be a number of seconds > 0, or null to disable")
    return seconds


@dataclass(frozen=True)
class HeartbeatTimeouts:
    """Initial and subsequent heartbeat timeouts (None: off), and whether they were learned."""

    initial: float | None = None
    subsequent: float | None = None
    were_calculated: bool = False

    @property
    def are_valid(self) -> bool:
        """Both timeouts are set."""
        return self.initial is not None and self.subsequent is not None


@dataclass(frozen=True)
class SectionTimeouts:
    """Section and out-of-section timeouts (None: off), and which of them were learned.

    ``calculated_sections`` may be given as any collection of names; it is kept as a frozenset.
    """

    section: Mapping[str, float | None] = field(default_factory=dict)
    out_of_section: float | None = None
    calculated_sections: frozenset[str] = frozenset()
    is_out_of_section_calculated: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "calculated_sections", frozenset(self.calculated_sections))

    @property
    def were_calculated(self) -> bool:
        """Every section timeout and the out-of-section timeout were learned."""
        return self.calculated_sections == frozenset(self.section) and self.is_out_of_section_calculated

    @property
    def are_valid(self) -> bool:
        """Every section timeout and the out-of-section timeout are set."""
        return all(v is not None for v in self.section.values()) and self.out_of_section is not None


@dataclass(frozen=True)
class Timeouts:
    """Every timeout in force for one rank. None means off."""

    initial_rank_heartbeat_timeout: float | None = None
    rank_heartbeat_timeout: float | None = None
    rank_section_timeouts: Mapping[str, float | None] = field(default_factory=dict)
    rank_out_of_section_timeout: float | None = None
    learned: frozenset[str] = frozenset()

    # -- views ---------------------------------------------------------------
    @property
    def hb(self) -> HeartbeatTimeouts:
        return HeartbeatTimeouts(
            initial=self.initial_rank_heartbeat_timeout,
            subsequent=self.rank_heartbeat_timeout,
            were_calculated=LEARNED_HB in self.learned or LEARNED_INITIAL_HB in self.learned,
        )

    @property
    def sections(self) -> SectionTimeouts:
        return SectionTimeouts(
            section=dict(self.rank_section_timeouts),
            out_of_section=self.rank_out_of_section_timeout,
            calculated_sections=frozenset(
                k[len(_SECTION_PREFIX) :] for k in self.learned if k.startswith(_SECTION_PREFIX)
            ),
            is_out_of_section_calculated=LEARNED_OUT_OF_SECTION in self.learned,
        )

    def with_updates(self, **changes: Any) -> Timeouts:
        return replace(self, **changes)

    @classmethod
    def from_config(cls, config: Any) -> Timeouts:
        """The timeouts a config (anything with the four timeout settings) puts in force."""
        return cls(
            initial_rank_heartbeat_timeout=config.initial_rank_heartbeat_timeout,
            rank_heartbeat_timeout=config.rank_heartbeat_timeout,
            rank_section_timeouts=dict(config.rank_section_timeouts),
            rank_out_of_section_timeout=config.rank_out_of_section_timeout,
        )

    def describe(self) -> str:
        """The timeouts as ``name=2.0s`` pairs for a person: each section's, then ``heartbeat``,
        ``initial_heartbeat`` and ``out_of_section`` (``off`` where not set), e.g.
        ``step=2.0s ckpt=120.0s heartbeat=60.0s initial_heartbeat=120.0s out_of_section=off``.
        A section name that does not print is shown as its repr."""
        pairs = [(name if name.isprintable() else repr(name), value)
                 for name, value in self.rank_section_timeouts.items()]
        pairs += [("heartbeat", self.rank_heartbeat_timeout),
                  ("initial_heartbeat", self.initial_rank_heartbeat_timeout),
                  ("out_of_section", self.rank_out_of_section_timeout)]
        return " ".join(f"{name}={_seconds(value)}" for name, value in pairs)

    # -- wire form -----------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        return {
            "initial_rank_heartbeat_timeout": self.initial_rank_heartbeat_timeout,
            "rank_heartbeat_timeout": self.rank_heartbeat_timeout,
            "rank_section_timeouts": dict(self.rank_section_timeouts),
            "rank_out_of_section_timeout": self.rank_out_of_section_timeout,
            "learned": sorted(self.learned),
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Timeouts:
        """Build from the wire map; raises TimeoutsError naming the bad entry."""
        known = {
            "initial_rank_heartbeat_timeout",
            "rank_heartbeat_timeout",
            "rank_section_timeouts",
            "rank_out_of_section_timeout",
            "learned",
        }
        unknown = set(data) - known
        if unknown:
            raise TimeoutsError(f"unknown timeout field(s): {', '.join(sorted(map(str, unknown)))}")
        sections = data.get("rank_section_timeouts") or {}
        if not isinstance(sections, Mapping):
            raise TimeoutsError(
                f"rank_section_timeouts = {sections!r}: must be a map of section name to seconds or null"
            )
        if len(sections) > MAX_SECTIONS:
            raise TimeoutsError(f"rank_section_timeouts has {len(sections)} sections; at most {MAX_SECTIONS}")
        checked: dict[str, float | None] = {}
        for name, value in sections.items():
            problem = section_name_problem(name)
            if problem is not None:
                raise TimeoutsError(f"rank_section_timeouts key {str(name)[:40]!r}: {problem}")
            checked[name] = check_timeout(value, f"rank_section_timeouts[{name!r}]")
        learned = data.get("learned") or []
        if not isinstance(learned, (list, tuple, set, frozenset)) or not all(isinstance(x, str) for x in learned):
            raise TimeoutsError(f"learned = {learned!r}: must be a list of strings")
        timeouts = cls(
            initial_rank_heartbeat_timeout=check_timeout(
                data.get("initial_rank_heartbeat_timeout"), "initial_rank_heartbeat_timeout"
            ),
            rank_heartbeat_timeout=check_timeout(data.get("rank_heartbeat_timeout"), "rank_heartbeat_timeout"),
            rank_section_timeouts=checked,
            rank_out_of_section_timeout=check_timeout(
                data.get("rank_out_of_section_timeout"), "rank_out_of_section_timeout"
            ),
            learned=frozenset(learned),
        )
        check_wire_size(timeouts)
        return timeouts


def _seconds(value: float | None) -> str:
    """``2.0s``, ``0.25s``, ``off``."""
    if value is None:
        return "off"
    return f"{value:.1f}s" if value == round(value, 1) else f"{value:g}s"


def check_wire_size(timeouts: Timeouts) -> None:
    """Raise TimeoutsError when the timeouts map is too large to travel in a frame."""
    import msgpack

    size = len(msgpack.packb(timeouts.to_wire(), use_bin_type=True))
    if size > MAX_WIRE_BYTES:
        raise TimeoutsError(f"the timeouts map takes {size} bytes encoded; at most {MAX_WIRE_BYTES} "
                            "(fewer or shorter section names)")


def section_needs_ipc(name: str, timeouts: Timeouts) -> bool:
    """Whether the daemon must hear about section ``name`` opening and closing.

    A section the daemon cannot act on costs no IPC: one not listed in
    rank_section_timeouts at all (as in nvidia-resiliency-ext). A listed section
    is sent when its timeout (or, for `step`, the warm-up timeout) is set, or
    when the out-of-section timeout is set, since an open section pauses it.
    """
    sections = timeouts.rank_section_timeouts
    if name not in sections:
        return False
    if sections[name] is not None or timeouts.rank_out_of_section_timeout is not None:
        return True
    return name == STEP_SECTION and sections.get(WARMUP_SECTION) is not None
