"""The ``/metrics`` endpoint's descriptors: the listening socket (bound in the caller's thread),
the descriptors open now and allowed (what `connection_cap` sizes the cap from), and one
connection's state as the server's loop reads, answers and closes it (metrics_http.py).
"""

from __future__ import annotations

import asyncio
import os
import resource
import socket

from ft_monitor.launcher.telemetry.metrics_admission import Held


def open_fds() -> int:
    """Descriptors open in this process now (0 where /proc cannot say)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    except OSError:
        return 0


def fd_limit() -> int:
    """The soft RLIMIT_NOFILE (what EMFILE is measured against)."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return 1024
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def listening_socket(address: str, port: int) -> socket.socket:
    """Bound here, in the caller's thread, so that a port in use is an OSError at start."""
    infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class Connection:
    """One connection: its request head read within the read deadline, one answer sent within
    the write deadline, closed. The server reads and writes it itself (non-blocking, with the
    loop's add_reader and add_writer): it is set up, and closed, at once, in the accept."""

    __slots__ = ("sock", "fd", "accepted_at", "answered_at", "uid", "buf", "out", "timer",
                 "reading", "writing", "closed")

    def __init__(self, sock: socket.socket, accepted_at: float, uid: int | None) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.accepted_at = accepted_at
        self.answered_at: float | None = None
        self.uid = uid
        self.buf = bytearray()
        self.out: memoryview | None = None
        """The answer's part not yet sent; None until the request head is complete."""
        self.timer: asyncio.TimerHandle | None = None
        self.reading = self.writing = self.closed = False

    def held(self) -> Held:
        return Held(self.accepted_at, self.answered_at, self.uid)
