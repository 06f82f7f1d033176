"""The meeting point of the in-process restart `Wrapper` and the monitor client.

Neither imports the other. The client (its control connection to the monitor)
reports a fault the monitor found with `report_fault`; a `Wrapper` running in
this process takes it with `set_fault_handler`. The other way, the Wrapper tells
every `RestartListener` (the client, which tells its monitor) when it starts
leaving the function for a restart (`aborting`) and when it re-enters it
(`entering`, with the `Restart` record of what happened). The first progress
after re-entry, from `CallWrapper.ping()` or from the client, is stamped on that
record with `Restart.progress`. Pure Python, no torch: importing it costs nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Fault:
    """Why the ranks must restart in-process."""

    reason: str
    """One line for a person, e.g. "rank 1: section 'step' open for 10.2 s, timeout 10.0 s"."""
    rank: int | None
    """The rank at fault (hung, raised, or died), when known."""
    iteration: int | None = None
    """The Wrapper iteration the fault belongs to, when known (a stale fault is ignored)."""
    source: str = "monitor"
    """"monitor" (a hang verdict), "exception", "timeout" (no ping), "exit" (a rank left the
    Wrapper), "store" (the restart store is unreachable)."""


@dataclass(slots=True)
class Restart:
    """One in-process restart as this rank lived it: the fault, and the wall-clock time
    (``time.time()``) at which each phase ended (`ft_client.inprocess.timeline.PHASES`)."""

    iteration: int
    """The iteration being entered (1 for the first restart)."""
    fault: Fault
    times: dict[str, float] = field(default_factory=dict)

    def progress(self, now: float | None = None) -> bool:
        """Stamp the first progress after re-entry; True the first time only."""
        if "first_progress" in self.times:
            return False
        self.times["first_progress"] = time.time() if now is None else now
        return True


class RestartListener(Protocol):
    def aborting(self, iteration: int) -> None:
        """The Wrapper saw a fault and leaves the function; it restarts as ``iteration``."""

    def entering(self, restart: Restart) -> None:
        """The Wrapper calls the function again as ``restart.iteration``."""

    def busy(self) -> bool:
        """True while an exception raised now would leave the listener broken (the client
        inside a call: halfway through a frame, a request or a record store): the Wrapper's
        interrupt waits for the next try."""


FaultHandler = Callable[[Fault], None]

_lock = threading.Lock()
_fault_handler: FaultHandler | None = None
_listeners: tuple[RestartListener, ...] = ()
"""Replaced, never changed in place: read without the lock (the interrupt's signal handler
reads it, and may run while its own thread holds the lock in add/remove)."""


def set_fault_handler(handler: FaultHandler | None) -> None:
    """Install (or, with None, remove) the handler of faults reported in this process."""
    global _fault_handler
    with _lock:
        _fault_handler = handler


def report_fault(fault: Fault) -> bool:
    """Hand a fault to the Wrapper running in this process; False if none runs."""
    with _lock:
        handler = _fault_handler
    if handler is None:
        return False
    handler(fault)
    return True


def add_restart_listener(listener: RestartListener) -> None:
    global _listeners
    with _lock:
        if listener not in _listeners:
            _listeners = (*_listeners, listener)


def remove_restart_listener(listener: RestartListener) -> None:
    global _listeners
    with _lock:
        _listeners = tuple(x for x in _listeners if x is not listener)


def _each_listener() -> tuple[RestartListener, ...]:
    return _listeners


def announce_aborting(iteration: int) -> None:
    """The Wrapper leaves the function to restart it as ``iteration``."""
    for listener in _each_listener():
        listener.aborting(iteration)


def busy() -> bool:
    """Some listener must not be interrupted right now (called from a signal handler)."""
    return any(listener.busy() for listener in _each_listener())


def announce_entering(restart: Restart) -> None:
    """The Wrapper is about to call the function again as ``restart.iteration``."""
    for listener in _each_listener():
        listener.entering(restart)
