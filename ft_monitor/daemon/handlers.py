"""What each message does: which connection may send what, and the handlers.

`dispatch` routes one decoded message from a connection. Before its HELLO a
connection may send nothing else; the rank's connection sends progress
(heartbeats, sections, iterations) into its session, and may push learned
timeouts (UPDATE_CONFIG, the reverse edge of the handshake's config) and say
GOODBYE; observers (and the rank) may ask STATUS and PING; a `snapshot` connection
gets the rank's snapshot memory at its HELLO and is closed. Decisions on
progress live in state.py; this module only applies messages to the daemon's
state and answers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from ft_client import wire
from ft_client.inprocess import timeline
from ft_client.session_info import SessionInfo
from ft_client.timeouts import Timeouts, TimeoutsError
from ft_monitor.core.server_log import printable
from ft_monitor.core.state import Phase, Session, SessionError
from ft_monitor.core.status import ExitSummary, InprocessRestart
from ft_monitor.daemon import record_watch
from ft_monitor.daemon.connection import Connection
from ft_monitor.daemon.ports import HandlerHost
from ft_monitor.daemon.rank import RankResources, error_file_from_hello

log = logging.getLogger("ft_monitor.server")

MAX_LOGGED_SESSION_ERRORS = 5
MAX_REASON = 4096
MAX_WARMUP_ITERS = 2**31 - 1


def dispatch(d: HandlerHost, conn: Connection, msg: wire.Message) -> None:
    t = type(msg)
    rank = d.rank
    if rank is not None and conn is rank.conn:
        handler = _RANK_HANDLERS.get(t)
        if handler is not None:
            try:
                handler(d, rank, msg)
            except SessionError as e:
                session_error(rank.session, e)
            return
    if conn.role is None:
        if not isinstance(msg, wire.Hello):
            raise wire.ProtocolError(f"expected HELLO first, got {t.__name__}")
        hello(d, conn, msg)
        return
    if conn.role == wire.Role.OBSERVER:
        d.observer_active(conn)
    if t is wire.Status:
        conn.send(wire.StatusReply(d.status().to_wire()))
    elif t is wire.Ping:
        conn.send(wire.PONG)
    elif t is wire.Hello:
        raise wire.ProtocolError("second HELLO on one connection")
    elif t is wire.WorkerStarted and conn.role == wire.Role.LAUNCHER:
        worker_started(d, conn, msg)  # type: ignore[arg-type]
    elif t is wire.DumpRequest and conn.role == wire.Role.LAUNCHER:
        d.snapshots.answer(conn, msg)  # type: ignore[arg-type]  # the roll call: rank_snapshot.py
    elif conn.role == wire.Role.OBSERVER:
        log.warning("closing observer connection from pid %d: %s is not allowed for an observer",
                    conn.pid, t.__name__)
        conn.fail(wire.ErrorCode.FORBIDDEN, f"{t.__name__} is not allowed for an observer")
    else:
        raise wire.ProtocolError(f"unexpected {t.__name__} from a client")


def session_error(s: Session, e: SessionError) -> None:
    """A message that makes no sense now: logged (the first few per session), ignored."""
    s.errors += 1
    if s.errors <= MAX_LOGGED_SESSION_ERRORS:
        log.warning("rank %d pid %d: %s (ignored)%s", s.rank, s.pid, e,
                    "; further such messages are counted, not logged"
                    if s.errors == MAX_LOGGED_SESSION_ERRORS else "")


def hello(d: HandlerHost, conn: Connection, msg: wire.Hello) -> None:
    if msg.version != wire.PROTOCOL_VERSION:
        log.warning("refused pid %d: protocol version %d, this monitor speaks %d",
                    conn.pid, msg.version, wire.PROTOCOL_VERSION)
        conn.fail(wire.ErrorCode.VERSION,
                  f"protocol version {msg.version} is not supported; this monitor speaks {wire.PROTOCOL_VERSION}")
        return
    if msg.role == wire.Role.OBSERVER:
        conn.hello_done(msg.role)
        conn.send(wire.HelloOk(wire.PROTOCOL_VERSION, {"monitor_pid": os.getpid()}))
        return
    if msg.role == wire.Role.CONTROL:
        control_hello(d, conn)
        return
    if msg.role == wire.Role.LAUNCHER:
        launcher_hello(d, conn)
        return
    if msg.role == wire.Role.SNAPSHOT:
        d.snapshot_memory.hello(conn, msg)  # snapshot_memory.py: one reply, then closed
        return
    if msg.role != wire.Role.RANK:
        raise wire.ProtocolError(f"unknown role {msg.role!r}")
    if conn.pid <= 0:
        log.warning("refused a rank connection from another pid namespace: the monitor cannot see its process, "
                    "so it could neither dump nor stop it")
        conn.fail(wire.ErrorCode.FORBIDDEN,
                  "the rank's process is in a pid namespace the monitor cannot see (SO_PEERCRED pid 0): it could "
                  "not be dumped or stopped. Run the monitor in the rank's pid namespace (Kubernetes: "
                  "shareProcessNamespace: true, or the monitor in the training container)")
        return
    if conn.process is None or not conn.process.alive():
        log.warning("refused a rank connection from pid %d: the process that connected has exited or "
                    "cannot be pinned", conn.pid)
        conn.fail(wire.ErrorCode.FORBIDDEN,
                  f"the process that connected (pid {conn.pid}) has exited or cannot be pinned (pidfd)")
        return
    if d.rank is not None:
        live = d.rank.conn.pid
        log.warning("refused rank connection from pid %d: rank pid %d is connected", conn.pid, live)
        conn.fail(wire.ErrorCode.BUSY, f"a rank is already connected to this monitor: pid {live}")
        return
    refusal = d.startup_watch.refusal(conn.pid)
    if refusal is not None:
        log.warning("refused rank connection from pid %d: %s", conn.pid, refusal)
        conn.fail(wire.ErrorCode.FORBIDDEN, refusal)
        return
    conn.hello_done(msg.role)
    process = conn.take_process()
    assert process is not None
    warmup = _num_warmup_iterations(d, msg)
    session = Session(rank=msg.rank, pid=conn.pid, started_at=d.clock.now(), timeouts=d.timeouts,
                      num_warmup_iterations=warmup)
    d.startup_watch.connected(session)
    rank = RankResources(conn, session, process, report_dir=d.report_dir,
                         error_file=error_file_from_hello(msg.info.get("error_file")), exits=d.exits)
    if d.config.report_dir is None:
        rank.use_attempt_dir()
    d.rank_connected(rank)
    cfg = d.config
    offered = record_watch.offer(d, msg.info)
    info = SessionInfo(
        rank=msg.rank, pid=conn.pid, session=d.sessions_started, timeouts=d.timeouts,
        num_warmup_iterations=warmup, stack_dump_signal=int(cfg.stack_dump_signal),
        stack_dump_path=str(rank.dump_path()), skip_section_response=cfg.skip_section_response,
        on_monitor_lost=cfg.on_monitor_lost, on_hang=cfg.on_hang, client_request_timeout=cfg.client_request_timeout,
        safety_factor=cfg.safety_factor, min_learned_timeout=cfg.min_learned_timeout,
        record=record_watch.INFO if offered is not None else None,
        flight_recorder=cfg.flight_recorder_entries > 0,
    )
    record_watch.send_hello_ok(rank, info, offered)
    log.info("rank %d pid %d connected (session %d)", msg.rank, conn.pid, d.sessions_started)


def _num_warmup_iterations(d: HandlerHost, msg: wire.Hello) -> int:
    """The rank's own warm-up length (``init_workload_monitoring(num_warmup_iters=)``, as
    nvidia-resiliency-ext's client sends it), else the monitor's setting."""
    n = msg.info.get("num_warmup_iters")
    if n is None:
        return d.config.num_warmup_iterations
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_WARMUP_ITERS:
        log.warning("rank %d: ignored num_warmup_iters = %.60r from its HELLO (a whole number 0..%d); using "
                    "num_warmup_iterations = %d", msg.rank, n, MAX_WARMUP_ITERS, d.config.num_warmup_iterations)
        return d.config.num_warmup_iterations
    return n


def control_hello(d: HandlerHost, conn: Connection) -> None:
    """The rank's control connection: the monitor pushes ABORT there (in-process restart).
    Only the connected rank's own process may open it, one at a time."""
    rank = d.rank
    if rank is None or conn.pid != rank.conn.pid:
        log.warning("refused a control connection from pid %d: it is not the connected rank's process", conn.pid)
        conn.fail(wire.ErrorCode.FORBIDDEN, "a control connection must come from the connected rank's process")
        return
    if rank.control is not None:
        conn.fail(wire.ErrorCode.BUSY, "the rank already has a control connection")
        return
    conn.hello_done(wire.Role.CONTROL)
    conn.release_process()
    d.others.pop(conn, None)
    rank.control = conn
    conn.send(wire.HelloOk(wire.PROTOCOL_VERSION, {"session": d.sessions_started}))


def launcher_hello(d: HandlerHost, conn: Connection) -> None:
    """The launcher that started this daemon announces its workers (WORKER_STARTED)."""
    if d.launcher_pid is None or conn.pid != d.launcher_pid:
        log.warning("refused a launcher connection from pid %d: not the launcher that started this monitor",
                    conn.pid)
        conn.fail(wire.ErrorCode.FORBIDDEN, "only the launcher that started this monitor may announce workers")
        return
    conn.hello_done(wire.Role.LAUNCHER)
    conn.release_process()
    conn.send(wire.HelloOk(wire.PROTOCOL_VERSION, {"monitor_pid": os.getpid()}))


def worker_started(d: HandlerHost, conn: Connection, msg: wire.WorkerStarted) -> None:
    if msg.pid <= 0:
        conn.send(wire.Error(wire.ErrorCode.BAD_REQUEST, f"pid {msg.pid} is not a process id"))
        return
    what = d.startup_watch.worker_started(msg.pid, msg.rank, error_file_from_hello(msg.error_file))
    conn.send(wire.Ack({"startup": what}))


# -- the rank's messages --------------------------------------------------------
def _heartbeat(d: HandlerHost, r: RankResources, m: Any) -> None:
    r.session.heartbeat(d.clock.now())


def _open(d: HandlerHost, r: RankResources, m: wire.SectionOpen) -> None:
    r.session.open_section(m.name, d.clock.now())


def _close(d: HandlerHost, r: RankResources, m: wire.SectionClose) -> None:
    took = r.session.close_section(m.name, d.clock.now())
    if took is not None:
        d.section_stats.record(m.name, took)


def _close_all(d: HandlerHost, r: RankResources, m: Any) -> None:
    r.session.close_all_sections(d.clock.now())


def _iteration(d: HandlerHost, r: RankResources, m: wire.Iteration) -> None:
    r.session.set_iteration(m.iteration)
    if d.iteration_high is None or m.iteration > d.iteration_high:
        d.iteration_high = m.iteration


def _update_config(d: HandlerHost, r: RankResources, msg: wire.UpdateConfig) -> None:
    """Learned timeouts from the rank: in force now, and for later sessions of this daemon."""
    try:
        timeouts = Timeouts.from_wire(msg.timeouts)
    except TimeoutsError as e:
        log.warning("rank %d: rejected timeouts update: %s", r.session.rank, e)
        r.conn.send(wire.Error(wire.ErrorCode.BAD_REQUEST, str(e)))
        return
    if timeouts != d.timeouts:
        learned = ", ".join(printable(name) for name in sorted(timeouts.learned))
        log.info("rank %d: timeouts now %s%s", r.session.rank, timeouts.describe(),
                 f" (learned: {learned})" if learned else "")
    for name in switched_on(d.config.timeouts(), d.timeouts, timeouts):
        log.warning("rank %d: the learned %s = %.1f s switches on a timeout the configuration leaves off (set it "
                    "in the config, or to null there and do not learn it, to choose)", r.session.rank, name,
                    getattr(timeouts, name))
    d.timeouts = timeouts
    r.session.set_timeouts(timeouts, d.clock.now())
    r.conn.send(wire.ConfigOk(timeouts.to_wire()))


OPTIONAL_TIMEOUTS = ("initial_rank_heartbeat_timeout", "rank_heartbeat_timeout", "rank_out_of_section_timeout")


def switched_on(configured: Timeouts, before: Timeouts, after: Timeouts) -> list[str]:
    """The timeouts the configuration leaves off (None) that an update switches on now."""
    return [n for n in OPTIONAL_TIMEOUTS
            if getattr(configured, n) is None and getattr(before, n) is None and getattr(after, n) is not None]


def _goodbye(d: HandlerHost, r: RankResources, msg: wire.Goodbye) -> None:
    """Clean shutdown: the session ends now, so the rank may connect again at once."""
    s = r.session
    if s.open_sections:
        log.warning("rank %d pid %d shut down with section(s) still open: %s",
                    s.rank, s.pid, ", ".join(map(printable, s.open_sections)))
    else:  # shutdown_workload_monitoring(), or the client's at a normal exit (ft_client.client.exiting)
        log.info("rank %d pid %d shut down monitoring; no longer timed", s.rank, s.pid)
    _end_session(d, r)


def _end_session(d: HandlerHost, r: RankResources) -> None:
    """The rank said its session is over (GOODBYE, EXITING): not timed any more."""
    r.session.goodbye()
    r.conn.role = wire.Role.OBSERVER  # what it may still send: STATUS, PING
    d.disconnected(r.conn)


def _exiting(d: HandlerHost, r: RankResources, msg: wire.Exiting) -> None:
    """The rank's process is on its way out (an uncaught exception): a crash, not a hang. Its
    session ends as at GOODBYE; the launcher sees the process exit and restarts for a failure."""
    log.warning("rank %d pid %d is exiting: %s; no longer timed (a crash, not a hang)", r.session.rank,
                r.session.pid, printable(msg.reason[:MAX_REASON]))
    d.last_exit = ExitSummary(r.session.pid, msg.reason[:MAX_REASON], d.clock.now())
    _end_session(d, r)


def _restarting(d: HandlerHost, r: RankResources, msg: wire.Restarting) -> None:
    """The rank's Wrapper saw a fault and restarts in-process (its own monitor asked, a
    peer's fault reached it through the store, or its function raised)."""
    was = r.session.phase
    r.session.restarting(msg.iteration, d.clock.now(), d.config.inprocess_restart_timeout)
    if was is Phase.ACTIVE:
        log.warning("rank %d pid %d restarts in-process as iteration %d (a fault elsewhere in the job, or an "
                    "exception); back within %.1fs or stopped", r.session.rank, r.session.pid, msg.iteration,
                    d.config.inprocess_restart_timeout)
    else:
        log.info("rank %d pid %d leaves its training function (in-process iteration %d next)",
                 r.session.rank, r.session.pid, msg.iteration)


def _reentered(d: HandlerHost, r: RankResources, msg: wire.Reentered) -> None:
    """The rank is back in its training function, in the same process."""
    r.session.reentered(msg.iteration, d.clock.now())
    d.last_restart = InprocessRestart(msg.iteration, msg.reason[:MAX_REASON], msg.fault_rank, msg.source[:64],
                                      {k[:32]: v for k, v in msg.times.items()})
    took = timeline.breakdown(msg.times.get(timeline.FAULT, 0.0), [msg.times])
    log.warning("rank %d pid %d re-entered its training function (in-process iteration %d) after: %s (%s)",
                r.session.rank, r.session.pid, msg.iteration, printable(msg.reason[:MAX_REASON]),
                timeline.describe(took))


def _control(d: HandlerHost, r: RankResources, msg: wire.Control) -> None:
    r.conn.send(wire.Error(wire.ErrorCode.BAD_REQUEST,
                           f"workload control {msg.action!r} needs ft-launcher; this monitor runs standalone"))


_RANK_HANDLERS: dict[type, Callable[[Any, RankResources, Any], None]] = {
    wire.Heartbeat: _heartbeat,
    wire.SectionOpen: _open,
    wire.SectionClose: _close,
    wire.SectionCloseAll: _close_all,
    wire.Iteration: _iteration,
    wire.UpdateConfig: _update_config,
    wire.Goodbye: _goodbye,
    wire.Exiting: _exiting,
    wire.Control: _control,
    wire.Restarting: _restarting,
    wire.Reentered: _reentered,
    wire.SectionSlot: record_watch.section_slot,
    wire.RecordDeclined: record_watch.declined,
}
