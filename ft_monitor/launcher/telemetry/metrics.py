"""ft-launcher's Prometheus metrics: what they are (`collect`), and where they are served.

Everything exported is read from one immutable `Snapshot` that the telemetry
(telemetry.py) replaces as the run goes; `FtCollector` turns the current one into
metric families with prometheus-client's own types, and prometheus-client writes
the exposition format (``/metrics`` over HTTP, served by metrics_http.py; node-exporter's
textfile, `write_textfile`). Names, labels and units follow Prometheus conventions and are
listed in docs/observability.md; ``rank`` is the global rank, ``local_rank`` the
rank on this node. The section histograms are the monitors' own (their bucket counts
travel in STATUS), not re-observed here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ft_monitor.core.section_stats import SectionHistogram
from ft_monitor.launcher.telemetry.goodput import Goodput

log = logging.getLogger("ft_monitor.launcher")

PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LOST_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
TIMEOUT_KINDS = {"initial_rank_heartbeat_timeout": "initial_heartbeat", "rank_heartbeat_timeout": "heartbeat",
                 "rank_out_of_section_timeout": "out_of_section"}


@dataclass(frozen=True, slots=True)
class RankView:
    rank: int
    local_rank: int
    last_progress: float | None
    """Wall clock of the rank's last heartbeat or section open/close."""
    iteration: int | None
    sections: Mapping[str, SectionHistogram]
    timeouts: Mapping[str, Any]
    """`Timeouts.to_wire()` of the timeouts in force in its monitor."""
    slow: bool = False
    slow_ratio: float | None = None
    snapshot_held: int | None = None
    """Bytes of snapshot memory its monitor holds (None: not known, an older monitor)."""
    snapshot_limit: int | None = None
    """Its monitor's snapshot_max_bytes."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    start: float
    ranks: tuple[RankView, ...] = ()
    hangs: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    """(the culprit's rank, reason, section or "") -> hangs."""
    restarts: Mapping[str, int] = field(default_factory=dict)
    """kind ("process", "inprocess") -> restarts."""
    failures: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """(rank, role: "root" or "victim") -> failed attempts the rank failed in, in that role."""
    restart_phases: Mapping[tuple[str, str], tuple[float, ...]] = field(default_factory=dict)
    """(restart kind, phase) -> seconds, one per restart whose phase is known."""
    incident_lost: tuple[float, ...] = ()
    goodput: Goodput | None = None


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def _histogram(values: Iterable[float], bounds: tuple[float, ...]) -> tuple[list[tuple[str, float]], float]:
    values = list(values)
    buckets = [(_le(b), float(sum(1 for v in values if v <= b))) for b in bounds]
    buckets.append(("+Inf", float(len(values))))
    return buckets, float(sum(values))


def collect(snap: Snapshot) -> Iterator[Metric]:
    """The metric families of ``snap`` (pure)."""
    g = GaugeMetricFamily("ft_launcher_start_time_seconds", "Wall clock when this ft-launcher started (Unix seconds).")
    g.add_metric([], snap.start)
    yield g

    progress = GaugeMetricFamily("ft_rank_last_progress_timestamp_seconds",
                                 "Wall clock of the rank's last heartbeat or section open/close, as its monitor "
                                 "saw it (Unix seconds).", labels=["rank", "local_rank"])
    iteration = GaugeMetricFamily("ft_rank_iteration", "The rank's training iteration (completed step sections, "
                                  "counted on from its checkpoint).", labels=["rank", "local_rank"])
    durations = HistogramMetricFamily("ft_section_duration_seconds",
                                      "How long the rank's sections took, timed by its monitor; section=\"step\" is "
                                      "the step time.", labels=["rank", "local_rank", "section"])
    timeouts = GaugeMetricFamily("ft_timeout_seconds", "Timeouts in force in the rank's monitor; source is learned "
                                 "or configured.", labels=["rank", "kind", "section", "source"])
    slow = GaugeMetricFamily("ft_rank_slow", "1 while the rank is flagged slow (its median section time exceeds "
                             "the others' by slow_rank_ratio), else 0.", labels=["rank", "local_rank"])
    ratio = GaugeMetricFamily("ft_rank_slow_ratio", "The rank's median section time over the other ranks' median "
                              "(the slow-rank section).", labels=["rank", "local_rank"])
    snap_held = GaugeMetricFamily("ft_snapshot_bytes_held", "Snapshot memory the rank's monitor holds: its own "
                                  "snapshot's buffers and the peer copy it keeps (bytes).",
                                  labels=["rank", "local_rank"])
    snap_limit = GaugeMetricFamily("ft_snapshot_bytes_limit", "The most snapshot memory the rank's monitor may hold "
                                   "(snapshot_max_bytes; 0: snapshots off).", labels=["rank", "local_rank"])
    for r in snap.ranks:
        ids = [str(r.rank), str(r.local_rank)]
        if r.last_progress is not None:
            progress.add_metric(ids, r.last_progress)
        if r.iteration is not None:
            iteration.add_metric(ids, r.iteration)
        for name, h in sorted(r.sections.items()):
            durations.add_metric([*ids, name], [(_le(b), float(n)) for b, n in h.cumulative()], h.sum_s)
        learned = set(r.timeouts.get("learned", ()))
        for key, kind in TIMEOUT_KINDS.items():
            value = r.timeouts.get(key)
            if value is not None:
                timeouts.add_metric([str(r.rank), kind, "", "learned" if key in learned else "configured"], value)
        for name, value in sorted((r.timeouts.get("rank_section_timeouts") or {}).items()):
            if value is not None:
                source = "learned" if f"section:{name}" in learned else "configured"
                timeouts.add_metric([str(r.rank), "section", name, source], value)
        slow.add_metric(ids, 1.0 if r.slow else 0.0)
        if r.slow_ratio is not None and math.isfinite(r.slow_ratio):
            ratio.add_metric(ids, r.slow_ratio)
        if r.snapshot_held is not None:
            snap_held.add_metric(ids, r.snapshot_held)
        if r.snapshot_limit is not None:
            snap_limit.add_metric(ids, r.snapshot_limit)
    yield from (progress, iteration, durations, timeouts, slow, ratio, snap_held, snap_limit)

    hangs = CounterMetricFamily("ft_hangs", "Hangs acted on by this node, by the rank that hung (the incident's "
                                "culprit), reason and section.", labels=["rank", "reason", "section"])
    for (rank, reason, section), n in sorted(snap.hangs.items()):
        hangs.add_metric([rank, reason, section], n)
    yield hangs
    failed = CounterMetricFamily("ft_failed_ranks", "Ranks of this node whose process failed (a crash, not a "
                                 "hang), by role: root (it failed on its own: killed, exited, raised) or victim "
                                 "(it failed because a peer or the store was gone).", labels=["rank", "role"])
    for (rank, role), n in sorted(snap.failures.items()):
        failed.add_metric([rank, role], n)
    yield failed
    restarts = CounterMetricFamily("ft_restarts", "Restarts of the local ranks: kind=\"process\" (the worker group "
                                   "stopped and started again) or \"inprocess\" (same processes).", labels=["kind"])
    for kind in ("process", "inprocess"):
        restarts.add_metric([kind], snap.restarts.get(kind, 0))
    yield restarts
    phases = HistogramMetricFamily("ft_restart_phase_seconds", "Where the time of each restart went, by kind "
                                   "(process, inprocess) and phase (total: detection to all ranks stepping again).",
                                   labels=["kind", "phase"])
    for (kind, phase), values in sorted(snap.restart_phases.items()):
        buckets, total = _histogram(values, PHASE_BUCKETS)
        phases.add_metric([kind, phase], buckets, total)
    yield phases
    lost = HistogramMetricFamily("ft_incident_lost_seconds", "Time lost to each hang: from the hung rank's last "
                                 "progress to all ranks stepping again, plus the work done again.")
    buckets, total = _histogram(snap.incident_lost, LOST_BUCKETS)
    lost.add_metric([], buckets, total)
    yield lost

    gp = snap.goodput
    if gp is not None:
        wall = GaugeMetricFamily("ft_wall_seconds", "Wall time since this ft-launcher started.")
        wall.add_metric([], gp.wall_s)
        yield wall
        lost_total = CounterMetricFamily("ft_lost_seconds", "Time lost to hangs and crashes on this node.")
        lost_total.add_metric([], gp.lost_s)
        yield lost_total
        if gp.productive_s is not None:
            productive = GaugeMetricFamily("ft_productive_seconds", "Step time of the local ranks (their mean) "
                                           "less the work done again after restarts.")
            productive.add_metric([], gp.productive_s)
            yield productive
        if gp.ratio is not None:
            ratio_g = GaugeMetricFamily("ft_goodput_ratio", "Productive step time / wall time since start (0..1).")
            ratio_g.add_metric([], gp.ratio)
            yield ratio_g


class FtCollector(Collector):
    """Collects whatever snapshot ``source()`` holds at scrape time."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        yield from collect(self.source())


def registry(source: Any) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FtCollector(source))
    return reg


def write_textfile(path: str, reg: CollectorRegistry) -> None:
    """node-exporter's textfile collector format, written atomically: a fresh file created
    exclusively beside ``path`` (node-exporter's folder is another user's, often shared: a name
    planted there is never opened) and renamed into place, mode 0644 less the umask for the
    collector to read (prometheus_client's own writer opens a guessable name and follows a link)."""
    from ft_client.safefiles import write_bytes_atomic

    try:
        write_bytes_atomic(path, generate_latest(reg), mode=0o644)
    except OSError as e:
        log.warning("ft-launcher: cannot write the metrics textfile %s: %s", path, e)
