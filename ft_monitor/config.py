"""FaultToleranceConfig: every setting of the daemon and launcher, validated once.

Sources, lowest precedence first: defaults < YAML file (the first
``fault_tolerance:`` mapping found anywhere in it, as nvidia-resiliency-ext does)
< environment ``FT_<FIELD>`` < command line ``--ft-<field>`` (dash or underscore).
`load_config()` merges them and validates the result; a bad value raises
ConfigError whose message names the field, the value, where it came from and the
rule. After loading, the config is only read. Each field's text forms and rule are
ft_monitor.config_text's parsers; this model runs them, and says where a bad value came
from.

This module must not import torch (nor does the daemon import it: pydantic stays in the
process that validates, see cli.py).
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import signal
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator, model_validator

from ft_client import env as ft_env
from ft_client.safefiles import write_bytes_atomic
from ft_client.timeouts import (
    Timeouts,
)
from ft_monitor.config_text import (
    IGNORED_NVRX_FIELDS,
    MAX_YAML_DEPTH,
    PARSERS,
    ConfigError,
    add_config_flags,
    cli_overrides,
    find_fault_tolerance_section,
    parse_section_timeouts,
    read_env,
    read_yaml,
)
from ft_monitor.core import rules

__all__ = ["ConfigError", "FaultToleranceConfig", "IGNORED_NVRX_FIELDS", "FIELDS", "MAX_YAML_DEPTH", "add_config_flags",
           "cli_overrides", "find_fault_tolerance_section", "load_config", "merge_layers", "parse_section_timeouts",
           "read_env", "read_yaml"]

shown = rules.shown


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
    progress_record: bool = True
    flight_recorder_entries: int = 0
    roll_call_timeout: float = 5.0
    native_stacks: bool = False
    snapshot_max_bytes: int = rules.SNAPSHOT_MAX_BYTES_DEFAULT

    # -- rules -----------------------------------------------------------------
    @field_validator("*", mode="before")
    @classmethod
    def _text_form(cls, v: Any, info: ValidationInfo) -> Any:
        """Every field's value in any text form, typed and checked by its parser
        (ft_monitor.config_text.PARSERS: the same rules `ft-monitor serve`'s quick start uses)."""
        parse = PARSERS.get(info.field_name or "")
        return v if parse is None else parse(v)

    @model_validator(mode="after")
    def _timeouts_fit_the_wire(self) -> FaultToleranceConfig:
        problem = rules.timeouts_problem(self.timeouts())
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _distinct_signals(self) -> FaultToleranceConfig:
        problem = rules.signals_problem(self.stack_dump_signal, self.rank_termination_signal)
        if problem is not None:
            raise ValueError(problem)
        return self

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
        try:  # a fresh file renamed into place: a link planted at cfg_path is replaced, not followed
            write_bytes_atomic(cfg_path, yaml.safe_dump({"fault_tolerance": data}, sort_keys=False).encode(),
                               mode=0o666)
        except OSError as e:
            raise ConfigError(f"cannot write config file {cfg_path}: {e.strerror or e}") from e


FIELDS: tuple[str, ...] = tuple(FaultToleranceConfig.model_fields)


# ---------------------------------------------------------------------------
# Loading


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
                close = difflib.get_close_matches(key, FIELDS, n=1, cutoff=0.75)
                hint = f" (did you mean {close[0]!r}?)" if close else f" (known fields: {', '.join(FIELDS)})"
                raise ConfigError(f"{source}: unknown field {shown(key)} = {shown(value)}{hint}")
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
