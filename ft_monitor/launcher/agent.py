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
(ft_client/startup.py) and tells each daemon its worker's pid (`FtRuntime.announce_workers`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server import local_elastic_agent as _lea
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ft_client import env as ft_env
from ft_client.errors import FtError
from ft_client.inprocess import timeline
from ft_client.inprocess.wrapper import HANG_SOURCES
from ft_client.jobkey import INPROCESS_KEY_ENV, launcher_inprocess_key
from ft_client.process_group import PROCESS_GROUP_TIMEOUT_ENV
from ft_client.startup import worker_env as startup_env
from ft_client.workload import WorkloadAction
from ft_monitor.core.notices import HangNotice
from ft_monitor.core.policy import Reason
from ft_monitor.core.server_log import printable
from ft_monitor.core.settings import Settings
from ft_monitor.core.startup import dump_spec
from ft_monitor.launcher import exit_codes
from ft_monitor.launcher.control import EventKind, LauncherEvent, LauncherServer
from ft_monitor.launcher.decide import (
    AttemptVerdict,
    HangDecision,
    LogLine,
    RollCallFindings,
    WorkerRef,
    decide_attempt_end,
    decide_hang,
    first_hang,
    iteration_high,
    read_hang_record,
    same_incident,
    triage_hang,
    with_diagnosis,
)
from ft_monitor.launcher.diagnosis import HungRank
from ft_monitor.launcher.groups import WorkerGroups
from ft_monitor.launcher.inprocess import InprocessLedger
from ft_monitor.launcher.monitors import MonitorPool
from ft_monitor.launcher.progress import ProgressTracker
from ft_monitor.launcher.rollcall import Rank, RollCaller, diagnosis_path, write_diagnosis
from ft_monitor.launcher.rootcause import read_stack, write_error_file
from ft_monitor.launcher.sealed import Sealer
from ft_monitor.launcher.store_auth import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    HangRecord,
    ShutdownRequest,
    StoreChannel,
    StoreMessageError,
)
from ft_monitor.processes.procinfo import descends_from

log = logging.getLogger("ft_monitor.launcher")

SHUTDOWN_KEY = "ft_launcher/shutdown"
SHUTDOWN_ACKS_KEY = "ft_launcher/shutdown_acks"
HANG_KEY = "ft_launcher/hang/{}"
STORE_POLL_INTERVAL = 1.0
INPROCESS_POLL_INTERVAL = 1.0
"""Seconds between reads of the monitors' STATUS for ranks back from an in-process restart."""
PIN_INTERVAL = 1.0
"""Seconds between pinning the processes in the workers' groups (their children)."""
FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
"""torch's Flight Recorder: entries each process keeps (0 or unset: off)."""
ATTRIBUTION_WINDOW = 0.5
"""Seconds a launcher waits, on several nodes, for the other nodes' hang reports of the
same rendezvous round: ranks waiting in a collective for a hung rank on another node
time out too, and only the earliest onset is the hung rank."""


HANG_REASONS = frozenset({r.value for r in Reason} | set(HANG_SOURCES))
"""In-process rows whose reason is a verdict on progress (a monitor's hang reason, or the Wrapper's
fault sources for one), as opposed to an exception or a peer that exited."""


def rendezvous_round(handler: Any, joined: int) -> int:
    """The rendezvous round just joined, the same number on every node: torch's dynamic
    handler's own (its store prefix names it too); else (a static rendezvous, whose one store
    every attempt shares, and whose nodes all restart together) ``joined``, the count of
    rendezvous this agent has done before."""
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    number = getattr(state, "round", None)
    if isinstance(number, int) and not isinstance(number, bool) and 0 <= number < 2**31:
        return number
    return joined


class TorchVersionError(FtError, RuntimeError):
    """torch's elastic internals are not what this launcher was built against."""


@dataclass
class RestartTiming:
    """One process restart of the worker group, whatever its cause, and where its time went
    between the failure's detection and all ranks running again."""

    rank: int
    detected: float  # wall clock, from the daemon (a hang) or the agent (a crash)
    notice_received: float
    stop_began: float | None = None
    stopped: float | None = None
    rendezvous_done: float | None = None
    workers_started: float | None = None
    first_step: float | None = None
    cause: str = "hang"
    """hang (the monitors' verdict), or failure (torch saw a worker exit: a crash, a kill)."""
    attempt: int = 0
    """The attempt that failed."""
    message: str = ""

    def row(self) -> dict[str, Any]:
        """The summary's row: cause, rank, attempt, message and the phases (`breakdown`)."""
        return {"cause": self.cause, "rank": self.rank, "attempt": self.attempt, "message": self.message,
                **self.breakdown()}

    def breakdown(self) -> dict[str, float | None]:
        def d(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(b - a, 3)

        return {
            "notify": d(self.detected, self.notice_received),
            "to_stop": d(self.notice_received, self.stop_began),
            "stop": d(self.stop_began, self.stopped),
            "rendezvous": d(self.stopped, self.rendezvous_done),
            "worker_start": d(self.rendezvous_done, self.workers_started),
            "first_step": d(self.workers_started, self.first_step),
            "total": d(self.detected, self.first_step),
        }


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
    inprocess: InprocessLedger = field(default_factory=InprocessLedger)
    """Restarts the ranks went through in their own processes (not charged to --max-restarts)."""

    @property
    def inprocess_restarts(self) -> list[dict[str, Any]]:
        return self.inprocess.summary()
    groups: WorkerGroups = field(default_factory=WorkerGroups)
    job_secret: bytes | None = None
    """Signs launcher messages in the rendezvous store (store_auth); None: cross-node features off."""
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

    def is_worker(self, pid: int) -> bool:
        """A current worker, or a process it started (a workload request may come from either)."""
        return descends_from(pid, self.worker_pids)

    def worker_env(self, local_rank: int) -> dict[str, str]:
        out = {
            ft_env.RANK_MONITOR_SOCKET: str(self.monitors.socket(local_rank)),
            ft_env.LAUNCHER_SOCKET: self.server.path,
            ft_env.LAUNCHER_PID: str(os.getpid()),
        }
        if self.inprocess_store is not None:
            out[ft_env.INPROCESS_STORE] = self.inprocess_store
        if self.config.startup_timeout is not None:  # the start-up hook: a stack dump before init
            report_dir = self.config.report_dir_for(self.monitors.socket(local_rank))
            out.update(startup_env(dump_spec(self.config, report_dir), os.environ))
        if self.config.process_group_timeout is not None:  # for ft_client.process_group_timeout()
            out[PROCESS_GROUP_TIMEOUT_ENV] = repr(self.config.process_group_timeout)
        if self.config.flight_recorder_entries > 0 and FR_BUFFER_ENV not in os.environ:
            out[FR_BUFFER_ENV] = str(self.config.flight_recorder_entries)  # torch's Flight Recorder, read at init
        return out

    def inprocess_key(self, run_id: str) -> str | None:
        """The workers' $FT_INPROCESS_KEY for run ``run_id`` (None: they choose, and warn)."""
        return launcher_inprocess_key(self.job_secret, self.local_key, run_id)

    def announce_workers(self, workers: list[tuple[int, int, int, str | None]]) -> None:
        """(local rank, global rank, pid, error file) of each worker just started: each daemon
        times its worker's start-up from now (startup_timeout)."""
        if self.config.startup_timeout is None:
            return
        for local_rank, global_rank, pid, error_file in workers:
            if not isinstance(error_file, str) or error_file == os.devnull:
                error_file = None
            self.monitors.announce(local_rank, pid, global_rank, error_file)


def store_address(store: object) -> str | None:
    """``host:port`` of the TCPStore under torch's PrefixStore wrappers, or None (another kind)."""
    for _ in range(8):
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if not isinstance(host, str) or not host or not isinstance(port, int) or not 0 < port < 65536:
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _how(exitcode: int) -> str:
    """How a worker ended, from its exit code (negative: the signal that killed it)."""
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        return f"was killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"was killed by signal {-exitcode}"


def _emit(lines: tuple[LogLine, ...]) -> None:
    for line in lines:
        log.log(line.level, line.msg, *line.args)


@contextlib.contextmanager
def _worker_env(ft: FtRuntime) -> Iterator[None]:
    """Add the FT_* variables to each worker's environment as torch starts them."""
    original = getattr(_lea, "start_processes")  # torch internals: checked to exist at start

    def start_processes(*args: Any, **kwargs: Any) -> Any:
        envs = kwargs.get("envs")
        if envs is None:
            raise TorchVersionError("ft-launcher: torch's start_processes was called without envs=; "
                                    "this torch version is not supported")
        for local_rank, worker_env in envs.items():
            worker_env.update(ft.worker_env(local_rank))
            worker_env.pop(SECRET_ENV, None)  # the job secret is the launchers', not the training code's
            worker_env.pop(SECRET_FILE_ENV, None)
            key = ft.inprocess_key(worker_env.get("TORCHELASTIC_RUN_ID") or "local")
            if key is not None:  # a key derived for the in-process Wrapper's records, not the secret
                worker_env[INPROCESS_KEY_ENV] = key
        return original(*args, **kwargs)

    setattr(_lea, "start_processes", start_processes)
    try:
        yield
    finally:
        setattr(_lea, "start_processes", original)


class FtLocalElasticAgent(_lea.LocalElasticAgent):
    def __init__(self, *args: Any, ft: FtRuntime, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ft = ft
        self._store_checked = 0.0
        self._pinned_at = 0.0
        self._pending_first_step: RestartTiming | None = None
        self._pending_error: tuple[str, dict[str, Any]] | None = None
        self._bad_store_values: set[bytes] = set()
        self._no_secret_warned = False
        self._inprocess_checked = 0.0
        self._rounds = 0
        self.rollcall = RollCaller(ft.monitors.socket, socket.gethostname(), ft.config.roll_call_timeout,
                                   ft.config.flight_recorder_entries > 0,
                                   sealer=Sealer(ft.job_secret) if ft.job_secret is not None else None)

    # -- start ---------------------------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        self._rounds += 1
        self.rollcall.new_round(rendezvous_round(worker_group.spec.rdzv_handler, self._rounds - 1))
        if self.ft.restarts and self.ft.restarts[-1].rendezvous_done is None:
            self.ft.restarts[-1].rendezvous_done = time.time()

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self.ft.monitors.check()
        self.ft.inprocess_store = store_address(worker_group.store)
        with _worker_env(self.ft):
            pids: dict[int, Any] = super()._start_workers(worker_group)
        self.ft.groups.close()
        self.ft.groups.track(pids.values())  # torch starts each worker in its own session
        self.ft.worker_pids = set(pids.values())
        self.ft.attempts.append({"attempt": self._attempt(), "pids": {
            w.global_rank: pids[w.local_rank] for w in worker_group.workers if w.local_rank in pids}})
        files = self._error_files()
        self.ft.announce_workers([(w.local_rank, w.global_rank, pids[w.local_rank], files.get(w.local_rank))
                                  for w in worker_group.workers if w.local_rank in pids])
        self._pinned_at = time.monotonic()
        if self.ft.restarts and self.ft.restarts[-1].workers_started is None:
            timing = self.ft.restarts[-1]
            timing.workers_started = time.time()
            self._pending_first_step = timing
        return pids

    # -- watch ---------------------------------------------------------------
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        ft = self.ft
        ft.monitors.check()
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
            self._attempt_ended(dict(watched.failures))
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
        assert event.action is not None
        log.warning("ft-launcher: rank %d requests %s: %s", event.rank, event.action.value,
                    printable(event.reason or "-"))
        if event.action is WorkloadAction.Continue:
            return None
        if event.action is WorkloadAction.ShutdownWorkload:
            self._publish_shutdown(wg, event.reason, event.rank)
            return self._stop_for_good(wg, exit_codes.SHUTDOWN_REQUESTED,
                                       f"workload shutdown requested by rank {event.rank}: {event.reason}",
                                       event.rank)
        # Leaving must not close the rendezvous (torch closes it when an agent ends
        # normally), or the other nodes could not go on without this one.
        wg.spec.rdzv_handler.shutdown = lambda: True  # type: ignore[method-assign]
        return self._stop_for_good(wg, exit_codes.NODE_EXCLUDED,
                                   f"rank {event.rank} asked to exclude this node: {event.reason}", event.rank)

    def _record_inprocess(self, notice: HangNotice) -> None:
        """A monitor asked its rank to restart in-process: a summary row, no restart here. The
        rank at fault is named once, when the ranks are back (`_inprocess_done`): the monitor
        that fired first may be that of a rank waiting for the hung one."""
        first = (self._attempt(), notice.restart_iteration or 0) not in self.ft.inprocess.rows
        self.ft.inprocess.on_notice(notice, self._attempt())
        self._inprocess_checked = 0.0  # look for the ranks' return at the next tick
        log.log(logging.WARNING if first else logging.INFO,
                "ft-launcher: rank %d's monitor reported no progress (%s)%s", notice.rank, printable(notice.message),
                f"; the ranks restart in-process as iteration {notice.restart_iteration} (same processes; not "
                "counted against --max-restarts)" if first else " too: part of the same in-process restart")

    def _note_inprocess(self) -> None:
        """Complete the rows of in-process restarts every local rank is back from."""
        now = time.monotonic()
        if now - self._inprocess_checked < INPROCESS_POLL_INTERVAL:
            return
        self._inprocess_checked = now
        statuses = self.ft.monitors.statuses()
        back = {lr: st.last_restart if st is not None else None for lr, st in statuses.items()}
        for row in self.ft.inprocess.on_statuses(back, len(statuses), self._attempt()):
            self._inprocess_done(row.to_json())

    def _inprocess_done(self, row: dict[str, Any]) -> None:
        """Every local rank is back from an in-process restart (the summary row is complete)."""
        b = row["phases"] or {}
        what = "hung" if row["reason"] in HANG_REASONS else "failed"
        log.warning("ft-launcher: rank %s %s: %s; all ranks back in their step loop %.2fs after it, in the same "
                    "processes (in-process iteration %d; %s)", row["rank"], what, printable(row["message"] or "-"),
                    b.get("total") or 0.0, row["iteration"], timeline.describe(b))

    def _on_hang(self, wg: WorkerGroup, notice: HangNotice) -> RunResult | None:
        """Gather the inputs of decide.py's verdict (store, files, daemons), then carry it out."""
        triage = triage_hang(notice, self._workers(wg), socket.gethostname())
        if triage.worker is None or triage.record is None:
            _emit(triage.logs)
            return None
        now = time.time()
        channel = self._channel(wg)
        peer_values = self._exchange_hang_records(wg, channel, triage.record)
        worker = triage.worker
        stack = read_stack(notice.stack_dump) if notice.stack_dump_captured else None
        decision = decide_hang(
            notice, worker, triage.record, now=now, peer_values=peer_values, channel=channel, stack=stack,
            error_file=self._error_file_of(worker.local_rank, worker.pid), attempt=self._attempt(),
            high=iteration_high(self.ft.monitors.statuses()), progress=self.ft.tracker.state,
            policy=self.ft.tracker.policy, remaining_restarts=self._remaining_restarts)
        return self._carry_out(self._diagnose(wg, channel, notice, decision, stack))

    # -- the roll call (rollcall.py) -------------------------------------------
    def _workers(self, wg: WorkerGroup) -> list[WorkerRef]:
        return [WorkerRef(w.global_rank, w.local_rank, w.id) for w in wg.workers]

    def _ranks(self, wg: WorkerGroup) -> list[Rank]:
        return [Rank(w.global_rank, w.local_rank, w.id) for w in wg.workers if w.id is not None]

    def _diagnose(self, wg: WorkerGroup, channel: StoreChannel | None, notice: HangNotice,
                  decision: HangDecision, stack: str | None) -> HangDecision:
        """Before the group is stopped: the roll call, when this node owns the verdict; else
        this node's answer to the owner's (its ranks are about to be stopped). Bounded by
        roll_call_timeout; a failure never stops the kill."""
        try:
            if decision.victim_of is not None:
                if self.rollcall.answered_recently():
                    return decision
                self.rollcall.answer_pending(self._ranks(wg), store=wg.store, channel=channel,
                                             group_rank=wg.group_rank or 0, group_world_size=wg.group_world_size or 1,
                                             wait=self.ft.config.roll_call_timeout + ATTRIBUTION_WINDOW)
                return decision
            found = self._roll_call(wg, channel, notice, decision.worker.local_rank)
        except Exception:  # noqa: BLE001 - diagnosis is best effort; the group is stopped regardless
            log.exception("ft-launcher: the roll call failed; stopping the group without a diagnosis")
            return decision
        return with_diagnosis(decision, notice, stack, found, self._workers(wg), self._error_files())

    def _roll_call(self, wg: WorkerGroup, channel: StoreChannel | None, notice: HangNotice,
                   local_rank: int) -> RollCallFindings:
        """Every rank of the job dumped and compared: diagnosis.json written; what it found."""
        hung = HungRank(notice.rank, socket.gethostname(), notice.pid, notice.message, notice.reason, notice.section,
                        notice.iteration, notice.detected_time, notice.report)
        multi = (wg.group_world_size or 1) > 1
        diagnosis = self.rollcall.run(
            hung, self._ranks(wg), store=wg.store if multi else None, channel=channel if multi else None,
            group_rank=wg.group_rank or 0, group_world_size=wg.group_world_size or 1,
            world_size=wg.workers[0].world_size if wg.workers else None, attempt=self._attempt())
        path = diagnosis_path(self._attempt_dir(local_rank))
        write_diagnosis(diagnosis, path)
        v, rc = diagnosis.verdict, diagnosis.roll_call
        answered = sum(1 for e in diagnosis.evidence if e.status == "answered")
        log.error("ft-launcher: verdict: %s", v.line)
        log.warning("ft-launcher: diagnosis %s (roll call %d: %.2fs, %d rank(s) answered of %d, Flight Recorder %s)",
                    path, rc.incident, rc.duration_s, answered, len(diagnosis.evidence) + len(diagnosis.missing_ranks),
                    "on" if rc.flight_recorder else "off")
        found = RollCallFindings.of(diagnosis, str(path))
        culprit = found.culprit is not None
        row = {"attempt": self._attempt(), "rank": found.culprit if culprit else notice.rank,
               "reported_by": notice.rank, "pid": found.pid if culprit and found.pid else notice.pid,
               "action": notice.action,
               "diagnosis": str(path), "verdict": v.line, "basis": v.basis, "behind": v.behind,
               "roll_call_s": round(rc.duration_s, 6), "detected_time": notice.detected_time,
               "written_time": time.time()}
        self.ft.diagnoses.append(row)
        self._diagnosed(row)
        return found

    def _diagnosed(self, row: dict[str, Any]) -> None:
        """A diagnosis was written (observed.py tells the telemetry)."""

    def _attempt_dir(self, local_rank: int) -> Path:
        """torch's ``<log_dir>/<run>/attempt_N`` (the parent of each worker's error file directory)."""
        path = self._error_files().get(local_rank)
        return Path(path).parent.parent if path is not None else Path(tempfile.mkdtemp(prefix="ft-diagnosis-"))

    def _on_dump(self, wg: WorkerGroup, notice: HangNotice) -> None:
        """``on_hang: dump``: the roll call and its diagnosis, once per incident; nothing is stopped."""
        triage = triage_hang(notice, self._workers(wg), socket.gethostname())
        if triage.worker is None or triage.record is None:
            _emit(triage.logs)
            return
        if same_incident(notice.onset_time, self.rollcall.last_started):
            log.warning("ft-launcher: rank %d hung too (no progress since the last roll call): part of the incident "
                        "already diagnosed", notice.rank)
            return
        _emit(triage.logs)
        channel = self._channel(wg)
        first, _ = first_hang(triage.record, channel, self._exchange_hang_records(wg, channel, triage.record),
                              after=self.rollcall.last_started)
        if first.rank != triage.record.rank:
            self.rollcall.last_started = time.time()
            log.warning("ft-launcher: rank %d on %s hung first; the roll call is its node's", first.rank,
                        printable(first.host))
            return
        try:
            self._roll_call(wg, channel, notice, triage.worker.local_rank)
        except Exception:  # noqa: BLE001 - the job keeps running whatever happens here
            log.exception("ft-launcher: the roll call failed")

    def _answer_roll_calls(self, wg: WorkerGroup) -> None:
        """Another node's roll call: dump this node's ranks and store them (polled at most every 0.25 s)."""
        if wg.store is None or (wg.group_world_size or 1) <= 1 or self.ft.job_secret is None:
            return
        try:
            self.rollcall.answer_pending(self._ranks(wg), store=wg.store, channel=self._channel(wg),
                                         group_rank=wg.group_rank or 0, group_world_size=wg.group_world_size or 1)
        except Exception:  # noqa: BLE001 - answering is best effort
            log.exception("ft-launcher: answering another node's roll call failed")

    def _carry_out(self, decision: HangDecision) -> RunResult:
        _emit(decision.logs)
        worker = decision.worker
        try:
            write_error_file(decision.error_file, decision.error_data)
        except OSError as e:
            log.error("ft-launcher: cannot write %s: %s", decision.error_file, e)
        failure = ProcessFailure(local_rank=worker.local_rank, pid=worker.pid, exitcode=decision.exitcode,
                                 error_file=decision.error_file)
        self.ft.hangs.append(decision.summary)
        self._pending_error = (decision.error_file, decision.error_data)
        self.ft.restarts.append(RestartTiming(worker.global_rank, decision.detected, decision.received,
                                              attempt=self._attempt()))
        self._end_attempt(decision.attempt)
        return RunResult(state=WorkerState.FAILED, failures={worker.global_rank: failure})

    def _error_files(self) -> dict[int, str]:
        """local rank -> where torch told the worker to write its error.json (torch's
        ``<log_dir>/<run>/attempt_N/<local rank>/error.json``); none under a null log dir."""
        files = getattr(self._pcontext, "error_files", None) or {}
        return {lr: p for lr, p in files.items() if isinstance(p, str) and p != os.devnull}

    def _error_file_of(self, local_rank: int, pid: int) -> str:
        """Where torch told this worker to write its error.json (never a path a peer names)."""
        return self._error_files().get(local_rank) or str(self.ft.monitors.run_dir / f"hang-error-{pid}.json")

    def _channel(self, wg: WorkerGroup) -> StoreChannel | None:
        """Signing for launcher messages in the store; None (logged once) without a job secret."""
        if self.ft.job_secret is None:
            if not self._no_secret_warned and (wg.group_world_size or 1) > 1:
                self._no_secret_warned = True
                log.warning("ft-launcher: no job secret (%s or --ft-job-secret-file): hang attribution and shutdown "
                            "across nodes are off, since anyone who reaches the rendezvous store could forge them",
                            SECRET_ENV)
            return None
        return StoreChannel(self.ft.job_secret, wg.spec.rdzv_handler.get_run_id())

    def _store_message(self, channel: StoreChannel, key: str, raw: bytes,
                       kind: type[HangRecord] | type[ShutdownRequest]) -> HangRecord | ShutdownRequest | None:
        try:
            return channel.decode(key, raw, kind)
        except StoreMessageError as e:
            self._warn_bad_store_value(key, raw, kind.KIND, e)
            return None

    def _warn_bad_store_value(self, key: str, raw: bytes, kind: str, error: Exception) -> None:
        """One warning per distinct bad value (at most 100 remembered)."""
        if raw not in self._bad_store_values and len(self._bad_store_values) < 100:
            self._bad_store_values.add(raw)
            log.warning("ft-launcher: ignored a %s message in the rendezvous store at %s: %s", kind, key, error)

    def _exchange_hang_records(self, wg: WorkerGroup, channel: StoreChannel | None,
                               mine: HangRecord) -> dict[str, bytes]:
        """Publish this node's hang in the rendezvous store (keys are per round) and return the
        values the other nodes stored within ATTRIBUTION_WINDOW, by key (decide.first_hang picks)."""
        store = wg.store
        values: dict[str, bytes] = {}
        if store is None or wg.group_world_size <= 1 or channel is None:
            return values
        try:
            keys = [HANG_KEY.format(r) for r in range(wg.group_world_size)]
            store.set(keys[wg.group_rank], channel.encode(keys[wg.group_rank], mine))
            end = time.monotonic() + ATTRIBUTION_WINDOW
            pending = [k for i, k in enumerate(keys) if i != wg.group_rank]
            while pending and time.monotonic() < end:
                for key in [k for k in pending if store.check([k])]:
                    raw = store.get(key)
                    values.pop(key, None)
                    values[key] = raw  # in order of the last read
                    record = read_hang_record(channel, key, raw)
                    if isinstance(record, HangRecord):  # a forged value stays pending: the real one may follow
                        pending.remove(key)
                    else:
                        self._warn_bad_store_value(key, raw, HangRecord.KIND, record)
                if pending:
                    time.sleep(0.05)
        except Exception as e:  # noqa: BLE001 - attribution is best effort
            log.warning("ft-launcher: could not compare hangs with other nodes: %s", e)
        return values

    def _attempt(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    def _attempt_ended(self, failures: dict[int, ProcessFailure] | None = None) -> None:
        """An attempt failed (torch saw a worker exit): stop restarting if restarts make no progress;
        a restart that goes on is timed and listed like a hang's (`RestartTiming`, cause failure)."""
        attempt = self._attempt()
        statuses = self.ft.monitors.statuses()
        self._end_attempt(decide_attempt_end(iteration_high(statuses), self.ft.tracker.state,
                                             self.ft.tracker.policy, self._remaining_restarts))
        if self._remaining_restarts > 0 and failures:
            # torch reports every failed worker at once, the ones it stopped itself (SIGTERM) among them,
            # and a rank whose peer raised may die of its own teardown (SIGABRT) before the one that
            # raised has exited. First: the ranks whose monitors heard them exit (EXITING), earliest
            # first; then one killed by a signal other than SIGTERM, one that exited, the earliest
            # error file, the rank
            exits = {r: e for r, f in failures.items() for st in [statuses.get(f.local_rank)]
                     if st is not None for e in [st.last_exit] if e is not None and e.pid == f.pid}
            order = sorted(failures, key=lambda r: (r not in exits, exits[r].at if r in exits else 0.0,
                                                    failures[r].exitcode == -signal.SIGTERM,
                                                    failures[r].exitcode >= 0, failures[r].timestamp, r))
            what = [f"rank {r} (pid {failures[r].pid}) "
                    + (f"raised {exits[r].reason[:200]} and " if r in exits else "") + _how(failures[r].exitcode)
                    for r in order]
            message = what[0] + (f" (then {', '.join(what[1:])})" if len(what) > 1 else "")
            now = time.time()
            self.ft.restarts.append(RestartTiming(order[0], now, now, cause="failure", attempt=attempt,
                                                  message=message))

    def _end_attempt(self, verdict: AttemptVerdict) -> None:
        self.ft.tracker.state = verdict.progress
        if verdict.outcome is not None:
            self.ft.outcome = verdict.outcome
            self.ft.outcome_message = verdict.outcome_message
        _emit(verdict.logs)
        self._remaining_restarts = verdict.restarts_left

    def _stop_for_good(self, wg: WorkerGroup, code: int, message: str, rank: int | None = None) -> RunResult:
        self.ft.outcome = code
        self.ft.outcome_message = message
        self._remaining_restarts = 0
        worker = next((w for w in wg.workers if w.global_rank == rank), wg.workers[0])
        failure = ProcessFailure(local_rank=worker.local_rank, pid=worker.id, exitcode=0, error_file="<N/A>")
        failure.message = message
        return RunResult(state=WorkerState.FAILED, failures={worker.global_rank: failure})

    # -- shutdown across nodes (through the rendezvous store) -----------------
    def _publish_shutdown(self, wg: WorkerGroup, reason: str, rank: int | None) -> None:
        store = wg.store
        channel = self._channel(wg)
        if store is None or channel is None or wg.group_world_size <= 1:
            return
        try:
            store.set(SHUTDOWN_KEY, channel.encode(SHUTDOWN_KEY, ShutdownRequest(reason, rank, socket.gethostname())))
            others = wg.group_world_size - 1
            end = time.monotonic() + 10.0
            while others > 0 and time.monotonic() < end and store.add(SHUTDOWN_ACKS_KEY, 0) < others:
                time.sleep(0.05)  # the store outlives this node only while we wait for the others to see it
        except Exception as e:  # noqa: BLE001 - the store may be gone; this node stops regardless
            log.warning("ft-launcher: could not publish the shutdown to other nodes: %s", e)

    def _check_shared_shutdown(self, wg: WorkerGroup) -> RunResult | None:
        now = time.monotonic()
        if wg.store is None or wg.group_world_size <= 1 or now - self._store_checked < STORE_POLL_INTERVAL:
            return None
        self._store_checked = now
        channel = self._channel(wg)
        if channel is None:
            return None
        try:
            if not wg.store.check([SHUTDOWN_KEY]):
                return None
            request = self._store_message(channel, SHUTDOWN_KEY, wg.store.get(SHUTDOWN_KEY), ShutdownRequest)
            if not isinstance(request, ShutdownRequest):
                return None
            wg.store.add(SHUTDOWN_ACKS_KEY, 1)
        except Exception:  # noqa: BLE001 - the store host may be gone
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
        statuses = self.ft.monitors.statuses()
        if all(st is not None and st.rank is not None and (st.rank.steps_started or st.rank.heartbeats)
               for st in statuses.values()):
            timing.first_step = time.time()
            self._pending_first_step = None
            b = timing.breakdown()
            log.warning("ft-launcher: all ranks running again %.2fs after rank %d's %s was detected "
                        "(notify %.3fs, to stop %.3fs, stop %.3fs, rendezvous %.3fs, worker start %.3fs, "
                        "first step %.3fs)", b["total"] or 0, timing.rank, timing.cause, b["notify"] or 0,
                        b["to_stop"] or 0, b["stop"] or 0, b["rendezvous"] or 0, b["worker_start"] or 0,
                        b["first_step"] or 0)
