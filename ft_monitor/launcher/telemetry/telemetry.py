"""What ft-launcher tells the people who run the cluster: events, metrics, goodput, slow ranks.

`Telemetry` is told what the agent does (observed.py calls it: an attempt started or
ended, a hang, the group stopped, all ranks running again, a workload request) and
polls the local monitors' STATUS once a second (`tick`, from the agent's monitor
loop: no thread of its own). From that it

* writes the event stream (events.py) into the run's log directory;
* keeps the `metrics.Snapshot` that ``/metrics`` and the textfile export;
* derives goodput and the time lost per incident (goodput.py);
* flags slow ranks (slow_ranks.py), comparing with the other nodes through the
  rendezvous store (step_exchange.py: store_auth.StepTimes, signed with the job secret);
* hands torchelastic's own events and aggregated metrics to the same stream
  (torch_events.py).

Nothing here is on the training hot path: the monitors already time every section,
and the launcher only reads their summaries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ft_client.timeouts import STEP_SECTION
from ft_monitor.core.section_stats import SectionHistogram, median
from ft_monitor.core.status import MonitorStatus
from ft_monitor.launcher.rdzv.rounds import rendezvous_round
from ft_monitor.launcher.stop_signal import reraise_stop
from ft_monitor.launcher.store.step_exchange import STEP_TIMES_INDEX_KEY, exchange_step_times
from ft_monitor.launcher.store.store_auth import StoreChannel
from ft_monitor.launcher.store.store_board import IndexReader
from ft_monitor.launcher.telemetry.events import EventLog
from ft_monitor.launcher.telemetry.goodput import Goodput, Incident, goodput
from ft_monitor.launcher.telemetry.metrics import RankView, Snapshot
from ft_monitor.launcher.telemetry.slow_ranks import MIN_SAMPLES, SlowVerdict, judge
from ft_monitor.launcher.telemetry.torch_events import TorchMetrics

log = logging.getLogger("ft_monitor.launcher")

POLL_INTERVAL = 1.0
"""Seconds between STATUS polls of the local monitors (more often while a restart is pending)."""
STATS_INTERVAL = 60.0
"""Seconds between `stats` events (and torchelastic metric aggregates) while the job runs."""
TEXTFILE_INTERVAL = 5.0
PROGRESS_SAMPLES = 100.0
"""`progress` events: at most one per poll while an iteration changes, and no more often than
every ``run age / PROGRESS_SAMPLES`` seconds (a day-long run writes about a thousand, a
ten-second one a few per second); one more, whatever the interval, when a hang is handled
and when an attempt ends, so the report draws each rank's last progress before it."""
EXCHANGE_INTERVAL = 10.0
"""Seconds between publishing this node's step times in the store and reading the others'."""


@dataclass
class _RankMemory:
    """What the launcher last knew of a local rank (kept while it is not connected)."""

    rank: int
    last_progress: float | None = None
    iteration: int | None = None
    timeouts: dict[str, Any] = field(default_factory=dict)
    sections: dict[str, SectionHistogram] = field(default_factory=dict)
    snapshot_held: int | None = None
    snapshot_limit: int | None = None


@dataclass
class _PendingRestart:
    """A restart whose ranks are not all stepping again yet."""

    timing: Any  # agent.RestartTiming (its breakdown() is the summary JSON's)
    cause: str
    attempt: int
    incident: int | None = None
    """Index into Telemetry.incidents (hangs), None for a failure."""


class Telemetry:
    def __init__(self, *, config: Any, monitors: Any, host: str, nproc: int, max_restarts: int,
                 job_secret: bytes | None = None, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.monitors = monitors
        self.host = host
        self.clock = clock
        self.monotonic = monotonic
        self.start = clock()
        self.events = EventLog(host)
        self.torch_metrics = TorchMetrics()
        self.job_secret = job_secret
        self.nproc = nproc
        self.max_restarts = max_restarts
        self.attempt = 0
        self.group_starts = 0
        self.ranks: dict[int, _RankMemory] = {}
        self.hang_counts: dict[tuple[str, str], int] = {}
        self.restart_counts: dict[str, int] = {"process": 0, "inprocess": 0}
        self._inprocess_incidents: dict[tuple[int, int], int] = {}
        """(attempt, Wrapper iteration) -> index in `incidents` of a hang recovered in place."""
        self._inprocess_hangs: dict[tuple[int, int], dict[str, Any]] = {}
        """The earliest hang notice of each in-process restart under way: its "hang" event is emitted
        once the ranks are back and the row names the culprit (`inprocess_restart`)."""
        self.phases: dict[tuple[str, str], list[float]] = {}
        """(restart kind, phase) -> seconds, one per restart."""
        self.incidents: list[Incident] = []
        self.pending: _PendingRestart | None = None
        self._failure_timing: Any = None
        self.failed_ranks: dict[tuple[str, str], int] = {}
        """(rank, role: root or victim) -> failed attempts, as the crash verdicts said (crash.py)."""
        self._hang_this_attempt = False
        self.flagged: set[int] = set()
        self.verdicts: dict[int, SlowVerdict] = {}
        self.remote_medians: dict[int, float] = {}
        self._polled_at = -1e18
        self._stats_at = monotonic()
        self._textfile_at = -1e18
        self._exchanged_at = -1e18
        self._bad_values: set[bytes] = set()
        self._listed_in: Any = None
        self._step_index: IndexReader | None = None
        """The round's store whose step-times index lists this node (step_exchange.py)."""
        self.snapshot = Snapshot(start=self.start)
        self.metrics_url: str | None = None
        self.textfile: str | None = None
        self.write_textfile: Callable[[], None] | None = None
        self.finished_at: float | None = None
        """When `finish` recorded the job's end."""
        self._progress_sent: dict[int, tuple[int | None, float | None]] = {}
        """rank -> (iteration, last progress) as the last `progress` event had them."""
        self._progress_at = -1e18

    # -- the agent tells ---------------------------------------------------------
    def launcher_started(self, metrics_url: str | None, textfile: str | None) -> None:
        self.metrics_url, self.textfile = metrics_url, textfile
        self.events.emit("launcher_start", self.clock(), nproc_per_node=self.nproc, max_restarts=self.max_restarts,
                         metrics_url=metrics_url, metrics_textfile=textfile)

    def attempt_started(self, attempt: int, run_id: str, node_rank: int | None, ranks: Mapping[int, int],
                        pids: Mapping[int, int], log_dir: str | None) -> None:
        """Workers of ``attempt`` started: ``ranks`` local -> global, ``pids`` local -> pid."""
        now = self.clock()
        if log_dir is not None and self.events.path is None and self.events.attach(log_dir) is not None:
            log.info("ft-launcher: events in %s", self.events.path)
        self._flush_torch_metrics(now)
        self.attempt = attempt
        self.group_starts += 1
        if self.group_starts > 1:
            self.restart_counts["process"] += 1
        self._hang_this_attempt = False
        self.remote_medians.clear()
        for lr, rank in ranks.items():
            mem = self.ranks.get(lr)
            if mem is None or mem.rank != rank:
                self.ranks[lr] = _RankMemory(rank)
        if self._failure_timing is not None and self._failure_timing.workers_started is None:
            self._failure_timing.workers_started = now
        self.events.emit("attempt_start", now, attempt=attempt, run_id=run_id, node_rank=node_rank,
                         ranks={str(ranks[lr]): {"local_rank": lr, "pid": pids.get(lr)} for lr in sorted(ranks)},
                         log_dir=log_dir)
        self._publish()

    def rendezvous_done(self) -> None:
        if self._failure_timing is not None and self._failure_timing.rendezvous_done is None:
            self._failure_timing.rendezvous_done = self.clock()

    def hang(self, summary: Mapping[str, Any]) -> None:
        """A hang the launcher acts on by stopping the group (decide.HangDecision.summary)."""
        now = self.clock()
        self._hang_this_attempt = True
        self._count_hang(summary)
        self.events.emit("hang", now, **_hang_fields(summary, "kill"))
        self._incident(summary, now)
        self._publish()

    def _incident(self, summary: Mapping[str, Any], now: float) -> None:
        statuses = self._poll(now)
        self._progress(now, forced=True)
        before = [mem.iteration for mem in self.ranks.values() if mem.iteration is not None]
        medians = [m for st in statuses.values() if st is not None
                   for m in [_recent_median(st.section_stats.get(STEP_SECTION))] if m is not None]
        self.incidents.append(Incident(rank=int(summary["rank"]), onset=float(summary.get("onset_time") or now),
                                       iteration_before=max(before) if before else None,
                                       step_median_s=sum(medians) / len(medians) if medians else None))

    def diagnosis(self, row: Mapping[str, Any]) -> None:
        """A roll call's diagnosis.json was written (agent._roll_call's row)."""
        self.events.emit("diagnosis", self.clock(), attempt=int(row["attempt"]), rank=int(row["rank"]),
                         action=str(row["action"]), path=str(row["diagnosis"]), verdict=str(row["verdict"]),
                         basis=str(row["basis"]), behind=list(row["behind"]), roll_call_s=float(row["roll_call_s"]))

    def hang_timing(self, timing: Any) -> None:
        """The agent's RestartTiming for the hang just reported: the restart to follow."""
        self.pending = _PendingRestart(timing, "hang", self.attempt + 1, len(self.incidents) - 1)

    def inprocess_hang(self, notice: Mapping[str, Any]) -> None:
        """A monitor's hang verdict the ranks recover from in their own processes. Ranks that
        waited in a collective for the hung one may time out too before the restart reaches
        them: one restart, one hang and one incident, which keeps the earliest onset (the
        hung rank's), as `InprocessLedger.on_notice` does."""
        now = self.clock()
        key = (int(notice.get("attempt") or 0), int(notice.get("restart_iteration") or 0))
        index = self._inprocess_incidents.get(key)
        if index is not None:
            inc = self.incidents[index]
            onset = notice.get("onset_time")
            if onset is not None and float(onset) < inc.onset:
                self.incidents[index] = replace(inc, rank=int(notice["rank"]), onset=float(onset))
                self._inprocess_hangs[key] = dict(notice)
            return
        self._count_hang(notice)
        self._incident(notice, now)
        self._inprocess_incidents[key] = len(self.incidents) - 1
        self._inprocess_hangs[key] = dict(notice)  # its "hang" event waits for the ranks' word on the culprit
        self._publish()

    def inprocess_restart(self, row: Mapping[str, Any]) -> None:
        """Every local rank is back in its training function, in the same process (restart
        kind "inprocess"; the row of `InprocessLedger`, with its phases). The time lost to a
        hang runs from its onset to the ranks' first progress; the work redone from the
        restored state is not counted (the ranks report no iteration to resume from)."""
        now = self.clock()
        self.restart_counts["inprocess"] += 1
        phases = dict(row.get("phases") or {})
        for phase, value in phases.items():
            if value is not None:
                self.phases.setdefault(("inprocess", phase), []).append(value)
        lost = None
        key = (int(row.get("attempt") or 0), int(row.get("iteration") or 0))
        index = self._inprocess_incidents.pop(key, None)
        notice = self._inprocess_hangs.pop(key, None)
        culprit = row.get("rank")
        if notice is not None:
            reported_by = None
            if culprit is not None and culprit != notice.get("rank"):  # the rank reported first waited for it
                reported_by = {"rank": notice.get("rank"), "pid": notice.get("pid"), "message": notice.get("message"),
                               "report": notice.get("report"), "stack_dump": notice.get("stack_dump")}
                notice = {**notice, "rank": culprit, "pid": row.get("pid") or 0, "message": row.get("message") or "",
                          "local_rank": None, "report": None, "stack_dump": None, "error_file": None}
            self.events.emit("hang", now, **_hang_fields(notice, "inprocess"),
                             **({"reported_by": reported_by} if reported_by else {}))
        if index is not None and culprit is not None:
            self.incidents[index] = replace(self.incidents[index], rank=int(culprit))
        if index is not None and phases.get("total") is not None and row.get("detected_time") is not None:
            inc = replace(self.incidents[index], running_again=float(row["detected_time"]) + float(phases["total"]))
            self.incidents[index] = inc
            lost = inc.lost_s
        cause = "hang" if row.get("report") or notice is not None else str(row.get("reason") or "fault")
        self.events.emit("restart", now, mode="inprocess", cause=cause, attempt=int(row.get("attempt") or 0),
                         rank=row.get("rank"), phases=phases, lost_s=lost if lost is not None else phases.get("total"),
                         redone_iterations=None)
        self._publish()

    def workers_stopping(self) -> None:
        if self._failure_timing is not None and self._failure_timing.stop_began is None:
            self._failure_timing.stop_began = self.clock()

    def workers_stopped(self, began: float, cause: str, signal_name: str, grace: float) -> None:
        now = self.clock()
        if self._failure_timing is not None and self._failure_timing.stopped is None:
            self._failure_timing.stopped = now
        self.events.emit("kill", now, attempt=self.attempt, cause=cause, signal=signal_name, grace_s=grace,
                         began=began, ended=now, duration_s=max(0.0, now - began))

    def attempt_ended(self, state: str, failures: Mapping[int, Any], restarts_left: int,
                      timing: Any = None, crash: Any = None) -> None:
        """torch's verdict on the attempt (SUCCEEDED, FAILED, UNHEALTHY); ``failures`` global rank -> failure.
        ``timing``: the agent's `RestartTiming` of the restart that follows a failure (it fills it in);
        without one the telemetry times that restart itself. ``crash``: the agent's
        `crash.CrashVerdict` on the failure (the root, the victims), which the event carries."""
        from ft_monitor.launcher.incident.restarts import RestartTiming

        now = self.clock()
        for key in [k for k in self._inprocess_hangs if k[0] == self.attempt]:  # never back in place: the
            # fallback stopped the processes; the hang is the one its monitor reported
            self.events.emit("hang", now, **_hang_fields(self._inprocess_hangs.pop(key), "inprocess"))
        statuses = self._poll(now)
        self._progress(now, forced=True)
        high = max((m.iteration for m in self.ranks.values() if m.iteration is not None), default=None)
        verdict = {} if crash is None else {"root": crash.root, **crash.row()}
        self.events.emit("attempt_end", now, attempt=self.attempt, state=state, iteration=high,
                         failures=[{"rank": r, "exitcode": getattr(f, "exitcode", None),
                                    "message": str(getattr(f, "message", "") or "")[:500]}
                                   for r, f in sorted(failures.items())], **verdict)
        if crash is not None:
            for rank, role in [(crash.root, "root" if crash.root_seen else "victim"),
                               *((r, "root") for r in crash.others), *((r, "victim") for r in crash.victims)]:
                self.failed_ranks[(str(rank), role)] = self.failed_ranks.get((str(rank), role), 0) + 1
        if state != "SUCCEEDED" and not self._hang_this_attempt and restarts_left > 0:
            if timing is None:
                first = crash.root if crash is not None else min(failures) if failures else -1
                timing = self._failure_timing = RestartTiming(first, now, now, cause="failure", attempt=self.attempt)
            self.pending = _PendingRestart(timing, "failure", self.attempt + 1)
        self._stats(now, statuses)

    def workload_request(self, rank: int, action: str, reason: str) -> None:
        now = self.clock()
        self.events.emit("workload_request", now, rank=rank, action=action, reason=reason)
        if action == "ExcludeThisNode":
            self.events.emit("exclusion", now, rank=rank, reason=reason)

    # -- the monitor loop ----------------------------------------------------------
    def tick(self, wg: Any = None) -> None:
        """Called at every monitor tick; polls the monitors when due."""
        mono = self.monotonic()
        due = mono - self._polled_at >= POLL_INTERVAL
        if self.pending is not None and self.pending.timing.first_step is None:
            due = due or self.pending.cause == "failure"
        if not due:
            return
        now = self.clock()
        statuses = self._poll(now)
        self._progress(now)
        self._restart_progress(now, statuses)
        self._slow_ranks(now, statuses, wg)
        if mono - self._stats_at >= STATS_INTERVAL:
            self._stats(now, statuses)
        self._publish()
        if self.write_textfile is not None and mono - self._textfile_at >= TEXTFILE_INTERVAL:
            self._textfile_at = mono
            self.write_textfile()

    def finish(self, exit_code: int, outcome: str) -> None:
        now = self.finished_at = self.clock()
        statuses = self._poll(now)
        self._stats(now, statuses)
        gp = self._goodput(now)
        self.events.emit("job_end", now, exit_code=exit_code, outcome=outcome,
                         hangs=sum(self.hang_counts.values()), restarts=dict(self.restart_counts),
                         goodput=gp.ratio, productive_s=gp.productive_s, wall_s=gp.wall_s, lost_s=gp.lost_s)
        self._publish()
        if self.write_textfile is not None:
            self.write_textfile()

    def close(self, fallback_dir: str | None) -> None:
        if self.events.path is None and fallback_dir:
            self.events.attach(fallback_dir)
        self.events.close()

    # -- inside ----------------------------------------------------------------------
    def _count_hang(self, summary: Mapping[str, Any]) -> None:
        key = (str(summary.get("reason") or "unknown"), str(summary.get("section") or ""))
        self.hang_counts[key] = self.hang_counts.get(key, 0) + 1

    def _poll(self, now: float) -> dict[int, MonitorStatus | None]:
        self._polled_at = self.monotonic()
        statuses: dict[int, MonitorStatus | None] = self.monitors.statuses()
        for lr, st in statuses.items():
            if st is None:
                continue
            rank = st.rank.rank if st.rank is not None else None
            mem = self.ranks.get(lr)
            if mem is None:
                mem = self.ranks[lr] = _RankMemory(rank if rank is not None else lr)
            elif rank is not None:
                mem.rank = rank
            if st.rank is not None:
                if st.rank.since_last_progress_s is not None:
                    mem.last_progress = now - st.rank.since_last_progress_s
                if st.rank.iteration_now is not None:
                    mem.iteration = st.rank.iteration_now
            elif st.last_iteration is not None:  # gone: where its session ended, not where a poll last saw it
                mem.iteration = st.last_iteration
            self._timeouts_seen(now, mem, st.timeouts)
            mem.sections = dict(st.section_stats.sections)
            if st.snapshots is not None:
                mem.snapshot_held, mem.snapshot_limit = st.snapshots.held, st.snapshots.limit
        return statuses

    def _progress(self, now: float, forced: bool = False) -> None:
        """A `progress` event (each local rank's iteration and last progress) when an iteration
        changed and the interval (`PROGRESS_SAMPLES`) has passed, or ``forced`` (a hang, an
        attempt's end) when anything changed."""
        seen = {m.rank: (m.iteration, m.last_progress) for m in self.ranks.values() if m.last_progress is not None}
        sent = self._progress_sent
        moved = any(sent.get(r, (None, None))[0] != it for r, (it, _) in seen.items())
        if forced:
            moved = moved or any(sent.get(r) != v for r, v in seen.items())
        elif now - self._progress_at < max(POLL_INTERVAL, (now - self.start) / PROGRESS_SAMPLES):
            return
        if not moved:
            return
        self._progress_at = now
        self._progress_sent = dict(seen)
        ranks = {str(m.rank): {"local_rank": lr, "iteration": m.iteration, "last_progress": m.last_progress}
                 for lr, m in sorted(self.ranks.items()) if m.last_progress is not None}
        self.events.emit("progress", now, attempt=self.attempt, ranks=ranks)

    def _timeouts_seen(self, now: float, mem: _RankMemory, timeouts: dict[str, Any]) -> None:
        before = mem.timeouts
        mem.timeouts = timeouts
        if not before or before == timeouts:
            return
        changed = sorted(k for k in set(before) | set(timeouts) if k != "learned" and before.get(k) != timeouts.get(k))
        sections_before = before.get("rank_section_timeouts") or {}
        sections_now = timeouts.get("rank_section_timeouts") or {}
        changed += sorted(f"section:{n}" for n in set(sections_before) | set(sections_now)
                          if sections_before.get(n) != sections_now.get(n))
        changed = [c for c in changed if c != "rank_section_timeouts"]
        self.events.emit("timeouts", now, rank=mem.rank, timeouts=timeouts, learned=list(timeouts.get("learned", [])),
                         changed=changed)

    def _restart_progress(self, now: float, statuses: Mapping[int, MonitorStatus | None]) -> None:
        """Failure restarts: all ranks stepping again (the agent notes it for hang restarts).
        Any restart: once running, the iteration the ranks resumed from; then the restart event."""
        p = self.pending
        if p is None:
            return
        connected = [st.rank for st in statuses.values() if st is not None and st.rank is not None]
        all_up = len(connected) == len(statuses) and bool(connected)
        if p.cause == "failure" and p.timing.first_step is None and p.timing.workers_started is not None \
                and all_up and all(r.steps_started or r.heartbeats for r in connected):
            p.timing.first_step = now
        if p.timing.first_step is None:
            return
        resumed = [r.iteration_base for r in connected if r.iteration_base is not None]
        if p.incident is not None and all_up and len(resumed) < len(connected) \
                and now - p.timing.first_step < 30.0:
            return  # wait (a little) for the ranks to say where they resumed
        self.pending = None
        if p.cause == "failure":
            self._failure_timing = None
        phases = p.timing.breakdown()
        for phase, value in phases.items():
            if value is not None:
                self.phases.setdefault(("process", phase), []).append(value)
        lost = redone = None
        if p.incident is not None:
            inc = replace(self.incidents[p.incident], running_again=p.timing.first_step,
                          resumed_from=min(resumed) if resumed else None)
            self.incidents[p.incident] = inc
            lost, redone = inc.lost_s, inc.redone_iterations
        self.events.emit("restart", now, mode="process", cause=p.cause, attempt=p.attempt, rank=p.timing.rank,
                         phases=phases, lost_s=lost, redone_iterations=redone)

    def _slow_ranks(self, now: float, statuses: Mapping[int, MonitorStatus | None], wg: Any) -> None:
        threshold = self.config.slow_rank_ratio
        if threshold is None:
            return
        section = self.config.slow_rank_section
        local: dict[int, float] = {}
        local_ranks: dict[int, int] = {}
        for lr, mem in self.ranks.items():
            h = mem.sections.get(section)
            if h is not None and len(h.recent) >= MIN_SAMPLES:
                m = h.median_recent()
                if m is not None:
                    local[mem.rank] = m
                    local_ranks[mem.rank] = lr
        self._exchange(wg, section, local)
        medians = {**self.remote_medians, **local}
        self.verdicts = judge(medians, threshold, frozenset(self.flagged))
        for rank, v in self.verdicts.items():
            if rank not in local:
                continue
            fields = {"rank": rank, "section": section, "median_s": v.median_s, "others_median_s": v.others_median_s,
                      "ratio": v.ratio, "threshold": threshold}
            if v.slow and rank not in self.flagged:
                self.flagged.add(rank)
                log.warning("ft-launcher: rank %d (local rank %d) is slow: median %r section %.3fs, %.2fx the "
                            "other ranks' %.3fs (slow_rank_ratio %.2f)", rank, local_ranks[rank], section,
                            v.median_s, v.ratio, v.others_median_s, threshold)
                self.events.emit("slow_rank", now, **fields)
            elif not v.slow and rank in self.flagged:
                self.flagged.discard(rank)
                log.warning("ft-launcher: rank %d is no longer slow: median %r section %.3fs, %.2fx the others'",
                            rank, section, v.median_s, v.ratio)
                self.events.emit("slow_rank_cleared", now, **fields)

    def _exchange(self, wg: Any, section: str, local: dict[int, float]) -> None:
        """Publish this node's medians and read the other nodes' (multi-node, with a job secret)."""
        if wg is None or getattr(wg, "store", None) is None or (wg.group_world_size or 1) <= 1 \
                or self.job_secret is None:
            return
        mono = self.monotonic()
        if mono - self._exchanged_at < EXCHANGE_INTERVAL:
            return
        self._exchanged_at = mono
        channel = StoreChannel(self.job_secret, wg.spec.rdzv_handler.get_run_id(),
                               rendezvous_round(wg.spec.rdzv_handler, 0))  # its step times: this round's only
        if self._step_index is None or self._step_index.nodes != wg.group_world_size:
            self._step_index = IndexReader(STEP_TIMES_INDEX_KEY, wg.group_world_size)
        try:
            medians, listed = exchange_step_times(wg.store, channel, wg.group_rank, wg.group_world_size, section, local,
                                                  self.host, self._bad_values, listed=self._listed_in is wg.store,
                                                  index=self._step_index)
            self.remote_medians.update(medians)
            self._listed_in = wg.store if listed else None
        except Exception as e:  # noqa: BLE001 - slow-rank comparison across nodes is best effort
            reraise_stop(e)
            log.debug("ft-launcher: could not exchange step times with other nodes: %s", e)

    def _goodput(self, now: float) -> Goodput:
        steps = {mem.rank: h.sum_s for mem in self.ranks.values()
                 for h in [mem.sections.get(STEP_SECTION)] if h is not None and h.count}
        return goodput(steps, self.incidents, start=self.start, now=now)

    def _stats(self, now: float, statuses: Mapping[int, MonitorStatus | None]) -> None:
        self._stats_at = self.monotonic()
        self._flush_torch_metrics(now)
        gp = self._goodput(now)
        ranks = {}
        for lr, mem in sorted(self.ranks.items()):
            ranks[str(mem.rank)] = {
                "local_rank": lr, "iteration": mem.iteration,
                "sections": {name: {"count": h.count, "sum_s": round(h.sum_s, 6),
                                    "median_s": _recent_median(h)} for name, h in sorted(mem.sections.items())},
            }
        self.events.emit("stats", now, ranks=ranks, goodput=gp.ratio, productive_s=gp.productive_s,
                         wall_s=gp.wall_s, lost_s=gp.lost_s)

    def _flush_torch_metrics(self, now: float) -> None:
        drained = self.torch_metrics.drain()
        if drained:
            self.events.emit("torchelastic_metrics", now, metrics=drained)

    def torch_event(self, name: str, source: str, timestamp: float | None, metadata: dict[str, Any]) -> None:
        self.events.emit("torchelastic_event", self.clock(), name=name, source=source, timestamp=timestamp,
                         metadata=metadata)

    def _publish(self) -> None:
        """A new snapshot for /metrics (replaced whole: the HTTP thread reads whichever is current)."""
        now = self.clock()
        views = []
        for lr, mem in sorted(self.ranks.items()):
            v = self.verdicts.get(mem.rank)
            views.append(RankView(rank=mem.rank, local_rank=lr, last_progress=mem.last_progress,
                                  iteration=mem.iteration, sections=dict(mem.sections), timeouts=dict(mem.timeouts),
                                  slow=mem.rank in self.flagged, slow_ratio=None if v is None else v.ratio,
                                  snapshot_held=mem.snapshot_held, snapshot_limit=mem.snapshot_limit))
        self.snapshot = Snapshot(
            start=self.start, ranks=tuple(views), hangs=dict(self.hang_counts), restarts=dict(self.restart_counts),
            failures=dict(self.failed_ranks),
            restart_phases={k: tuple(v) for k, v in self.phases.items()},
            incident_lost=tuple(i.lost_s for i in self.incidents if i.lost_s is not None),
            goodput=self._goodput(now))

    def summary(self) -> dict[str, Any]:
        """For the launcher's summary JSON: goodput as of the job's end (job_end), not counting
        the launcher's own teardown after it (stopping the monitors and the /metrics server)."""
        gp = self._goodput(self.finished_at if self.finished_at is not None else self.clock())
        return {"events": None if self.events.path is None else str(self.events.path),
                "metrics_url": self.metrics_url, "metrics_textfile": self.textfile,
                "goodput": gp.ratio, "productive_s": gp.productive_s, "wall_s": gp.wall_s, "lost_s": gp.lost_s,
                "incidents": [{"rank": i.rank, "onset": i.onset, "running_again": i.running_again,
                               "iteration_before": i.iteration_before, "resumed_from": i.resumed_from,
                               "redone_iterations": i.redone_iterations, "step_median_s": i.step_median_s,
                               "lost_s": i.lost_s} for i in self.incidents],
                "slow_ranks": sorted(self.flagged)}


def _recent_median(h: SectionHistogram | None) -> float | None:
    return None if h is None else median(h.recent)


def _hang_fields(s: Mapping[str, Any], action: str) -> dict[str, Any]:
    """A ``hang`` event's fields from a summary row: a row whose culprit is on another node is
    the event of this node's rank that waited for it (``waiting``), with ``victim_of``."""
    waiting = s.get("waiting")
    if isinstance(waiting, Mapping):
        s = {**s, **waiting}
    return {"attempt": int(s.get("attempt") or 0), "rank": int(s["rank"]), "local_rank": s.get("local_rank"),
            "pid": int(s.get("pid") or 0), "reason": str(s.get("reason") or "unknown"), "section": s.get("section"),
            "message": str(s.get("message") or ""), "elapsed_s": float(s.get("elapsed_s") or 0.0),
            "timeout_s": float(s.get("timeout_s") or 0.0), "onset_time": float(s.get("onset_time") or 0.0),
            "detected_time": float(s.get("detected_time") or 0.0), "iteration": s.get("iteration"),
            "action": action, "report": s.get("report"), "stack_dump": s.get("stack_dump"),
            "error_file": s.get("error_file"), "victim_of": s.get("victim_of")}
