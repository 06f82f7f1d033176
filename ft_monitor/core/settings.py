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
  socket, the loop, ``-- CMD``, the log file, the launcher socket, the parent to die with). The
  ``--check-serve`` helper prints one; ft-launcher writes one per daemon to
  ``<run>/monitor<L>.json``; ``--run-checked`` reads it back (`to_json` /
  `from_json`).

tests/test_settings.py checks that the fields, types and defaults here match
FaultToleranceConfig's.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import types
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from ft_client.errors import FtError
from ft_client.timeouts import Timeouts
from ft_monitor.core import rules

LOOPS = ("auto", "asyncio", "uvloop")


class SettingsError(FtError, ValueError):
    """A setting that breaks a rule. The message is meant for the user, as is."""


_shown = rules.shown


def _frozen_sections(v: Any) -> Mapping[str, float | None]:
    return types.MappingProxyType(rules.section_timeouts(v))


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

    initial_rank_heartbeat_timeout: float | None = _setting(None, rules.timeout)
    rank_heartbeat_timeout: float | None = _setting(None, rules.timeout)
    rank_section_timeouts: Mapping[str, float | None] = _setting({}, _frozen_sections)
    rank_out_of_section_timeout: float | None = _setting(None, rules.timeout)
    num_warmup_iterations: int = _setting(5, rules.whole)
    safety_factor: float = _setting(5.0, rules.safety_factor)
    min_learned_timeout: float = _setting(5.0, rules.duration)
    rank_termination_signal: signal.Signals = _setting(signal.SIGTERM, rules.signal_number)
    termination_grace_time: float = _setting(5.0, rules.duration)
    stack_dump_signal: signal.Signals = _setting(signal.SIGUSR2, rules.signal_number)
    stack_dump_timeout: float = _setting(5.0, rules.duration)
    report_dir: str | None = _setting(None, rules.report_dir)
    skip_section_response: bool = _setting(True, rules.boolean)
    log_level: int = _setting(logging.INFO, rules.log_level)
    on_monitor_lost: str = _setting("warn", rules.on_monitor_lost)
    client_request_timeout: float = _setting(10.0, rules.request_timeout)
    launcher_response_timeout: float = _setting(10.0, rules.duration)
    handshake_timeout: float = _setting(10.0, rules.positive_seconds)
    max_no_progress_cycles: int = _setting(3, rules.whole)
    min_progress_iterations: int = _setting(1, rules.whole)
    max_connections: int = _setting(256, rules.connections)
    observer_idle_timeout: float = _setting(60.0, rules.positive_seconds)
    on_hang: str = _setting("kill", rules.on_hang)
    inprocess_restart_timeout: float = _setting(30.0, rules.positive_seconds)
    max_inprocess_restarts: int = _setting(10, rules.whole)
    metrics_port: int | None = _setting(None, rules.metrics_port)
    metrics_address: str = _setting("127.0.0.1", rules.metrics_address)
    metrics_textfile: str | None = _setting(None, rules.metrics_textfile)
    slow_rank_ratio: float | None = _setting(1.5, rules.slow_rank_ratio)
    slow_rank_section: str = _setting("step", rules.section_name)
    startup_timeout: float | None = _setting(None, rules.timeout)
    startup_until: str = _setting("handshake", rules.startup_until)
    process_group_timeout: float | None = _setting(None, rules.timeout)
    scheduler_grace_time: float | None = _setting(None, rules.timeout)
    timeout_check: str = _setting("warn", rules.timeout_check)
    progress_record: bool = _setting(True, rules.boolean)
    flight_recorder_entries: int = _setting(0, rules.flight_recorder_entries)
    roll_call_timeout: float = _setting(5.0, rules.positive_seconds)
    native_stacks: bool = _setting(False, rules.boolean)
    snapshot_max_bytes: int = _setting(rules.SNAPSHOT_MAX_BYTES_DEFAULT, rules.snapshot_max_bytes)

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
        problem = rules.signals_problem(self.stack_dump_signal, self.rank_termination_signal)
        if problem is None:
            problem = rules.timeouts_problem(self.timeouts())
        if problem is not None:
            raise SettingsError(f"invalid settings: {problem}")

    # -- derived -------------------------------------------------------------
    def timeouts(self) -> Timeouts:
        """The timeouts these settings put in force, none of them learned."""
        return Timeouts.from_config(self)

    def report_dir_for(self, socket_path: str | os.PathLike[str]) -> Path:
        """Where a daemon serving ``socket_path`` writes its reports: report_dir, or
        ``<socket directory>/reports`` when that is not set."""
        return Path(self.report_dir) if self.report_dir else Path(socket_path).absolute().parent / "reports"

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
    parent_pid: int | None = None
    """Die with this process: the daemon gets SIGTERM when its parent exits (and does not
    start if its parent is not this pid any more). None: outlive the parent."""

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
        pid = self.parent_pid
        _check_spec("parent_pid", pid, pid is None or (isinstance(pid, int) and not isinstance(pid, bool) and pid > 0),
                    "must be a process id > 0, or null")

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.settings.to_dict(), "socket": self.socket, "loop": self.loop, "cmd": list(self.cmd),
                "log_file": self.log_file, "launcher_socket": self.launcher_socket, "parent_pid": self.parent_pid}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: Any) -> ServeSpec:
        if not isinstance(data, Mapping):
            raise SettingsError(f"invalid serve spec: must be a map, not {type(data).__name__}")
        known = ("config", "socket", "loop", "cmd", "log_file", "launcher_socket", "parent_pid")
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
                   tuple(cmd), data.get("log_file"), data.get("launcher_socket"), data.get("parent_pid"))

    @classmethod
    def from_json(cls, text: str | bytes) -> ServeSpec:
        return cls.from_dict(_loads(text, "serve spec"))


def _check_spec(name: str, value: Any, ok: bool, rule: str) -> None:
    if not ok:
        raise SettingsError(f"invalid serve spec {name} = {_shown(value)}: {rule}")
