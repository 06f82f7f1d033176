"""What a monitor answers to the launcher's roll call (DUMP_REPLY), checked field by field.

In a roll call (docs/hang-handling.md) the launcher asks each of its monitors
(DUMP_REQUEST) to dump its rank: a faulthandler stack dump, optionally native
stacks (py-spy), then the rank's Flight Recorder trace. The monitor answers with a
`MonitorSnapshot`: where each file is and which bytes of the stack dump file are
this dump (the file holds every dump of the process). Both sides build and read it
through `to_wire` / `from_wire`, so the keys are spelled once; `from_wire` raises
`SnapshotError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ft_client.errors import FtError

MAX_TEXT = 4096
MAX_NOTES = 16


class SnapshotError(FtError, ValueError):
    """A DUMP_REPLY whose fields do not follow the rules."""


STARTING = "starting"
"""The phase of a worker that has not connected to its monitor yet (dumped through the
start-up hook's faulthandler: it may wait in ``init_process_group`` or never get there)."""
FR_NOTE = "Flight Recorder:"
"""How the notes about the Flight Recorder trace start (the launcher picks them out)."""


@dataclass(frozen=True, slots=True)
class MonitorSnapshot:
    connected: bool
    """A rank was connected to the monitor when it was asked."""
    rank: int | None = None
    pid: int | None = None
    phase: str | None = None
    """The rank's session phase (active, hung, ...)."""
    alive: bool = False
    iteration: int | None = None
    """The rank's iteration now, as the monitor counts its steps."""
    stack_dump: str | None = None
    stack_from: int = 0
    stack_to: int = 0
    """Bytes [stack_from, stack_to) of ``stack_dump`` are this dump."""
    stack_captured: bool = False
    native_stack: str | None = None
    """py-spy's ``dump --native`` output file, when taken."""
    flight_recorder: str | None = None
    """The rank's Flight Recorder trace (torch's JSON), when it wrote one."""
    took_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    """What was skipped or did not come, and why."""

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> MonitorSnapshot:
        if not isinstance(data, Mapping):
            raise SnapshotError(f"dump reply must be a map, got {type(data).__name__}")
        unknown = sorted(map(str, set(data) - set(cls.__dataclass_fields__)))
        if unknown:
            raise SnapshotError(f"dump reply has unknown field(s) {', '.join(unknown)}")

        def flag(key: str) -> bool:
            v = data.get(key, False)
            if not isinstance(v, bool):
                raise SnapshotError(f"dump reply {key} = {v!r:.60}: must be true or false")
            return v

        def whole(key: str, optional: bool = True) -> int | None:
            v = data.get(key)
            if v is None and optional:
                return None
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise SnapshotError(f"dump reply {key} = {v!r:.60}: must be a whole number >= 0")
            return v

        def text(key: str) -> str | None:
            v = data.get(key)
            if v is None:
                return None
            if not isinstance(v, str) or len(v) > MAX_TEXT or "\0" in v:
                raise SnapshotError(f"dump reply {key} = {v!r:.60}: must be text of at most {MAX_TEXT} characters")
            return v

        notes = data.get("notes", [])
        if not isinstance(notes, list) or len(notes) > MAX_NOTES or not all(isinstance(n, str) for n in notes):
            raise SnapshotError(f"dump reply notes: must be a list of at most {MAX_NOTES} texts")
        took = data.get("took_s", 0.0)
        if isinstance(took, bool) or not isinstance(took, (int, float)) or not 0 <= took < 1e6:
            raise SnapshotError(f"dump reply took_s = {took!r:.60}: must be a number of seconds >= 0")
        return cls(
            connected=flag("connected"), rank=whole("rank"), pid=whole("pid"), phase=text("phase"),
            alive=flag("alive"), iteration=whole("iteration"), stack_dump=text("stack_dump"),
            stack_from=whole("stack_from", False) or 0, stack_to=whole("stack_to", False) or 0,
            stack_captured=flag("stack_captured"), native_stack=text("native_stack"),
            flight_recorder=text("flight_recorder"), took_s=float(took), notes=[n[:MAX_TEXT] for n in notes],
        )
