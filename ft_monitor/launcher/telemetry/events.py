"""ft-launcher's event stream: one JSON object per line in ``events.jsonl``, with a versioned schema.

Every line has the envelope ``{"v": 1, "seq": N, "time": <wall seconds>, "kind": K,
"host": H, "launcher_pid": P}`` and the fields of its kind (`SCHEMA`; docs/observability.md
has the table). ``seq`` counts from 0 per launcher, so a reader sees the order even
when two events share a timestamp. A new field may be added to a kind without a
new version; removing or retyping one bumps `SCHEMA_VERSION`.

`EventLog` writes the lines (one ``write`` each, O_APPEND, never following a
symlink); until it knows the run's log directory (torch creates it when the first
workers start) it keeps them in memory. `validate_event` checks one object
against the schema (the tests and ``ft-monitor report`` use it). This module has
no torch and no clock of its own: the caller passes ``time``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from pathlib import Path
from typing import Any

from ft_client.errors import FtError
from ft_client.inprocess.timeline import PHASES as INPROCESS_PHASES
from ft_client.safefiles import open_append

log = logging.getLogger("ft_monitor.launcher")

SCHEMA_VERSION = 1
EVENTS_FILE = "events.jsonl"
MAX_PENDING = 10_000
"""Events kept in memory before the log directory is known; older ones are dropped (counted)."""

NUM = (int, float)
OPT_NUM = (int, float, type(None))
OPT_INT = (int, type(None))
OPT_STR = (str, type(None))
OPT_MAP = (dict, type(None))

ENVELOPE: dict[str, tuple[type, ...]] = {"v": (int,), "seq": (int,), "time": NUM, "kind": (str,), "host": (str,),
                                         "launcher_pid": (int,)}

LOG_FOLDER_FILE = "log-folder"
"""In the launcher's private folder (its monitors' sockets): the run's log folder, where
events.jsonl is (`ft-launcher status LOG_FOLDER` finds the launcher by it)."""

SCHEMA: dict[str, dict[str, tuple[type, ...]]] = {
    "launcher_start": {"nproc_per_node": (int,), "max_restarts": (int,), "metrics_url": OPT_STR,
                       "metrics_textfile": OPT_STR},
    "attempt_start": {"attempt": (int,), "run_id": (str,), "node_rank": OPT_INT, "ranks": (dict,),
                      "log_dir": OPT_STR},
    "hang": {"attempt": (int,), "rank": (int,), "local_rank": OPT_INT, "pid": OPT_INT, "reason": (str,),
             "section": OPT_STR, "message": (str,), "elapsed_s": NUM, "timeout_s": NUM, "onset_time": NUM,
             "detected_time": NUM, "iteration": OPT_INT, "action": (str,), "report": OPT_STR,
             "stack_dump": OPT_STR, "error_file": OPT_STR, "victim_of": OPT_INT},
    "diagnosis": {"attempt": (int,), "rank": (int,), "action": (str,), "path": (str,), "verdict": (str,),
                  "basis": (str,), "behind": (list,), "roll_call_s": NUM},
    "kill": {"attempt": (int,), "cause": (str,), "signal": (str,), "grace_s": NUM, "began": NUM, "ended": NUM,
             "duration_s": NUM},
    "attempt_end": {"attempt": (int,), "state": (str,), "failures": (list,), "iteration": OPT_INT},
    "restart": {"mode": (str,), "cause": (str,), "attempt": (int,), "rank": OPT_INT, "phases": (dict,),
                "lost_s": OPT_NUM, "redone_iterations": OPT_INT},
    "timeouts": {"rank": (int,), "timeouts": (dict,), "learned": (list,), "changed": (list,)},
    "workload_request": {"rank": (int,), "action": (str,), "reason": (str,)},
    "exclusion": {"rank": (int,), "reason": (str,)},
    "slow_rank": {"rank": (int,), "section": (str,), "median_s": NUM, "others_median_s": NUM, "ratio": NUM,
                  "threshold": NUM},
    "slow_rank_cleared": {"rank": (int,), "section": (str,), "median_s": NUM, "others_median_s": NUM,
                          "ratio": NUM, "threshold": NUM},
    "progress": {"attempt": (int,), "ranks": (dict,)},
    "stats": {"ranks": (dict,), "goodput": OPT_NUM, "productive_s": OPT_NUM, "wall_s": NUM, "lost_s": NUM},
    "job_end": {"exit_code": (int,), "outcome": (str,), "hangs": (int,), "restarts": (dict,),
                "goodput": OPT_NUM, "productive_s": OPT_NUM, "wall_s": NUM, "lost_s": NUM},
    "torchelastic_event": {"name": (str,), "source": (str,), "timestamp": OPT_NUM, "metadata": (dict,)},
    "torchelastic_metrics": {"metrics": (dict,)},
}
"""Fields of each kind (besides the envelope) and their JSON types; ``None`` allowed where listed."""

RESTART_PHASES: dict[str, tuple[str, ...]] = {
    "process": ("notify", "to_stop", "stop", "rendezvous", "worker_start", "first_step"),
    "inprocess": tuple(name for name, _ in INPROCESS_PHASES),
}
"""The phases of a `restart` event by its ``mode``, in order (besides ``total``): the process
restart's are restarts.RestartTiming's, the in-process restart's ft_client.inprocess.timeline's."""

MAX_MAGNITUDE = 1e15
"""Numbers beyond this (either sign) are refused: wall times are near 1.7e9 s, durations,
counts and pids far below; a reader doing arithmetic on a time never overflows."""
MAX_DEPTH = 8
"""Nesting of an event's maps and lists (the deepest the launcher writes is 4)."""


class EventSchemaError(FtError, ValueError):
    """An event line that does not follow the schema."""


def validate_event(obj: Any) -> dict[str, Any]:
    """``obj`` if it is a version-`SCHEMA_VERSION` event of a known kind with every field of
    its kind, each of the right type; raises EventSchemaError naming what is wrong."""
    if not isinstance(obj, dict):
        raise EventSchemaError(f"an event is a JSON object, not {type(obj).__name__}")
    kind = obj.get("kind")
    if not isinstance(kind, str) or kind not in SCHEMA:
        raise EventSchemaError(f"unknown event kind {kind!r:.80} (known: {', '.join(SCHEMA)})")
    if obj.get("v") != SCHEMA_VERSION:
        raise EventSchemaError(f"{kind} event of version {obj.get('v')!r:.80}; this reader knows {SCHEMA_VERSION}")
    for name, types in {**ENVELOPE, **SCHEMA[kind]}.items():
        if name not in obj:
            raise EventSchemaError(f"{kind} event without its field {name!r}")
        value = obj[name]
        if isinstance(value, bool) and bool not in types:
            raise EventSchemaError(f"{kind} event field {name!r} = {value!r:.80} is a boolean")
        if not isinstance(value, types):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise EventSchemaError(f"{kind} event field {name!r} = {value!r:.80}: must be {want}")
    for name, value in obj.items():
        _check_value(kind, name, value, 0)
    for (field, checker) in NESTED.get(kind, ()):
        checker(kind, field, obj[field])
    return obj


def _check_value(kind: str, name: str, value: Any, depth: int) -> None:
    """Every number finite and within MAX_MAGNITUDE, every key a string, nesting bounded."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise EventSchemaError(f"{kind} event field {name!r} holds {value!r}: numbers must be finite")
        if abs(value) > MAX_MAGNITUDE:
            shown = f"{value:.3g}" if isinstance(value, float) else f"an integer of {value.bit_length()} bits"
            raise EventSchemaError(f"{kind} event field {name!r} holds {shown}: numbers must be within "
                                   f"{MAX_MAGNITUDE:g}")
        return
    if depth >= MAX_DEPTH:
        raise EventSchemaError(f"{kind} event field {name!r} is nested deeper than {MAX_DEPTH}")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise EventSchemaError(f"{kind} event field {name!r} has a key that is not a string")
            _check_value(kind, name, v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_value(kind, name, v, depth + 1)
    else:
        raise EventSchemaError(f"{kind} event field {name!r} holds a {type(value).__name__}")


def _typed(kind: str, where: str, value: Any, types: tuple[type, ...]) -> None:
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise EventSchemaError(f"{kind} event {where} = {value!r:.80}: must be {want}")


def _map_of(kind: str, name: str, value: dict[str, Any], fields: dict[str, tuple[type, ...]],
            rank_keys: bool) -> None:
    """``value``: {key: {field: typed value}} (the fields listed are optional; others pass)."""
    for key, entry in value.items():
        if rank_keys and not (key.isascii() and key.isdecimal() and len(key) <= 10):
            raise EventSchemaError(f"{kind} event field {name!r} has key {key!r:.40}: must be a rank number")
        _typed(kind, f"{name}[{key!r:.40}]", entry, (dict,))
        for f, types in fields.items():
            if f in entry:
                _typed(kind, f"{name}[{key!r:.40}][{f!r}]", entry[f], types)


def _phases(kind: str, name: str, value: dict[str, Any]) -> None:
    for key, v in value.items():
        _typed(kind, f"{name}[{key!r:.40}]", v, OPT_NUM)


def _stats_ranks(kind: str, name: str, value: dict[str, Any]) -> None:
    _map_of(kind, name, value, {"local_rank": OPT_INT, "iteration": OPT_INT, "sections": (dict,)}, True)
    for key, entry in value.items():
        _map_of(kind, f"{name}[{key!r:.40}]['sections']", entry.get("sections", {}),
                {"count": OPT_INT, "sum_s": OPT_NUM, "median_s": OPT_NUM}, False)


def _attempt_ranks(kind: str, name: str, value: dict[str, Any]) -> None:
    _map_of(kind, name, value, {"local_rank": OPT_INT, "pid": OPT_INT}, True)


def _progress_ranks(kind: str, name: str, value: dict[str, Any]) -> None:
    _map_of(kind, name, value, {"local_rank": OPT_INT, "iteration": OPT_INT, "last_progress": OPT_NUM}, True)


NESTED: dict[str, tuple[tuple[str, Any], ...]] = {
    "restart": (("phases", _phases),),
    "stats": (("ranks", _stats_ranks),),
    "attempt_start": (("ranks", _attempt_ranks),),
    "progress": (("ranks", _progress_ranks),),
}
"""The inner shape of the fields that readers (``ft-monitor report``) look into."""


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event of an events.jsonl file, validated, in file order."""
    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                out.append(validate_event(json.loads(raw.decode("utf-8"))))
            except (ValueError, RecursionError, EventSchemaError) as e:  # RecursionError: "[[[[..." too deep
                raise EventSchemaError(f"{path}:{n}: {type(e).__name__ if isinstance(e, RecursionError) else ''}"
                                       f"{e}") from e
    return out


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: such numbers become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class EventLog:
    """Appends events to ``<dir>/events.jsonl`` once `attach` names the directory."""

    def __init__(self, host: str, pid: int | None = None) -> None:
        self.host = host
        self.pid = os.getpid() if pid is None else pid
        self.path: Path | None = None
        self._fd: int | None = None
        self._pending: list[bytes] = []
        self._dropped = 0
        self._seq = 0
        self._lock = threading.Lock()
        self._failed = False

    def emit(self, kind: str, time: float, /, **fields: Any) -> dict[str, Any]:
        """Write one event (or keep it until `attach`); returns it. A write error is logged
        once, never raised: the job goes on without its event file."""
        if kind not in SCHEMA:
            raise EventSchemaError(f"unknown event kind {kind!r}")
        clash = set(fields) & set(ENVELOPE)
        if clash:
            raise EventSchemaError(f"{kind} event fields {sorted(clash)} would overwrite the envelope")
        with self._lock:
            event = {"v": SCHEMA_VERSION, "seq": self._seq, "time": time, "kind": kind, "host": self.host,
                     "launcher_pid": self.pid, **_finite(fields)}
            self._seq += 1
            line = (json.dumps(event, separators=(",", ":"), default=str) + "\n").encode()
            if self._fd is None:
                if self.path is None and not self._failed:
                    self._pending.append(line)
                    if len(self._pending) > MAX_PENDING:
                        self._pending.pop(0)
                        self._dropped += 1
            else:
                self._write(line)
        return event

    def attach(self, directory: str | os.PathLike[str]) -> Path | None:
        """Start writing to ``directory``/events.jsonl (the events so far first); the first call wins."""
        with self._lock:
            if self.path is not None or self._failed:
                return self.path
            path = Path(directory) / EVENTS_FILE
            try:
                self._fd = open_append(path)
            except OSError as e:
                self._failed = True
                self._pending.clear()
                log.error("ft-launcher: cannot write events to %s: %s; events are not recorded", path, e)
                return None
            self.path = path
            if self._dropped:
                log.warning("ft-launcher: %d early event(s) were dropped before %s existed", self._dropped, path)
            pending, self._pending = self._pending, []
            for line in pending:
                self._write(line)
            return path

    def _write(self, line: bytes) -> None:
        assert self._fd is not None
        try:
            os.write(self._fd, line)
        except OSError as e:
            if not self._failed:
                log.error("ft-launcher: cannot append to %s: %s; later events may be missing", self.path, e)
            self._failed = True

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

