"""`FtRuntime`: the monitors' side of the launcher, made by the CLI (main.py) and shared
with the agent: the settings, the local daemons, the launcher socket, the progress
tracker, and what the run has gathered for its summary (hangs, restarts, in-process
restarts, attempts, diagnoses) and its outcome."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ft_client.startup.loaded_modules import MODULES_FILE_ENV
from ft_client.store.jobkey import launcher_inprocess_key
from ft_monitor.core.settings import Settings
from ft_monitor.launcher.agent.control import LauncherServer
from ft_monitor.launcher.agent.groups import WorkerGroups
from ft_monitor.launcher.agent.inprocess import InprocessLedger
from ft_monitor.launcher.agent.monitors import MonitorPool
from ft_monitor.launcher.agent.worker_env import worker_variables
from ft_monitor.launcher.incident.progress import ProgressTracker
from ft_monitor.launcher.incident.restarts import RestartTiming
from ft_monitor.launcher.rdzv.static_rdzv import USE_AGENT_STORE_ENV
from ft_monitor.processes.procinfo import descends_from


@dataclass
class FtRuntime:
    """The monitors' side of the launcher, shared by the agent and the CLI."""

    config: Settings
    monitors: MonitorPool
    server: LauncherServer
    tracker: ProgressTracker
    outcome: int | None = None
    """An exit code decided by the monitors (no progress, shutdown, excluded), else None."""
    outcome_message: str = ""
    hangs: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[RestartTiming] = field(default_factory=list)
    last_failure: str = ""
    """The latest failed attempt's verdict (crash.py), the line the summary ends a job with when
    no restart was left for it."""
    inprocess: InprocessLedger = field(default_factory=InprocessLedger)
    """Restarts the ranks went through in their own processes (not charged to --max-restarts)."""

    @property
    def inprocess_restarts(self) -> list[dict[str, Any]]:
        return self.inprocess.summary()
    groups: WorkerGroups = field(default_factory=WorkerGroups)
    job_secret: bytes | None = None
    """Signs launcher messages in the rendezvous store (store_auth), when the user gave one."""
    agreed_key: bytes | None = None
    """Without a job secret on several nodes (static, c10d): the key the launchers agreed on through
    the rendezvous store in the round joined last (agreed_key.py); None: none could be agreed."""
    local_key: bytes | None = None
    """Without a job secret on a single node: a random key made at start, from which the
    workers' in-process key is derived (jobkey.launcher_inprocess_key)."""
    worker_pids: set[int] = field(default_factory=set)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    """Each attempt's workers: ``{"attempt": n, "pids": {global rank: pid}}`` (summary JSON)."""
    diagnoses: list[dict[str, Any]] = field(default_factory=list)
    """Each roll call's diagnosis: attempt, hung rank, path of diagnosis.json, verdict line (summary JSON)."""
    inprocess_store: str | None = None
    """``host:port`` of the rendezvous store, given to the workers for the in-process Wrapper."""
    warm: Any = None
    """`warm.WarmStarts` with ``--ft-warm-restart``: restarts fork their workers from a template."""
    own_worker_store: bool = False
    """The workers get a store of the attempt's own, not the agent's (static_rdzv.py)."""

    def is_worker(self, pid: int) -> bool:
        """A current worker, or a process it started (a workload request may come from either)."""
        return descends_from(pid, self.worker_pids)

    def worker_env(self, local_rank: int) -> dict[str, str]:
        """The variables `worker_env.started_with_ft_env` adds to this worker's environment."""
        out = worker_variables(self.config, self.monitors.socket(local_rank), self.server.path,
                               self.inprocess_store)
        if self.own_worker_store:  # global rank 0 hosts it at MASTER_PORT (static_rdzv.py)
            out[USE_AGENT_STORE_ENV] = str(False)
        modules_file = self.warm.modules_file(local_rank) if self.warm is not None else None
        if modules_file is not None:
            out[MODULES_FILE_ENV] = modules_file
        return out

    @property
    def report_dir(self) -> str | None:
        """report_dir as configured (None: each rank's reports and dumps go to its attempt directory)."""
        return self.config.report_dir

    def inprocess_key(self, run_id: str) -> str | None:
        """The workers' $FT_INPROCESS_KEY for run ``run_id`` (None: they choose, and warn)."""
        return launcher_inprocess_key(self.launcher_key, self.local_key, run_id)

    @property
    def launcher_key(self) -> bytes | None:
        """What signs the launchers' messages to each other: the job secret, else the agreed key
        (None: the cross-node facts are off)."""
        return self.job_secret if self.job_secret is not None else self.agreed_key

    def announce_workers(self, workers: list[tuple[int, int, int, str | None]]) -> None:
        """(local rank, global rank, pid, error file) of each worker just started: each daemon
        times its worker's start-up from now (startup_timeout)."""
        if self.config.startup_timeout is None:
            return
        for local_rank, global_rank, pid, error_file in workers:
            if not isinstance(error_file, str) or error_file == os.devnull:
                error_file = None
            self.monitors.announce(local_rank, pid, global_rank, error_file)
