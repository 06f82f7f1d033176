"""The daemon's watch on the connected rank's deadlines: the timer armed, a due deadline
judged, and what a hang found sets off.

`arm` puts the deadline timer (deadline.py, wired by the daemon) on the session's earliest
deadline (`policy.next_deadline`), or sooner on the progress record's tick (record_watch).
When it fires, `due` reads the record first (the rank's latest progress), judges
(`policy.check`) and, if the rank hung, acts as ``on_hang`` says:

* ``inprocess``: the rank is asked to restart in its own process (ABORT on its control
  connection, after its stack dump is written), within ``max_inprocess_restarts``; a rank
  without a control connection, a spent budget, a restart that did not come back or a
  start-up that did not end takes the usual path instead;
* ``dump``: report, dump and hand-off to the launcher once per hang, the rank left running;
* otherwise the usual path: the session marked hung and the executor's task (report, dump,
  hand-off, termination) started through the daemon's `handle_hang`.

A passed deadline found while the rank's socket still holds unread input is judged again
after that input is read (the daemon may have been stopped while the rank reported
progress). It takes a `HangHost`, never the daemon itself (kept beside it, as
`connection.ConnectionHost` is: the daemon is its only host).
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine
from typing import Any, Protocol

from ft_client import wire
from ft_monitor.core.policy import Hang, Reason, check, deadline_inputs, next_deadline
from ft_monitor.core.server_log import printable
from ft_monitor.core.status import HangSummary
from ft_monitor.daemon import record_watch
from ft_monitor.daemon.deadline import DeadlineTimer
from ft_monitor.daemon.executor import HangCase, HangExecutor, PendingDump
from ft_monitor.daemon.ports import RecordHost, RecordSettings
from ft_monitor.daemon.rank import Hold, RankResources

log = logging.getLogger("ft_monitor.server")

READ_FIRST_DELAY = 0.001
MAX_READ_FIRST = 100
"""A deadline found passed while the rank's socket still holds unread input is judged
again after that input is read (the daemon may have been stopped while the rank
reported progress); at most this many times in a row."""


class HangSettings(RecordSettings, Protocol):
    """The config values the watch reads (it reads the progress record, so those too)."""

    @property
    def on_hang(self) -> str:
        """What a hang sets off: ``kill`` (the usual path), ``dump`` or ``inprocess``."""

    @property
    def max_inprocess_restarts(self) -> int:
        """How many in-process restarts the daemon may ask for."""

    @property
    def inprocess_restart_timeout(self) -> float:
        """How long a rank asked to restart in-process has to come back."""


class HangHost(RecordHost, Protocol):
    """What the watch needs from the daemon (the progress record's host too: it reads the record
    before judging)."""

    @property
    def config(self) -> HangSettings:
        """``on_hang`` and the in-process restart's budget and timeout."""

    @property
    def rank(self) -> RankResources | None:
        """The connected rank, whose session is judged."""

    @property
    def deadline(self) -> DeadlineTimer:
        """The one timer on the session's earliest deadline; the daemon calls `HangWatch.due` when it fires."""

    @property
    def executor(self) -> HangExecutor:
        """Dumps the stack and writes the report of an in-process restart, and tells the launcher."""

    @property
    def hangs(self) -> list[HangSummary]:
        """The daemon's hangs (STATUS); each one acted on is added."""

    inprocess_restarts: int
    """In-process restarts asked for so far (bounded by ``max_inprocess_restarts``)."""

    def spawn(self, coro: Coroutine[Any, Any, Any], hold: Hold | None = None) -> None:
        """Run a task (holding the rank's resources) that the daemon waits for at shutdown."""

    async def handle_hang(self, case: HangCase) -> None:
        """Act on a hang (the executor: report, dump, hand-off, termination)."""


class HangWatch:
    def __init__(self, daemon: HangHost) -> None:
        self.d = daemon
        self._read_first = 0
        """How many times in a row a passed deadline waited for unread rank input."""
        self._due: tuple[float | None, tuple[object, ...]] | None = None
        """The next deadline as `arm` last found it, and the session it found it for
        (`deadline_inputs`): a record tick that changed nothing need not judge again."""
        self._diagnosed: tuple[int, str, str | None, float] | None = None
        """With ``on_hang: dump``: the hang (pid, reason, section, onset) last diagnosed and left running."""

    def arm(self) -> None:
        """The timer on the earliest deadline, or sooner on the progress record's tick."""
        rank = self.d.rank
        d = next_deadline(rank.session) if rank is not None else None
        at = None if d is None else d.at
        self._due = None if rank is None else (at, deadline_inputs(rank.session))
        self._arm_at(at)

    def _arm_at(self, at: float | None) -> None:
        rank = self.d.rank
        tick = record_watch.tick(rank) if rank is not None else None
        if tick is not None:
            at = self.d.clock.now() + tick if at is None else min(at, self.d.clock.now() + tick)
        if at is None:
            self.d.deadline.cancel()
        else:
            self.d.deadline.arm(at)

    def due(self) -> None:
        """The deadline timer fired: judge the rank's session, and act on a hang."""
        rank = self.d.rank
        if rank is None:
            return
        s = rank.session
        record_watch.sync(self.d, rank)  # the rank's latest progress in its record, before judging
        now = self.d.clock.now()
        due = self._due
        if due is not None and (due[0] is None or now < due[0]) and due[1] == deadline_inputs(s):
            self._arm_at(due[0])  # a record tick that found nothing new: read again at the next one
            return
        hang = check(s, now)
        if hang is None:
            self._read_first = 0
            self.arm()
            return
        if self._read_first < MAX_READ_FIRST and rank.conn.unread_bytes() > 0:
            # progress the rank reported may be waiting in the socket (the daemon was
            # stopped, frozen or starved): read it before judging
            self._read_first += 1
            self.d.deadline.arm(now + READ_FIRST_DELAY)
            return
        self._read_first = 0
        if self._restart_inprocess(rank, hang):
            return
        if self.d.config.on_hang == "dump" and hang.reason not in (Reason.INPROCESS_RESTART, Reason.STARTUP):
            self._dump_and_keep_running(rank, hang)
            # the passed deadline is not acted on again; progress re-arms the timer, and a rank
            # that reports through its record sends nothing that would: read it on the tick
            self._due = (None, deadline_inputs(s))
            self._arm_at(None)
            return
        s.mark_hung()
        case = HangCase(hang, rank.process, rank.report_path(), rank.dump_path(), error_file=rank.error_file)
        self.d.hangs.append(HangSummary(hang.rank, hang.pid, hang.describe(), str(case.report_path)))
        self.d.spawn(self.d.handle_hang(case), rank.hold())

    def _dump_and_keep_running(self, rank: RankResources, hang: Hang) -> None:
        """``on_hang: dump``: report, dump and tell the launcher (it diagnoses the job), once per
        hang; the session stays active, and the same passed deadline is not acted on again until
        the rank makes progress past it."""
        key = (hang.pid, hang.reason.value, hang.section, hang.onset)
        if self._diagnosed == key:
            return
        self._diagnosed = key
        case = HangCase(hang, rank.process, rank.report_path(f"-dump{len(self.d.hangs) + 1}"), rank.dump_path(),
                        error_file=rank.error_file, action="dump")
        self.d.hangs.append(HangSummary(hang.rank, hang.pid, hang.describe(), str(case.report_path)))
        self.d.spawn(self.d.handle_hang(case), rank.hold())

    def _restart_inprocess(self, rank: RankResources, hang: Hang) -> bool:
        """With ``on_hang: inprocess``, ask the rank to restart in its own process (ABORT on
        its control connection) instead of killing it; False where that is not possible:
        the rank has no control connection, the restart budget is spent, or the hang is
        itself a restart that did not come back, or a start-up that did not end (then today's
        path: dump, kill)."""
        d = self.d
        cfg = d.config
        if cfg.on_hang != "inprocess" or hang.reason in (Reason.INPROCESS_RESTART, Reason.STARTUP):
            return False
        s = rank.session
        if rank.control is None:
            log.warning("rank %d pid %d: on_hang is inprocess but the rank has no control connection (no "
                        "ft_client.inprocess.Wrapper?); stopping it instead", s.rank, s.pid)
            return False
        if d.inprocess_restarts >= cfg.max_inprocess_restarts:
            log.warning("rank %d pid %d: %d in-process restart(s) used, max_inprocess_restarts is %d; stopping it "
                        "instead", s.rank, s.pid, d.inprocess_restarts, cfg.max_inprocess_restarts)
            return False
        d.inprocess_restarts += 1
        now = d.clock.now()
        s.begin_restart(now, cfg.inprocess_restart_timeout)
        log.error("hang detected: rank=%d pid=%d reason=%s section=%s elapsed=%.3fs timeout=%.3fs: %s; restarting "
                  "in-process (%d of at most %d), back within %.1fs or stopped", hang.rank, hang.pid,
                  hang.reason.value, printable(hang.section), hang.elapsed, hang.timeout, hang.describe(),
                  d.inprocess_restarts, cfg.max_inprocess_restarts, cfg.inprocess_restart_timeout)
        case = HangCase(hang, rank.process, rank.report_path(f"-inprocess{d.inprocess_restarts}"),
                        rank.dump_path(), error_file=rank.error_file, action="inprocess",
                        restart_iteration=s.wrapper_iteration + 1)
        dumping = d.executor.request_dump(case)  # the stack as it hangs, before the abort unwinds it
        abort = wire.Abort(iteration=s.wrapper_iteration, reason=f"rank {hang.rank}: {hang.describe()}",
                           hung_rank=hang.rank)
        case.actions.append(f"in-process restart requested ({d.inprocess_restarts} of at most "
                            f"{cfg.max_inprocess_restarts})")
        case.terminated_by = "inprocess"
        d.executor.write_report(case)
        d.hangs.append(HangSummary(hang.rank, hang.pid, hang.describe(), str(case.report_path)))
        d.spawn(self._abort_inprocess(rank, case, abort, dumping), rank.hold())
        self.arm()
        return True

    async def _abort_inprocess(self, rank: RankResources, case: HangCase, abort: wire.Abort,
                               dumping: PendingDump | None) -> None:
        """Push ABORT once the stack dump is written (faulthandler reads every thread's frames
        without the GIL: a rank whose threads start running, as an ABORT makes them, while it
        dumps can crash), then tell the launcher (it records the restart; its restart budget
        is untouched)."""
        executor = self.d.executor
        if dumping is not None:
            await executor.await_dump(case, dumping)
            executor.write_report(case)
        if rank.control is not None:
            rank.control.send(abort)
        else:
            log.warning("rank %d: its control connection closed before the ABORT could be pushed; it is stopped "
                        "if it does not come back within inprocess_restart_timeout", case.hang.rank)
        if executor.handoff is None:
            return
        try:
            await executor.handoff.notify(case)
        except Exception:  # the launcher being gone does not stop an in-process restart
            log.exception("rank %d: telling the launcher of the in-process restart failed", case.hang.rank)
