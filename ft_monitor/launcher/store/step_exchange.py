"""The slow-rank exchange through the rendezvous store: each node publishes its local ranks'
median section times (store_auth.StepTimes, signed) at its own key and reads the other
nodes' (slow_ranks.py judges them; telemetry/slow_watch.py calls this every EXCHANGE_INTERVAL).

Issue 28: it was a ``check`` and a ``get`` per other node, O(M) round trips per node and
O(M^2) for the job. Now a node lists itself once per round in an index
(``ft_launcher/step_times_index``, appended) beside its key, and an exchange is five
operations whatever M: ``set`` its medians, ``check`` and ``get`` the index, one ``check`` and one
``multi_get`` of the listed nodes' keys (their values stay signed at their own keys; the
index only says which to read: an entry pointing at a missing key makes those keys read
one by one, never waited for). A store without torch's extended API (no ``append``,
``multi_get``) reads every other node's key as before, and so does an exchange whose index
another user grew past what the nodes could have written (store_board.IndexReader, issue 38)."""

from __future__ import annotations

import logging
from typing import Any

from ft_monitor.launcher.store.store_auth import StepTimes, StoreChannel, StoreMessageError
from ft_monitor.launcher.store.store_board import IndexReader, existing, extended, first_sight, read_all

log = logging.getLogger("ft_monitor.launcher")

STEP_TIMES_KEY = "ft_launcher/step_times/{}"
STEP_TIMES_INDEX_KEY = "ft_launcher/step_times_index"


def exchange_step_times(store: Any, channel: StoreChannel, group_rank: int, group_world_size: int, section: str,
                        local: dict[int, float], host: str, bad_values: set[bytes],
                        listed: bool = False, index: IndexReader | None = None) -> tuple[dict[int, float], bool]:
    """Publish ``local`` (global rank -> median seconds of ``section``) and return the other
    nodes' medians of the same section, and whether this node is now listed in the round's
    index (``listed``: it was already, in this round's store); a value that does not check out
    is logged once (its digest kept in ``bad_values``, at most 100) and ignored. ``index`` reads the
    index (one per caller: it remembers an index found too long, store_board.IndexReader; then
    every other node's key is read). Store errors propagate."""
    mine = STEP_TIMES_KEY.format(group_rank)
    store.set(mine, channel.encode(mine, StepTimes(section, local, host)))
    others = [n for n in range(group_world_size) if n != group_rank]
    if extended(store):
        if not listed:
            store.append(STEP_TIMES_INDEX_KEY, f"{group_rank},")
            listed = True
        index = index or IndexReader(STEP_TIMES_INDEX_KEY, group_world_size)
        listed_ranks = index.read(store)
        if listed_ranks is not None:
            others = sorted(listed_ranks - {group_rank})
    keys = existing(store, [STEP_TIMES_KEY.format(n) for n in others])
    medians: dict[int, float] = {}
    for key, raw in zip(keys, read_all(store, keys), strict=True):
        try:
            theirs = channel.decode(key, raw, StepTimes)
        except StoreMessageError as e:
            if first_sight(bad_values, raw):
                log.warning("ft-launcher: ignored a step_times message in the rendezvous store at %s: %s", key, e)
            continue
        if theirs.section == section:
            medians.update(theirs.medians)
    return medians, listed
