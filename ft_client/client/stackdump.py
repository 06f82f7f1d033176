"""Python stack dumps on a signal, for a rank that may be stuck holding the GIL.

faulthandler writes the traceback of every thread from inside the C signal
handler, without taking the GIL, so a rank hung in a C call still dumps. The
monitor names the file (next to its hang report); the client opens it here. Nothing
is written here: the monitor writes a header just before each dump it asks for
(ft_monitor/forensics/dump_file.py), and a file no dump went into is removed when dumping stops.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from typing import IO

from ft_client.safefiles import open_append


class StackDumper:
    def __init__(self) -> None:
        self._file: IO[str] | None = None
        self._signum: int | None = None
        self._path = ""

    def enable(self, signum: int, path: str) -> None:
        """Dump all threads' stacks to ``path`` on ``signum``, chaining to a handler the
        program already had (never to the default action, which would kill the rank)."""
        self.disable()
        previous = signal.getsignal(signum)
        chain = previous not in (signal.SIG_DFL, signal.SIG_IGN, None)
        fd = open_append(path)  # no symlink, FIFO or another user's file: it could block or leak the dump
        self._file = os.fdopen(fd, "a", buffering=1)  # kept open for the signal handler
        self._path = path
        faulthandler.register(signum, file=self._file, all_threads=True, chain=chain)
        self._signum = signum

    def disable(self) -> None:
        if self._signum is not None:
            faulthandler.unregister(self._signum)
            self._signum = None
        if self._file is not None:
            remove_if_unused(self._file.fileno(), self._path)
            self._file.close()
            self._file = None

    def abandon(self) -> None:
        """In a forked child: stop dumping on the signal (the dumps are the rank's)."""
        if self._signum is not None:
            faulthandler.unregister(self._signum)
            self._signum = None
        if self._file is not None:
            self._file.close()
            self._file = None


def remove_if_unused(fd: int, path: str) -> None:
    """Remove ``path`` when it is still the file open on ``fd`` and nothing was written
    to it: a rank never dumped leaves no file behind."""
    try:
        st = os.fstat(fd)
        if st.st_size == 0 and os.path.samestat(st, os.lstat(path)):
            os.unlink(path)
    except OSError:
        pass
