"""The slow-rank exchange through the rendezvous store: each node publishes its local ranks'
median section times (store_auth.StepTimes, signed) at its own key and reads the other
nodes' (slow_ranks.py judges them; telemetry.py calls this every EXCHANGE_INTERVAL).

One ``set``, one ``check`` of every other node's key and one ``multi_get`` per exchange
once every node has published (issue 28: it was a ``check`` and a ``get`` per node, O(M)
round trips per node and O(M^2) for the job); while some have not, one ``check`` per key
finds those that have (a ``multi_get`` of a missing key would wait for it)."""

from __future__ import annotations

import logging
from typing import Any

from ft_monitor.launcher.store_auth import StepTimes, StoreChannel, StoreMessageError
from ft_monitor.launcher.store_board import existing, read_all

log = logging.getLogger("ft_monitor.launcher")

STEP_TIMES_KEY = "ft_launcher/step_times/{}"


def exchange_step_times(store: Any, channel: StoreChannel, group_rank: int, group_world_size: int, section: str,
                        local: dict[int, float], host: str, bad_values: set[bytes]) -> dict[int, float]:
    """Publish ``local`` (global rank -> median seconds of ``section``) and return the other
    nodes' medians of the same section; a value that does not check out is logged once (its
    bytes kept in ``bad_values``, at most 100) and ignored. Store errors propagate."""
    mine = STEP_TIMES_KEY.format(group_rank)
    store.set(mine, channel.encode(mine, StepTimes(section, local, host)))
    keys = existing(store, [STEP_TIMES_KEY.format(n) for n in range(group_world_size) if n != group_rank])
    medians: dict[int, float] = {}
    for key, raw in zip(keys, read_all(store, keys), strict=True):
        try:
            theirs = channel.decode(key, raw, StepTimes)
        except StoreMessageError as e:
            if raw not in bad_values and len(bad_values) < 100:
                bad_values.add(raw)
                log.warning("ft-launcher: ignored a step_times message in the rendezvous store at %s: %s", key, e)
            continue
        if theirs.section == section:
            medians.update(theirs.medians)
    return medians
