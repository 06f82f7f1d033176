"""FtLocalElasticAgent: torch's LocalElasticAgent plus the monitors.

Overrides only what the monitors need, and calls torch for everything else:

* `_start_workers`: every worker's environment gains FT_RANK_MONITOR_IPC_SOCKET
  (its own daemon) and FT_LAUNCHER_IPC_SOCKET;
* `_monitor_workers`: before asking torch about process exits, act on what the
  launcher socket received: a hang notice fails the attempt with a synthesized
  error.json (root cause = the hung rank), a workload request stops the job or
  this node; dead daemons are restarted; progress is tracked per attempt.
  What to do about a hang, and whether restarting goes on, is decided by the
  pure functions of decide.py; `_on_hang` gathers their inputs (the store
  exchange with the other nodes, the stack dump, the daemons' iterations) and
  carries out the result;
* `_stop_workers`: the grace period is termination_grace_time, and whatever is
  left of each worker's process group after torch's stop is SIGKILLed, only while
  the group is provably still the worker's (`groups.WorkerGroups`);
* `_rendezvous`: timed, for the restart breakdown.

On a hang, before the group is stopped (or, with ``on_hang: dump``, instead), the node
that owns the verdict takes the roll call of every rank of the job (rollcall.py) and
writes ``diagnosis.json`` in the attempt's log directory (diagnosis.py, verdict line in
the log and the summary); the other nodes answer its request from their monitor loop.

Checked with torch 2.13 (the only minor pyproject.toml admits). It relies on these
agent internals: `_start_workers`, `_monitor_workers`, `_stop_workers`, `_rendezvous`,
`_remaining_restarts`, `_pcontext`, `start_processes(envs=...)` in
local_elastic_agent, and `LocalElasticAgent` as a global of launcher/api.py;
torch_support.py checks each of them (and the others the launcher uses) at start and
refuses a torch that lacks one, before any worker starts.

With ``startup_timeout``, `_start_workers` also gives each worker the start-up hook
(ft_client/startup/__init__.py) and tells each daemon its worker's pid (`FtRuntime.announce_workers`).

This module is the agent's overrides and its attempt bookkeeping; the jobs they hand work
to have their own modules: runtime.py (`FtRuntime`), worker_env.py (the workers'
environment), hangs.py (a hang notice, the roll call: the `HangHandling` mixin),
crossnode.py (messages to the other nodes through the store), inprocess_watch.py (the
rows of in-process restarts) and restarts.py (`RestartTiming`). Their names used
elsewhere are importable from here too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from typing import Any

from torch.distributed.elastic.agent.server import local_elastic_agent as _lea
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ft_client.workload import WorkloadAction
from ft_monitor.core.notices import HangNotice
from ft_monitor.core.server_log import printable
from ft_monitor.launcher import exit_codes
from ft_monitor.launcher.agent.control import EventKind, LauncherEvent
from ft_monitor.launcher.agent.hangs import HangHandling, emit
from ft_monitor.launcher.agent.inprocess_watch import HANG_REASONS, INPROCESS_POLL_INTERVAL, InprocessWatch, log_back
from ft_monitor.launcher.agent.runtime import FtRuntime
from ft_monitor.launcher.agent.torch_support import with_stopped_workers
from ft_monitor.launcher.agent.worker_env import FR_BUFFER_ENV, TorchVersionError, store_address
from ft_monitor.launcher.agent.worker_env import started_with_ft_env as _worker_env
from ft_monitor.launcher.incident.crash import CrashVerdict, decide_crash, on_another_node
from ft_monitor.launcher.incident.crossnode import (
    ATTRIBUTION_WINDOW,
    CRASH_WAIT,
    HANG_KEY,
    SHUTDOWN_ACK_KEY,
    SHUTDOWN_KEY,
    STORE_POLL_INTERVAL,
    NodeMessages,
)
from ft_monitor.launcher.incident.decide import AttemptVerdict, decide_attempt_end, iteration_high
from ft_monitor.launcher.incident.restarts import RestartTiming, all_stepping, failed_ranks, failure_restart
from ft_monitor.launcher.incident.rollcall import RollCaller
from ft_monitor.launcher.incident.rootcause import crash_error_data, remote_crash_error_data, write_error_file
from ft_monitor.launcher.rdzv import etcd_state
from ft_monitor.launcher.rdzv.rdzv_delay import no_first_run_delay
from ft_monitor.launcher.rdzv.rounds import rendezvous_round, rounds_apart
from ft_monitor.launcher.rdzv.static_rdzv import fresh_worker_store, worker_store_address
from ft_monitor.launcher.store.agreed_key import round_key
from ft_monitor.launcher.store.sealed import Sealer
from ft_monitor.launcher.store.store_auth import CrashRecord

__all__ = [
    "FtLocalElasticAgent", "FtRuntime", "RestartTiming", "TorchVersionError", "store_address",
    "ATTRIBUTION_WINDOW", "FR_BUFFER_ENV", "HANG_KEY", "HANG_REASONS", "INPROCESS_POLL_INTERVAL", "PIN_INTERVAL",
    "SHUTDOWN_ACK_KEY", "SHUTDOWN_KEY", "STORE_POLL_INTERVAL",
]

log = logging.getLogger("ft_monitor.launcher")

PIN_INTERVAL = 1.0
"""Seconds between pinning the processes in the workers' groups (their children)."""


class FtLocalElasticAgent(HangHandling, _lea.LocalElasticAgent):
    def __init__(self, *args: Any, ft: FtRuntime, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ft = ft
        self._pinned_at = 0.0
        self._pending_first_step: RestartTiming | None = None
        self._pending_error: tuple[str, dict[str, Any]] | None = None
        self.crash: CrashVerdict | None = None
        """The latest failed attempt's verdict (crash.py), for the telemetry."""
        self.nodes = NodeMessages(ft.launcher_key)  # without a secret: the key agreed at each rendezvous
        etcd_state.guard(self._worker_group.spec.rdzv_handler)  # torch's etcd state: parsed by us, refused in a line
        self.inprocess = InprocessWatch(ft.inprocess, ft.monitors)
        self._rounds = 0
        self.rollcall = RollCaller(ft.monitors.socket, socket.gethostname(), ft.config.roll_call_timeout,
                                   ft.config.flight_recorder_entries > 0,
                                   sealer=Sealer(ft.launcher_key) if ft.launcher_key is not None else None)

    # -- start ---------------------------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        previous, previous_rank = worker_group.store, worker_group.group_rank
        # A restart is not torch's "first run": no random 0-0.3 s before joining (rdzv_delay).
        with no_first_run_delay() if self._rounds > 0 else contextlib.nullcontext(False):
            super()._rendezvous(worker_group)
        self._rounds += 1
        if previous is not None and previous is not worker_group.store \
                and rounds_apart(worker_group.spec.rdzv_handler):  # every node has left that round
            self.nodes.leave_round(previous, previous_rank, self.rollcall.written)
        self.nodes.round = rendezvous_round(worker_group.spec.rdzv_handler, self._rounds - 1, worker_group.store)
        self.rollcall.new_round(self.nodes.round)
        self._use_key(worker_group)
        self.ft.own_worker_store = fresh_worker_store(worker_group.spec.rdzv_handler)
        if self.ft.own_worker_store:  # static: a worker store of the attempt's own (static_rdzv.py)
            addr, port = worker_store_address(worker_group.spec.rdzv_handler, worker_group.store,
                                              worker_group.group_rank or 0, self.nodes.round)
            worker_group.master_addr, worker_group.master_port = addr, port  # type: ignore[assignment]  # torch: None
        if self.ft.restarts and self.ft.restarts[-1].rendezvous_done is None:
            self.ft.restarts[-1].rendezvous_done = time.time()

    def _use_key(self, wg: WorkerGroup) -> None:
        """The key of this round's messages to the other nodes: the job secret, else (several
        nodes under a static or c10d rendezvous) the key the launchers agree on through the
        round's store (agreed_key.py); None: the cross-node facts are off this round."""
        if self.ft.job_secret is None and self.ft.local_key is None:
            self.ft.agreed_key = round_key(wg.spec.rdzv_handler, wg.store, self.nodes.round)
        key = self.ft.launcher_key
        self.nodes.job_secret = key
        self.rollcall.sealer = Sealer(key) if key is not None else None

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self.ft.monitors.check()
        self.crash = None
        self.ft.inprocess_store = store_address(worker_group.store)
        warm = self.ft.warm.forking(self._attempt()) if self.ft.warm is not None else contextlib.nullcontext([])
        t0 = time.monotonic()
        with _worker_env(self.ft), warm as forked:
            pids: dict[int, Any] = super()._start_workers(worker_group)
        if forked:
            log.info("ft-launcher: attempt %d: %d worker(s) forked from the worker template in %.3f s (pids %s)",
                     self._attempt(), len(forked), time.monotonic() - t0, ", ".join(map(str, forked)))
        self.ft.groups.close()
        self.ft.groups.track(pids.values())  # torch starts each worker in its own session
        self.ft.worker_pids = set(pids.values())
        self.ft.attempts.append({"attempt": self._attempt(), "pids": {
            w.global_rank: pids[w.local_rank] for w in worker_group.workers if w.local_rank in pids},
            "started": "forked" if forked else "exec"})
        files = self._error_files()
        self.ft.announce_workers([(w.local_rank, w.global_rank, pids[w.local_rank], files.get(w.local_rank))
                                  for w in worker_group.workers if w.local_rank in pids])
        self._pinned_at = time.monotonic()
        if self.ft.restarts and self.ft.restarts[-1].workers_started is None:
            timing = self.ft.restarts[-1]
            timing.workers_started = time.time()
            timing.pids = frozenset(int(p) for p in pids.values())
            self._pending_first_step = timing
        return pids

    # -- watch ---------------------------------------------------------------
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        ft = self.ft
        ft.monitors.check()
        if ft.warm is not None:
            ft.warm.poll()
        self._note_first_step()
        self._note_inprocess()
        if time.monotonic() - self._pinned_at >= PIN_INTERVAL:
            self._pinned_at = time.monotonic()
            ft.groups.pin_members()
        # Several ranks may be reported at once (those waiting in a collective for the
        # hung one time out too): the earliest onset is the hung rank.
        events = sorted(ft.server.drain(), key=lambda e: (e.kind is not EventKind.HANG,
                                                          e.notice.onset_time if e.notice else 0.0))
        for event in events:
            result = self._on_event(worker_group, event)
            if result is not None:
                return result
        result = self._check_shared_shutdown(worker_group)
        if result is not None:
            return result
        self._answer_roll_calls(worker_group)
        watched: RunResult = super()._monitor_workers(worker_group)
        if watched.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            watched = self._attempt_ended(watched)
        return watched

    def _on_event(self, wg: WorkerGroup, event: LauncherEvent) -> RunResult | None:
        if event.kind is EventKind.HANG:
            assert event.notice is not None
            if event.notice.action == "inprocess":
                self._record_inprocess(event.notice)
                return None
            if event.notice.action == "dump":
                self._on_dump(wg, event.notice)
                return None
            return self._on_hang(wg, event.notice)
        if event.kind is EventKind.CONFIGURATION:  # not a fault: no restart would go otherwise
            message = f"configuration error on rank {event.rank}: {printable(event.reason or '-')}"
            log.error("ft-launcher: %s; stopping the job without a restart", message)
            self.nodes.publish_shutdown(wg, message, event.rank)
            return self._stop_for_good(wg, exit_codes.LAUNCHER_ERROR, message, event.rank)
        assert event.action is not None
        log.warning("ft-launcher: rank %d requests %s: %s", event.rank, event.action.value,
                    printable(event.reason or "-"))
        if event.action is WorkloadAction.Continue:
            return None
        if event.action is WorkloadAction.ShutdownWorkload:
            self.nodes.publish_shutdown(wg, event.reason, event.rank)
            return self._stop_for_good(wg, exit_codes.SHUTDOWN_REQUESTED,
                                       f"workload shutdown requested by rank {event.rank}: {event.reason}",
                                       event.rank)
        # Leaving must not close the rendezvous (torch closes it when an agent ends
        # normally), or the other nodes could not go on without this one.
        wg.spec.rdzv_handler.shutdown = lambda: True  # type: ignore[method-assign]
        return self._stop_for_good(wg, exit_codes.NODE_EXCLUDED,
                                   f"rank {event.rank} asked to exclude this node: {event.reason}", event.rank)

    # -- in-process restarts (inprocess_watch.py) -------------------------------
    def _record_inprocess(self, notice: HangNotice) -> None:
        """A monitor asked its rank to restart in-process: a summary row, no restart here."""
        self.inprocess.noticed(notice, self._attempt())

    def _note_inprocess(self) -> None:
        """Complete the rows of in-process restarts every local rank is back from."""
        for row in self.inprocess.completed(self._attempt()):
            self._inprocess_done(row)

    def _inprocess_done(self, row: dict[str, Any]) -> None:
        """Every local rank is back from an in-process restart (the summary row is complete)."""
        log_back(row)

    # -- attempts ----------------------------------------------------------------
    def _error_files(self) -> dict[int, str]:
        """local rank -> where torch told the worker to write its error.json (torch's
        ``<log_dir>/<run>/attempt_N/<local rank>/error.json``); none under a null log dir."""
        files = getattr(self._pcontext, "error_files", None) or {}
        return {lr: p for lr, p in files.items() if isinstance(p, str) and p != os.devnull}

    def _attempt(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    def _attempt_ended(self, result: RunResult) -> RunResult:
        """An attempt failed (torch saw a worker exit): the root of the crash is decided once
        (crash.py) and named first to torch (its failure table, a parent's error.json) and in
        every output; restarting stops if restarts make no progress; a restart that goes on is
        timed and listed like a hang's (`RestartTiming`, cause failure)."""
        attempt = self._attempt()
        statuses = self.ft.monitors.statuses()
        # before torch 2.10 torch's table holds only the first to fail, not the workers it then stopped
        failures = with_stopped_workers(dict(result.failures), self._pcontext, self._worker_group.workers)
        self.crash = decide_crash(failed_ranks(failures, statuses)) if failures else None
        self._end_attempt(decide_attempt_end(iteration_high(statuses), self.ft.tracker.state,
                                             self.ft.tracker.policy, self._remaining_restarts))
        if self.crash is None:
            return result
        self.crash = self._across_nodes(self.crash)
        log.error("ft-launcher: attempt %d failed: %s", attempt, printable(self.crash.message))
        self.ft.last_failure = f"attempt {attempt} failed: {self.crash.message}"
        if self.crash.root not in failures:  # on another node: torch's failures here are all victims
            ordered = self._victim_first(failures, self.crash)
        else:
            ordered = self._root_first(failures, self.crash)
        if self._remaining_restarts > 0:  # the error file of the rank named first here (the root's, or one naming it)
            first_file = next(iter(ordered.values())).error_file
            named = self.crash.root_seen and isinstance(first_file, str) and os.path.isfile(first_file)
            self.ft.restarts.append(failure_restart(self.crash, attempt, first_file if named else None))
        return RunResult(state=result.state, failures=ordered, return_values=result.return_values)

    def _across_nodes(self, verdict: CrashVerdict) -> CrashVerdict:
        """With several nodes: a root seen here is published for the others (crossnode.py); where
        every rank that failed here lost a peer, the root is looked for in another node's record
        (waited for a little: that node may decide after this one)."""
        wg = self._worker_group
        if wg.group_world_size is None or wg.group_world_size <= 1:
            return verdict
        round_ = rendezvous_round(wg.spec.rdzv_handler, self._rounds - 1, wg.store)
        if verdict.root_seen:
            self.nodes.publish_crash(wg, CrashRecord(verdict.root, verdict.how, socket.gethostname()), round_)
            return verdict
        remote = self.nodes.crash_elsewhere(wg, round_, wait=CRASH_WAIT)
        return verdict if remote is None else on_another_node(remote.rank, remote.how, remote.host, verdict)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """torch restarts the workers of a healthy node when another node waits to join (a
        membership change): where that node's ranks failed, its crash record names the root,
        and this node's restart is listed as that failure's (a summary row, one line)."""
        pending = self.ft.restarts and self.ft.restarts[-1].stop_began is None
        if not pending and worker_group.group_world_size and worker_group.group_world_size > 1:
            round_ = rendezvous_round(worker_group.spec.rdzv_handler, self._rounds - 1, worker_group.store)
            remote = self.nodes.crash_elsewhere(worker_group, round_)
            if remote is not None:
                verdict = on_another_node(remote.rank, remote.how, remote.host, None)
                log.error("ft-launcher: attempt %d: %s; this node's workers restart with the others",
                          self._attempt(), printable(verdict.message))
                self.ft.restarts.append(failure_restart(verdict, self._attempt()))
                self._failed_elsewhere(verdict)
        super()._restart_workers(worker_group)

    def _failed_elsewhere(self, verdict: CrashVerdict) -> None:
        """This node's attempt ends with another node's failure (observed.py tells the telemetry)."""

    def _root_first(self, failures: dict[int, ProcessFailure], verdict: CrashVerdict) -> dict[int, ProcessFailure]:
        """``failures`` with the root first and no later than any other (torch's "first observed
        failure" is the earliest timestamp, the first on a tie); a root that wrote no error file
        (killed, or exited without an exception) gets one saying so."""
        first = min(int(f.timestamp) for f in failures.values())
        path = self._error_files().get(failures[verdict.root].local_rank)  # torch's says "<N/A>" where none was written
        data = crash_error_data(verdict, first) if verdict.root_seen and path is not None \
            and not os.path.isfile(path) else None
        return self._first(failures, verdict.root, data)

    def _victim_first(self, failures: dict[int, ProcessFailure], verdict: CrashVerdict) -> dict[int, ProcessFailure]:
        """``failures`` (all victims) when the root was on another node (``verdict``, from its crash
        record): the earliest victim first, its error file saying that the root was that rank, on
        that node (what the victim raised itself kept below), so that torch's failure table and a
        parent launcher's error.json here name the root too."""
        victim = next((r for r in verdict.victims if r in failures), None)
        if victim is None:
            return failures
        first = min(int(f.timestamp) for f in failures.values())
        own = getattr(failures[victim], "error_file_data", None)
        return self._first(failures, victim, remote_crash_error_data(verdict, victim, own, first))

    def _first(self, failures: dict[int, ProcessFailure], rank: int,
               data: dict[str, Any] | None) -> dict[int, ProcessFailure]:
        """``failures`` with ``rank`` first and no later than any other (torch's "first observed
        failure" is the earliest timestamp, the first on a tie); ``data``: an error file to write
        for it first, at the path torch gave it (torch's failure then reads it)."""
        failure = failures[rank]
        first = min(int(f.timestamp) for f in failures.values())
        path = self._error_files().get(failure.local_rank)
        if data is not None and path is not None:
            try:
                write_error_file(path, data)
                failure = ProcessFailure(local_rank=failure.local_rank, pid=failure.pid, exitcode=failure.exitcode,
                                         error_file=path)
            except (OSError, ValueError) as e:
                log.warning("ft-launcher: cannot write the error file of rank %d, which names the root of the "
                            "failure: %s", rank, e)
        failure.timestamp = min(int(failure.timestamp), first)
        return {rank: failure, **{r: f for r, f in failures.items() if r != rank}}

    def _end_attempt(self, verdict: AttemptVerdict) -> None:
        self.ft.tracker.state = verdict.progress
        if verdict.outcome is not None:
            self.ft.outcome = verdict.outcome
            self.ft.outcome_message = verdict.outcome_message
        emit(verdict.logs)
        self._remaining_restarts = verdict.restarts_left

    def _stop_for_good(self, wg: WorkerGroup, code: int, message: str, rank: int | None = None) -> RunResult:
        self.ft.outcome = code
        self.ft.outcome_message = message
        self._remaining_restarts = 0
        worker = next((w for w in wg.workers if w.global_rank == rank), wg.workers[0])
        failure = ProcessFailure(local_rank=worker.local_rank, pid=worker.id, exitcode=0, error_file="<N/A>")
        failure.message = message
        return RunResult(state=WorkerState.FAILED, failures={worker.global_rank: failure})

    # -- shutdown across nodes (crossnode.py) -----------------------------------
    def _check_shared_shutdown(self, wg: WorkerGroup) -> RunResult | None:
        request = self.nodes.shared_shutdown(wg)
        if request is None:
            return None
        who = f"rank {request.rank}" if request.rank is not None else "a rank"
        return self._stop_for_good(wg, exit_codes.SHUTDOWN_REQUESTED,
                                   f"workload shutdown requested by {who} on {printable(request.host)}: "
                                   f"{printable(request.reason)}")

    # -- stop ----------------------------------------------------------------
    def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        timing = self.ft.restarts[-1] if self.ft.restarts and self.ft.restarts[-1].stop_began is None else None
        if timing is not None:
            timing.stop_began = time.time()
        self.ft.groups.pin_members()  # while the workers still lead their groups
        if self._pcontext is not None:
            self._pcontext.close(signal.SIGTERM, self.ft.config.termination_grace_time)  # type: ignore[arg-type]
        self.ft.groups.kill()
        super()._stop_workers(worker_group, *args, **kwargs)
        if timing is not None:
            timing.stopped = time.time()
        pending = self._pending_error
        if pending is not None:  # a dying worker may have written its own error.json over ours
            write_error_file(*pending)
            self._pending_error = None

    def _note_first_step(self) -> None:
        timing = self._pending_first_step
        if timing is None:
            return
        if all_stepping(timing, self.ft.monitors.statuses()):
            self._pending_first_step = None
            if self.ft.warm is not None:
                self.ft.warm.resume(force=True)  # a template paused for the restart imports on
