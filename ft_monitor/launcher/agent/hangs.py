"""The agent's handling of a hang notice (`HangHandling`, a mixin of FtLocalElasticAgent):
gather the inputs of decide.py's verdict (the hang records of the other nodes, the stack
dump, the daemons' iterations), take the roll call when this node owns the verdict (or
answer the owner's), write ``diagnosis.json``, and carry the verdict out (the synthesized
error.json, the summary row, the restart's timing). ``on_hang: dump`` takes the roll call
and stops nothing."""

from __future__ import annotations

import logging
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ft_monitor.core.notices import HangNotice
from ft_monitor.core.server_log import printable
from ft_monitor.launcher.agent.runtime import FtRuntime
from ft_monitor.launcher.incident.crossnode import ATTRIBUTION_WINDOW, NodeMessages
from ft_monitor.launcher.incident.decide import (
    AttemptVerdict,
    HangDecision,
    LogLine,
    RollCallFindings,
    WorkerRef,
    decide_hang,
    first_hang,
    iteration_high,
    same_incident,
    triage_hang,
    with_diagnosis,
)
from ft_monitor.launcher.incident.diagnosis import HungRank
from ft_monitor.launcher.incident.restarts import RestartTiming
from ft_monitor.launcher.incident.rollcall import Rank, RollCaller, diagnosis_path, write_diagnosis
from ft_monitor.launcher.incident.rootcause import read_stack, write_error_file
from ft_monitor.launcher.stop_signal import reraise_stop
from ft_monitor.launcher.store.store_auth import MAX_TEXT, CrashRecord, RollCallVerdict, StoreChannel

log = logging.getLogger("ft_monitor.launcher")


def emit(lines: tuple[LogLine, ...]) -> None:
    """Log the lines decide.py's verdicts carry."""
    for line in lines:
        log.log(line.level, line.msg, *line.args)


class HangHandling:
    """Hang notices (action stop or dump), for FtLocalElasticAgent, which provides what is
    declared here."""

    ft: FtRuntime
    rollcall: RollCaller
    nodes: NodeMessages
    _remaining_restarts: int
    _pending_error: tuple[str, dict[str, Any]] | None

    if TYPE_CHECKING:
        def _attempt(self) -> int: ...

        def _error_files(self) -> dict[int, str]: ...

        def _end_attempt(self, verdict: AttemptVerdict) -> None: ...

    def _on_hang(self, wg: WorkerGroup, notice: HangNotice) -> RunResult | None:
        """Gather the inputs of decide.py's verdict (store, files, daemons), then carry it out."""
        triage = triage_hang(notice, self._workers(wg), socket.gethostname())
        if triage.worker is None or triage.record is None:
            emit(triage.logs)
            return None
        now = time.time()
        channel = self.nodes.channel(wg)
        peer_values = self.nodes.exchange_hang_records(wg, channel, triage.record)
        worker = triage.worker
        record = triage.record
        stack = read_stack(notice.stack_dump) if notice.stack_dump_captured else None
        high = iteration_high(self.ft.monitors.statuses())

        def decide(peers: Mapping[str, bytes]) -> HangDecision:
            return decide_hang(
                notice, worker, record, now=now, peer_values=peers, channel=channel, stack=stack,
                error_file=self._error_file_of(worker.local_rank, worker.pid), attempt=self._attempt(),
                high=high, progress=self.ft.tracker.state, policy=self.ft.tracker.policy,
                remaining_restarts=self._remaining_restarts)

        decision = self._diagnose(wg, channel, notice, decide(peer_values), stack, lambda: decide({}))
        self._publish_hang_root(wg, decision)
        return self._carry_out(decision)

    def _publish_hang_root(self, wg: WorkerGroup, decision: HangDecision) -> None:
        """The hung rank is this node's: its crash record for the round too (crossnode.py), for the
        nodes whose ranks fail on its kill (a peer gone) before their own monitors fire, or that
        torch restarts with it, so that they name it rather than the root being unknown there."""
        if decision.victim_of is not None or (wg.group_world_size or 1) <= 1 or self.nodes.round is None:
            return
        w = decision.worker
        how = f"rank {w.global_rank} (pid {w.pid}) hung: {decision.root_cause.message}"[:MAX_TEXT]
        self.nodes.publish_crash(wg, CrashRecord(w.global_rank, how, socket.gethostname()), self.nodes.round)

    # -- the roll call (rollcall.py) -------------------------------------------
    def _workers(self, wg: WorkerGroup) -> list[WorkerRef]:
        return [WorkerRef(w.global_rank, w.local_rank, w.id) for w in wg.workers]

    def _ranks(self, wg: WorkerGroup) -> list[Rank]:
        return [Rank(w.global_rank, w.local_rank, w.id) for w in wg.workers if w.id is not None]

    def _diagnose(self, wg: WorkerGroup, channel: StoreChannel | None, notice: HangNotice,
                  decision: HangDecision, stack: str | None,
                  alone: Callable[[], HangDecision] | None = None) -> HangDecision:
        """Before the group is stopped: the roll call, when this node owns the verdict; else
        this node's answer to the owner's (its ranks are about to be stopped), and then the
        owner's verdict, which this node takes as its own (``alone``: this node's decision
        without the other nodes' hang records, which the verdict then corrects): one incident,
        one culprit, on every node. Bounded by roll_call_timeout; a failure never stops the kill."""
        try:
            if decision.victim_of is not None:
                if not self.rollcall.answered_recently():
                    self.rollcall.answer_pending(
                        self._ranks(wg), store=wg.store, channel=channel, group_rank=wg.group_rank or 0,
                        group_world_size=wg.group_world_size or 1,
                        wait=self.ft.config.roll_call_timeout + ATTRIBUTION_WINDOW)
                return self._owners_verdict(wg, channel, notice, decision, stack, alone)
            found = self._roll_call(wg, channel, notice, decision.worker.local_rank)
        except Exception as e:  # noqa: BLE001 - diagnosis is best effort; the group is stopped regardless
            reraise_stop(e)
            log.exception("ft-launcher: the roll call failed; stopping the group without a diagnosis")
            return decision
        return with_diagnosis(decision, notice, stack, found, self._workers(wg), self._error_files())

    def _owners_verdict(self, wg: WorkerGroup, channel: StoreChannel | None, notice: HangNotice,
                        decision: HangDecision, stack: str | None,
                        alone: Callable[[], HangDecision] | None) -> HangDecision:
        """The verdict of the roll call this node answered, as this node's decision: the first
        hang by onset is only a guess (with a heartbeat timeout every rank misses its deadline,
        and the one waiting in a collective may have stopped first)."""
        if not self.rollcall.answered_recently():  # no roll call of this incident answered: nothing to wait for
            return decision
        verdict = self.rollcall.verdict_answered(wg.store, channel, self.ft.config.roll_call_timeout + 2.0)
        if verdict is None or verdict.culprit is None or alone is None:
            return decision
        mine = self.rollcall.last_evidence.get(verdict.culprit)
        found = RollCallFindings(f"{verdict.diagnosis} (on {verdict.host})", verdict.line, verdict.culprit,
                                 verdict.host, verdict.pid, mine.stack if mine is not None else None,
                                 mine.files.get("stack_dump") if mine is not None else None)
        log.warning("ft-launcher: the roll call's verdict, from the node that took it: %s", printable(verdict.line))
        return with_diagnosis(alone(), notice, stack, found, self._workers(wg), self._error_files())

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
        if multi:  # the nodes that answered take this verdict as theirs (`_owners_verdict`)
            self.rollcall.publish_verdict(wg.store, channel, wg.group_rank or 0, RollCallVerdict(
                rc.incident, found.culprit, found.host or socket.gethostname(), found.pid, v.line, str(path)))
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
            emit(triage.logs)
            return
        if same_incident(notice.onset_time, self.rollcall.last_started):
            log.warning("ft-launcher: rank %d hung too (no progress since the last roll call): part of the incident "
                        "already diagnosed", notice.rank)
            return
        emit(triage.logs)
        channel = self.nodes.channel(wg)
        first, _ = first_hang(triage.record, channel, self.nodes.exchange_hang_records(wg, channel, triage.record),
                              after=self.rollcall.last_started)
        if first.rank != triage.record.rank:
            self.rollcall.last_started = time.time()
            log.warning("ft-launcher: rank %d on %s hung first; the roll call is its node's", first.rank,
                        printable(first.host))
            return
        try:
            self._roll_call(wg, channel, notice, triage.worker.local_rank)
        except Exception as e:  # noqa: BLE001 - the job keeps running whatever happens here
            reraise_stop(e)
            log.exception("ft-launcher: the roll call failed")

    def _answer_roll_calls(self, wg: WorkerGroup) -> None:
        """Another node's roll call: dump this node's ranks and store them (polled at most every 0.25 s)."""
        if wg.store is None or (wg.group_world_size or 1) <= 1 or self.nodes.job_secret is None:
            return
        try:
            self.rollcall.answer_pending(self._ranks(wg), store=wg.store, channel=self.nodes.channel(wg),
                                         group_rank=wg.group_rank or 0, group_world_size=wg.group_world_size or 1)
        except Exception as e:  # noqa: BLE001 - answering is best effort
            reraise_stop(e)
            log.exception("ft-launcher: answering another node's roll call failed")

    def _carry_out(self, decision: HangDecision) -> RunResult:
        emit(decision.logs)
        worker = decision.worker
        try:
            write_error_file(decision.error_file, decision.error_data)
        except OSError as e:
            log.error("ft-launcher: cannot write %s: %s", decision.error_file, e)
        failure = ProcessFailure(local_rank=worker.local_rank, pid=worker.pid, exitcode=decision.exitcode,
                                 error_file=decision.error_file)
        self.ft.hangs.append(decision.summary)
        self._pending_error = (decision.error_file, decision.error_data)
        verdict = decision.summary.get("verdict") or decision.summary.get("message") or ""
        self.ft.restarts.append(RestartTiming(decision.root_cause.rank, decision.detected, decision.received,
                                              attempt=self._attempt(), message=str(verdict)))  # the culprit's
        self._end_attempt(decision.attempt)
        return RunResult(state=WorkerState.FAILED, failures={worker.global_rank: failure})

    def _error_file_of(self, local_rank: int, pid: int) -> str:
        """Where torch told this worker to write its error.json (never a path a peer names)."""
        return self._error_files().get(local_rank) or str(self.ft.monitors.run_dir / f"hang-error-{pid}.json")
