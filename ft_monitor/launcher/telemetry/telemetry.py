"""What ft-launcher tells the people who run the cluster: events, metrics, goodput, slow ranks.

`Telemetry` is told what the agent does (observed.py calls it: an attempt started or
ended, a hang, the group stopped, all ranks running again, a workload request) and
polls the local monitors' STATUS once a second (`tick`, from the agent's monitor
loop: no thread of its own). From that it

* writes the event stream (events.py) into the run's log directory;
* remembers each local rank's last word (local_ranks.py);
* keeps the `metrics.Snapshot` that ``/metrics`` and the textfile export;
* derives goodput and the time lost per incident (goodput.py);
* flags slow ranks (slow_watch.py, judged by slow_ranks.py), comparing with the other nodes
  through the rendezvous store (step_exchange.py: store_auth.StepTimes, signed with the job secret);
* hands torchelastic's own events and aggregated metrics to the same stream
  (torch_events.py).

Here: the restarts and incidents as the agent tells them, and what the events, the metrics
snapshot and the summary say of them (their fields: telemetry_fields.py, pure).

Nothing here is on the training hot path: the monitors already time every section,
and the launcher only reads their summaries.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ft_client.safefiles import write_bytes_atomic
from ft_client.timeouts import STEP_SECTION
from ft_monitor.core.status import MonitorStatus
from ft_monitor.launcher.telemetry.events import LOG_FOLDER_FILE, EventLog
from ft_monitor.launcher.telemetry.goodput import Goodput, Incident, goodput
from ft_monitor.launcher.telemetry.local_ranks import POLL_INTERVAL, LocalRanks
from ft_monitor.launcher.telemetry.metrics import Snapshot
from ft_monitor.launcher.telemetry.slow_watch import SlowRankWatch
from ft_monitor.launcher.telemetry.telemetry_fields import culprit_notice, hang_fields, incident_rows, recent_median
from ft_monitor.launcher.telemetry.torch_events import TorchMetrics

log = logging.getLogger("ft_monitor.launcher")

STATS_INTERVAL = 60.0
"""Seconds between `stats` events (and torchelastic metric aggregates) while the job runs."""
TEXTFILE_INTERVAL = 5.0


@dataclass
class _PendingRestart:
    """A restart whose ranks are not all stepping again yet."""

    timing: Any  # agent.RestartTiming (its breakdown() is the summary JSON's)
    cause: str
    attempt: int
    incident: int | None = None
    """Index into Telemetry.incidents (a hang's, or a failure's whose root was decided)."""


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
        self.local = LocalRanks(self.events, self.start)
        self.slow = SlowRankWatch(config=config, events=self.events, host=host, job_secret=job_secret,
                                  monotonic=monotonic)
        self.nproc = nproc
        self.max_restarts = max_restarts
        self.attempt = 0
        self.group_starts = 0
        self.hang_counts: dict[tuple[str, str, str], int] = {}
        self.restart_counts: dict[str, int] = {"process": 0, "inprocess": 0}
        self._inprocess_incidents: dict[tuple[int, int], int] = {}
        """(attempt, Wrapper iteration) -> index in `incidents` of a hang recovered in place."""
        self._inprocess_hangs: dict[tuple[int, int], dict[str, Any]] = {}
        """The earliest hang notice of each in-process restart under way: its "hang" event is emitted
        once the ranks are back and the row names the culprit (`inprocess_restart`)."""
        self._inprocess_done: dict[tuple[int, int], Mapping[str, Any]] = {}
        """The ledger's rows of the in-process restarts over, by (attempt, iteration): a hang notice
        that comes after its restart's row (read from the monitors' status first) is settled at once."""
        self._inprocess_told: set[tuple[int, int]] = set()
        """The in-process restarts whose hang event was emitted: a later notice is part of them."""
        self.phases: dict[tuple[str, str], list[float]] = {}
        """(restart kind, phase) -> seconds, one per restart."""
        self.incidents: list[Incident] = []
        self.pending: _PendingRestart | None = None
        self._failure_timing: Any = None
        self.failed_ranks: dict[tuple[str, str], int] = {}
        """(rank, role: root or victim) -> failed attempts, as the crash verdicts said (crash.py)."""
        self._hang_this_attempt = False
        self._polled_at = -1e18
        self._stats_at = monotonic()
        self._textfile_at = -1e18
        self.snapshot = Snapshot(start=self.start)
        self.metrics_url: str | None = None
        self.textfile: str | None = None
        self.write_textfile: Callable[[], None] | None = None
        self.finished_at: float | None = None
        """When `finish` recorded the job's end."""

    @property
    def flagged(self) -> set[int]:
        """The ranks flagged slow now (`SlowRankWatch`)."""
        return self.slow.flagged

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
            self._name_log_folder(log_dir)
        self._flush_torch_metrics(now)
        self.attempt = attempt
        self.group_starts += 1
        if self.group_starts > 1:
            self.restart_counts["process"] += 1
        self._hang_this_attempt = False
        self.slow.remote_medians.clear()
        self.local.attempt_started(ranks)
        if self._failure_timing is not None and self._failure_timing.workers_started is None:
            self._failure_timing.workers_started = now
            self._failure_timing.pids = frozenset(int(p) for p in pids.values())
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
        self.events.emit("hang", now, **hang_fields(summary, "kill"))
        self._incident(summary, now)
        self._publish()

    def _incident(self, summary: Mapping[str, Any], now: float) -> None:
        statuses = self._poll(now)
        self.local.progress(now, self.attempt, forced=True)
        medians = [m for st in statuses.values() if st is not None
                   for m in [recent_median(st.section_stats.get(STEP_SECTION))] if m is not None]
        self.incidents.append(Incident(rank=int(summary["rank"]), onset=float(summary.get("onset_time") or now),
                                       iteration_before=self.local.highest_iteration(),
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
        if key in self._inprocess_told:  # a waiting rank's monitor, after the restart was told
            return
        index = self._inprocess_incidents.get(key)
        if index is not None:
            inc = self.incidents[index]
            onset = notice.get("onset_time")
            if onset is not None and float(onset) < inc.onset:
                self.incidents[index] = replace(inc, rank=int(notice["rank"]), onset=float(onset))
                self._inprocess_hangs[key] = dict(notice)
            return
        self._incident(notice, now)  # counted (ft_hangs_total) with its hang event, once the culprit is known
        self._inprocess_incidents[key] = len(self.incidents) - 1
        self._inprocess_hangs[key] = dict(notice)  # its "hang" event waits for the ranks' word on the culprit
        done = self._inprocess_done.get(key)
        if done is not None:  # the ranks' word came first (read from the monitors' status): settled now
            self._settle_inprocess(key, done, now)
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
        key = (int(row.get("attempt") or 0), int(row.get("iteration") or 0))
        self._inprocess_done[key] = row
        hang = key in self._inprocess_hangs
        lost = self._settle_inprocess(key, row, now)
        cause = "hang" if row.get("report") or hang else str(row.get("reason") or "fault")
        self.events.emit("restart", now, mode="inprocess", cause=cause, attempt=int(row.get("attempt") or 0),
                         rank=row.get("rank"), phases=phases, lost_s=lost if lost is not None else phases.get("total"),
                         redone_iterations=None)
        self._publish()

    def _settle_inprocess(self, key: tuple[int, int], row: Mapping[str, Any], now: float) -> float | None:
        """The in-process restart ``key`` is over (``row``, the ledger's, names the culprit): the hang
        event of its notice, named after the culprit, and its incident's culprit and end, whichever of
        the notice and the row came first. The time lost, when known."""
        index = self._inprocess_incidents.pop(key, None)
        notice = self._inprocess_hangs.pop(key, None)
        culprit = row.get("rank")
        if notice is not None:
            self._inprocess_told.add(key)
            told, reported_by = culprit_notice(notice, row)  # reported_by: the rank reported first waited for it
            self._count_hang(told)
            self.events.emit("hang", now, **hang_fields(told, "inprocess"),
                             **({"reported_by": reported_by} if reported_by else {}))
        if index is None:
            return None
        if culprit is not None:
            self.incidents[index] = replace(self.incidents[index], rank=int(culprit))
        phases = row.get("phases") or {}
        if phases.get("total") is None or row.get("detected_time") is None:
            return None
        inc = replace(self.incidents[index], running_again=float(row["detected_time"]) + float(phases["total"]))
        self.incidents[index] = inc
        return inc.lost_s

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
            notice = self._inprocess_hangs.pop(key)
            self._count_hang(notice)
            self.events.emit("hang", now, **hang_fields(notice, "inprocess"))
        statuses = self._poll(now)
        self.local.progress(now, self.attempt, forced=True)
        high = self.local.highest_iteration()
        verdict = {} if crash is None else {"root": crash.named, **crash.row()}
        self.events.emit("attempt_end", now, attempt=self.attempt, state=state, iteration=high,
                         failures=[{"rank": r, "exitcode": getattr(f, "exitcode", None),
                                    "message": str(getattr(f, "message", "") or "")[:500]}
                                   for r, f in sorted(failures.items())], **verdict)
        if crash is not None:
            for rank, role in [(crash.root, "root" if crash.root_seen else "victim"),
                               *((r, "root") for r in crash.others), *((r, "victim") for r in crash.victims)]:
                self.failed_ranks[(str(rank), role)] = self.failed_ranks.get((str(rank), role), 0) + 1
        incident = None
        if state != "SUCCEEDED" and not self._hang_this_attempt and crash is not None and crash.named is not None:
            # a crash is an incident as a hang is: its time and the work redone count as lost (named after
            # its root as every output names it: never a victim here whose root was not seen)
            onset = getattr(timing, "detected", None) or now
            self._incident({"rank": crash.named, "onset_time": onset}, now)
            incident = len(self.incidents) - 1
        if state != "SUCCEEDED" and not self._hang_this_attempt and restarts_left > 0:
            if timing is None:
                first = crash.root if crash is not None else min(failures) if failures else -1
                timing = self._failure_timing = RestartTiming(first, now, now, cause="failure", attempt=self.attempt,
                                                              crash=crash)
            self.pending = _PendingRestart(timing, "failure", self.attempt + 1, incident)
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
        self.local.progress(now, self.attempt)
        self._restart_progress(now, statuses)
        self.slow.check(now, self.local.ranks, wg)
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
    def _name_log_folder(self, log_dir: str) -> None:
        """The run's log folder, named in the launcher's private folder (`LOG_FOLDER_FILE`):
        `ft-launcher status LOG_FOLDER` finds this launcher's monitors by it. Nothing that
        outlives the launcher names its private folder."""
        run_dir = getattr(self.monitors, "run_dir", None)
        if run_dir is None:
            return
        try:
            write_bytes_atomic(Path(run_dir) / LOG_FOLDER_FILE, os.path.realpath(log_dir).encode())
        except OSError as e:
            log.warning("ft-launcher: cannot name the log folder in %s: %s", run_dir, e)

    def _count_hang(self, summary: Mapping[str, Any]) -> None:
        """One more hang of the culprit ``summary`` names (a row whose culprit is on another node
        names it too), as its ``hang`` event does."""
        key = (str(summary.get("rank")), str(summary.get("reason") or "unknown"), str(summary.get("section") or ""))
        self.hang_counts[key] = self.hang_counts.get(key, 0) + 1

    def _poll(self, now: float) -> dict[int, MonitorStatus | None]:
        self._polled_at = self.monotonic()
        statuses: dict[int, MonitorStatus | None] = self.monitors.statuses()
        self.local.seen(now, statuses)
        return statuses

    def _restart_progress(self, now: float, statuses: Mapping[int, MonitorStatus | None]) -> None:
        """Failure restarts: all ranks stepping again (the agent notes it for hang restarts).
        Any restart: once running, the iteration the ranks resumed from; then the restart event."""
        from ft_monitor.launcher.incident.restarts import running_again_at  # torch's, once a restart is pending

        p = self.pending
        if p is None:
            return
        connected = [st.rank for st in statuses.values() if st is not None and st.rank is not None]
        all_up = len(connected) == len(statuses) and bool(connected)
        if p.cause == "failure" and p.timing.first_step is None and p.timing.workers_started is not None:
            at = running_again_at(statuses, p.timing.pids, wall=now, mono=self.monotonic())
            if at is not None:
                p.timing.first_step = max(at, p.timing.workers_started)
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
        self.events.emit("restart", now, mode="process", cause=p.cause, attempt=p.attempt, rank=p.timing.named,
                         phases=phases, lost_s=lost, redone_iterations=redone)

    def _goodput(self, now: float) -> Goodput:
        return goodput(self.local.step_sums(), self.incidents, start=self.start, now=now)

    def _stats(self, now: float, statuses: Mapping[int, MonitorStatus | None]) -> None:
        self._stats_at = self.monotonic()
        self._flush_torch_metrics(now)
        gp = self._goodput(now)
        self.events.emit("stats", now, ranks=self.local.stats_rows(), goodput=gp.ratio, productive_s=gp.productive_s,
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
        self.snapshot = Snapshot(
            start=self.start, ranks=self.local.views(self.slow.verdicts, self.slow.flagged),
            hangs=dict(self.hang_counts), restarts=dict(self.restart_counts),
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
                "incidents": incident_rows(self.incidents), "slow_ranks": sorted(self.slow.flagged)}
