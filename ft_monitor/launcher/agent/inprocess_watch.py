"""The agent's watch over in-process restarts (the ranks restart in their own processes;
torch's agent sees nothing): a monitor's hang notice with action ``inprocess`` opens a
summary row, and the local monitors' STATUS, read at most every INPROCESS_POLL_INTERVAL,
tells when every local rank is back (the rows are kept by inprocess.py's pure ledger)."""

from __future__ import annotations

import logging
import time
from typing import Any

from ft_client.inprocess import timeline
from ft_client.inprocess.coordinate import HANG_SOURCES
from ft_monitor.core.notices import HangNotice
from ft_monitor.core.policy import Reason
from ft_monitor.core.server_log import printable
from ft_monitor.launcher.agent.inprocess import InprocessLedger
from ft_monitor.launcher.agent.monitors import MonitorPool

log = logging.getLogger("ft_monitor.launcher")

INPROCESS_POLL_INTERVAL = 1.0
"""Seconds between reads of the monitors' STATUS for ranks back from an in-process restart."""
HANG_REASONS = frozenset({r.value for r in Reason} | set(HANG_SOURCES))
"""In-process rows whose reason is a verdict on progress (a monitor's hang reason, or the Wrapper's
fault sources for one), as opposed to an exception or a peer that exited."""


class InprocessWatch:
    """The rows of ``ledger``, fed from the hang notices and the monitors' STATUS."""

    def __init__(self, ledger: InprocessLedger, monitors: MonitorPool) -> None:
        self.ledger = ledger
        self.monitors = monitors
        self._checked = 0.0

    def noticed(self, notice: HangNotice, attempt: int) -> None:
        """A monitor asked its rank to restart in-process: a summary row, no restart here. The
        rank at fault is named once, when the ranks are back (`log_back`): the monitor that
        fired first may be that of a rank waiting for the hung one."""
        first = (attempt, notice.restart_iteration or 0) not in self.ledger.rows
        self.ledger.on_notice(notice, attempt)
        self._checked = 0.0  # look for the ranks' return at the next tick
        log.log(logging.WARNING if first else logging.INFO,
                "ft-launcher: rank %d's monitor reported no progress (%s)%s", notice.rank, printable(notice.message),
                f"; the ranks restart in-process as iteration {notice.restart_iteration} (same processes; not "
                "counted against --max-restarts)" if first else " too: part of the same in-process restart")

    def completed(self, attempt: int) -> list[dict[str, Any]]:
        """The rows of in-process restarts every local rank is now back from (summary JSON form)."""
        now = time.monotonic()
        if now - self._checked < INPROCESS_POLL_INTERVAL:
            return []
        self._checked = now
        statuses = self.monitors.statuses()
        back = {lr: st.last_restart if st is not None else None for lr, st in statuses.items()}
        pids = {st.rank.rank: st.rank.pid for st in statuses.values() if st is not None and st.rank is not None}
        return [row.to_json() for row in self.ledger.on_statuses(back, len(statuses), attempt, pids)]


def log_back(row: dict[str, Any]) -> None:
    """Every local rank is back from an in-process restart: its line, naming the rank at fault."""
    b = row["phases"] or {}
    what = "hung" if row["reason"] in HANG_REASONS else "failed"
    log.warning("ft-launcher: rank %s %s: %s; all ranks back in their step loop %.2fs after it, in the same "
                "processes (in-process iteration %d; %s)", row["rank"], what, printable(row["message"] or "-"),
                b.get("total") or 0.0, row["iteration"], timeline.describe(b))
