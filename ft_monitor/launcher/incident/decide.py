"""What the launcher does about a hang notice, decided without side effects.

The agent (agent.py) gathers the facts, calls these functions, and carries out
what they return; nothing here reads a clock, a file, a socket or the
rendezvous store, or logs (log lines are returned as `LogLine`s), so every
branch is tested with plain values (tests/test_launcher_decide.py).

A hang notice goes through two steps, because attribution across nodes needs a
store round-trip in between:

1. `triage_hang`: is the notice about a current worker (else it is ignored: a
   rank of an attempt already stopped, typically a victim reported late), and
   what this node publishes to the others (a `HangRecord`).
2. `decide_hang`: given the other nodes' store values for this round (checked
   here: unsigned, forged, replayed or malformed values are ignored, see
   store_auth.py), the rank that hung first (earliest onset; this node's own
   record wins a tie), whether this rank was its victim, the error.json to
   write, the summary entry, the restart timing's first timestamps, and whether
   restarting goes on (`decide_attempt_end`, also used for attempts that failed
   by a crash).
3. `with_diagnosis`, after the roll call: the culprit, decided once. The monitor
   whose deadline fired first is not always the hung rank's: with a heartbeat
   timeout every rank misses its deadline, and a rank waiting in a collective for
   the hung one may fire first. When the roll call's evidence (Flight Recorder,
   stacks) puts another rank behind, that rank is the culprit, and everything the
   launcher writes (the "hung" line, error.json, the summary entry, the restart's
   rank, events, metrics) names it; the monitor that fired is kept as ``reported_by``.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ft_monitor.core.notices import HangNotice
from ft_monitor.core.server_log import printable
from ft_monitor.core.status import MonitorStatus
from ft_monitor.launcher import exit_codes
from ft_monitor.launcher.incident.diagnosis import Diagnosis
from ft_monitor.launcher.incident.progress import Progress, ProgressPolicy
from ft_monitor.launcher.incident.rootcause import hang_error_data
from ft_monitor.launcher.store.store_auth import HangRecord, StoreChannel, StoreMessageError

HANG_EXIT_CODE = -int(signal.SIGTERM)
"""The exit code of the ProcessFailure a hang fails the attempt with (the launcher stops the rank with SIGTERM)."""


@dataclass(frozen=True)
class LogLine:
    """A line for the launcher's log, in logging's %-style (so the text is what ``log.log`` prints)."""

    level: int
    msg: str
    args: tuple[Any, ...] = ()

    def text(self) -> str:
        return self.msg % self.args if self.args else self.msg


@dataclass(frozen=True)
class WorkerRef:
    """One worker of the current attempt on this node."""

    global_rank: int
    local_rank: int
    pid: int


@dataclass(frozen=True)
class HangTriage:
    worker: WorkerRef | None
    """The hung worker; None when the notice names no current worker (it is ignored)."""
    record: HangRecord | None
    """This node's hang, to publish to the other nodes of the round (None when ignored)."""
    logs: tuple[LogLine, ...]

    @property
    def act(self) -> bool:
        return self.worker is not None


STOPPING = "stopping the worker group"


def hung_line(worker: WorkerRef, message: str, then: str = STOPPING) -> LogLine:
    """The launcher's one "hung" line of an incident."""
    return LogLine(logging.ERROR, "ft-launcher: rank %d (local rank %d, pid %d) hung: %s; %s",
                   (worker.global_rank, worker.local_rank, worker.pid, printable(message), then))


def triage_hang(notice: HangNotice, workers: Iterable[WorkerRef], host: str) -> HangTriage:
    """``logs``: with ``on_hang: dump`` the line to print; a hang that stops the group prints
    its line once the culprit is decided (`decide_hang`, `with_diagnosis`)."""
    worker = next((w for w in workers if w.pid == notice.pid), None)
    if worker is None:  # a worker of an attempt already stopped
        return HangTriage(None, None, (LogLine(logging.INFO, "ft-launcher: ignoring a hang notice for pid %d, "
                                                             "not a current worker", (notice.pid,)),))
    then = STOPPING if notice.action != "dump" else "diagnosing it; the job keeps running (on_hang: dump)"
    line = hung_line(worker, notice.message, then)
    return HangTriage(worker, HangRecord(worker.global_rank, notice.onset_time, notice.message, host), (line,))


@dataclass(frozen=True)
class AttemptVerdict:
    """After a failed attempt: the progress record, and whether restarting goes on."""

    progress: Progress
    restarts_left: int
    """torch's remaining restarts from now on: 0 when restarting stops for lack of progress."""
    outcome: int | None
    """exit_codes.NO_PROGRESS when restarting stops for lack of progress, else None."""
    outcome_message: str
    logs: tuple[LogLine, ...]

    @property
    def restart(self) -> bool:
        return self.restarts_left > 0


def iteration_high(statuses: Mapping[int, MonitorStatus | None]) -> int | None:
    """The highest ``iteration_high`` the local daemons report (their status replies), or None."""
    known = [st.iteration_high for st in statuses.values() if st is not None and st.iteration_high is not None]
    return max(known) if known else None


def decide_attempt_end(high: int | None, progress: Progress, policy: ProgressPolicy,
                       remaining_restarts: int) -> AttemptVerdict:
    """An attempt failed (hang or crash) with ``high`` the highest iteration reached: stop
    restarting if restarts make no progress (and any are left to stop)."""
    after, stop = progress.after_attempt(high, policy)
    if stop and remaining_restarts > 0:
        message = after.describe(policy)
        return AttemptVerdict(after, 0, exit_codes.NO_PROGRESS, message,
                              (LogLine(logging.ERROR, "ft-launcher: %s; not restarting again", (message,)),))
    return AttemptVerdict(after, remaining_restarts, None, "", ())


def read_hang_record(channel: StoreChannel, key: str, raw: bytes) -> HangRecord | StoreMessageError:
    """Another node's hang record at ``key``, or why the value is not an authentic one."""
    try:
        record = channel.decode(key, raw, HangRecord)
    except StoreMessageError as e:
        return e
    assert isinstance(record, HangRecord)
    return record


def first_hang(mine: HangRecord, channel: StoreChannel | None, peer_values: Mapping[str, bytes],
               after: float | None = None) -> tuple[HangRecord, tuple[tuple[str, str], ...]]:
    """The earliest-onset hang among this node's and the authentic records of the others
    (this node's wins a tie, then the order of ``peer_values``), and the values ignored, as (key, why).
    ``after``: with ``on_hang: dump`` the round goes on, and the other nodes' records of an
    earlier incident stay in the store: a record whose onset is not after it is ignored."""
    seen = [mine]
    ignored: list[tuple[str, str]] = []
    for key, raw in peer_values.items():
        record = read_hang_record(channel, key, raw) if channel is not None else \
            StoreMessageError("no job secret to check it with")
        if isinstance(record, HangRecord) and after is not None and record.onset_time <= after:
            ignored.append((key, "a hang of an earlier incident"))
        elif isinstance(record, HangRecord):
            seen.append(record)
        else:
            ignored.append((key, str(record)))
    return min(seen, key=lambda h: h.onset_time), tuple(ignored)


@dataclass(frozen=True)
class HangDecision:
    """What to do about a hang of a current worker: the attempt fails with `worker` as its failure."""

    worker: WorkerRef
    root_cause: HangRecord
    """The rank that hung first in this round, on any node (this node's record when no earlier one)."""
    victim_of: HangRecord | None
    """``root_cause`` when it is another rank: this rank was most likely waiting for it."""
    error_file: str
    error_data: dict[str, Any]
    """The error.json to write at ``error_file`` (and again after the stop), onset as its timestamp."""
    exitcode: int
    """Of the ProcessFailure the attempt fails with."""
    summary: dict[str, Any]
    """The hang's entry in the launcher's summary (``hangs[]``)."""
    detected: float
    """Wall clock of the detection (the daemon's, else ``now``), for the restart timing."""
    received: float
    attempt: AttemptVerdict
    ignored_records: tuple[tuple[str, str], ...]
    """Other nodes' store values that are not authentic hang records, as (key, why)."""
    logs: tuple[LogLine, ...]
    """After the store exchange, before the error file is written."""


def decide_hang(notice: HangNotice, worker: WorkerRef, mine: HangRecord, *, now: float,
                peer_values: Mapping[str, bytes], channel: StoreChannel | None, stack: str | None,
                error_file: str, attempt: int, high: int | None, progress: Progress, policy: ProgressPolicy,
                remaining_restarts: int) -> HangDecision:
    """Decide about the hang of ``worker`` (triaged, with ``mine`` published to the other nodes).

    ``now``: wall clock when the notice was taken up; ``peer_values``: the other nodes'
    values of this round's hang keys, as read from the store; ``stack``: the rank's stack
    dump text (None when not captured); ``error_file``: where torch told this worker to
    write its error.json; ``attempt``: the attempt's number; ``high``: the highest
    iteration the local daemons report; ``progress``/``policy``/``remaining_restarts``:
    the restart budget's state.
    """
    first, ignored = first_hang(mine, channel, peer_values)
    victim_of = first if first.rank != mine.rank else None
    logs: tuple[LogLine, ...] = (hung_line(worker, notice.message),)
    if victim_of is not None:
        logs = (_waited_line(victim_of, worker),)
    summary = {**notice.to_wire(), "error_file": error_file, "local_rank": worker.local_rank, "attempt": attempt,
               "victim_of": None if victim_of is None else victim_of.rank}
    if victim_of is not None:
        summary = victim_row(summary, victim_of.rank, worker)
    return HangDecision(
        worker=worker, root_cause=first, victim_of=victim_of, error_file=error_file,
        error_data=hang_error_data(notice, stack, victim_of), exitcode=HANG_EXIT_CODE, summary=summary,
        detected=notice.detected_time or now, received=now,
        attempt=decide_attempt_end(high, progress, policy, remaining_restarts),
        ignored_records=ignored, logs=logs,
    )


def victim_row(summary: dict[str, Any], culprit: int, worker: WorkerRef) -> dict[str, Any]:
    """The summary's row of a hang whose culprit is on another node: it names the culprit
    (``rank``, ``victim_of``), as every node's row of the incident does; this node's rank that
    waited for it is ``waiting`` (its rank, local rank and pid; the row's stack dump, report
    and error file are its)."""
    waiting = {"rank": summary.get("rank", worker.global_rank), "local_rank": worker.local_rank, "pid": worker.pid}
    return {**summary, "rank": culprit, "local_rank": None, "pid": None, "victim_of": culprit, "waiting": waiting}


def _waited_line(first: HangRecord, worker: WorkerRef) -> LogLine:
    return LogLine(logging.ERROR, "ft-launcher: rank %d on %s hung first (%s); rank %d here (local rank %d, pid %d) "
                                  "was waiting for it; %s",
                   (first.rank, printable(first.host), printable(first.message), worker.global_rank,
                    worker.local_rank, worker.pid, STOPPING))


@dataclass(frozen=True)
class RollCallFindings:
    """What a roll call's diagnosis says about who is behind, as the decision needs it."""

    path: str
    """diagnosis.json."""
    verdict: str
    culprit: int | None
    """The rank the evidence (Flight Recorder, stacks) puts behind the others; None when the
    verdict rests on the monitor's word alone."""
    host: str | None = None
    pid: int | None = None
    stack: str | None = None
    """The culprit's stack dump text, from the roll call."""
    stack_dump: str | None = None
    """Its file."""

    @classmethod
    def of(cls, diagnosis: Diagnosis, path: str) -> RollCallFindings:
        v = diagnosis.verdict
        culprit = v.behind[0] if v.basis != "monitor" and v.behind else None
        ev = next((e for e in diagnosis.evidence if e.rank == culprit), None)
        if ev is None:
            return cls(path, v.line, culprit)
        return cls(path, v.line, culprit, ev.host, ev.pid, ev.stack, ev.files.get("stack_dump"))


def with_diagnosis(decision: HangDecision, notice: HangNotice, stack: str | None, found: RollCallFindings,
                   workers: Iterable[WorkerRef] = (), error_files: Mapping[int, str] | None = None) -> HangDecision:
    """The decision once the roll call's diagnosis is written: error.json points at it and the
    summary entry carries its path and verdict line. When the evidence puts another rank behind
    the one whose monitor fired, that rank is the culprit: a worker of this node takes the
    failure, the "hung" line, error.json (at its own, from ``error_files`` by local rank) and
    the summary entry; a rank of another node makes this one its victim."""
    base = {**decision.summary, "diagnosis": found.path, "verdict": found.verdict}
    culprit = found.culprit
    if culprit is None or culprit == decision.worker.global_rank or decision.victim_of is not None:
        return replace(decision, summary=base,
                       error_data=hang_error_data(notice, stack, decision.victim_of, diagnosis=found.path,
                                                  verdict=found.verdict))
    reported = f"rank {notice.rank}'s monitor reported first: {notice.message}"
    local = next((w for w in workers if w.global_rank == culprit), None)
    if local is None:  # behind, on another node: this rank waited for it
        first = HangRecord(culprit, notice.onset_time, found.verdict, found.host or "another node")
        return replace(decision, victim_of=first, root_cause=first, logs=(_waited_line(first, decision.worker),),
                       summary=victim_row({**base, "victim_of": culprit}, culprit, decision.worker),
                       error_data=hang_error_data(notice, stack, first, diagnosis=found.path, verdict=found.verdict))
    message = f"{found.verdict} ({reported})"
    error_file = (error_files or {}).get(local.local_rank, decision.error_file)
    as_culprit = replace(notice, rank=local.global_rank, pid=local.pid, message=message,
                         stack_dump=found.stack_dump, stack_dump_captured=found.stack is not None)
    summary = {**base, "rank": local.global_rank, "local_rank": local.local_rank, "pid": local.pid,
               "message": message, "stack_dump": found.stack_dump, "stack_dump_captured": found.stack is not None,
               "report": None, "error_file": error_file,
               "reported_by": {"rank": notice.rank, "pid": notice.pid, "message": notice.message,
                               "report": notice.report, "stack_dump": notice.stack_dump}}
    return replace(decision, worker=local, error_file=error_file, summary=summary, logs=(hung_line(local, message),),
                   root_cause=HangRecord(culprit, notice.onset_time, message, decision.root_cause.host),
                   error_data=hang_error_data(as_culprit, found.stack, diagnosis=found.path, verdict=found.verdict))


def same_incident(onset_time: float, last_roll_call: float | None) -> bool:
    """With ``on_hang: dump`` (the job keeps running): a rank whose last progress is older than
    the last roll call was already stuck when it was taken, so its hang is part of that incident
    (no second roll call); one that made progress after it starts a new incident."""
    return last_roll_call is not None and onset_time <= last_roll_call
