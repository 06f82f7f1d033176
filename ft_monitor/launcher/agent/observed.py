"""FtObservedAgent: FtLocalElasticAgent, with every step it takes told to the telemetry.

A subclass rather than calls spread through agent.py: the agent decides and acts,
this only watches (an attempt starting or ending, a hang carried out, the group
stopped, all ranks running again, a workload request) and tells `Telemetry`
(telemetry.py), which writes events and keeps the metrics. Each override calls the
agent's method and reports what happened; none changes what the agent does.
Telemetry errors are logged, never raised into the agent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState

from ft_monitor.core.notices import HangNotice
from ft_monitor.launcher.agent.agent import FtLocalElasticAgent
from ft_monitor.launcher.agent.control import EventKind, LauncherEvent
from ft_monitor.launcher.incident.decide import HangDecision
from ft_monitor.launcher.stop_signal import reraise_stop
from ft_monitor.launcher.store import job_identity
from ft_monitor.launcher.telemetry.telemetry import Telemetry

log = logging.getLogger("ft_monitor.launcher")


class FtObservedAgent(FtLocalElasticAgent):
    def __init__(self, *args: Any, telemetry: Telemetry, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.telemetry = telemetry
        self._attempt_open = False
        self._failed_telemetry = False
        self._identity: str | None = None
        """The job's identity agreed through the store, where torch's run id is ``none``."""

    def _tell(self, fn: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - telemetry must never stop the job
            reraise_stop(e)
            if not self._failed_telemetry:
                log.exception("ft-launcher: telemetry failed (events and metrics may be incomplete)")
            self._failed_telemetry = True

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        self.telemetry.slow.job_secret = self.nodes.job_secret  # the round's key (agent._use_key)
        self._tell(self.telemetry.rendezvous_done)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        pids: dict[int, Any] = super()._start_workers(worker_group)
        ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
        self._attempt_open = True
        self._tell(self.telemetry.attempt_started, self._attempt(), self._run_id(worker_group),
                   worker_group.group_rank, ranks,
                   {lr: int(p) for lr, p in pids.items()}, self._run_log_dir())
        return pids

    def _run_id(self, worker_group: WorkerGroup) -> str:
        """torch's run id, or, where it is the default ``none``, one the launchers agree on
        (job_identity.py): the report never merges two jobs' folders."""
        torch_id = str(worker_group.spec.rdzv_handler.get_run_id())
        if torch_id != job_identity.DEFAULT_RUN_ID:
            return torch_id
        mine = self._identity or job_identity.proposal()
        try:
            self._identity = job_identity.agree(worker_group.store, mine) if worker_group.store is not None else mine
        except Exception as e:  # noqa: BLE001 - a store error here is the rendezvous's to report, not ours
            reraise_stop(e)
            self._identity = mine
        return job_identity.run_id(torch_id, self._identity)

    def _run_log_dir(self) -> str | None:
        """torch's ``<log_dir>/<run_id>_<random>`` (the parent of ``attempt_N``), where events.jsonl goes."""
        for path in self._error_files().values():
            return str(Path(path).parent.parent.parent)
        return None

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._tell(self.telemetry.tick, worker_group)
        result: RunResult = super()._monitor_workers(worker_group)
        if self._attempt_open and result.state in (WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._attempt_open = False
            last = self.ft.restarts[-1] if self.ft.restarts else None
            crash = last if last is not None and last.cause == "failure" and last.stop_began is None else None
            verdict = getattr(self, "crash", None) if result.state is not WorkerState.SUCCEEDED else None
            self._tell(self.telemetry.attempt_ended, result.state.value, dict(result.failures),
                       self._remaining_restarts, crash, verdict)
        return result

    def _carry_out(self, decision: HangDecision) -> RunResult:
        result = super()._carry_out(decision)
        self._tell(self.telemetry.hang, decision.summary)
        self._tell(self.telemetry.hang_timing, self.ft.restarts[-1])
        return result

    def _failed_elsewhere(self, verdict: Any) -> None:
        """Torch restarts this node's healthy workers because another node's failed: its
        attempt_end and restart events name that failure's root, as the summary does."""
        super()._failed_elsewhere(verdict)
        if self._attempt_open:
            self._attempt_open = False
            self._tell(self.telemetry.attempt_ended, "FAILED", {}, self._remaining_restarts, self.ft.restarts[-1],
                       verdict)

    def _diagnosed(self, row: dict[str, Any]) -> None:
        super()._diagnosed(row)
        self._tell(self.telemetry.diagnosis, row)

    def _record_inprocess(self, notice: HangNotice) -> None:
        super()._record_inprocess(notice)
        self._tell(self.telemetry.inprocess_hang, {**notice.to_wire(), "attempt": self._attempt()})

    def _inprocess_done(self, row: dict[str, Any]) -> None:
        super()._inprocess_done(row)
        self._tell(self.telemetry.inprocess_restart, row)

    def _on_event(self, wg: WorkerGroup, event: LauncherEvent) -> RunResult | None:
        if event.kind is EventKind.CONTROL and event.action is not None:
            self._tell(self.telemetry.workload_request, event.rank, event.action.value, event.reason or "")
        return super()._on_event(wg, event)

    def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        began = time.time()
        cause = "hang" if self.ft.restarts and self.ft.restarts[-1].stop_began is None else "failure"
        if self.ft.outcome is not None:
            cause = "stop"
        self._tell(self.telemetry.workers_stopping)
        super()._stop_workers(worker_group, *args, **kwargs)
        self._tell(self.telemetry.workers_stopped, began, cause, "SIGTERM", self.ft.config.termination_grace_time)
