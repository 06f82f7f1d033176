"""The daemon's watch on a worker that was started but has not connected yet.

With ``startup_timeout`` set, the daemon hears of each worker when it starts: ft-launcher
sends WORKER_STARTED (handlers.py), ``serve -- CMD`` calls `StartupWatch.worker_started`
for its own child. From then on one timer runs on the worker's start-up deadline
(startup.py decides). It ends when the worker, or a process it started (a wrapper script
that runs python), connects as the rank (handlers.hello calls `connected`): with
``startup_until: handshake`` the start-up is over, with ``first_step`` its session goes on
timing it until the first heartbeat or step (policy.py). It also ends when the worker
exits (its launcher sees the exit).

When the deadline passes first, the hang takes the daemon's usual path (executor.py):
report (reason ``startup``), stack dump, hand-off to the launcher, termination. The
dump comes from the faulthandler that the start-up hook armed in the worker
(ft_client/startup/__init__.py), in the file both compute from the same spec; a worker without a
handler for the dump signal (not started through the hook, or not Python yet) is not
sent it, since its default action would end the process before anything is known.

At most one worker is watched: a new announcement replaces the previous one. Nothing
here decides whether a worker hung (startup.py) or how a hang is acted on (executor.py).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from pathlib import Path

from ft_monitor.core import startup
from ft_monitor.core.state import Session
from ft_monitor.core.status import HangSummary
from ft_monitor.daemon.clock import Timer
from ft_monitor.daemon.executor import HangCase
from ft_monitor.daemon.ports import Starting, StartupHost
from ft_monitor.daemon.rank import report_name
from ft_monitor.forensics import dump_file
from ft_monitor.processes.procinfo import ProcessHandle, catches_signal, descends_from

log = logging.getLogger("ft_monitor.server")


class _Watched:
    __slots__ = ("worker", "process", "timer")

    def __init__(self, worker: startup.Spawned, process: ProcessHandle) -> None:
        self.worker = worker
        self.process = process
        self.timer: Timer | None = None


class StartupWatch:
    def __init__(self, daemon: StartupHost) -> None:
        self.d = daemon
        self.watched: _Watched | None = None
        self.handling: dict[int, Starting] = {}
        """Pids whose start-up hang is being acted on: they may not connect as the rank."""
        self.catches: Callable[[int, int], bool | None] = catches_signal
        """Whether a pid handles a signal (the seam in-process tests replace)."""
        self.descends: Callable[[int, int], bool] = descends_from

    # -- events -------------------------------------------------------------------
    def worker_started(self, pid: int, rank: int, error_file: str | None = None,
                       process: ProcessHandle | None = None) -> str:
        """Time the start-up of the worker ``pid`` (just started) from now. Returns what
        was done, in a few words (the launcher's ACK carries it)."""
        cfg, now = self.d.config, self.d.clock.now()
        timeout = cfg.startup_timeout
        if timeout is None:
            if process is not None:
                process.close()
            return "startup_timeout is off"
        rank_now = self.d.rank
        if rank_now is not None and self.descends(rank_now.session.pid, pid):  # it connected first
            if process is not None:
                process.close()
            s = rank_now.session
            if cfg.startup_until == "first_step" and not s.started_training:
                s.startup_since, s.startup_timeout = s.started_at, timeout
                self.d.after_batch(rank_now.conn)  # arm on the session's deadlines
                return "connected already; timed until its first heartbeat or step"
            return "connected already"
        proc = process if process is not None else ProcessHandle.open(pid)
        if proc is None or not proc.alive():
            if proc is not None:
                proc.close()
            log.warning("rank %d: worker pid %d was announced but has already exited", rank, pid)
            return "already exited"
        self._drop()
        w = _Watched(startup.Spawned(rank, pid, now, timeout, error_file), proc)
        self.watched = w
        w.timer = self.d.clock.call_later(timeout, self._due)
        exited = self.d.exits.exited(proc)
        if exited is not None:
            exited.add_done_callback(lambda f: self._exited(w))
        log.info("rank %d: worker pid %d started; it has %.1fs to %s", rank, pid, timeout,
                 "connect" if cfg.startup_until == "handshake" else "send a heartbeat or start a step")
        return "timed"

    def starting(self) -> Starting | None:
        """The worker this monitor's rank is still starting as (for a roll call), if any."""
        w = self.watched
        if w is not None:
            return Starting(w.worker.rank, w.worker.pid, w.process, self._dump_path(w.worker))
        return next(iter(self.handling.values()), None)

    def _dump_path(self, worker: startup.Spawned) -> Path:
        """Where the worker's start-up hook has faulthandler write (both compute it from the spec)."""
        spec = startup.dump_spec(self.d.config, self.d.report_dir)
        return Path(spec.dump_path(worker.rank, worker.pid, worker.error_file))

    def refusal(self, pid: int) -> str | None:
        """Why ``pid`` may not connect as the rank now, or None."""
        if pid in self.handling:
            return (f"pid {pid} missed its startup_timeout and is being stopped; a restarted worker gets a new "
                    "session")
        return None

    def connected(self, session: Session) -> None:
        """A rank's session began: if it is the watched worker (or a process it started),
        its start-up before the handshake is over."""
        w = self.watched
        if w is None or not self.descends(session.pid, w.worker.pid):
            return
        now = self.d.clock.now()
        if self.d.config.startup_until == "first_step":
            session.startup_since, session.startup_timeout = w.worker.since, w.worker.timeout
        log.info("rank %d: worker pid %d connected %.2fs after it started", session.rank, session.pid,
                 now - w.worker.since)
        self._drop()

    def _exited(self, w: _Watched) -> None:
        if self.watched is w:
            log.info("rank %d: worker pid %d exited before connecting", w.worker.rank, w.worker.pid)
            dump_file.remove_if_empty(self._dump_path(w.worker))  # its start-up hook's file, never dumped
            self._drop()

    def close(self) -> None:
        """The daemon shuts down."""
        self._drop()

    # -- the deadline ---------------------------------------------------------------
    def _due(self) -> None:
        w = self.watched
        if w is None:
            return
        w.timer = None
        now = self.d.clock.now()
        hang = startup.check(w.worker, now)
        if hang is None:  # a timer that fired early: arm again on the deadline
            w.timer = self.d.clock.call_later(max(0.0, startup.deadline(w.worker).at - now), self._due)
            return
        self.watched = None  # the hang task owns the process handle from here
        cfg = self.d.config
        spec = startup.dump_spec(cfg, self.d.report_dir)
        directory = Path(spec.dump_dir(w.worker.error_file))  # the rank's reports go there too
        case = HangCase(hang, w.process, directory / report_name(hang.rank, hang.pid), self._dump_path(w.worker),
                        error_file=w.worker.error_file)
        if self.catches(w.worker.pid, int(cfg.stack_dump_signal)) is False:
            case.dump_path = None
            case.actions.append(f"no stack dump: pid {hang.pid} has no handler for "
                                f"{signal.Signals(cfg.stack_dump_signal).name} (not started through the start-up "
                                "hook, or not running Python yet)")
        self.handling[w.worker.pid] = Starting(w.worker.rank, w.worker.pid, w.process, case.dump_path)
        self.d.hangs.append(HangSummary(hang.rank, hang.pid, hang.describe(), str(case.report_path)))
        self.d.spawn(self._handle(case))

    async def _handle(self, case: HangCase) -> None:
        try:
            await self.d.handle_hang(case)
        finally:
            if case.dump_path is not None and not case.process.alive():
                dump_file.remove_if_empty(case.dump_path)
            self.handling.pop(case.hang.pid, None)
            self.d.exits.forget(case.process)
            case.process.close()

    def _drop(self) -> None:
        w, self.watched = self.watched, None
        if w is None:
            return
        if w.timer is not None:
            w.timer.cancel()
        self.d.exits.forget(w.process)
        w.process.close()
