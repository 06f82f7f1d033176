"""File descriptors: the daemon must never be too short of them to act on a hang.

The soft RLIMIT_NOFILE is raised to the hard one; the connection cap is sized so
that every connection it allows, the reserve and the daemon's own files fit;
and a few descriptors are held back (`FdReserve`) and released only while a
hang is handled (its report, temporary files, the pidfds of the rank's children).
"""

from __future__ import annotations

import os
import resource

FD_RESERVE = 16
"""Descriptors held back for the hang path."""
FDS_PER_CONNECTION = 2
"""A connection's socket and the pidfd of its process until its role is known."""
FD_BASELINE = 64
"""The daemon's own files: the listener, the loop's, logs, the rank's pidfd."""


class FdReserve:
    def __init__(self, size: int = FD_RESERVE) -> None:
        self.size = size
        self._fds: list[int] = []
        self.fill()

    def fill(self) -> None:
        while len(self._fds) < self.size:
            try:
                self._fds.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                return

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one; return the soft limit in force."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    except (OSError, ValueError):
        return 1024


def connections_that_fit(fd_limit: int, wanted: int) -> int:
    """The connection cap that keeps every descriptor within ``fd_limit`` (pure)."""
    fits = max(1, (fd_limit - FD_BASELINE - FD_RESERVE) // FDS_PER_CONNECTION)
    return min(wanted, fits)
