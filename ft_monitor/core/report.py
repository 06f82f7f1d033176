"""The hang report: what one hang was and what was done about it (JSON, versioned).

Written by the executor beside the stack dump (`rank<R>-pid<P>-hang.json`), read
by people, by the launcher's summary and by the benches. Its keys are spelled
here once; `to_wire` gives the JSON object, `from_wire` reads one back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from ft_client.errors import FtError

REPORT_VERSION = 1


class ReportError(FtError, ValueError):
    """A hang report that is not one this version wrote."""


@dataclass(frozen=True, slots=True)
class HangReport:
    version: int
    rank: int
    pid: int
    hostname: str
    reason: str
    message: str
    section: str | None
    elapsed_s: float
    timeout_s: float
    onset_time: float
    """Wall-clock seconds of the rank's last progress."""
    detected_time: float
    last_heartbeat_age_s: float | None
    open_sections: dict[str, float]
    """Open section -> seconds it had been open at detection."""
    iteration: int | None
    stack_dump: str | None
    stack_dump_captured: bool
    terminated_by: str | None
    """"launcher", the signal that ended the rank, "SIGKILL", or "already exited"; None while acting."""
    actions: tuple[str, ...]
    monitor_pid: int

    def to_wire(self) -> dict[str, Any]:
        out = asdict(self)
        out["actions"] = list(self.actions)
        return out

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> HangReport:
        if not isinstance(data, Mapping) or data.get("version") != REPORT_VERSION:
            raise ReportError(f"not a version {REPORT_VERSION} hang report")
        try:
            values = {f.name: data[f.name] for f in fields(cls)}
        except KeyError as e:
            raise ReportError(f"hang report has no field {e.args[0]!r}") from e
        values["actions"] = tuple(values["actions"])
        return cls(**values)
