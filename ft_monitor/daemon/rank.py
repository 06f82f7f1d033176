"""Everything the daemon holds for one connected rank, with one owner and one `close()`.

A `RankResources` is made when a rank's HELLO is accepted and holds: its
connection, its monitoring session (state.py), its pinned process (pidfd) and
the watch on that process's exit, the directory its reports go to, and, under
torchelastic, the `monitor.log` handler in its attempt directory.

Tasks that still need the process after the rank is gone (acting on its hang,
reporting its exit) `hold()` the resources (the daemon releases the hold when the
task is done, even if it never ran); `close()` (when the session ends) frees
them once the last hold is released, so exactly one place closes the
pidfd and the log, whatever order a disconnect, a hang and a shutdown come in.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ft_client.safefiles import open_append, private_dir_problem
from ft_client.startup import stack_dump_name
from ft_monitor.core.server_log import LOG_FORMAT
from ft_monitor.core.state import Session
from ft_monitor.daemon.connection import Connection
from ft_monitor.forensics import dump_file
from ft_monitor.processes.exits import ExitWatch
from ft_monitor.processes.procinfo import ProcessHandle

if TYPE_CHECKING:
    from ft_monitor.daemon.rank_record import RankRecord

log = logging.getLogger("ft_monitor.server")

MAX_PATH_BYTES = 4096


class RankResources:
    def __init__(self, conn: Connection, session: Session, process: ProcessHandle, *,
                 report_dir: Path, error_file: str | None, exits: ExitWatch) -> None:
        self.conn = conn
        self.control: Connection | None = None
        """The rank's control connection (in-process restart pushes ABORT there), if it opened one."""
        self.record: RankRecord | None = None
        """The rank's progress record, while the daemon reads it (record_watch.py)."""
        self.session = session
        self.process = process
        self.error_file = error_file
        self.exits = exits
        self.session_dir = report_dir
        """Where this session's hang report, stack dump and monitor log go: report_dir, or,
        when report_dir is not configured and the rank runs under torchelastic, its
        attempt directory (beside torch's error.json); see `use_attempt_dir`."""
        self._log: logging.Handler | None = None
        self._holds = 0
        self._closed = False
        self._freed = False

    # -- where the files go ------------------------------------------------------
    def use_attempt_dir(self) -> None:
        """Put reports and a monitor.log in the rank's torchelastic attempt directory
        (beside its error.json) when that directory is private to us."""
        if not self.error_file:
            return
        attempt_dir = Path(self.error_file).parent
        problem = private_dir_problem(attempt_dir)
        if problem is not None:
            if os.path.lexists(attempt_dir):
                log.warning("rank %d: not writing into its attempt directory: %s; reports go to %s",
                            self.session.rank, problem, self.session_dir)
            return
        self.session_dir = attempt_dir
        path = attempt_dir / "monitor.log"
        try:
            stream = os.fdopen(open_append(path), "a")
        except OSError as e:
            log.warning("cannot write the monitor log %s: %s", path, e)
            return
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logging.getLogger().addHandler(handler)
        self._log = handler

    def dump_path(self) -> Path:
        return self.session_dir / stack_dump_name(self.session.rank, self.session.pid)

    def report_path(self, tag: str = "") -> Path:
        """``tag`` tells apart several reports of one process (in-process restarts)."""
        return self.session_dir / report_name(self.session.rank, self.session.pid, tag)

    # -- the process -------------------------------------------------------------
    def watch_exit(self, on_exit: Callable[[RankResources], None]) -> None:
        """Call ``on_exit(self)`` when the rank's process exits, even if its socket
        stays open (a forked child may hold it)."""
        fut = self.exits.exited(self.process)
        if fut is None:
            return

        def exited(f: asyncio.Future[None]) -> None:
            if not f.cancelled() and not self._closed:
                on_exit(self)

        fut.add_done_callback(exited)

    # -- ownership ---------------------------------------------------------------
    def hold(self) -> Hold:
        """Keep the process handle (and the log) open past `close()` until the hold
        is released. Taken at once (not when a task first runs), so a task spawned
        just before the session ends still finds the process open."""
        self._holds += 1
        return Hold(self)

    def _release(self) -> None:
        self._holds -= 1
        self._free_if_done()

    @property
    def held(self) -> bool:
        return self._holds > 0

    def close(self) -> None:
        """The session is over: free everything now, or when the last hold is released."""
        self._closed = True
        self._free_if_done()

    def _free_if_done(self) -> None:
        if not self._closed or self._holds or self._freed:
            return
        self._freed = True
        if not self.process.alive():  # a rank never dumped leaves no stack file (a live one may still write it)
            dump_file.remove_if_empty(self.dump_path())
        if self.record is not None:
            self.record.close()
            self.record = None
        self.exits.forget(self.process)
        self.process.close()
        if self._log is not None:
            logging.getLogger().removeHandler(self._log)
            self._log.close()
            stream = getattr(self._log, "stream", None)
            if stream is not None:
                stream.close()
            self._log = None


class Hold:
    """One task's claim on a rank's resources; `release()` is idempotent."""

    __slots__ = ("rank", "_released")

    def __init__(self, rank: RankResources) -> None:
        self.rank = rank
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.rank._release()


def report_name(rank: int, pid: int, tag: str = "") -> str:
    """The file name of a hang report (a connected rank's, or a start-up hang's)."""
    return f"rank{rank}-pid{pid}{tag}-hang.json"


def error_file_from_hello(value: object) -> str | None:
    """The rank's torchelastic error file from its HELLO, if it is a usable absolute path."""
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        return None
    if len(os.fsencode(value)) > MAX_PATH_BYTES or any(len(os.fsencode(p)) > 255 for p in value.split("/")):
        return None
    return value
