"""The slow-rank watch (`SlowRankWatch`): each local rank's median of the configured section
(``slow_rank_section``) judged against every other rank's (slow_ranks.py, pure), the other
nodes' medians read through the rendezvous store every `EXCHANGE_INTERVAL` while this node's
are published there (step_exchange.py: store_auth.StepTimes, signed with the job secret); a
local rank that turns slow is a warning and a ``slow_rank`` event, one that recovers a line and
``slow_rank_cleared``. Told by telemetry.py at each poll.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from ft_monitor.launcher.rdzv.rounds import rendezvous_round
from ft_monitor.launcher.stop_signal import reraise_stop
from ft_monitor.launcher.store.step_exchange import STEP_TIMES_INDEX_KEY, exchange_step_times
from ft_monitor.launcher.store.store_auth import StoreChannel
from ft_monitor.launcher.store.store_board import IndexReader
from ft_monitor.launcher.telemetry.events import EventLog
from ft_monitor.launcher.telemetry.local_ranks import RankMemory
from ft_monitor.launcher.telemetry.slow_ranks import MIN_SAMPLES, SlowVerdict, judge

log = logging.getLogger("ft_monitor.launcher")

EXCHANGE_INTERVAL = 10.0
"""Seconds between publishing this node's step times in the store and reading the others'."""


class SlowRankWatch:
    def __init__(self, *, config: Any, events: EventLog, host: str, job_secret: bytes | None,
                 monotonic: Callable[[], float]) -> None:
        self.config = config
        self.events = events
        self.host = host
        self.job_secret = job_secret
        self.monotonic = monotonic
        self.flagged: set[int] = set()
        """The ranks flagged slow now."""
        self.verdicts: dict[int, SlowVerdict] = {}
        self.remote_medians: dict[int, float] = {}
        """The other nodes' ranks' medians (rank -> seconds), forgotten at each attempt's start."""
        self._exchanged_at = -1e18
        self._bad_values: set[bytes] = set()
        self._listed_in: Any = None
        self._step_index: IndexReader | None = None
        """The round's store whose step-times index lists this node (step_exchange.py)."""

    def check(self, now: float, ranks: Mapping[int, RankMemory], wg: Any) -> None:
        """Judge the ranks again (``ranks``: local rank -> memory; ``wg``: torch's worker group,
        for the store), when ``slow_rank_ratio`` is set."""
        threshold = self.config.slow_rank_ratio
        if threshold is None:
            return
        section = self.config.slow_rank_section
        local: dict[int, float] = {}
        local_ranks: dict[int, int] = {}
        for lr, mem in ranks.items():
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
