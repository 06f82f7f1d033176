"""Typed, validated settings: what the daemon runs from, and what the launcher hands it.

`ft-monitor serve` and `ft-launcher` validate the user's config with pydantic
(ft_monitor.config: YAML, FT_<FIELD>, --ft-<field>, every rule with the layer a
value came from). The daemon itself never imports pydantic or yaml (they would
double its memory: DESIGN's 30 MB target), so the validated result is handed to
it as JSON and read back into the types here:

* `Settings`: a frozen dataclass with one typed field per FaultToleranceConfig
  field, same names and defaults, so the daemon reads ``config.<field>`` as
  before. It is checked again on the way in (``Settings(...)``, `from_dict`,
  `from_json`): a bad value raises SettingsError naming the field, the value
  and the rule, as config.py's errors do. Its JSON form is exactly
  ``FaultToleranceConfig.model_dump(mode="json")``.
* `ServeSpec`: everything a validated ``serve`` runs from (the settings, the
  socket, the loop, ``-- CMD``, the log file, the launcher socket). The
  ``--check-serve`` helper prints one; ft-launcher writes one per daemon to
  ``<run>/monitor<L>.json``; ``--run-checked`` reads it back (`to_json` /
  `from_json`).

tests/test_settings.py checks that the fields, types and defaults here match
FaultToleranceConfig's.
"""

from __future__ import annotations

import json
import logging
import math
import reprlib
import signal
import types
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from ft_client.errors import FtError
from ft_client.timeouts import (
    MAX_SECTION_NAME_BYTES,
    MAX_SECTIONS,
    Timeouts,
    TimeoutsError,
    check_timeout,
    check_wire_size,
)

MAX_WHOLE = 2**63 - 1
"""Whole-number settings travel in msgpack as signed 64-bit integers."""
FAULTHANDLER_RESERVED = frozenset({signal.SIGSEGV, signal.SIGFPE, signal.SIGABRT, signal.SIGBUS, signal.SIGILL})
"""Signals faulthandler keeps for crashes: it cannot register them to dump on request."""
LOOPS = ("auto", "asyncio", "uvloop")


class SettingsError(FtError, ValueError):
    """A setting that breaks a rule. The message is meant for the user, as is."""


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 120
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = _REPR.maxset = 8
_REPR.maxlevel = 2


def _shown(value: Any) -> str:
    """repr() of a value for an error line, bounded in size and depth (as config.shown)."""
    return _REPR.repr(value)


# -- rules, on the JSON form of each value (the text forms are config.py's job) --------------
# Each takes a value and returns it in its field's type, or raises ValueError(rule).
# The rule texts are config.py's.

_TIMEOUT_RULE = "must be a number of seconds > 0, or null to disable"
_WHOLE_RULE = f"must be a whole number >= 0 and <= {MAX_WHOLE}"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _timeout(v: Any) -> float | None:
    try:
        return check_timeout(v, "value")
    except ValueError as e:
        raise ValueError(_TIMEOUT_RULE) from e


def _section_timeouts(v: Any) -> Mapping[str, float | None]:
    if not isinstance(v, Mapping):
        raise ValueError("must be a map of section name to seconds or null (CLI form: step:30,ckpt:none)")
    if len(v) > MAX_SECTIONS:
        raise ValueError(f"has {len(v)} sections; at most {MAX_SECTIONS}")
    out: dict[str, float | None] = {}
    for name, value in v.items():
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise ValueError(f"section name {_shown(name)} must be a non-empty string without surrounding blanks")
        if len(name.encode("utf-8", "replace")) > MAX_SECTION_NAME_BYTES:
            raise ValueError(f"section name {name[:40]!r}... is longer than {MAX_SECTION_NAME_BYTES} bytes")
        try:
            out[name] = check_timeout(value, name)
        except ValueError as e:
            raise ValueError(f"section {_shown(name)} = {_shown(value)}: {_TIMEOUT_RULE}") from e
    return types.MappingProxyType(out)


def _whole(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_WHOLE:
        raise ValueError(_WHOLE_RULE)
    return v


def _connections(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 65536:
        raise ValueError("must be a whole number from 1 to 65536 (connections besides the rank's)")
    return v


def _number(bound: float, inclusive: bool, rule: str) -> Callable[[Any], float]:
    def check(v: Any) -> float:
        if not _is_number(v) or v < bound or (v == bound and not inclusive):
            raise ValueError(rule)
        return float(v)

    return check


def _signal(v: Any) -> signal.Signals:
    try:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(v)
        sig = signal.Signals(v)
    except ValueError as e:
        raise ValueError("must be a signal number, e.g. 15 for SIGTERM") from e
    if sig in (signal.SIGSTOP, signal.SIGCONT):
        raise ValueError(f"{sig.name} cannot be used here")
    return sig


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("must be true or false")
    return v


def _log_level(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_WHOLE:
        raise ValueError("must be a logging level number (DEBUG 10, INFO 20, ...)")
    return v


def _on_monitor_lost(v: Any) -> str:
    if v not in ("warn", "raise"):
        raise ValueError("must be 'warn' (log once, keep training) or 'raise'")
    return v  # type: ignore[no-any-return]


def _on_hang(v: Any) -> str:
    if v not in ("kill", "inprocess"):
        raise ValueError("must be 'kill' or 'inprocess'")
    return str(v)


def _report_dir(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v.startswith("/"):
        raise ValueError("must be an absolute directory path, or null")
    return v


_DURATION = _number(0.0, True, "must be a number of seconds >= 0")
_POSITIVE = _number(0.0, False, "must be a number of seconds > 0")


def _setting(default: Any, rule: Callable[[Any], Any]) -> Any:
    """A field with its default and the rule that checks (and types) its value."""
    if isinstance(default, dict):
        return field(default_factory=lambda: types.MappingProxyType(dict(default)), metadata={"rule": rule})
    return field(default=default, metadata={"rule": rule})


@dataclass(frozen=True, init=False)
class Settings:
    """Every setting of the daemon and the launcher, typed and checked (see docs/configuration.md).

    Field names, types and defaults are FaultToleranceConfig's. Timeouts are in
    seconds; None turns one off. Construct from the JSON form
    (``Settings({"rank_heartbeat_timeout": 30.0, ...})``, as
    ``FaultToleranceConfig.model_dump(mode="json")`` writes it) and/or keyword
    arguments, typed or in JSON form (an int signal number or a
    ``signal.Signals``, an int number of seconds or a float). A field not given
    takes its default; an unknown field or a bad value raises SettingsError.
    """

    initial_rank_heartbeat_timeout: float | None = _setting(None, _timeout)
    rank_heartbeat_timeout: float | None = _setting(None, _timeout)
    rank_section_timeouts: Mapping[str, float | None] = _setting({}, _section_timeouts)
    rank_out_of_section_timeout: float | None = _setting(None, _timeout)
    num_warmup_iterations: int = _setting(5, _whole)
    safety_factor: float = _setting(5.0, _number(1.0, True, "must be a number >= 1.0 (a factor below 1 makes "
                                                             "timeouts shorter than observed)"))
    min_learned_timeout: float = _setting(5.0, _DURATION)
    rank_termination_signal: signal.Signals = _setting(signal.SIGTERM, _signal)
    termination_grace_time: float = _setting(5.0, _DURATION)
    stack_dump_signal: signal.Signals = _setting(signal.SIGUSR2, _signal)
    stack_dump_timeout: float = _setting(5.0, _DURATION)
    report_dir: str | None = _setting(None, _report_dir)
    skip_section_response: bool = _setting(True, _bool)
    log_level: int = _setting(logging.INFO, _log_level)
    on_monitor_lost: str = _setting("warn", _on_monitor_lost)
    client_request_timeout: float = _setting(10.0, _number(0.0, False, "must be a number of seconds > 0 (a request "
                                                                       "must not wait forever)"))
    launcher_response_timeout: float = _setting(10.0, _DURATION)
    handshake_timeout: float = _setting(10.0, _POSITIVE)
    max_no_progress_cycles: int = _setting(3, _whole)
    min_progress_iterations: int = _setting(1, _whole)
    max_connections: int = _setting(256, _connections)
    observer_idle_timeout: float = _setting(60.0, _POSITIVE)
    on_hang: str = _setting("kill", _on_hang)
    inprocess_restart_timeout: float = _setting(30.0, _POSITIVE)
    max_inprocess_restarts: int = _setting(10, _whole)

    def __init__(self, data: Mapping[str, Any] | None = None, /, **values: Any) -> None:
        if data is not None and not isinstance(data, Mapping):
            raise SettingsError(f"invalid settings: must be a map of field to value, not {type(data).__name__}")
        given = {**(data or {}), **values}
        known = {f.name: f for f in fields(self)}
        unknown = [k for k in given if k not in known]
        if unknown:
            raise SettingsError(f"invalid settings: unknown field {_shown(unknown[0])} = {_shown(given[unknown[0]])} "
                                f"(known fields: {', '.join(known)})")
        for name, f in known.items():
            if name in given:
                value = given[name]
            elif f.default_factory is not MISSING:
                value = f.default_factory()
            else:
                value = f.default
            object.__setattr__(self, name, value)
        self._check()

    def _check(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            try:
                typed = f.metadata["rule"](value)
            except ValueError as e:
                raise SettingsError(f"invalid setting {f.name} = {_shown(value)}: {e}") from e
            object.__setattr__(self, f.name, typed)
        self._check_across_fields()

    def _check_across_fields(self) -> None:
        dump, term = self.stack_dump_signal, self.rank_termination_signal
        if dump == term:
            raise SettingsError(f"invalid settings: stack_dump_signal = {dump.name} is also rank_termination_signal: "
                                "the dump signal must not stop the rank; choose another (default SIGUSR2)")
        if dump in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
            raise SettingsError(f"invalid settings: stack_dump_signal = {dump.name} would stop the rank instead of "
                                "dumping its stack; use SIGUSR1, SIGUSR2 or a real-time signal")
        if dump in FAULTHANDLER_RESERVED:
            raise SettingsError(f"invalid settings: stack_dump_signal = {dump.name} is kept by faulthandler for "
                                "crashes and cannot dump a stack on request; use SIGUSR1, SIGUSR2 or a real-time "
                                "signal")
        try:
            check_wire_size(self.timeouts())
        except TimeoutsError as e:
            raise SettingsError(f"invalid settings: {e}") from e

    # -- derived -------------------------------------------------------------
    def timeouts(self) -> Timeouts:
        """The timeouts these settings put in force, none of them learned."""
        return Timeouts.from_config(self)

    # -- JSON form (FaultToleranceConfig.model_dump(mode="json")) -------------
    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.names():
            value = getattr(self, name)
            if isinstance(value, signal.Signals):
                value = int(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            out[name] = value
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Settings:
        """From the JSON form; a missing field takes its default, an unknown one is an error."""
        if not isinstance(data, Mapping):
            raise SettingsError(f"invalid settings: must be a map of field to value, not {type(data).__name__}")
        return cls(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> Settings:
        return cls.from_dict(_loads(text, "settings"))

    @classmethod
    def from_config(cls, config: Any) -> Settings:
        """From a validated ft_monitor.config.FaultToleranceConfig (through its JSON form, as the daemon gets it)."""
        return cls.from_dict(config.model_dump(mode="json"))


def _loads(text: str | bytes, what: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise SettingsError(f"invalid {what}: not JSON ({e})") from e


@dataclass(frozen=True)
class ServeSpec:
    """What a validated `ft-monitor serve` runs from: the helper's output, or ft-launcher's file."""

    settings: Settings
    socket: str
    loop: str = "auto"
    cmd: tuple[str, ...] = ()
    """`serve -- CMD ...`: a rank process to start and watch; empty for none."""
    log_file: str | None = None
    launcher_socket: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "cmd", tuple(self.cmd) if isinstance(self.cmd, (list, tuple)) else self.cmd)
        if not isinstance(self.settings, Settings):
            raise SettingsError(f"invalid serve spec: settings must be Settings, not {type(self.settings).__name__}")
        _check_spec("socket", self.socket, isinstance(self.socket, str), "must be a path")  # the daemon checks it
        _check_spec("loop", self.loop, self.loop in LOOPS, f"must be one of {', '.join(LOOPS)}")
        _check_spec("cmd", self.cmd, isinstance(self.cmd, tuple) and all(isinstance(a, str) for a in self.cmd),
                    "must be a list of strings")
        for name in ("log_file", "launcher_socket"):
            value = getattr(self, name)
            _check_spec(name, value, value is None or isinstance(value, str), "must be a path, or null")

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.settings.to_dict(), "socket": self.socket, "loop": self.loop, "cmd": list(self.cmd),
                "log_file": self.log_file, "launcher_socket": self.launcher_socket}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: Any) -> ServeSpec:
        if not isinstance(data, Mapping):
            raise SettingsError(f"invalid serve spec: must be a map, not {type(data).__name__}")
        known = ("config", "socket", "loop", "cmd", "log_file", "launcher_socket")
        unknown = [k for k in data if k not in known]
        if unknown:
            raise SettingsError(f"invalid serve spec: unknown field {_shown(unknown[0])} "
                                f"(known fields: {', '.join(known)})")
        for name in ("config", "socket"):
            if name not in data:
                raise SettingsError(f"invalid serve spec: {name} is missing")
        cmd = data.get("cmd") or ()
        _check_spec("cmd", cmd, isinstance(cmd, (list, tuple)), "must be a list of strings")
        return cls(Settings.from_dict(data["config"]), data["socket"], data.get("loop", "auto"),
                   tuple(cmd), data.get("log_file"), data.get("launcher_socket"))

    @classmethod
    def from_json(cls, text: str | bytes) -> ServeSpec:
        return cls.from_dict(_loads(text, "serve spec"))


def _check_spec(name: str, value: Any, ok: bool, rule: str) -> None:
    if not ok:
        raise SettingsError(f"invalid serve spec {name} = {_shown(value)}: {rule}")
