"""The client's side of an in-process restart: the monitor is told when the Wrapper
unwinds (RESTARTING) and when the rank is back (REENTERED, sent by the first progress call
after re-entry); progress made while unwinding is not reported."""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

from ft_client import wire
from ft_client.client.state import ClientState

if TYPE_CHECKING:
    from ft_client.inprocess import events
    from ft_client.wire.transport import Transport

_now_ns = time.monotonic_ns


class ClientRestart(ClientState):
    """`RankMonitorClient`'s in-process restart gate."""

    def _aborting(self, iteration: int) -> None:
        """An in-process Wrapper leaves the training function after a fault (any thread):
        the monitor is told (RESTARTING) and stops timing this rank, and progress calls
        made while the rank unwinds are not reported."""
        with self._lock:
            self._restart = True
            t = self._transport
            if t is not None:
                self._event(t, wire.encode(wire.Restarting(iteration)))

    def _entering(self, restart: events.Restart) -> None:
        """The Wrapper calls the training function again: sections opened before the fault
        are gone, partial intervals are not learned from, and the first progress call
        tells the monitor the rank is back (REENTERED)."""
        with self._lock:
            self._open.clear()
            self._calc.start(self._clock())
            self._restart = restart
            if self._record is not None:
                self._record.reset(_now_ns())  # a new epoch: what was open while unwinding reads as closed

    def _restart_gate(self, t: Transport | None) -> bool:
        """Called by progress calls while a restart is under way: True to report nothing
        (unwinding); after re-entry, the first call sends REENTERED and goes on."""
        restart = self._restart
        if restart is True:
            return True
        self._restart = None
        if restart is not None:  # an events.Restart
            restart.progress()
            if t is not None:
                f = restart.fault
                self._event(t, wire.encode(wire.Reentered(restart.iteration, f.reason, f.rank, f.source,
                                                          dict(restart.times))))
        return False


class RestartHook:
    """The client's `events.RestartListener`, holding it weakly (a listener must not keep a
    dropped client alive)."""

    __slots__ = ("_client",)

    def __init__(self, client: ClientRestart) -> None:
        self._client = weakref.ref(client)

    def aborting(self, iteration: int) -> None:
        client = self._client()
        if client is not None:
            client._aborting(iteration)

    def entering(self, restart: events.Restart) -> None:
        client = self._client()
        if client is not None:
            client._entering(restart)

    def busy(self) -> bool:
        """The client is in a call on this thread (its lock held: an interrupt raised there,
        even between the lock's acquire and the ``try`` that releases it, could leave the
        lock held or a record group half-stored), or its main connection is mid-frame or
        mid-request (an interrupt would cut a frame in two or leave a reply unread)."""
        client = self._client()
        if client is None:
            return False
        if client._lock._is_owned():  # type: ignore[attr-defined]  # RLock's own, as threading.Condition uses it
            return True
        t = client._transport
        return t is not None and t.io_busy()
