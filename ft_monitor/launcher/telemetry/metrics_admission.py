"""Which connections the ``/metrics`` endpoint holds (pure): how many the descriptor limit
allows (`connection_cap`), and which one gives way to a new connection at that cap
(`eviction_victim`). The server (metrics_http.py) measures the descriptors and the peers' uids
and acts on the answers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

MAX_CONNECTIONS = 64
"""The most connections served at once, whatever the descriptor limit allows."""
RESTART_FD_RESERVE = 256
"""Descriptors the endpoint never takes: what the launcher needs beyond those it holds when
the endpoint starts, to stop and start the job again (each worker's pipes, log files and
pidfd, its monitor's connection and pidfd, torch's store and rendezvous sockets, the hang
report and dumps it reads). A two-rank job's launcher holds about 20 once its workers run
(19 in tests/test_metrics_http.py's flood test), so 256 leaves room for many more ranks and
for what a restart opens before it closes the old ones."""
ANSWER_STALL_S = 1.0
"""An answer not taken this long after it was ready (a peer that reads slowly or not at all):
its connection may give way to a new one at the cap (`eviction_victim`)."""


def connection_cap(limit: int, open_now: int, wanted: int = MAX_CONNECTIONS,
                   reserve: int = RESTART_FD_RESERVE) -> int:
    """How many connections the endpoint may hold (pure): what is left of ``limit`` after the
    descriptors open now, the restart reserve and the one socket accepted over the cap before
    it is closed; at most ``wanted``, at least 1."""
    return max(1, min(wanted, limit - open_now - reserve - 1))


@dataclass(frozen=True, slots=True)
class Held:
    """What `eviction_victim` sees of a connection the endpoint holds."""

    accepted_at: float
    answered_at: float | None
    """When its answer was ready; None while its request head is still awaited."""
    uid: int | None
    """The owner of the peer's socket (a peer on this host, `PeerUids`); None: not known."""


def eviction_victim(held: Sequence[Held], newcomer_uid: int | None, own_uid: int, now: float,
                    stall_s: float = ANSWER_STALL_S) -> int | None:
    """The index in ``held`` of the connection to close so that a new connection (of peer uid
    ``newcomer_uid``) can be served, the endpoint being at its cap; None: none may be closed,
    the new one is refused (pure; ``now`` is the loop's clock, as ``held``'s times).

    * a connection of the launcher's own uid (``own_uid``) is never closed for another uid's
      (or an unknown peer's); a new one of the launcher's uid may close any other uid's;
    * otherwise only a connection that is still waiting for its request head, or whose answer
      has not been taken within ``stall_s``, may be closed: a complete request from a peer that
      reads its answer is always served;
    * among those: another uid's before the launcher's own, then the uid holding the most
      connections (a flood pays for itself before a lone scraper does), then one waiting for
      its head before a stalled answer before a fresh one, then the one waiting longest
      (from its accept, or from its answer)."""
    own_newcomer = newcomer_uid is not None and newcomer_uid == own_uid
    counts = Counter(h.uid for h in held)
    best: tuple[bool, int, int, float, int] | None = None
    for i, h in enumerate(held):
        own = h.uid is not None and h.uid == own_uid
        if own and not own_newcomer:
            continue
        if h.answered_at is None:
            phase, since = 0, h.accepted_at
        elif now - h.answered_at >= stall_s:
            phase, since = 1, h.answered_at
        elif own_newcomer and not own:
            phase, since = 2, h.answered_at
        else:
            continue
        key = (own, -counts[h.uid], phase, since, i)
        if best is None or key < best:
            best = key
    return None if best is None else best[-1]
