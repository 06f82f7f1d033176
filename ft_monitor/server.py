"""The monitor daemon: an asyncio Unix-socket server for one rank.

Bytes -> wire messages -> session state -> policy -> executor. This module owns
the loop lifecycle (`startup`, `serve`, `shutdown`), the connections, the timer
armed on the earliest deadline, and which messages each connection may send.
Decisions live in state.py/policy.py; signals and files in executor.py.

One rank connection at a time (its pid from SO_PEERCRED); observers
(`ft-monitor status`) may connect beside it and ask STATUS/PING. Timeouts
pushed by UPDATE_CONFIG stay in force for later sessions of the same daemon.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Any

from ft_client import wire
from ft_client.timeouts import Timeouts, TimeoutsError
from ft_monitor.clock import Clock, SystemClock, to_wall
from ft_monitor.executor import HangCase, HangExecutor, wait_for_exit
from ft_monitor.listener import ListenerError, bind_unix_listener, remove_socket_file
from ft_monitor.policy import Hang, check, next_deadline
from ft_monitor.procinfo import (
    ProcessHandle,
    describe_wait_status,
    peer_credentials,
    zombie_exit_status,
)
from ft_monitor.server_log import LOG_FORMAT
from ft_monitor.settings import Settings
from ft_monitor.state import Phase, Session, SessionError

log = logging.getLogger("ft_monitor.server")

SOCKET_CHECK_INTERVAL = 2.0
"""Seconds between checks that the socket file is still the daemon's."""
MAX_LOGGED_SESSION_ERRORS = 5
MAX_STATUS_SECTIONS = 50
"""Open sections listed in a STATUS reply (the rest are counted): the reply must fit a frame."""


class Connection(asyncio.Protocol):
    """One client connection: frames in, messages to the daemon, replies out."""

    def __init__(self, daemon: "MonitorDaemon") -> None:
        self.daemon = daemon
        self.decoder = wire.FrameDecoder()
        self.transport: asyncio.Transport | None = None
        self.pid = 0
        self.uid = -1
        self.role: str | None = None
        self.closing = False
        self._hello_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ----------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport subclasses
        sock = transport.get_extra_info("socket")
        cred = peer_credentials(sock)
        self.pid, self.uid = cred.pid, cred.uid
        if cred.uid != os.geteuid():
            log.warning("refused connection from pid %d: uid %d is not the monitor's uid %d",
                        cred.pid, cred.uid, os.geteuid())
            self.fail(wire.ErrorCode.FORBIDDEN, f"peer uid {cred.uid} differs from the monitor's uid {os.geteuid()}")
            return
        self._hello_timer = asyncio.get_running_loop().call_later(self.daemon.config.handshake_timeout,
                                                                  self._hello_expired)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        daemon = self.daemon
        try:
            for msg in self.decoder.feed(data):
                daemon.dispatch(self, msg)
                if self.closing:
                    return
        except wire.ProtocolError as e:
            log.warning("closing connection from pid %d: protocol error: %s", self.pid, e)
            self.fail(wire.ErrorCode.PROTOCOL, str(e))
            return
        daemon.after_batch(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.decoder.buffered and not self.closing:
            log.warning("connection from pid %d closed in the middle of a frame (%d bytes unread)",
                        self.pid, self.decoder.buffered)
        self.closing = True
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self.daemon.disconnected(self)

    # -- helpers -------------------------------------------------------------
    def send(self, msg: wire.Message) -> None:
        if self.transport is not None and not self.closing:
            self.transport.write(wire.encode(msg))

    def fail(self, code: str, message: str) -> None:
        """Send an ERROR and close this connection (the daemon keeps serving)."""
        self.send(wire.Error(code, message))
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def hello_done(self, role: str) -> None:
        self.role = role
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None

    def _hello_expired(self) -> None:
        if self.role is None and not self.closing:
            limit = self.daemon.config.handshake_timeout
            log.warning("closing connection from pid %d: no handshake within %.1fs", self.pid, limit)
            self.fail(wire.ErrorCode.PROTOCOL, f"no HELLO within {limit:.1f}s")


class MonitorDaemon:
    def __init__(
        self,
        config: Settings,
        socket_path: str | os.PathLike[str],
        *,
        clock: Clock | None = None,
        launcher_socket: str | None = None,
    ) -> None:
        self.config = config
        self.socket_path = Path(socket_path).absolute()
        self.clock = clock or SystemClock()
        self.report_dir = Path(config.report_dir) if config.report_dir else self.socket_path.parent / "reports"
        self.session_dir = self.report_dir
        """Where this session's hang report, stack dump and monitor log go: report_dir, or,
        when report_dir is not set and the rank runs under torchelastic, its attempt
        directory (beside torch's error.json)."""
        self.launcher_socket = launcher_socket
        self.timeouts: Timeouts = config.timeouts()
        self.executor = HangExecutor(
            clock=self.clock,
            stack_dump_signal=config.stack_dump_signal,
            stack_dump_timeout=config.stack_dump_timeout,
            termination_signal=config.rank_termination_signal,
            termination_grace_time=config.termination_grace_time,
            before_kill=self._tell_launcher if launcher_socket else None,
            launcher_response_timeout=config.launcher_response_timeout,
        )
        self.rank_conn: Connection | None = None
        self.session: Session | None = None
        self.process: ProcessHandle | None = None
        self.sessions_started = 0
        self.hangs: list[Hang] = []
        self.iteration_high: int | None = None
        """The highest training iteration any session reported (progress across restarts)."""
        self.error_file: str | None = None
        self._session_log: logging.Handler | None = None
        self.started_at = self.clock.now()
        self._server: asyncio.AbstractServer | None = None
        self._socket_check: asyncio.TimerHandle | None = None
        self._inode = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._handling: set[ProcessHandle] = set()
        """Process handles a hang task is still using."""
        self.children: dict[int, asyncio.Future[int]] = {}
        """pid -> wait status (when known) of processes this daemon started (`serve -- CMD`)."""
        self.no_rank = asyncio.Event()
        """Set while no rank is connected."""
        self.no_rank.set()

    # -- lifecycle -------------------------------------------------------------
    async def startup(self) -> None:
        sock, self._inode = bind_unix_listener(self.socket_path)  # creates the private directory first
        try:
            self.report_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            sock.close()
            remove_socket_file(self.socket_path, self._inode)
            raise ListenerError(f"cannot create report directory {self.report_dir}: {e.strerror}") from None
        if os.stat(self.report_dir).st_mode & 0o022:
            log.warning("report directory %s is writable by other users: they could plant files where hang "
                        "reports and stack dumps go; make it 0700", self.report_dir)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: Connection(self), sock=sock)
        self._socket_check = loop.call_later(SOCKET_CHECK_INTERVAL, self._check_socket_file)
        log.info("monitor pid %d serving %s (reports in %s)", os.getpid(), self.socket_path, self.report_dir)

    def _check_socket_file(self) -> None:
        """A socket file removed under a running daemon (a cleanup script, a tmp reaper)
        would keep every restarted rank out: listen on the path again."""
        loop = asyncio.get_running_loop()
        self._socket_check = loop.call_later(SOCKET_CHECK_INTERVAL, self._check_socket_file)
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
        self._spawn(self._serve_again(sock))

    async def _serve_again(self, sock: Any) -> None:
        self._server = await asyncio.get_running_loop().create_unix_server(lambda: Connection(self), sock=sock)

    async def shutdown(self, reason: str) -> None:
        log.info("monitor shutting down: %s", reason)
        if self._server is not None:
            self._server.close()
        if self._socket_check is not None:
            self._socket_check.cancel()
        self._cancel_timer()
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            done, still = await asyncio.wait(pending, timeout=self.config.termination_grace_time + 1.0)
            for t in still:
                t.cancel()
            if still:
                log.warning("cancelled %d hang-handling task(s) still running at shutdown", len(still))
        if self.rank_conn is not None and self.rank_conn.transport is not None:
            self.rank_conn.transport.close()
        if self.process is not None:
            self.process.close()
        remove_socket_file(self.socket_path, self._inode)
        self._close_session_log()

    # -- messages --------------------------------------------------------------
    def dispatch(self, conn: Connection, msg: wire.Message) -> None:
        t = type(msg)
        if conn is self.rank_conn and self.session is not None:
            handler = _RANK_HANDLERS.get(t)
            if handler is not None:
                try:
                    handler(self, self.session, msg)
                except SessionError as e:
                    self._session_error(self.session, e)
                return
        if conn.role is None:
            if t is not wire.Hello:
                raise wire.ProtocolError(f"expected HELLO first, got {t.__name__}")
            self._hello(conn, msg)  # type: ignore[arg-type]
            return
        if t is wire.Status:
            conn.send(wire.StatusReply(self.status()))
        elif t is wire.Ping:
            conn.send(wire.PONG)
        elif t is wire.Hello:
            raise wire.ProtocolError("second HELLO on one connection")
        elif conn.role == wire.Role.OBSERVER:
            log.warning("closing observer connection from pid %d: %s is not allowed for an observer",
                        conn.pid, t.__name__)
            conn.fail(wire.ErrorCode.FORBIDDEN, f"{t.__name__} is not allowed for an observer")
        else:
            raise wire.ProtocolError(f"unexpected {t.__name__} from a client")

    def _session_error(self, s: Session, e: SessionError) -> None:
        """A message that makes no sense now: logged (the first few per session), ignored."""
        s.errors += 1
        if s.errors <= MAX_LOGGED_SESSION_ERRORS:
            log.warning("rank %d pid %d: %s (ignored)%s", s.rank, s.pid, e,
                        "; further such messages are counted, not logged"
                        if s.errors == MAX_LOGGED_SESSION_ERRORS else "")

    def _hello(self, conn: Connection, msg: wire.Hello) -> None:
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
        if msg.role != wire.Role.RANK:
            raise wire.ProtocolError(f"unknown role {msg.role!r}")
        if self.rank_conn is not None:
            live = self.rank_conn.pid
            log.warning("refused rank connection from pid %d: rank pid %d is connected", conn.pid, live)
            conn.fail(wire.ErrorCode.BUSY, f"a rank is already connected to this monitor: pid {live}")
            return
        conn.hello_done(msg.role)
        now = self.clock.now()
        self.rank_conn = conn
        self.no_rank.clear()
        self.sessions_started += 1
        self.process = ProcessHandle(conn.pid)
        self.session = Session(
            rank=msg.rank, pid=conn.pid, started_at=now, timeouts=self.timeouts,
            num_warmup_iterations=self.config.num_warmup_iterations,
        )
        self._open_session_dir(msg)
        dump_path = self.dump_path(msg.rank, conn.pid)
        conn.send(wire.HelloOk(wire.PROTOCOL_VERSION, {
            "rank": msg.rank,
            "pid": conn.pid,
            "session": self.sessions_started,
            "timeouts": self.timeouts.to_wire(),
            "num_warmup_iterations": self.config.num_warmup_iterations,
            "stack_dump_signal": int(self.config.stack_dump_signal),
            "stack_dump_path": str(dump_path),
            "skip_section_response": self.config.skip_section_response,
            "on_monitor_lost": self.config.on_monitor_lost,
            "client_request_timeout": self.config.client_request_timeout,
            "safety_factor": self.config.safety_factor,
            "min_learned_timeout": self.config.min_learned_timeout,
        }))
        log.info("rank %d pid %d connected (session %d)", msg.rank, conn.pid, self.sessions_started)

    def _open_session_dir(self, msg: wire.Hello) -> None:
        error_file = msg.info.get("error_file")
        self.error_file = error_file if isinstance(error_file, str) and error_file else None
        self.session_dir = self.report_dir
        if self.config.report_dir is None and self.error_file:
            attempt_dir = Path(self.error_file).parent
            if attempt_dir.is_dir():
                self.session_dir = attempt_dir
        if self.session_dir != self.report_dir and self._session_log is None:
            try:
                handler = logging.FileHandler(self.session_dir / "monitor.log")
            except OSError as e:
                log.warning("cannot write the monitor log in %s: %s", self.session_dir, e)
            else:
                handler.setFormatter(logging.Formatter(LOG_FORMAT))
                logging.getLogger().addHandler(handler)
                self._session_log = handler

    def _close_session_log(self) -> None:
        if self._session_log is not None:
            logging.getLogger().removeHandler(self._session_log)
            self._session_log.close()
            self._session_log = None

    def dump_path(self, rank: int, pid: int) -> Path:
        return self.session_dir / f"rank{rank}-pid{pid}-stack.txt"

    def report_path(self, rank: int, pid: int) -> Path:
        return self.session_dir / f"rank{rank}-pid{pid}-hang.json"

    async def _tell_launcher(self, case: HangCase) -> bool:
        from ft_monitor.launcher_link import notify_launcher

        h = case.hang
        assert self.launcher_socket is not None
        notice = {
            "rank": h.rank,
            "pid": h.pid,
            "reason": h.reason.value,
            "section": h.section,
            "message": h.describe(),
            "elapsed_s": h.elapsed,
            "timeout_s": h.timeout,
            "onset_time": to_wall(self.clock, h.onset),
            "detected_time": to_wall(self.clock, h.detected_at),
            "iteration": h.iteration,
            "report": str(case.report_path),
            "stack_dump": str(case.dump_path) if case.dump_path else None,
            "stack_dump_captured": case.dump_captured,
            "error_file": self.error_file,
        }
        return await notify_launcher(self.launcher_socket, h.rank, notice, self.config.launcher_response_timeout)

    def _update_config(self, session: Session, msg: wire.UpdateConfig) -> None:
        try:
            timeouts = Timeouts.from_wire(msg.timeouts)
        except TimeoutsError as e:
            log.warning("rank %d: rejected timeouts update: %s", session.rank, e)
            assert self.rank_conn is not None
            self.rank_conn.send(wire.Error(wire.ErrorCode.BAD_REQUEST, str(e)))
            return
        if timeouts != self.timeouts:
            log.info("rank %d: timeouts now %s", session.rank, timeouts.to_wire())
        self.timeouts = timeouts
        session.set_timeouts(timeouts, self.clock.now())
        assert self.rank_conn is not None
        self.rank_conn.send(wire.ConfigOk(timeouts.to_wire()))

    def _goodbye(self, session: Session, msg: wire.Goodbye) -> None:
        """Clean shutdown: the session ends now, so the rank may connect again at once."""
        if session.open_sections:
            log.warning("rank %d pid %d shut down with section(s) still open: %s",
                        session.rank, session.pid, ", ".join(session.open_sections))
        session.goodbye()
        assert self.rank_conn is not None
        self.rank_conn.role = wire.Role.OBSERVER  # what it may still send: STATUS, PING
        self.disconnected(self.rank_conn)

    def _control(self, session: Session, msg: wire.Control) -> None:
        assert self.rank_conn is not None
        self.rank_conn.send(wire.Error(wire.ErrorCode.BAD_REQUEST,
                                       f"workload control {msg.action!r} needs ft-launcher; this monitor runs standalone"))

    # -- detection -------------------------------------------------------------
    def after_batch(self, conn: Connection) -> None:
        if conn is self.rank_conn and self.session is not None:
            self._arm()

    def _arm(self) -> None:
        """Keep the timer on the earliest deadline. A later deadline leaves an
        earlier timer armed: it fires, finds nothing due, and re-arms."""
        s = self.session
        d = next_deadline(s) if s is not None else None
        if d is None:
            self._cancel_timer()
            return
        if self._timer_at is not None and self._timer_at <= d.at:
            return
        self._cancel_timer()
        self._timer_at = d.at
        delay = max(0.0, d.at - self.clock.now())
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_at = None

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        s = self.session
        if s is None:
            return
        hang = check(s, self.clock.now())
        if hang is None:
            self._arm()
            return
        s.mark_hung()
        self.hangs.append(hang)
        assert self.process is not None
        case = HangCase(hang, self.process, self.report_path(hang.rank, hang.pid),
                        self.dump_path(hang.rank, hang.pid))
        self._spawn(self._handle_hang(case))

    async def _handle_hang(self, case: HangCase) -> None:
        self._handling.add(case.process)
        try:
            await self.executor.handle(case)
        finally:
            self._handling.discard(case.process)
            if self.process is not case.process:  # the hung rank's connection is gone
                case.process.close()
            if self.rank_conn is None:
                self._close_session_log()

    # -- disconnects -----------------------------------------------------------
    def disconnected(self, conn: Connection) -> None:
        """The rank's connection closed, or it said GOODBYE."""
        if conn is not self.rank_conn:
            return
        s, proc = self.session, self.process
        self.no_rank.set()
        self.rank_conn = None
        self.session = None
        self.process = None
        self._cancel_timer()
        if s is None:
            return
        phase = s.phase
        s.end()
        if s.errors > MAX_LOGGED_SESSION_ERRORS:
            log.warning("rank %d pid %d: %d messages ignored in this session in all", s.rank, s.pid, s.errors)
        if phase is Phase.CLOSING:
            log.info("rank %d pid %d shut down monitoring cleanly", s.rank, s.pid)
            if proc is not None:
                proc.close()
            self._close_session_log()
        elif phase is Phase.HUNG:
            log.info("rank %d pid %d (hung) disconnected", s.rank, s.pid)
            if proc is not None and proc not in self._handling:  # else its hang task closes it
                proc.close()
        else:
            assert proc is not None
            self._spawn(self._report_exit(s, proc))

    async def _report_exit(self, s: Session, proc: ProcessHandle) -> None:
        """A rank that went away without GOODBYE: it exited (or closed its socket); not a hang."""
        await wait_for_exit(proc, 1.0)
        status: int | None = None
        child = self.children.get(s.pid)
        if child is not None:
            try:
                status = await asyncio.wait_for(asyncio.shield(child), 1.0)
            except asyncio.TimeoutError:
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
        proc.close()
        if self.rank_conn is None:
            self._close_session_log()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- status ----------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = self.clock.now()
        s = self.session
        out: dict[str, Any] = {
            "monitor_pid": os.getpid(),
            "socket": str(self.socket_path),
            "uptime_s": now - self.started_at,
            "sessions": self.sessions_started,
            "hangs_detected": len(self.hangs),
            "iteration_high": self.iteration_high,
            "timeouts": self.timeouts.to_wire(),
            "connected": s is not None,
        }
        if s is not None:
            d = next_deadline(s)
            out.update({
                "rank": s.rank,
                "pid": s.pid,
                "phase": s.phase.value,
                "session_age_s": now - s.started_at,
                "heartbeats": s.heartbeats,
                "since_last_heartbeat_s": None if s.last_heartbeat is None else now - s.last_heartbeat,
                "open_sections": [
                    {"name": sec.name, "elapsed_s": now - sec.opened_at, "timeout_s": sec.timeout,
                     "warmup": sec.warmup}
                    for sec in list(s.open_sections.values())[:MAX_STATUS_SECTIONS]
                ],
                "open_sections_not_listed": max(0, len(s.open_sections) - MAX_STATUS_SECTIONS),
                "ignored_messages": s.errors,
                "out_of_section_s": None if s.out_of_section_since is None else now - s.out_of_section_since,
                "steps_started": s.steps_started,
                "iteration": s.iteration,
                "events": s.events,
                "next_deadline": None if d is None else {
                    "reason": d.reason.value, "section": d.section, "in_s": d.at - now, "timeout_s": d.timeout,
                },
            })
        if self.hangs:
            h = self.hangs[-1]
            out["last_hang"] = {"rank": h.rank, "pid": h.pid, "message": h.describe(),
                                "report": str(self.report_path(h.rank, h.pid))}
        return out


def _heartbeat(d: MonitorDaemon, s: Session, m: Any) -> None:
    s.heartbeat(d.clock.now())


def _open(d: MonitorDaemon, s: Session, m: wire.SectionOpen) -> None:
    s.open_section(m.name, d.clock.now())


def _close(d: MonitorDaemon, s: Session, m: wire.SectionClose) -> None:
    s.close_section(m.name, d.clock.now())


def _close_all(d: MonitorDaemon, s: Session, m: Any) -> None:
    s.close_all_sections(d.clock.now())


def _iteration(d: MonitorDaemon, s: Session, m: wire.Iteration) -> None:
    s.set_iteration(m.iteration)
    if d.iteration_high is None or m.iteration > d.iteration_high:
        d.iteration_high = m.iteration


_RANK_HANDLERS: dict[type, Any] = {
    wire.Heartbeat: _heartbeat,
    wire.SectionOpen: _open,
    wire.SectionClose: _close,
    wire.SectionCloseAll: _close_all,
    wire.Iteration: _iteration,
    wire.UpdateConfig: lambda d, s, m: d._update_config(s, m),
    wire.Goodbye: lambda d, s, m: d._goodbye(s, m),
    wire.Control: lambda d, s, m: d._control(s, m),
}


async def run_daemon(
    config: Settings,
    socket_path: str | os.PathLike[str],
    *,
    command: list[str] | None = None,
    ready: asyncio.Event | None = None,
    launcher_socket: str | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (or until ``command``, if given, exits). Returns the exit code."""
    _yield_to_training()
    daemon = MonitorDaemon(config, socket_path, launcher_socket=launcher_socket)
    await daemon.startup()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    stop_reason: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        stop_reason.append(f"received {sig.name}")
        stop.set()

    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
        installed.append(sig)
    code = 0
    child: asyncio.subprocess.Process | None = None
    try:
        if ready is not None:
            ready.set()
        if command:
            env = dict(os.environ)
            from ft_client.env import RANK_MONITOR_SOCKET

            env[RANK_MONITOR_SOCKET] = str(daemon.socket_path)
            child = await asyncio.create_subprocess_exec(*command, env=env, start_new_session=True)
            log.info("started %s as pid %d", command[0], child.pid)
            exit_status: asyncio.Future[int] = loop.create_future()
            daemon.children[child.pid] = exit_status
            waiter = loop.create_task(child.wait())
            stopper = loop.create_task(stop.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if waiter.done():
                rc = waiter.result()
                exit_status.set_result(_returncode_to_status(rc))
                code = rc if rc >= 0 else 128 - rc
                stop_reason.append(f"command exited ({describe_wait_status(exit_status.result())})")
                try:  # let the rank's disconnect be logged with its exit status
                    await asyncio.wait_for(daemon.no_rank.wait(), 2.0)
                except asyncio.TimeoutError:
                    pass
            else:
                waiter.cancel()
        else:
            await stop.wait()
    finally:
        if child is not None and child.returncode is None:
            try:
                os.killpg(child.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(child.wait(), config.termination_grace_time)
            except asyncio.TimeoutError:
                os.killpg(child.pid, signal.SIGKILL)
                await child.wait()
        await daemon.shutdown(stop_reason[0] if stop_reason else "stopped")
        for sig in installed:
            loop.remove_signal_handler(sig)
    return code


def _yield_to_training() -> None:
    """SCHED_BATCH: woken by a rank's event, the daemon does not preempt the rank (the
    scheduler lets it wait for its turn). Its timers still fire within a scheduler tick
    of milliseconds, well inside the 50 ms detection target."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError) as e:
        log.debug("SCHED_BATCH not available: %s", e)


def _returncode_to_status(rc: int) -> int:
    """asyncio returncode -> a waitpid-style status."""
    return (-rc) & 0x7F if rc < 0 else (rc & 0xFF) << 8
