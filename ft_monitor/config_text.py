"""Settings in their text forms, and where they come from, without pydantic.

Owns: the sources of settings (the first ``fault_tolerance:`` mapping of a YAML file,
``FT_<FIELD>`` variables, ``--ft-<field>`` flags) and one parser per field (`PARSERS`)
that turns a value in any of its forms ("none", "30", "SIGTERM", "step:30,ckpt:none",
"yes", a number, a map) into its typed value and applies the field's rule
(ft_monitor.core.rules). The pydantic model (ft_monitor.config) runs these parsers as its
validators, and adds the layer each value came from to its error lines.

`quick_settings` runs the same parsers without pydantic: `ft-monitor serve` starts its
daemon from their result at once when every value parses and nothing calls for a
warning (pydantic and yaml cost the start about 100 ms; see docs/benchmarks.md).
Anything else (an unknown or nvidia-resiliency-ext-only field, a value a rule refuses)
returns None, and the caller takes the pydantic way, which says exactly what is wrong
and where it came from.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ft_client import env as ft_env
from ft_client.errors import FtError
from ft_monitor.core import rules
from ft_monitor.core.settings import Settings, SettingsError


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
FIELDS: tuple[str, ...] = Settings.names()
"""Every setting (the pydantic model has the same fields, tests/test_settings.py checks)."""
MAX_YAML_DEPTH = 64
TRUE = frozenset({"true", "1", "yes", "on"})
FALSE = frozenset({"false", "0", "no", "off"})


# -- text forms --------------------------------------------------------------------------
def none_words(v: Any) -> Any:
    if isinstance(v, str) and v.strip().lower() in ("none", "null", "off", ""):
        return None
    return v


def number_words(v: Any) -> Any:
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


def _word(v: Any) -> Any:
    return v.strip().lower() if isinstance(v, str) else v


def _stripped(v: Any) -> Any:
    return v.strip() if isinstance(v, str) else v


def _timeout(v: Any) -> Any:
    return rules.timeout(number_words(none_words(v)))


def _sections(v: Any) -> Any:
    if v is None:
        return {}
    if isinstance(v, str):
        v = parse_section_timeouts(v)
    if isinstance(v, Mapping):  # names with blanks around them
        v = {(k.strip() if isinstance(k, str) and k.strip() else k): x for k, x in v.items()}
    return rules.section_timeouts(v, lambda x: number_words(none_words(x)))


def _boolean(v: Any) -> Any:
    if isinstance(v, int) and not isinstance(v, bool) and v in (0, 1):
        v = bool(v)
    elif isinstance(v, str) and v.strip().lower() in TRUE | FALSE:
        v = v.strip().lower() in TRUE
    return rules.boolean(v)


def _log_level(v: Any) -> Any:
    import logging

    if isinstance(v, str):
        name = v.strip().upper()
        level = logging.getLevelName(name)
        if name.isdigit():
            v = int(name)
        elif isinstance(level, int):
            v = level
    return rules.log_level(v)


def _metrics_textfile(v: Any) -> Any:
    v = none_words(v)
    if isinstance(v, str) and v.startswith("~"):
        v = str(Path(v).expanduser())
    return rules.metrics_textfile(v)


def _report_dir(v: Any) -> Any:
    v = none_words(v)
    if v is None:
        return None
    if not isinstance(v, (str, os.PathLike)) or not str(v):
        raise ValueError("must be a directory path")
    try:
        return rules.report_dir(str(Path(v).expanduser().absolute()))
    except RuntimeError as e:  # ~user that does not exist
        raise ValueError(f"cannot expand the path: {e}") from e


def _then(rule: Callable[[Any], Any], first: Callable[[Any], Any] = number_words) -> Callable[[Any], Any]:
    return lambda v: rule(first(v))


PARSERS: dict[str, Callable[[Any], Any]] = {
    **dict.fromkeys(("initial_rank_heartbeat_timeout", "rank_heartbeat_timeout", "rank_out_of_section_timeout",
                     "startup_timeout", "process_group_timeout", "scheduler_grace_time"), _timeout),
    "rank_section_timeouts": _sections,
    **dict.fromkeys(("num_warmup_iterations", "max_no_progress_cycles", "min_progress_iterations",
                     "max_inprocess_restarts"), _then(rules.whole)),
    "max_connections": _then(rules.connections),
    "safety_factor": _then(rules.safety_factor),
    **dict.fromkeys(("termination_grace_time", "stack_dump_timeout", "min_learned_timeout",
                     "launcher_response_timeout"), _then(rules.duration)),
    "client_request_timeout": _then(rules.request_timeout),
    **dict.fromkeys(("handshake_timeout", "observer_idle_timeout", "inprocess_restart_timeout", "roll_call_timeout"),
                    _then(rules.positive_seconds)),
    **dict.fromkeys(("rank_termination_signal", "stack_dump_signal"), rules.signal_number),
    **dict.fromkeys(("skip_section_response", "progress_record", "native_stacks"), _boolean),
    "flight_recorder_entries": _then(rules.flight_recorder_entries),
    "snapshot_max_bytes": _then(rules.snapshot_max_bytes),
    "log_level": _log_level,
    "on_hang": _then(rules.on_hang, _word),
    "startup_until": _then(rules.startup_until, _word),
    "timeout_check": _then(rules.timeout_check, _word),
    "on_monitor_lost": _then(rules.on_monitor_lost, _word),
    "metrics_port": _then(rules.metrics_port, lambda v: number_words(none_words(v))),
    "metrics_address": _then(rules.metrics_address, _stripped),
    "metrics_textfile": _metrics_textfile,
    "slow_rank_ratio": _then(rules.slow_rank_ratio, lambda v: number_words(none_words(v))),
    "slow_rank_section": _then(rules.section_name, _stripped),
    "report_dir": _report_dir,
}
"""Field -> its value in any text form, typed and checked (raises ValueError: the rule)."""


# -- sources -------------------------------------------------------------------------------
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
    import yaml

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


def add_config_flags(parser: argparse.ArgumentParser, *, with_cfg_path: bool = False,
                     param_aliases: bool = False) -> None:
    """Add `--ft-<field>` (and `--ft_<field>`) for every field; values stay strings until load_config.
    With ``param_aliases`` (ft-launcher), also nvidia-resiliency-ext's older spelling
    `--ft-param-<field>` (and `--ft_param_<field>`), the same setting, left out of --help."""
    group = parser.add_argument_group("fault tolerance settings (override the config file and FT_<FIELD>)")
    if with_cfg_path:
        group.add_argument("--ft-cfg-path", "--ft_cfg_path", dest="ft_cfg_path", default=None, metavar="FILE",
                           help="YAML file with a fault_tolerance: mapping")
    for name in sorted(FIELDS) + sorted(IGNORED_NVRX_FIELDS):
        flags = {f"--ft-{name.replace('_', '-')}", f"--ft_{name}"}
        hidden = name in IGNORED_NVRX_FIELDS
        group.add_argument(*sorted(flags), dest=f"ft_{name}", default=argparse.SUPPRESS, metavar="VALUE",
                           help=argparse.SUPPRESS if hidden else f"sets {name}")
        if param_aliases:  # --ft-param-rank_heartbeat_timeout too: the spelling of many existing launch scripts
            aliases = {f"--ft-param-{name.replace('_', '-')}", f"--ft_param_{name}", f"--ft-param-{name}"}
            group.add_argument(*sorted(aliases), dest=f"ft_{name}", default=argparse.SUPPRESS, metavar="VALUE",
                               help=argparse.SUPPRESS)


def cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The --ft-<field> values given on the command line."""
    out: dict[str, Any] = {}
    for name in FIELDS + tuple(IGNORED_NVRX_FIELDS):
        key = f"ft_{name}"
        if hasattr(args, key):
            out[name] = getattr(args, key)
    return out


# -- the quick way -------------------------------------------------------------------------
def quick_settings(yaml_path: str | os.PathLike[str] | None, environ: Mapping[str, str],
                   cli: Mapping[str, Any]) -> Settings | None:
    """The settings YAML < env < CLI make, when every value parses and no field is unknown
    or nvidia-resiliency-ext's only; None otherwise (the pydantic way then says why)."""
    try:
        layers = [read_yaml(yaml_path)] if yaml_path is not None else []
    except ConfigError:
        return None
    layers += [read_env(environ), dict(cli)]
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if not isinstance(key, str) or key not in PARSERS:
                return None
            merged[key] = value
    try:
        return Settings({key: PARSERS[key](value) for key, value in merged.items()})
    except (ValueError, SettingsError):
        return None
