"""Read-only access to a monitor daemon: is it up, what is its state.

Used by `ft-monitor status`, by ft-launcher to watch its daemons, and by tests
and benchmarks to wait for a daemon to be ready. Connects as an observer, which
a daemon accepts beside its rank.
"""

from __future__ import annotations

from typing import Any

from ft_client import wire
from ft_client.wire.transport import TransportError, connect


def _ask(path: str, timeout: float, request: wire.Message) -> wire.Message:
    t, _ = connect(path, timeout, wire.Role.OBSERVER, -1)
    try:
        return t.request(request)
    finally:
        t.close()


def status(path: str, timeout: float = 5.0) -> dict[str, Any]:
    """The daemon's live state; raises OSError / TransportError if it does not answer."""
    reply = _ask(path, timeout, wire.STATUS)
    if not isinstance(reply, wire.StatusReply):
        raise TransportError(f"monitor at {path} answered STATUS with {reply!r}")
    return reply.status


def try_status(path: str, timeout: float = 2.0) -> dict[str, Any] | None:
    """status(), or None if nothing answers."""
    try:
        return status(path, timeout)
    except (OSError, TransportError):
        return None


def ping(path: str, timeout: float = 1.0) -> bool:
    """True when a daemon answers at ``path`` (the readiness check)."""
    try:
        return isinstance(_ask(path, timeout, wire.PING), wire.Pong)
    except (OSError, TransportError):
        return False
