"""nvidia-resiliency-ext's ``ft_launcher`` flags that torchrun's parser does not have, and what
each one is here: `FLAGS`, one table (pure data), read by `add_flags` (the flags on a parser, in
their own --help group) and by `apply` (what a parsed command line that gives them asks of the
launch). Read from the reference's launcher.py and cli_args.py at NVIDIA/nvidia-resiliency-ext
``d8686d9c7015``, older releases' flags included (marked ``old``: launch scripts still carry them).

Each flag is one of:

* ``alias``: another spelling of one of ours (``target`` is its argparse dest);
* ``torch``: a torchrun flag of the same meaning (``target``: its dest), the value converted;
* ``setting``: a setting of ours of the same meaning (``target``: the field), as ``--ft-<field>``;
* ``same``: what ft-launcher always does; a value in ``only`` is accepted silently, any other is
  refused with ``why`` (what to do instead);
* ``ignored``: no meaning here: accepted, and one warning line says ``why``.

The reference's settings flags (``--ft-<field>``, its ``--ft-<field_with_underscores>`` and the
older ``--ft-param-<field>``) are the settings' own flags (config_text.add_config_flags, and
`field_spellings` here for the mixed spelling); a setting of the reference that has no meaning
here is ignored by the config with its own warning line.

`apply` checks values and conflicts and returns one refusal line (the launcher exits 2 with it,
before torch is imported when the early check can tell: early_check.py) or the lines to log.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["alias", "torch", "setting", "same", "ignored"]
Value = Literal["str", "float", "int", "switch"]

GROUP = "nvidia-resiliency-ext ft_launcher flags (accepted for its launch scripts; docs/migration.md)"
GROUP_HELP = ("its settings flags are the --ft-<field> flags above (also spelled --ft-param-<field> and "
              "--ft-<field_with_underscores>); these are its other flags, and what each is here")

LOGS = ("no per-cycle log files and no log server here: the workers' output goes to the launcher's output, or with "
        "--log-dir and --redirects/--tee to attempt_N/<rank>/ files; the launcher logs to stderr and each monitor "
        "to monitor.log in the attempt's directory")
ATTRIBUTION = ("no attribution service here: ft-launcher names the root cause itself (error.json, diagnosis.json, "
               "the summary)")
HEALTH = "no node health check service here: GPU, NIC and storage health checks are not part of ft-launcher"
HOT_SPARES = "no hot spares or segment-aware rank assignment here: the node ranks are torch's rendezvous's"


@dataclass(frozen=True)
class NvrxFlag:
    """One flag of the reference's ft_launcher and what it is here."""

    names: tuple[str, ...]
    """Its spellings in the reference today (listed in --help); empty for a flag it has removed."""
    kind: Kind
    why: str
    """What it is here; ``ignored``: the warning's reason; ``same``: what to do instead of another value."""
    brief: str
    """--help's text."""
    target: str = ""
    value: Value = "str"
    choices: tuple[str, ...] = ()
    """The values the reference accepts (others are refused as it refuses them)."""
    only: tuple[str, ...] = ()
    old: tuple[str, ...] = ()
    """Spellings of older releases (accepted, left out of --help, as every spelling but the first is)."""

    @property
    def flag(self) -> str:
        """The name the launcher's lines use."""
        return (self.names or self.old)[0]

    @property
    def dest(self) -> str:
        if self.kind == "alias":
            return self.target
        return "nvrx_" + self.flag.lstrip("-").replace("-", "_")


def _ignored(*names: str, why: str, brief: str, old: tuple[str, ...] = (),
             choices: tuple[str, ...] = ()) -> NvrxFlag:
    return NvrxFlag(names, "ignored", why, "ignored: " + brief, old=old, choices=choices)


def _family(name: str, why: str, brief: str, old: bool = False) -> NvrxFlag:
    """One of a family of flags ignored for the same reason, spelled ``--ft-a-b`` and ``--ft_a_b``."""
    spellings = (name, "--ft_" + name.removeprefix("--ft-").replace("-", "_"))
    return _ignored(*(() if old else spellings), why=why, brief=brief, old=spellings if old else ())


def _logs(name: str, old: bool = False) -> NvrxFlag:
    return _family(name, LOGS, "no log server or per-cycle log files here (--log-dir, --redirects, --tee)", old)


def _attribution(name: str, old: bool = False) -> NvrxFlag:
    return _family(name, ATTRIBUTION, "no attribution service here", old)


FLAGS: tuple[NvrxFlag, ...] = (
    # stopping the workers
    NvrxFlag(("--term-timeout", "--term_timeout"), "torch", target="shutdown_timeout", value="float",
             why="torch's --shutdown-timeout (whole seconds, rounded up): the wait between the signal the launcher "
                 "forwards to the workers (it got SIGTERM, SIGINT, ...) and SIGKILL",
             brief="= torch's --shutdown-timeout (rounded up to whole seconds)"),
    NvrxFlag(("--workers-stop-timeout", "--workers_stop_timeout"), "setting", target="termination_grace_time",
             value="float",
             why="the termination_grace_time setting: the wait between SIGTERM and SIGKILL when the workers are "
                 "stopped for a restart (the monitor's stop of a hung rank waits as long)",
             brief="= --ft-termination-grace-time"),
    # the config file
    NvrxFlag(("--ft-cfg_path",), "alias", target="ft_cfg_path", old=("--ft-param-cfg-path", "--fault-tol-cfg-path"),
             why="--ft-cfg-path", brief="= --ft-cfg-path"),
    NvrxFlag(("--ft-ignore-missing-cfg",), "same", value="switch",
             old=("--ft-ignore_missing_cfg", "--ft-param-ignore-missing-cfg", "--ft-param-ignore_missing_cfg",
                  "--ignore-missing-fault-tol-cfg"),
             why="no config is needed here: without one the defaults apply (a --ft-cfg-path that cannot be read is "
                 "refused, as the reference fails on it)",
             brief="accepted: no config is needed here"),
    # settings spelled otherwise
    NvrxFlag(("--ft-storage-health-check-path", "--ft_storage_health_check_path"), "alias",
             target="ft_storage_healthcheck_path", why="--ft-storage-healthcheck-path (ignored, as the setting is)",
             brief="= --ft-storage-healthcheck-path (ignored, as that setting is)"),
    NvrxFlag((), "alias", target="ft_max_no_progress_cycles", old=("--ft-max-no-progress-restarts",
                                                                    "--ft-max_no_progress_restarts"),
             why="--ft-max-no-progress-cycles", brief="= --ft-max-no-progress-cycles"),
    # restarts
    NvrxFlag(("--ft-restart-policy", "--ft-restart_policy"), "same", choices=("any-failed", "min-healthy"),
             only=("any-failed",),
             old=("--ft-param-restart-policy", "--ft-param-restart_policy", "--restart-policy", "--restart_policy"),
             why="ft-launcher restarts every worker group when any worker fails (any-failed, torchrun's way); "
                 "drop the flag (for a job that goes on with fewer nodes, torch's --nnodes MIN:MAX)",
             brief="accepted: any-failed (what ft-launcher does); min-healthy is refused"),
    NvrxFlag(("--ft-no-restart-exit-code", "--ft_no_restart_exit_code"), "same", value="int", only=("3",),
             why="ft-launcher's exit code when it stops restarting for lack of progress is 3 (NO_PROGRESS; 4 and 5 "
                 "are a workload's requests) and cannot be changed: drop the flag and test for 3 (docs/launcher.md, "
                 "'Exit codes')",
             brief="accepted: 3 (ft-launcher's no-progress exit code); any other code is refused"),
    # rendezvous and rank assignment
    _ignored("--ft-rdzv-impl", "--ft-rdzv_impl", choices=("barrier", "legacy"),
             why="ft-launcher uses torch's rendezvous (--rdzv-backend; the reference defaults to c10d, torchrun to "
                 "static): there is no FT rendezvous to choose",
             brief="torch's rendezvous here (--rdzv-backend)"),
    _ignored(old=("--ft-use-infra-group-rank", "--ft-use_infra_group_rank"),
             why="node ranks are torch's rendezvous's; to make SLURM_PROCID the node rank use torch's static "
                 "rendezvous with --node-rank $SLURM_PROCID",
             brief="node ranks are torch's rendezvous's"),
    _ignored(old=("--ft-domain-id-from-node-name", "--ft-domain_id_from_node_name"), why=HOT_SPARES,
             brief="no hot spares here"),
    _ignored(old=("--ft-domain-id-prefix", "--ft-domain_id_prefix"), why=HOT_SPARES, brief="no hot spares here"),
    # health checks, monitors
    _ignored("--ft-node-health-check-endpoint", "--ft-node_health_check_endpoint", why=HEALTH,
             brief="no node health check service here"),
    _ignored(old=("--ft-enable-gpu-memory-check", "--ft-enable_gpu_memory_check"),
             why="no GPU memory check between restarts here: the monitors wait for the ranks' processes to exit",
             brief="no GPU memory check here"),
    _ignored(old=("--ft-enable-rank-monitors", "--ft-enable_rank_monitors"),
             why="every rank has its monitor under ft-launcher (torchrun runs without them)",
             brief="every rank has its monitor"),
    # logs
    _logs("--ft-per-cycle-applog-prefix"),
    _logs("--ft-nvrx-logfile"),
    _logs("--ft-enable-log-server"),
    _logs("--ft-log-server-port"),
    _logs("--ft-log-aggregator-count"),
    _logs("--ft-log-leaf-max-queue-chunks"),
    _logs("--ft-log-server-log-prefix"),
    _logs("--ft-log-server-graceful-shutdown-timeout"),
    _logs("--ft-log-server-log", old=True),
    _logs("--ft-base-logfile", old=True),
    # attribution (its endpoint, stop action and export URL are settings: ignored by the config)
    _attribution("--ft-attribution-startup-timeout"),
    _attribution("--ft-attribution-llm-api-key-file"),
    _attribution("--ft-attribution-llm-base-url"),
    _attribution("--ft-attribution-llm-model"),
    _attribution("--ft-attribution-analysis-backend"),
    _attribution("--ft-attribution-log-level"),
    _attribution("--ft-attribution-compute-timeout", old=True),
    _attribution("--ft-attribution-decision-timeout", old=True),
    _attribution("--ft-attrsvc-host", old=True),
    _attribution("--ft-attrsvc-port", old=True),
)
"""Every flag of the reference's ft_launcher that torchrun's parser lacks, but its settings flags."""


def field_spellings(fields: Iterable[str]) -> list[tuple[str, str]]:
    """(flag, dest): the reference's ``--ft-<field_with_underscores>`` spelling of each setting
    with an underscore in its name (``--ft-rank_heartbeat_timeout``)."""
    return [(f"--ft-{name}", f"ft_{name}") for name in fields if "_" in name]


def add_flags(parser: argparse.ArgumentParser, fields: Iterable[str]) -> None:
    """Every flag of `FLAGS` in their own --help group, which lists each by its first spelling,
    and `field_spellings` of ``fields`` (left out of --help)."""
    group = parser.add_argument_group(GROUP, GROUP_HELP)
    for entry in FLAGS:
        kwargs: dict[str, Any] = {"dest": entry.dest}
        if entry.value == "switch":
            kwargs["action"] = "store_true"
        else:
            kwargs.update(type={"str": str, "float": float, "int": int}[entry.value], metavar="VALUE")
            if entry.choices:
                kwargs.update(choices=entry.choices, metavar="{" + ",".join(entry.choices) + "}")
        if entry.kind == "alias":
            kwargs["default"] = argparse.SUPPRESS  # our flag's own default stays
        if entry.names:
            group.add_argument(entry.names[0], help=entry.brief, **kwargs)
        hidden = entry.names[1:] + entry.old
        if hidden:
            group.add_argument(*hidden, **{**kwargs, "default": argparse.SUPPRESS, "help": argparse.SUPPRESS})
    for flag, dest in field_spellings(fields):
        group.add_argument(flag, dest=dest, default=argparse.SUPPRESS, metavar="VALUE", help=argparse.SUPPRESS)


@dataclass(frozen=True)
class Outcome:
    """What the reference's flags on a command line ask of the launch."""

    refusal: str | None = None
    """One line: the launch is refused (exit 2)."""
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    """What a flag became (info lines)."""


def _seconds(flag: str, value: float) -> float | str:
    if not math.isfinite(value) or value < 0:
        return f"{flag} {value:g}: must be a number of seconds >= 0"
    return value


def apply(args: argparse.Namespace) -> Outcome:
    """Carry the reference's flags in ``args`` (parsed by a parser with `add_flags`) over to
    ours (torch's flag or our setting, set in ``args``), and say what is ignored; or the one
    line the launch is refused with."""
    notes: list[str] = []
    ignored: dict[str, list[str]] = {}
    for entry in FLAGS:
        given = getattr(args, entry.dest, None)
        if entry.kind == "alias" or given is None or given is False:
            continue
        if entry.kind == "ignored":
            ignored.setdefault(entry.why, []).append(entry.flag)
        elif entry.kind == "same":
            if entry.only and str(given) not in entry.only:
                return Outcome(refusal=f"{entry.flag} {given}: {entry.why}")
        elif entry.kind == "torch":
            seconds = _seconds(entry.flag, given)
            if isinstance(seconds, str):
                return Outcome(refusal=seconds)
            whole = math.ceil(seconds)
            if not hasattr(args, entry.target):  # torchrun has --shutdown-timeout from torch 2.12
                notes.append(f"{entry.flag} {given:g} (nvidia-resiliency-ext) is ignored: this torch's torchrun has "
                             f"no --{entry.target.replace('_', '-')} (it has from torch 2.12) and waits its fixed "
                             "30 s")
                continue
            other = getattr(args, entry.target, None)
            if other is not None and other != whole:
                return Outcome(refusal=f"{entry.flag} {given:g} and --{entry.target.replace('_', '-')} {other} (or "
                                       f"PET_{entry.target.upper()}) set the same wait: give one of them")
            setattr(args, entry.target, whole)
            notes.append(f"{entry.flag} {given:g} (nvidia-resiliency-ext): torch's --{entry.target.replace('_', '-')} "
                         f"{whole} s")
        elif entry.kind == "setting":
            seconds = _seconds(entry.flag, given)
            if isinstance(seconds, str):
                return Outcome(refusal=seconds)
            dest = f"ft_{entry.target}"
            other = getattr(args, dest, None)
            if other is not None and _number(other) != seconds:
                return Outcome(refusal=f"{entry.flag} {given:g} and --ft-{entry.target.replace('_', '-')} {other} "
                                       f"set the same setting ({entry.target}): give one of them")
            setattr(args, dest, f"{seconds:g}")
            notes.append(f"{entry.flag} {given:g} (nvidia-resiliency-ext): {entry.target} = {seconds:g} s")
    warnings = [f"ignored nvidia-resiliency-ext flag{'s' if len(flags) > 1 else ''} {', '.join(flags)}: {why}"
                for why, flags in ignored.items()]
    return Outcome(warnings=tuple(warnings), notes=tuple(notes))


def _number(value: object) -> float | None:
    try:
        return float(str(value))
    except ValueError:
        return None
