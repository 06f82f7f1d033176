"""torchelastic's own events and metrics, into ft-launcher's event stream instead of nowhere.

torch.distributed.elastic records events (`events.record(event, destination)`: the
agent's START/SUCCEEDED/FAILED per worker and per run, to the handler named by
torchrun's ``--event-log-handler``, "null" by default) and rendezvous events (to the
"dynamic_rendezvous" handler, a NullHandler by default), and publishes metrics
(`metrics.put_metric`, to the handler `metrics.configure` set; by default a null one).
ft-launcher inherits all of that and so, unless told, loses it. `routed` registers:

* a logging handler named `HANDLER_NAME` in torch's handler table, used when
  ``--event-log-handler`` is left at "null" (a handler the user chose is kept), and in
  place of the "dynamic_rendezvous" NullHandler: each event becomes one
  ``torchelastic_event`` line, except the rendezvous keep-alives (three every 5 s
  per node) and the state syncs that come with them, which are only counted
  (``rendezvous.keep_alive``, ``rendezvous.sync`` in the metrics);
* a `MetricHandler` as torch's default: metrics are aggregated per name (count, sum,
  min, max, last), because torch times every monitor tick (``_monitor_workers`` is
  wrapped in ``@prof``: ten points a second), and `TorchMetrics.drain` hands the
  aggregates to the telemetry, which writes one ``torchelastic_metrics`` line at
  attempt boundaries, at the end, and at most once a minute.

Checked with torch 2.13.0: `events.handlers._log_handlers`, `events._events_loggers`
and `metrics.api._default_metrics_handler` are the internals relied on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

HANDLER_NAME = "ft-monitor"
RDZV_DESTINATION = "dynamic_rendezvous"

EventSink = Callable[[str, str, float | None, dict[str, Any]], None]
"""(name, source, timestamp in seconds or None, metadata)"""


class TorchEventHandler(logging.Handler):
    """torchelastic's event loggers hand it ``Event.serialize()`` / ``RdzvEvent.serialize()`` text."""

    def __init__(self, sink: EventSink, counts: TorchMetrics | None = None) -> None:
        super().__init__()
        self.sink = sink
        self.counts = counts

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = json.loads(record.getMessage())
        except ValueError:
            data = None
        if not isinstance(data, dict):
            self.sink("unparsed", "UNKNOWN", None, {"message": record.getMessage()[:4096]})
            return
        if "source" in data:  # Event: name, source, timestamp, metadata
            metadata = data.get("metadata")
            ts = data.get("timestamp")
            self.sink(str(data.get("name", "")), str(data.get("source")),
                      ts if isinstance(ts, (int, float)) and ts > 0 else None,
                      dict(metadata) if isinstance(metadata, dict) else {})
        else:  # RdzvEvent: name, run_id, message, hostname, pid, node_state, ...
            name = str(data.pop("name", ""))
            if "_keep_alive" in name and self.counts is not None:
                self.counts.count("rendezvous", "keep_alive")
                return
            if SYNC_MESSAGE in str(data.get("message", "")) and self.counts is not None:
                self.counts.count("rendezvous", "sync")  # every keep-alive's state sync: most of the file
                return
            self.sink(name, "RENDEZVOUS", None, data)


SYNC_MESSAGE = "has successfully synced its local changes with other nodes"
"""torch's rendezvous event after each sync of its state, one with every keep-alive (every 5 s
per node): 42 of a short job's 67 events were torch's, most of them this one."""


class TorchMetrics:
    """A torchelastic MetricHandler that aggregates per ``group.name``; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._agg: dict[str, dict[str, float]] = {}

    def count(self, group: str, name: str) -> None:
        self._add(f"{group}.{name}", 1.0)

    def emit(self, metric_data: Any) -> None:
        self._add(f"{metric_data.group_name}.{metric_data.name}", float(metric_data.value))

    def _add(self, key: str, value: float) -> None:
        with self._lock:
            a = self._agg.get(key)
            if a is None:
                self._agg[key] = {"count": 1, "sum": value, "min": value, "max": value, "last": value}
            else:
                a["count"] += 1
                a["sum"] += value
                a["min"] = min(a["min"], value)
                a["max"] = max(a["max"], value)
                a["last"] = value

    def drain(self) -> dict[str, dict[str, float]]:
        """The aggregates since the last drain (then forgotten)."""
        with self._lock:
            out, self._agg = self._agg, {}
        return out


def metric_handler(metrics: TorchMetrics) -> Any:
    """`metrics` as a subclass of torch's MetricHandler (torch is imported here, not at module load)."""
    from torch.distributed.elastic.metrics.api import MetricHandler

    class Handler(MetricHandler):
        def emit(self, metric_data: Any) -> None:
            metrics.emit(metric_data)

    return Handler()


@contextlib.contextmanager
def routed(sink: EventSink, metrics: TorchMetrics, args: Any) -> Iterator[None]:
    """For the length of the run: torchelastic's events to ``sink``, its metrics to ``metrics``.
    ``args.event_log_handler`` (torchrun's flag) is set to ours when the user left it at "null"."""
    from torch.distributed.elastic import events as te_events
    from torch.distributed.elastic.events import handlers as te_handlers
    from torch.distributed.elastic.metrics import api as te_metrics

    table: dict[str, logging.Handler] = getattr(te_handlers, "_log_handlers")
    loggers: dict[str, logging.Logger] = getattr(te_events, "_events_loggers")
    handler = TorchEventHandler(sink, metrics)
    saved_rdzv = table.get(RDZV_DESTINATION)
    saved_logger = loggers.pop(RDZV_DESTINATION, None)  # built lazily from the table: rebuilt with ours
    saved_metrics = getattr(te_metrics, "_default_metrics_handler")
    saved_flag = getattr(args, "event_log_handler", None)
    table[HANDLER_NAME] = handler
    table[RDZV_DESTINATION] = handler
    te_metrics.configure(metric_handler(metrics))
    if saved_flag in (None, "null"):
        args.event_log_handler = HANDLER_NAME
    try:
        yield
    finally:
        table.pop(HANDLER_NAME, None)
        loggers.pop(HANDLER_NAME, None)
        loggers.pop(RDZV_DESTINATION, None)
        if saved_logger is not None:
            loggers[RDZV_DESTINATION] = saved_logger
        if saved_rdzv is not None:
            table[RDZV_DESTINATION] = saved_rdzv
        te_metrics.configure(saved_metrics)
        if saved_flag is not None:
            args.event_log_handler = saved_flag
