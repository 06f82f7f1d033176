"""FaultToleranceConfig: every setting of the daemon and launcher, validated once.

Sources, lowest precedence first: defaults < YAML file (the first
``fault_tolerance:`` mapping found anywhere in it, as nvidia-resiliency-ext does)
< environment ``FT_<FIELD>`` < command line ``--ft-<field>`` (dash or underscore).
`load_config()` merges them and validates the result; a bad value raises
ConfigError whose message names the field, the value, where it came from and the
rule. After loading, the config is only read.

This module must not import torch; it is imported by the daemon.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from ft_client import env as ft_env
from ft_client.errors import FtError
from ft_client.timeouts import (
    Timeouts,
)
from ft_monitor import rules


class ConfigError(FtError, ValueError):
    """A setting that breaks a rule. The message is meant for the user, as is."""


# Fields of nvidia-resiliency-ext's FaultToleranceConfig that have no meaning here.
# They are accepted, so that its YAML files and flags keep working, and ignored
# with one warning line.
IGNORED_NVRX_FIELDS = frozenset(
    {
        "workload_check_interval",  # detection here is deadline-driven, not periodic
        "node_health_check_interval",
        "restart_check_interval",
        "enable_nic_monitor",
        "enable_nic_healthcheck",
        "enable_dist_storage_healthcheck",
        "storage_healthcheck_path",
        "pci_topo_file",
        "link_down_path_template",
        "link_state_path_template",
        "segment",
        "numa_bind_strict",
        "gpu_memory_reclaim_timeout",
        "gpu_memory_tolerance_mb",
        "gpu_memory_poll_interval",
        "check_remaining_processes",
        "checkpoint_iteration_file",
        "install_exception_hook",
        "attribution_endpoint",
        "attribution_stop_action",
        "attribution_export_url",
        "cycle_info_dir",
        "segment_health_check_dir",
    }
)

MAX_WHOLE = rules.MAX_WHOLE
FAULTHANDLER_RESERVED = rules.FAULTHANDLER_RESERVED
parse_signal = rules.parse_signal
shown = rules.shown
"""Signals faulthandler keeps for crashes: it cannot register them to dump on request."""
MAX_YAML_DEPTH = 64




class FaultToleranceConfig(BaseModel):
    """Settings of the monitor daemon and of ft-launcher.

    Timeouts are in seconds; None (YAML ``null``, CLI ``none``) turns one off.
    docs/configuration.md describes each field.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    initial_rank_heartbeat_timeout: float | None = None
    rank_heartbeat_timeout: float | None = None
    rank_section_timeouts: dict[str, float | None] = {}
    rank_out_of_section_timeout: float | None = None
    num_warmup_iterations: int = 5
    safety_factor: float = 5.0
    min_learned_timeout: float = 5.0
    rank_termination_signal: signal.Signals = signal.SIGTERM
    termination_grace_time: float = 5.0
    stack_dump_signal: signal.Signals = signal.SIGUSR2
    stack_dump_timeout: float = 5.0
    report_dir: str | None = None
    skip_section_response: bool = True
    log_level: int = logging.INFO
    on_monitor_lost: str = "warn"
    client_request_timeout: float = 10.0
    launcher_response_timeout: float = 10.0
    handshake_timeout: float = 10.0
    max_no_progress_cycles: int = 3
    min_progress_iterations: int = 1
    max_connections: int = 256
    observer_idle_timeout: float = 60.0
    on_hang: str = "kill"
    inprocess_restart_timeout: float = 30.0
    max_inprocess_restarts: int = 10
    metrics_port: int | None = None
    metrics_address: str = "127.0.0.1"
    metrics_textfile: str | None = None
    slow_rank_ratio: float | None = 1.5
    slow_rank_section: str = "step"
    startup_timeout: float | None = None
    startup_until: str = "handshake"
    process_group_timeout: float | None = None
    scheduler_grace_time: float | None = None
    timeout_check: str = "warn"
    flight_recorder_entries: int = 0
    roll_call_timeout: float = 5.0
    native_stacks: bool = False

    # -- rules -----------------------------------------------------------------
    @field_validator(
        "initial_rank_heartbeat_timeout", "rank_heartbeat_timeout", "rank_out_of_section_timeout", "startup_timeout",
        "process_group_timeout", "scheduler_grace_time", mode="before"
    )
    @classmethod
    def _timeout(cls, v: Any) -> Any:
        return rules.timeout(_number_words(_none_words(v)))

    @field_validator("rank_section_timeouts", mode="before")
    @classmethod
    def _sections(cls, v: Any) -> Any:
        if v is None:
            return {}
        if isinstance(v, str):
            v = parse_section_timeouts(v)
        if isinstance(v, Mapping):  # names with blanks around them
            v = {(k.strip() if isinstance(k, str) and k.strip() else k): x for k, x in v.items()}
        return rules.section_timeouts(v, lambda x: _number_words(_none_words(x)))

    @model_validator(mode="after")
    def _timeouts_fit_the_wire(self) -> FaultToleranceConfig:
        problem = rules.timeouts_problem(self.timeouts())
        if problem is not None:
            raise ValueError(problem)
        return self

    @field_validator("num_warmup_iterations", "max_no_progress_cycles", "min_progress_iterations",
                     "max_inprocess_restarts", mode="before")
    @classmethod
    def _warmup(cls, v: Any) -> Any:
        return rules.whole(_number_words(v))

    @field_validator("max_connections", mode="before")
    @classmethod
    def _max_connections(cls, v: Any) -> Any:
        return rules.connections(_number_words(v))

    @field_validator("safety_factor", mode="before")
    @classmethod
    def _safety(cls, v: Any) -> Any:
        return rules.safety_factor(_number_words(v))

    @field_validator("termination_grace_time", "stack_dump_timeout", "min_learned_timeout",
                     "launcher_response_timeout", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Any:
        return rules.duration(_number_words(v))

    @field_validator("client_request_timeout", mode="before")
    @classmethod
    def _request_timeout(cls, v: Any) -> Any:
        return rules.request_timeout(_number_words(v))

    @field_validator("handshake_timeout", "observer_idle_timeout", "inprocess_restart_timeout", "roll_call_timeout",
                     mode="before")
    @classmethod
    def _handshake(cls, v: Any) -> Any:
        return rules.positive_seconds(_number_words(v))

    @field_validator("rank_termination_signal", "stack_dump_signal", mode="before")
    @classmethod
    def _signal(cls, v: Any) -> Any:
        return rules.signal_number(v)

    @model_validator(mode="after")
    def _distinct_signals(self) -> FaultToleranceConfig:
        problem = rules.signals_problem(self.stack_dump_signal, self.rank_termination_signal)
        if problem is not None:
            raise ValueError(problem)
        return self

    @field_validator("flight_recorder_entries", mode="before")
    @classmethod
    def _fr_entries(cls, v: Any) -> Any:
        return rules.flight_recorder_entries(_number_words(v))

    @field_validator("skip_section_response", "native_stacks", mode="before")
    @classmethod
    def _bool(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool) and v in (0, 1):
            v = bool(v)
        elif isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
            v = v.strip().lower() in _TRUE
        return rules.boolean(v)

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level(cls, v: Any) -> Any:
        if isinstance(v, str):
            name = v.strip().upper()
            level = logging.getLevelName(name)
            if name.isdigit():
                v = int(name)
            elif isinstance(level, int):
                v = level
        return rules.log_level(v)

    @field_validator("on_hang", mode="before")
    @classmethod
    def _on_hang(cls, v: Any) -> Any:
        return rules.on_hang(v.strip().lower() if isinstance(v, str) else v)

    @field_validator("startup_until", mode="before")
    @classmethod
    def _startup_until(cls, v: Any) -> Any:
        return rules.startup_until(v.strip().lower() if isinstance(v, str) else v)

    @field_validator("timeout_check", mode="before")
    @classmethod
    def _timeout_check(cls, v: Any) -> Any:
        return rules.timeout_check(v.strip().lower() if isinstance(v, str) else v)

    @field_validator("on_monitor_lost", mode="before")
    @classmethod
    def _on_lost(cls, v: Any) -> Any:
        return rules.on_monitor_lost(v.strip().lower() if isinstance(v, str) else v)

    @field_validator("metrics_port", mode="before")
    @classmethod
    def _metrics_port(cls, v: Any) -> Any:
        return rules.metrics_port(_number_words(_none_words(v)))

    @field_validator("metrics_address", mode="before")
    @classmethod
    def _metrics_address(cls, v: Any) -> Any:
        return rules.metrics_address(v.strip() if isinstance(v, str) else v)

    @field_validator("metrics_textfile", mode="before")
    @classmethod
    def _metrics_textfile(cls, v: Any) -> Any:
        v = _none_words(v)
        if isinstance(v, str) and v.startswith("~"):
            v = str(Path(v).expanduser())
        return rules.metrics_textfile(v)

    @field_validator("slow_rank_ratio", mode="before")
    @classmethod
    def _slow_ratio(cls, v: Any) -> Any:
        return rules.slow_rank_ratio(_number_words(_none_words(v)))

    @field_validator("slow_rank_section", mode="before")
    @classmethod
    def _slow_section(cls, v: Any) -> Any:
        return rules.section_name(v.strip() if isinstance(v, str) else v)

    @field_validator("report_dir", mode="before")
    @classmethod
    def _report_dir(cls, v: Any) -> Any:
        v = _none_words(v)
        if v is None:
            return None
        if not isinstance(v, (str, os.PathLike)) or not str(v):
            raise ValueError("must be a directory path")
        try:
            return rules.report_dir(str(Path(v).expanduser().absolute()))
        except RuntimeError as e:  # ~user that does not exist
            raise ValueError(f"cannot expand the path: {e}") from e

    # -- derived -------------------------------------------------------------
    def timeouts(self) -> Timeouts:
        """The timeouts this config puts in force, none of them learned."""
        return Timeouts.from_config(self)

    @property
    def is_progress_tracking_enabled(self) -> bool:
        """Whether restarts that make no progress end the job (max_no_progress_cycles > 0)."""
        return self.max_no_progress_cycles > 0

    # -- nvidia-resiliency-ext's loaders (same names and arguments) -------------
    @classmethod
    def from_kwargs(cls, ignore_not_recognized: bool = True, **kwargs: Any) -> FaultToleranceConfig:
        """A config from keyword arguments (field = value), validated like every other source.

        Fields of nvidia-resiliency-ext that mean nothing here are dropped with a warning.
        Other unknown names are dropped with a warning naming them, or, with
        ``ignore_not_recognized=False``, raise ConfigError. Raises ConfigError (a
        ValueError) naming the field, the value and the rule for a bad value."""
        return merge_layers([("keyword arguments", kwargs)], unknown="warn" if ignore_not_recognized else "error")

    @classmethod
    def from_yaml_file(cls, cfg_path: str | os.PathLike[str], ignore_not_recognized: bool = True
                       ) -> FaultToleranceConfig:
        """A config from the first ``fault_tolerance:`` mapping in a YAML file (at any depth).
        Unknown names as in `from_kwargs`; raises ConfigError for a file that cannot be read
        or has no such mapping."""
        return merge_layers([(f"config file {cfg_path}", read_yaml(cfg_path))],
                            unknown="warn" if ignore_not_recognized else "error")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FaultToleranceConfig:
        """A config from parsed command-line arguments: the file ``args.ft_cfg_path`` (if set)
        overridden by every ``args.ft_<field>`` that is set and not None (strings such as
        "30", "none" or "step:30,ckpt:none" are read as on the command line). The
        environment is not read (as in nvidia-resiliency-ext); `load_config` reads it."""
        layers: list[tuple[str, Mapping[str, Any]]] = []
        path = getattr(args, "ft_cfg_path", None)
        if path is not None:
            layers.append((f"config file {path}", read_yaml(path)))
        given = {}
        for name in FIELDS + tuple(sorted(IGNORED_NVRX_FIELDS)):
            value = getattr(args, f"ft_{name}", None)
            if value is not None:
                given[name] = value
        layers.append(("command line", given))
        return merge_layers(layers)

    def to_yaml_file(self, cfg_path: str | os.PathLike[str]) -> None:
        """Write this config as a ``fault_tolerance:`` mapping that `from_yaml_file` reads back
        as an equal config (signals by name). Raises ConfigError if the file cannot be written."""
        data = self.model_dump(mode="json")
        for name in ("rank_termination_signal", "stack_dump_signal"):
            data[name] = getattr(self, name).name
        try:
            with open(cfg_path, "w") as f:
                yaml.safe_dump({"fault_tolerance": data}, f, sort_keys=False)
        except OSError as e:
            raise ConfigError(f"cannot write config file {cfg_path}: {e.strerror or e}") from e


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
FIELDS: tuple[str, ...] = tuple(FaultToleranceConfig.model_fields)


def _none_words(v: Any) -> Any:
    if isinstance(v, str) and v.strip().lower() in ("none", "null", "off", ""):
        return None
    return v


def _number_words(v: Any) -> Any:
    """Strings from env and CLI: '30' -> 30, '2.5' -> 2.5; anything else unchanged."""
    if isinstance(v, str):
        text = v.strip()
        for conv in (int, float):
            try:
                return conv(text)
            except ValueError:
                pass
    return v


def parse_section_timeouts(text: str) -> dict[str, Any]:
    """'step:30,ckpt:none' -> {'step': '30', 'ckpt': 'none'} (values validated later)."""
    out: dict[str, Any] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, value = item.rpartition(":")
        if not sep or not name.strip():
            raise ValueError(f"entry {item!r} is not NAME:SECONDS (CLI form: step:30,ckpt:none)")
        out[name.strip()] = value.strip()
    return out


# ---------------------------------------------------------------------------
# Loading


def find_fault_tolerance_section(data: Any) -> Mapping[str, Any] | None:
    """The first `fault_tolerance:` mapping in document order, at any depth.

    Each node is visited once: YAML aliases can make a small file a graph with
    exponentially many paths (an "alias bomb") or a cycle, and neither may cost
    more than the file's size."""
    seen: set[int] = set()

    def walk(node: Any, depth: int) -> Mapping[str, Any] | None:
        if id(node) in seen or depth > MAX_YAML_DEPTH:
            return None
        seen.add(id(node))
        if isinstance(node, Mapping):
            for key, value in node.items():
                if key == "fault_tolerance" and isinstance(value, Mapping):
                    return value
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            return None
        for value in children:
            if isinstance(value, (Mapping, list)):
                found = walk(value, depth + 1)
                if found is not None:
                    return found
        return None

    return walk(data, 0)


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    except RecursionError as e:
        raise ConfigError(f"config file {path} is nested too deeply to read") from e
    section = find_fault_tolerance_section(data)
    if section is None:
        raise ConfigError(f"config file {path} has no 'fault_tolerance:' mapping")
    return dict(section)


def read_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """FT_<FIELD> variables that name a config field (others, such as the socket paths, are not config)."""
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for name in FIELDS:
        key = ft_env.CONFIG_ENV_PREFIX + name.upper()
        if key in environ:
            out[name] = environ[key]
    return out


def add_config_flags(parser: argparse.ArgumentParser, *, with_cfg_path: bool = False) -> None:
    """Add `--ft-<field>` (and `--ft_<field>`) for every field; values stay strings until load_config."""
    group = parser.add_argument_group("fault tolerance settings (override the config file and FT_<FIELD>)")
    if with_cfg_path:
        group.add_argument("--ft-cfg-path", "--ft_cfg_path", dest="ft_cfg_path", default=None, metavar="FILE",
                           help="YAML file with a fault_tolerance: mapping")
    for name in sorted(FIELDS) + sorted(IGNORED_NVRX_FIELDS):
        flags = {f"--ft-{name.replace('_', '-')}", f"--ft_{name}"}
        hidden = name in IGNORED_NVRX_FIELDS
        group.add_argument(*sorted(flags), dest=f"ft_{name}", default=argparse.SUPPRESS, metavar="VALUE",
                           help=argparse.SUPPRESS if hidden else f"sets {name}")


def cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The --ft-<field> values given on the command line."""
    out: dict[str, Any] = {}
    for name in FIELDS + tuple(IGNORED_NVRX_FIELDS):
        key = f"ft_{name}"
        if hasattr(args, key):
            out[name] = getattr(args, key)
    return out


def load_config(
    yaml_path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
    *,
    log: logging.Logger | None = None,
) -> FaultToleranceConfig:
    """Merge defaults < YAML < env < CLI and validate; raises ConfigError."""
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if yaml_path is not None:
        layers.append((f"config file {yaml_path}", read_yaml(yaml_path)))
    layers.append(("environment", read_env(environ)))
    layers.append(("command line", dict(cli or {})))
    return merge_layers(layers, log=log)


def merge_layers(
    layers: list[tuple[str, Mapping[str, Any]]], *, unknown: str = "error", log: logging.Logger | None = None
) -> FaultToleranceConfig:
    """Merge ``(source, values)`` layers, later ones winning, and validate; raises ConfigError.

    Fields of nvidia-resiliency-ext that mean nothing here are dropped with one warning.
    Any other unknown field is an error (``unknown="error"``) or dropped with a warning
    naming it (``unknown="warn"``)."""
    logger = log or logging.getLogger("ft_monitor.config")
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    ignored: list[str] = []
    dropped: list[str] = []
    for source, values in layers:
        for key, value in values.items():
            if not isinstance(key, str):
                raise ConfigError(f"{source}: key {shown(key)} is not a field name")
            if key in IGNORED_NVRX_FIELDS:
                ignored.append(key)
                continue
            if key not in FaultToleranceConfig.model_fields:
                if unknown == "warn":
                    dropped.append(f"{shown(key)} (from {source})")
                    continue
                raise ConfigError(
                    f"{source}: unknown field {shown(key)} = {shown(value)} (known fields: {', '.join(FIELDS)})"
                )
            merged[key] = value
            origin[key] = _origin_label(source, key)
    if ignored:
        logger.warning("ignored nvidia-resiliency-ext setting(s) with no meaning here: %s",
                       ", ".join(sorted(set(ignored))))
    if dropped:
        logger.warning("ignored unknown setting(s): %s (known fields: %s)", ", ".join(dropped), ", ".join(FIELDS))
    try:
        return FaultToleranceConfig(**merged)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, merged, origin)) from e


def _origin_label(source: str, key: str) -> str:
    if source == "environment":
        return f"env {ft_env.CONFIG_ENV_PREFIX}{key.upper()}"
    if source == "command line":
        return f"--ft-{key.replace('_', '-')}"
    return source


def _format_validation_error(e: ValidationError, values: Mapping[str, Any], origin: Mapping[str, str]) -> str:
    lines = []
    for err in e.errors():
        if not err["loc"]:  # a rule across fields
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"invalid settings: {msg}")
            continue
        field = str(err["loc"][0])
        value = values.get(field, err.get("input"))
        rule = err["msg"]
        if rule.startswith("Value error, "):
            rule = rule[len("Value error, ") :]
        where = origin.get(field, "default")
        lines.append(f"invalid setting {field} = {shown(value)} (from {where}): {rule}")
    return "\n".join(lines)
