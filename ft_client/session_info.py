"""What the monitor tells a rank at the handshake (HELLO_OK's session map).

The monitor's config reaches the client here: timeouts in force, how to dump a
stack, what to do when the monitor is lost. Both sides build and read it through
`SessionInfo.to_wire` / `from_wire`, so its keys are spelled once; a map a monitor
sent that breaks the rules raises `SessionInfoError` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ft_client.errors import RankMonitorClientError
from ft_client.timeouts import Timeouts, TimeoutsError


class SessionInfoError(RankMonitorClientError, ValueError):
    """The monitor's HELLO_OK session map does not follow the rules."""


@dataclass(frozen=True, slots=True)
class RecordInfo:
    """The progress record the monitor passed with HELLO_OK (ft_client.record)."""

    version: int
    size: int
    slots: int

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "size": self.size, "slots": self.slots}

    @classmethod
    def from_wire(cls, data: Any) -> RecordInfo | None:
        if data is None:
            return None
        if not isinstance(data, Mapping):
            raise SessionInfoError(f"session info record = {data!r:.60}: must be a map or null")
        return cls(_whole(data, "version", "record "), _whole(data, "size", "record "),
                   _whole(data, "slots", "record "))


@dataclass(frozen=True, slots=True)
class SessionInfo:
    rank: int
    pid: int
    session: int
    """How many rank sessions this monitor has started, this one included."""
    timeouts: Timeouts
    num_warmup_iterations: int
    stack_dump_signal: int
    stack_dump_path: str | None
    skip_section_response: bool
    on_monitor_lost: str
    on_hang: str
    """"kill", "dump", or "inprocess": the client opens a control connection for ABORT pushes."""
    client_request_timeout: float
    safety_factor: float
    min_learned_timeout: float
    record: RecordInfo | None = None
    """The progress record passed with this HELLO_OK (SCM_RIGHTS), or None: progress goes
    through the socket. A monitor that predates the record sends no key (None)."""
    flight_recorder: bool = False
    """The monitor may ask for the rank's Flight Recorder trace in a roll call (FR_DUMP on the
    control connection, which the client then opens whatever on_hang is). Absent from the
    map of a monitor that predates it: False."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "pid": self.pid,
            "session": self.session,
            "timeouts": self.timeouts.to_wire(),
            "num_warmup_iterations": self.num_warmup_iterations,
            "stack_dump_signal": self.stack_dump_signal,
            "stack_dump_path": self.stack_dump_path,
            "skip_section_response": self.skip_section_response,
            "on_monitor_lost": self.on_monitor_lost,
            "on_hang": self.on_hang,
            "client_request_timeout": self.client_request_timeout,
            "safety_factor": self.safety_factor,
            "min_learned_timeout": self.min_learned_timeout,
            "record": None if self.record is None else self.record.to_wire(),
            "flight_recorder": self.flight_recorder,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> SessionInfo:
        if not isinstance(data, Mapping):
            raise SessionInfoError(f"session info must be a map, got {type(data).__name__}")
        raw = data.get("timeouts")
        if not isinstance(raw, Mapping):
            raise SessionInfoError(f"session info timeouts = {raw!r:.60}: must be a map")
        try:
            timeouts = Timeouts.from_wire(raw)
        except TimeoutsError as e:
            raise SessionInfoError(f"monitor sent invalid timeouts: {e}") from e
        path = data.get("stack_dump_path")
        if path is not None and (not isinstance(path, str) or not path):
            raise SessionInfoError(f"session info stack_dump_path = {path!r:.60}: must be a path or null")
        lost = data.get("on_monitor_lost")
        if lost not in ("warn", "raise"):
            raise SessionInfoError(f"session info on_monitor_lost = {lost!r:.60}: must be 'warn' or 'raise'")
        on_hang = data.get("on_hang")
        if on_hang not in ("kill", "inprocess", "dump"):
            raise SessionInfoError(f"session info on_hang = {on_hang!r:.60}: must be 'kill', 'inprocess' or 'dump'")
        flight_recorder = data.get("flight_recorder", False)
        if not isinstance(flight_recorder, bool):
            raise SessionInfoError(f"session info flight_recorder = {flight_recorder!r:.60}: must be true or false")
        skip = data.get("skip_section_response")
        if not isinstance(skip, bool):
            raise SessionInfoError(f"session info skip_section_response = {skip!r:.60}: must be true or false")
        return cls(
            rank=_whole(data, "rank"),
            pid=_whole(data, "pid"),
            session=_whole(data, "session"),
            timeouts=timeouts,
            num_warmup_iterations=_whole(data, "num_warmup_iterations"),
            stack_dump_signal=_whole(data, "stack_dump_signal"),
            stack_dump_path=path,
            skip_section_response=skip,
            on_monitor_lost=lost,
            on_hang=on_hang,
            client_request_timeout=_positive(data, "client_request_timeout"),
            safety_factor=_positive(data, "safety_factor"),
            min_learned_timeout=_positive(data, "min_learned_timeout", zero_ok=True),
            record=RecordInfo.from_wire(data.get("record")),
            flight_recorder=flight_recorder,
        )


def _whole(data: Mapping[str, Any], key: str, prefix: str = "") -> int:
    v = data.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise SessionInfoError(f"session info {prefix}{key} = {v!r:.60}: must be a whole number >= 0")
    return v


def _positive(data: Mapping[str, Any], key: str, *, zero_ok: bool = False) -> float:
    v = data.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > 0 or (zero_ok and v == 0)):
        return float(v)
    rule = ">= 0" if zero_ok else "> 0"
    raise SessionInfoError(f"session info {key} = {v!r:.60}: must be a finite number {rule}")
