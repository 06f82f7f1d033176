"""Telling the monitor that the process is on its way out, before it is gone.

An uncaught exception ends the process, but not at once: the interpreter prints the
traceback, runs atexit handlers and destroys its objects (a process group's teardown can
take many seconds). Until the process is gone its monitor saw an active rank with no
progress, and reported a crash as a hang (and restarted the job for a hang). The first
`RankMonitorClient` that connects chains a `sys.excepthook` (the previous hook runs after
it, unchanged); on an exception that reaches it, every connected client sends EXITING
with the exception's type and message, and its monitor stops timing the rank.
"""

from __future__ import annotations

import sys
import threading
import weakref
from types import TracebackType
from typing import Protocol

MAX_REASON = 1000


class _Client(Protocol):
    def _exiting(self, reason: str) -> None: ...


_clients: weakref.WeakSet[_Client] = weakref.WeakSet()
_lock = threading.Lock()
_installed = False


def watch(client: _Client) -> None:
    """Tell ``client``'s monitor when an uncaught exception ends the process."""
    global _installed
    with _lock:
        _clients.add(client)
        if not _installed:
            _installed = True
            previous = sys.excepthook

            def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
                tell(f"{kind.__name__}: {value}"[:MAX_REASON] if str(value) else kind.__name__)
                previous(kind, value, tb)

            sys.excepthook = hook


def unwatch(client: _Client) -> None:
    with _lock:
        _clients.discard(client)


def tell(reason: str) -> None:
    """Every watched client's monitor learns that the process exits (``reason``); never raises."""
    with _lock:
        clients = list(_clients)
    for c in clients:
        try:
            c._exiting(reason)
        except Exception:  # noqa: BLE001 - the process is exiting: the traceback printed next matters more
            pass
