"""Typed messages between the daemon and the launcher, checked field by field at the edge.

`HangNotice` is what a monitor tells its launcher on a hang (HANG_NOTICE). Both
sides build and read it through `to_wire` / `from_wire`, so its keys are spelled
once and a peer cannot slip a wrong type past the reader: `from_wire` raises
`NoticeError` naming the field, the value and the rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from ft_client.errors import FtError

MAX_TEXT = 4096
MAX_INT = 2**63 - 1


class NoticeError(FtError, ValueError):
    """A notice whose fields do not follow the rules."""


def _int(data: Mapping[str, Any], key: str, *, optional: bool = False, low: int = 0) -> int | None:
    v = data.get(key)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= MAX_INT:
        raise NoticeError(f"hang notice {key} = {v!r:.60}: must be a whole number >= {low}")
    return v


def _float(data: Mapping[str, Any], key: str) -> float:
    v = data.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise NoticeError(f"hang notice {key} = {v!r:.60}: must be a finite number >= 0")
    return float(v)


def _text(data: Mapping[str, Any], key: str, *, optional: bool = False) -> str | None:
    v = data.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str) or len(v) > MAX_TEXT or "\0" in v:
        raise NoticeError(f"hang notice {key} = {v!r:.60}: must be text of at most {MAX_TEXT} characters")
    return v


@dataclass(frozen=True, slots=True)
class HangNotice:
    rank: int
    pid: int
    reason: str
    section: str | None
    message: str
    elapsed_s: float
    timeout_s: float
    onset_time: float
    """Wall-clock seconds of the hung rank's last progress."""
    detected_time: float
    iteration: int | None
    report: str
    stack_dump: str | None
    stack_dump_captured: bool
    error_file: str | None
    action: str = "kill"
    """"kill": the launcher stops and restarts the worker group (ACK hands it over);
    "inprocess": the ranks restart in their own processes, the launcher only records it;
    "dump" (``on_hang: dump``): the launcher diagnoses the job (the roll call) and stops nothing."""
    restart_iteration: int | None = None
    """With "inprocess": the Wrapper iteration the ranks restart as (their REENTERED says it too)."""

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> HangNotice:
        if not isinstance(data, Mapping):
            raise NoticeError(f"hang notice must be a map, got {type(data).__name__}")
        unknown = sorted(map(str, set(data) - {f.name for f in fields(cls)}))
        if unknown:
            raise NoticeError(f"hang notice has unknown field(s) {', '.join(unknown)}")
        action = data.get("action", "kill")
        if action not in ("kill", "inprocess", "dump"):
            raise NoticeError(f"hang notice action = {action!r:.60}: must be 'kill', 'inprocess' or 'dump'")
        captured = data.get("stack_dump_captured")
        if not isinstance(captured, bool):
            raise NoticeError(f"hang notice stack_dump_captured = {captured!r:.60}: must be true or false")
        return cls(
            rank=_int(data, "rank"),  # type: ignore[arg-type]
            pid=_int(data, "pid", low=1),  # type: ignore[arg-type]
            reason=_text(data, "reason"),  # type: ignore[arg-type]
            section=_text(data, "section", optional=True),
            message=_text(data, "message"),  # type: ignore[arg-type]
            elapsed_s=_float(data, "elapsed_s"),
            timeout_s=_float(data, "timeout_s"),
            onset_time=_float(data, "onset_time"),
            detected_time=_float(data, "detected_time"),
            iteration=_int(data, "iteration", optional=True),
            report=_text(data, "report"),  # type: ignore[arg-type]
            stack_dump=_text(data, "stack_dump", optional=True),
            stack_dump_captured=captured,
            error_file=_text(data, "error_file", optional=True),
            action=action,
            restart_iteration=_int(data, "restart_iteration", optional=True, low=1),
        )
