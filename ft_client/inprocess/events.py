"""The meeting point of the in-process restart `Wrapper` and the monitor client.

Neither imports the other: the client (its control connection to the monitor)
reports a fault the monitor found with `report_fault`; a `Wrapper` running in
this process takes it with `set_fault_handler`. The other way, the Wrapper
announces each re-entry with `announce_restart`, and the client, which tells
its monitor (RESTARTING), listens with `add_restart_listener`. Pure Python, no
torch: importing it costs nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


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
    """"monitor" (a hang verdict), "exception", "timeout" (no ping), "peer" (another rank)."""


FaultHandler = Callable[[Fault], None]
RestartListener = Callable[[int], None]

_lock = threading.Lock()
_fault_handler: FaultHandler | None = None
_restart_listeners: list[RestartListener] = []


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
    with _lock:
        if listener not in _restart_listeners:
            _restart_listeners.append(listener)


def remove_restart_listener(listener: RestartListener) -> None:
    with _lock:
        if listener in _restart_listeners:
            _restart_listeners.remove(listener)


def announce_restart(iteration: int) -> None:
    """The Wrapper is about to (re-)enter the wrapped function with ``iteration``."""
    with _lock:
        listeners = list(_restart_listeners)
    for listener in listeners:
        listener(iteration)
