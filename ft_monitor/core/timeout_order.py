"""Timeouts in the wrong order, found at launch (pure: values in, findings out).

A hang is diagnosed right only when the monitor acts before anything else gives up on
the job. Three orders matter (docs/configuration.md, "Timeouts in order", has the table):

1. Each detection timeout, plus ``stack_dump_timeout``, below the process-group timeout:
   ranks waiting in a collective (or in ``init_process_group``'s rendezvous) for a hung
   rank fail at that timeout; if they fail first, the hang is reported as their crash.
2. The same below ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` when it is set: NCCL's heartbeat
   monitor aborts a process whose watchdog is stuck that long (a rank hung in a CUDA or
   NCCL call), before it could be dumped.
3. The stop of a hang being handled (``stack_dump_timeout + termination_grace_time``;
   under ft-launcher also torch's shutdown wait and the monitors' stop) below the
   scheduler's grace between SIGTERM and SIGKILL (``scheduler_grace_time``: Slurm's
   KillWait, Kubernetes' terminationGracePeriodSeconds): else the SIGKILL cuts the dump.

`facts` gathers what can be read (settings, environment, torch's default when the caller
read it), `inversions` returns one `Inversion` per pair in the wrong order; its
`message` names both values, where they came from, and the fix. Logging them, or
refusing to start (``timeout_check: strict``), is the caller's (ft-launcher's main, the
``serve`` check).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ft_monitor.core.settings import Settings

NCCL_HEARTBEAT_ENV = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
NCCL_MONITORING_ENV = "TORCH_NCCL_ENABLE_MONITORING"
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
TORCH_SHUTDOWN_TIMEOUT = 30.0
"""torch.distributed.elastic's wait between SIGTERM and SIGKILL of the workers when the agent is stopped."""


@dataclass(frozen=True, slots=True)
class Limit:
    """Something outside the monitor that gives up on the job after ``seconds``."""

    seconds: float
    what: str
    """What it is and where the value came from, e.g. "the process-group timeout of 5 s
    (process_group_timeout)"."""


@dataclass(frozen=True, slots=True)
class Facts:
    """What is known at launch besides the settings."""

    process_group: Limit | None = None
    """None where unknown (``ft-monitor serve`` does not import torch)."""
    nccl_heartbeat: Limit | None = None
    shutdown_timeout: float | None = None
    """Under ft-launcher: torch's wait between SIGTERM and SIGKILL when the launcher is stopped."""


@dataclass(frozen=True, slots=True)
class Inversion:
    inner: str
    """The monitor's side, e.g. "rank_section_timeouts['step'] = 30 s"."""
    outer: str
    """The limit it must stay below, with where it came from."""
    consequence: str
    fix: str

    def message(self) -> str:
        return f"{self.inner} is not below {self.outer}: {self.consequence}. Fix: {self.fix}"


def _s(seconds: float) -> str:
    return f"{seconds:g} s"


def facts(config: Settings, environ: Mapping[str, str], *, torch_default: Limit | None = None,
          shutdown_timeout: float | None = None) -> Facts:
    """The limits known at launch: the process-group timeout (``process_group_timeout``, else
    ``torch_default`` when the caller could read torch), NCCL's heartbeat timeout from the
    environment, and (ft-launcher) torch's shutdown wait."""
    pg = torch_default
    if config.process_group_timeout is not None:
        pg = Limit(config.process_group_timeout,
                   f"the process-group timeout of {_s(config.process_group_timeout)} (process_group_timeout)")
    heartbeat = None
    text = environ.get(NCCL_HEARTBEAT_ENV)
    if text is not None and environ.get(NCCL_MONITORING_ENV, "1").strip() != "0":
        seconds = _seconds(text)
        if seconds is not None:
            heartbeat = Limit(seconds, f"NCCL's heartbeat timeout of {_s(seconds)} ({NCCL_HEARTBEAT_ENV})")
    return Facts(pg, heartbeat, shutdown_timeout)


def _seconds(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def detection_timeouts(config: Settings) -> list[tuple[str, float]]:
    """(name, seconds) of every configured timeout after which the monitor acts on a rank."""
    out: list[tuple[str, float]] = []
    for name in ("startup_timeout", "initial_rank_heartbeat_timeout", "rank_heartbeat_timeout",
                 "rank_out_of_section_timeout"):
        value = getattr(config, name)
        if value is not None:
            out.append((name, value))
    for section, value in config.rank_section_timeouts.items():
        if value is not None:
            out.append((f"rank_section_timeouts[{section!r}]", value))
    if config.on_hang == "inprocess":
        out.append(("inprocess_restart_timeout", config.inprocess_restart_timeout))
    return out


def inversions(config: Settings, known: Facts) -> list[Inversion]:
    """Every pair in the wrong order, in the order of the module docstring's rules."""
    out: list[Inversion] = []
    dump = config.stack_dump_timeout
    for limit, consequence, how in (
        (known.process_group,
         "ranks waiting for the hung rank in a collective or in init_process_group would time out first, and the "
         "hang would be reported as their crash",
         "process_group_timeout above {need}, passed as init_process_group(timeout=ft_client.process_group_timeout())"),
        (known.nccl_heartbeat,
         "NCCL's heartbeat monitor would abort a rank hung in a CUDA or NCCL call before it is dumped",
         NCCL_HEARTBEAT_ENV + " above {need}"),
    ):
        if limit is None:
            continue
        for name, seconds in detection_timeouts(config):
            need = seconds + dump
            if need < limit.seconds:
                continue
            inner = f"{name} = {_s(seconds)}" + (f" (+ stack_dump_timeout {_s(dump)})" if dump else "")
            fix = how.format(need=_s(need))
            if limit.seconds - dump > 0:
                fix += f", or {name} below {_s(limit.seconds - dump)}"
            out.append(Inversion(inner, limit.what, consequence, fix))
    grace = config.scheduler_grace_time
    if grace is not None:
        parts = [("stack_dump_timeout", dump), ("termination_grace_time", config.termination_grace_time)]
        if known.shutdown_timeout is not None:
            parts += [("torch's shutdown timeout", known.shutdown_timeout),
                      ("the monitors' stop (termination_grace_time)", config.termination_grace_time)]
        need = sum(seconds for _, seconds in parts)
        if need >= grace:
            spelled = " + ".join(f"{name} {_s(seconds)}" for name, seconds in parts)
            out.append(Inversion(
                f"stopping a hang being handled ({spelled} = {_s(need)})",
                f"scheduler_grace_time = {_s(grace)} (the scheduler's SIGTERM-to-SIGKILL grace)",
                "a job stopped by the scheduler while a hang is handled would be SIGKILLed before its stack dump and "
                "reports are written",
                f"a scheduler grace above {_s(need)} (Slurm: an early signal, --signal=B:TERM@<seconds>, or KillWait; "
                "Kubernetes: terminationGracePeriodSeconds) and scheduler_grace_time to match, or a shorter "
                "termination_grace_time"))
    return out


def refusal(found: list[Inversion]) -> str:
    """The one line ``timeout_check: strict`` exits with (the first inversion, and how many more)."""
    more = f" ({len(found) - 1} more: timeout_check: warn logs each)" if len(found) > 1 else ""
    return f"timeouts in the wrong order (timeout_check: strict): {found[0].message()}{more}"
