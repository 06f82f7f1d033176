"""The monitor daemon for one rank: its listener, its connections, its rank, its hangs.

Data flow (reverse edges marked <-)::

    rank --frames--> Connection --message--> handlers.dispatch --> Session (state.py)
         <-HELLO_OK (SessionInfo: the config the rank runs with)
         --UPDATE_CONFIG (learned timeouts)--> daemon.timeouts, later sessions too
         <-CONFIG_OK
    DeadlineTimer --due--> HangWatch.due (hang_watch.py) --policy.check: Hang--> HangExecutor (executor.py)
         executor --HANG_NOTICE--> launcher (LauncherHandoff) <-ACK: the launcher stops the group
         executor --signals--> rank (ProcessOps: pidfds), --files--> hang report, stack dump
    observer --STATUS--> status.build_status <-STATUS_REPLY
    snapshot --HELLO(kind, bytes)--> SnapshotMemory (snapshot_memory.py) <-HELLO_OK + two memfds, closed

`MonitorDaemon` owns the loop-side lifecycle (`startup`, `shutdown`, the socket
file's watch), admits connections under a cap, holds the connected rank's
resources (rank.py: one owner, one close), wires the deadline timer to its watch
(hang_watch.py arms it, judges the session when it fires and decides what a hang
sets off: in-process restart, dump, or the executor) and runs hang and exit
tasks. Every timer runs on the injected `Clock`, every process operation of the
hang path goes through the executor's `ProcessOps`, so the whole daemon runs
in-process in tests with a `ManualClock` and fakes.
`server.run_daemon` runs it as a process (signals, `serve -- CMD`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from ft_client import wire
from ft_client.safefiles import private_dir_problem
from ft_client.timeouts import Timeouts
from ft_monitor.core.policy import iteration_now
from ft_monitor.core.section_stats import SectionStats
from ft_monitor.core.settings import Settings
from ft_monitor.core.state import Phase, Session
from ft_monitor.core.status import (
    FIRST_PROGRESS,
    ExitSummary,
    HangSummary,
    InprocessRestart,
    MonitorStatus,
    build_status,
)
from ft_monitor.daemon import handlers, record_watch
from ft_monitor.daemon.clock import Clock, SystemClock, Timer
from ft_monitor.daemon.connection import Connection
from ft_monitor.daemon.deadline import DeadlineTimer
from ft_monitor.daemon.executor import HangCase, HangExecutor, ProcessOps, RealProcessOps
from ft_monitor.daemon.fdlimits import FdReserve, connections_that_fit, raise_fd_limit
from ft_monitor.daemon.hang_watch import HangWatch
from ft_monitor.daemon.launcher_link import LauncherHandoff
from ft_monitor.daemon.listener import ListenerError, bind_unix_listener, remove_socket_file
from ft_monitor.daemon.rank import Hold, RankResources
from ft_monitor.daemon.rank_snapshot import RankSnapshots
from ft_monitor.daemon.snapshot_memory import SnapshotMemory
from ft_monitor.daemon.startup_watch import StartupWatch
from ft_monitor.processes.exits import ExitWatch
from ft_monitor.processes.procinfo import describe_wait_status, zombie_exit_status

log = logging.getLogger("ft_monitor.server")

SOCKET_CHECK_INTERVAL = 2.0
"""Seconds between checks that the socket file is still the daemon's."""
MAX_LOGGED_EVICTIONS = 5


class MonitorDaemon:
    def __init__(
        self,
        config: Settings,
        socket_path: str | os.PathLike[str],
        *,
        clock: Clock | None = None,
        launcher_socket: str | None = None,
        ops: ProcessOps | None = None,
    ) -> None:
        self.config = config
        self.socket_path = Path(socket_path).absolute()
        self.clock: Clock = clock or SystemClock()
        self.report_dir = config.report_dir_for(self.socket_path)
        self.timeouts: Timeouts = config.timeouts()
        """In force for the connected rank and for later sessions (UPDATE_CONFIG changes it)."""
        self.exits = ExitWatch()
        self.executor = HangExecutor(
            clock=self.clock,
            stack_dump_signal=config.stack_dump_signal,
            stack_dump_timeout=config.stack_dump_timeout,
            termination_signal=config.rank_termination_signal,
            termination_grace_time=config.termination_grace_time,
            ops=ops or RealProcessOps(self.exits),
            handoff=LauncherHandoff(launcher_socket, self.clock, config.launcher_response_timeout)
            if launcher_socket else None,
            launcher_response_timeout=config.launcher_response_timeout,
        )
        self.rank: RankResources | None = None
        """The connected rank (at most one)."""
        self.sessions_started = 0
        self.hangs: list[HangSummary] = []
        self.iteration_high: int | None = None
        """The highest training iteration any session reported or ended at (progress across restarts)."""
        self.last_iteration: int | None = None
        """The rank's iteration when its latest session ended (`policy.iteration_now` then):
        what STATUS says of a rank that is gone, so the launcher's last word is not a poll's."""
        self.last_exit: ExitSummary | None = None
        """The latest session's EXITING (handlers.py), for STATUS."""
        self.last_gone: ExitSummary | None = None
        self.last_trained: ExitSummary | None = None
        """When the latest ended session's process first made progress (`Session.trained_at`), for STATUS."""
        """When the latest session's process went without a GOODBYE (its connection closed, or
        its process exited with the connection held elsewhere), for STATUS."""
        self.section_stats = SectionStats()
        """How long the rank's sections took, over all sessions (STATUS: step times for the launcher)."""
        self.started_at = self.clock.now()
        self.deadline = DeadlineTimer(self.clock, self._deadline_due)
        self._server: asyncio.AbstractServer | None = None
        self._socket_check: Timer | None = None
        self._inode = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self.children: dict[int, asyncio.Future[int]] = {}
        """pid -> wait status (when known) of processes this daemon started (`serve -- CMD`)."""
        self.no_rank = asyncio.Event()
        """Set while no rank is connected."""
        self.no_rank.set()
        self.others: dict[Connection, None] = {}
        """Connections that are not the rank's (in handshake, or observers), least recently active first."""
        self.max_connections = config.max_connections
        self._evictions = 0
        self.reserve: FdReserve | None = None
        self._hangs_in_progress = 0
        self.inprocess_restarts = 0
        """In-process restarts this daemon asked for (bounded by max_inprocess_restarts)."""
        self.last_restart: InprocessRestart | None = None
        """The rank's last in-process restart, as its REENTERED said (STATUS)."""
        self.startup_watch = StartupWatch(self)
        """The worker started for this rank that has not connected yet (startup_timeout)."""
        self.launcher_pid: int | None = os.getppid() if launcher_socket else None
        """The launcher that started this daemon: the only process that may announce workers."""
        self.snapshots = RankSnapshots(self)
        """The rank's part in a roll call (DUMP_REQUEST from the launcher)."""
        self.snapshot_memory = SnapshotMemory(config.snapshot_max_bytes)
        """The rank's in-memory snapshots (`snapshot` connections): kept across its sessions and
        processes, closed at shutdown."""
        self.hang_watch = HangWatch(self)
        """Arms the deadline timer on the rank's session, judges it when due, acts on a hang."""

    # -- lifecycle -------------------------------------------------------------
    async def startup(self) -> None:
        sock, self._inode = bind_unix_listener(self.socket_path)  # creates the private directory first
        try:
            self.report_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            problem = private_dir_problem(self.report_dir)
        except OSError as e:
            problem = f"cannot create {self.report_dir}: {e.strerror}"
        if problem is not None:
            sock.close()
            remove_socket_file(self.socket_path, self._inode)
            raise ListenerError(f"report directory: {problem}. Hang reports, stack dumps and logs go there: "
                                "use a directory of your own that no one else can write (mode 0700)")
        fd_limit = raise_fd_limit()
        fits = connections_that_fit(fd_limit, self.max_connections)
        if fits < self.max_connections:
            log.warning("max_connections lowered from %d to %d to fit the open-file limit of %d",
                        self.max_connections, fits, fd_limit)
            self.max_connections = fits
        self.reserve = FdReserve()
        await self._serve(sock)
        self._socket_check = self.clock.call_later(SOCKET_CHECK_INTERVAL, self._check_socket_file)
        log.info("monitor pid %d serving %s (reports in %s)", os.getpid(), self.socket_path, self.report_dir)

    async def _serve(self, sock: socket.socket) -> None:
        self._server = await asyncio.get_running_loop().create_unix_server(
            lambda: Connection(self), sock=sock, backlog=socket.SOMAXCONN)

    def _check_socket_file(self) -> None:
        """A socket file removed under a running daemon (a cleanup script, a tmp reaper)
        would keep every restarted rank out: listen on the path again."""
        self._socket_check = self.clock.call_later(SOCKET_CHECK_INTERVAL, self._check_socket_file)
        try:
            if os.lstat(self.socket_path).st_ino == self._inode:
                return
            log.error("socket file %s was replaced by something else; not touching it", self.socket_path)
            return
        except FileNotFoundError:
            pass
        log.error("socket file %s was removed; listening on it again (connected ranks are unaffected)",
                  self.socket_path)
        try:
            sock, self._inode = bind_unix_listener(self.socket_path)
        except ListenerError as e:
            log.error("cannot listen on %s again: %s", self.socket_path, e)
            return
        if self._server is not None:
            self._server.close()
        self.spawn(self._serve(sock))

    async def shutdown(self, reason: str) -> None:
        log.info("monitor shutting down: %s", reason)
        if self._server is not None:
            self._server.close()
        if self._socket_check is not None:
            self._socket_check.cancel()
        self.deadline.cancel()
        self.startup_watch.close()
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            done, still = await asyncio.wait(pending, timeout=self.config.termination_grace_time + 1.0)
            for t in still:
                t.cancel()
            if still:
                log.warning("cancelled %d hang-handling task(s) still running at shutdown", len(still))
                await asyncio.wait(still, timeout=1.0)
        rank, self.rank = self.rank, None
        if rank is not None:
            rank.conn.close()
            rank.close()
        remove_socket_file(self.socket_path, self._inode)
        self.snapshot_memory.close()
        if self.reserve is not None:
            self.reserve.release()

    # -- connections ----------------------------------------------------------
    def admit(self, conn: Connection) -> None:
        """Count a new connection; past max_connections the oldest one still in its
        handshake, else the least recently active observer, is closed, so a new
        connection (the rank's, maybe) always gets in and descriptors stay bounded."""
        self.others[conn] = None
        if len(self.others) <= self.max_connections:
            return
        victim = next((c for c in self.others if c.role is None and c is not conn), None)
        if victim is None:
            victim = next(c for c in self.others if c is not conn)
        self.others.pop(victim, None)
        self._evictions += 1
        if self._evictions <= MAX_LOGGED_EVICTIONS or self._evictions % 1000 == 0:
            log.warning("connection cap (%d) reached: closing the %s connection from pid %d (%d closed so far)",
                        self.max_connections, "idle observer" if victim.role else "oldest unidentified",
                        victim.pid, self._evictions)
        victim.fail(wire.ErrorCode.BUSY, f"too many connections to this monitor (at most {self.max_connections})")

    def observer_active(self, conn: Connection) -> None:
        conn.touch(self.clock.now())
        self.others.pop(conn, None)  # most recently active last
        self.others[conn] = None

    def dispatch(self, conn: Connection, msg: wire.Message) -> None:
        rank = self.rank
        if rank is not None and rank.record is not None and conn is rank.conn:
            record_watch.sync(self, rank)  # what the rank stored before it sent this comes first
        handlers.dispatch(self, conn, msg)

    def after_batch(self, conn: Connection) -> None:
        if self.rank is not None and conn is self.rank.conn:
            self.hang_watch.arm()

    def rank_connected(self, rank: RankResources) -> None:
        self.others.pop(rank.conn, None)
        self.rank = rank
        self.no_rank.clear()
        self.sessions_started += 1
        rank.watch_exit(self._rank_exited)

    def _rank_exited(self, rank: RankResources) -> None:
        """The rank's process exited while its socket stays open (held by a child): end
        its session, so an exit is never left to look like a hang."""
        if rank is not self.rank or rank.session.phase is not Phase.ACTIVE:
            return
        log.warning("rank %d pid %d exited while its connection is still open (held by a child process?); "
                    "ending its session", rank.session.rank, rank.session.pid)
        self.disconnected(rank.conn)
        rank.conn.close()

    def disconnected(self, conn: Connection) -> None:
        """A connection closed; for the rank's: its session ends (also on GOODBYE, or
        when its process exits) and its resources are closed, at once or after the
        task that still holds them."""
        self.others.pop(conn, None)
        rank = self.rank
        if rank is not None and conn is rank.control:
            rank.control = None
            return
        if rank is None or conn is not rank.conn:
            return
        if rank.record is not None:
            record_watch.sync(self, rank)  # what the rank stored before it went is counted
        self.rank = None
        self.no_rank.set()
        self.deadline.cancel()
        s = rank.session
        phase = s.phase
        if phase is not Phase.CLOSING:
            self.last_gone = ExitSummary(s.pid, f"connection closed in phase {phase.value}", self.clock.now())
        if s.trained_at is not None:
            self.last_trained = ExitSummary(s.pid, FIRST_PROGRESS, s.trained_at)
        s.end()
        self._session_ended_at(iteration_now(s))
        if s.errors > handlers.MAX_LOGGED_SESSION_ERRORS:
            log.warning("rank %d pid %d: %d messages ignored in this session in all", s.rank, s.pid, s.errors)
        if phase is Phase.CLOSING:
            log.info("rank %d pid %d shut down monitoring cleanly", s.rank, s.pid)
        elif phase is Phase.HUNG:
            log.info("rank %d pid %d (hung) disconnected", s.rank, s.pid)
        else:
            self.spawn(self._report_exit(rank), rank.hold())
        rank.close()

    def _session_ended_at(self, iteration: int | None) -> None:
        if iteration is None:
            return
        self.last_iteration = iteration
        if self.iteration_high is None or iteration > self.iteration_high:
            self.iteration_high = iteration

    async def _report_exit(self, rank: RankResources) -> None:
        """A rank that went away without GOODBYE: it exited (or closed its socket); not a hang."""
        s: Session = rank.session
        proc = rank.process
        await self.exits.wait(proc, 1.0)
        status: int | None = None
        child = self.children.get(s.pid)
        if child is not None:
            try:
                status = await asyncio.wait_for(asyncio.shield(child), 1.0)
            except TimeoutError:
                pass
        else:
            status = zombie_exit_status(s.pid)
        if proc.alive():
            what = "is still running"
        elif status is not None:
            what = f"exited ({describe_wait_status(status)})"
        else:
            what = "exited (exit status unknown: not a child of the monitor)"
        log.warning("rank %d pid %d disconnected without shutdown_workload_monitoring(); the process %s",
                    s.rank, s.pid, what)

    # -- detection (hang_watch.py) -------------------------------------------
    def _deadline_due(self) -> None:
        """The deadline timer fired: the watch judges the rank's session."""
        self.hang_watch.due()

    async def handle_hang(self, case: HangCase) -> None:
        """Act on a hang (the executor), with the reserved descriptors free while it runs."""
        self._hangs_in_progress += 1
        if self.reserve is not None:
            self.reserve.release()  # descriptors for the report, temporary files and pidfds
        try:
            await self.executor.handle(case)
        finally:
            self._hangs_in_progress -= 1
            if self.reserve is not None and not self._hangs_in_progress:
                self.reserve.fill()

    def spawn(self, coro: Coroutine[Any, Any, Any], hold: Hold | None = None) -> None:
        """Run a task; ``hold`` (on a rank's resources) is released when it is done,
        cancelled, or cancelled before it ever ran."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if hold is not None:
            task.add_done_callback(lambda _t: hold.release())

    # -- status ----------------------------------------------------------------
    def status(self) -> MonitorStatus:
        progress = None
        if self.rank is not None:
            record_watch.sync(self, self.rank)
            progress = "record" if self.rank.record is not None else "socket"
        return build_status(
            now=self.clock.now(), monitor_pid=os.getpid(), socket=str(self.socket_path),
            started_at=self.started_at, sessions=self.sessions_started, timeouts=self.timeouts,
            iteration_high=self.iteration_high, session=self.rank.session if self.rank else None,
            hangs=self.hangs, last_restart=self.last_restart, section_stats=self.section_stats,
            progress=progress, last_iteration=self.last_iteration, last_exit=self.last_exit,
            last_gone=self.last_gone, snapshots=self.snapshot_memory.status(), first_progress=self.last_trained,
        )
