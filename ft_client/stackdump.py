"""Python stack dumps on a signal, for a rank that may be stuck holding the GIL.

faulthandler writes the traceback of every thread from inside the C signal
handler, without taking the GIL, so a rank hung in a C call still dumps. The
monitor names the file (next to its hang report); the client opens it here.
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

    def enable(self, signum: int, path: str) -> None:
        """Dump all threads' stacks to ``path`` on ``signum``, chaining to a handler the
        program already had (never to the default action, which would kill the rank)."""
        self.disable()
        previous = signal.getsignal(signum)
        chain = previous not in (signal.SIG_DFL, signal.SIG_IGN, None)
        fd = open_append(path)  # no symlink, FIFO or another user's file: it could block or leak the dump
        self._file = os.fdopen(fd, "a", buffering=1)  # kept open for the signal handler
        self._file.write(f"# ft-monitor stack dumps for pid {os.getpid()} (signal {signal.Signals(signum).name})\n")
        self._file.flush()
        faulthandler.register(signum, file=self._file, all_threads=True, chain=chain)
        self._signum = signum

    def disable(self) -> None:
        if self._signum is not None:
            faulthandler.unregister(self._signum)
            self._signum = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def abandon(self) -> None:
        """In a forked child: stop dumping on the signal (the dumps are the rank's)."""
        self.disable()
