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
import fcntl
import logging
import os
import resource
import signal
import socket
import struct
import termios
from pathlib import Path
from typing import Any

from ft_client import wire
from ft_client.safefiles import UnsafeFileError, open_append, private_dir_problem
from ft_client.timeouts import Timeouts, TimeoutsError
from ft_monitor.clock import Clock, SystemClock, to_wall
from ft_monitor.executor import ExitWatch, HangCase, HangExecutor
from ft_monitor.listener import ListenerError, bind_unix_listener, remove_socket_file
from ft_monitor.notices import HangNotice
from ft_monitor.policy import Hang, check, next_deadline
from ft_monitor.procinfo import (
    ProcessHandle,
    describe_wait_status,
    peer_credentials,
    peer_pidfd,
    zombie_exit_status,
)
from ft_monitor.server_log import LOG_FORMAT, printable
from ft_monitor.settings import Settings
from ft_monitor.state import Phase, Session, SessionError

log = logging.getLogger("ft_monitor.server")

SOCKET_CHECK_INTERVAL = 2.0
"""Seconds between checks that the socket file is still the daemon's."""
MAX_LOGGED_SESSION_ERRORS = 5
MAX_STATUS_SECTIONS = 50
"""Open sections listed in a STATUS reply (the rest are counted): the reply must fit a frame."""
OUTPUT_HIGH_WATER = 256 * 1024
"""Unsent reply bytes at which the daemon stops reading a peer's requests."""
MAX_OUTPUT = 1024 * 1024
"""Unsent reply bytes at which a peer that asks and never reads is dropped."""
READ_FIRST_DELAY = 0.001
MAX_READ_FIRST = 100
"""A deadline found passed while the rank's socket still holds unread input is judged
again after that input is read (the daemon may have been stopped while the rank
reported progress); at most this many times in a row."""
FD_RESERVE = 16
"""Descriptors held back for the hang path (report, pidfds of the rank's children)."""
FDS_PER_CONNECTION = 2
"""A connection's socket and the pidfd of its process until its role is known."""
FD_BASELINE = 64
MAX_PATH_BYTES = 4096


class Connection(asyncio.Protocol):
    """One client connection: frames in, messages to the daemon, replies out.

    The peer's process is pinned (pidfd) when it connects, so a HELLO sent after
    that process exited cannot make the daemon watch a process that reused its pid.
    """

    def __init__(self, daemon: "MonitorDaemon") -> None:
        self.daemon = daemon
        self.decoder = wire.FrameDecoder()
        self.transport: asyncio.Transport | None = None
        self.pid = 0
        self.uid = -1
        self.role: str | None = None
        self.closing = False
        self.process: ProcessHandle | None = None
        """The peer's process, pinned at connect; handed to the daemon if it becomes the rank."""
        self.last_active = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ----------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport subclasses
        self.transport.set_write_buffer_limits(high=OUTPUT_HIGH_WATER)  # type: ignore[union-attr]
        sock = transport.get_extra_info("socket")
        cred = peer_credentials(sock)
        self.pid, self.uid = cred.pid, cred.uid
        self.last_active = self.daemon.clock.now()
        if cred.uid != os.geteuid():
            log.warning("refused connection from pid %d: uid %d is not the monitor's uid %d",
                        cred.pid, cred.uid, os.geteuid())
            self.fail(wire.ErrorCode.FORBIDDEN, f"peer uid {cred.uid} differs from the monitor's uid {os.geteuid()}")
            return
        if cred.pid > 0:
            fd = peer_pidfd(sock)  # the very process that connected, even if its pid is reused by now
            self.process = ProcessHandle.adopt(cred.pid, fd) if fd is not None else ProcessHandle.open(cred.pid)
        self._timer = asyncio.get_running_loop().call_later(self.daemon.config.handshake_timeout,
                                                            self._hello_expired)
        self.daemon.admit(self)

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
        self._cancel_timer()
        self.daemon.disconnected(self)
        self.release_process()

    def pause_writing(self) -> None:
        """Replies pile up unread: read no more requests until they drain."""
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closing:
            self.transport.resume_reading()

    # -- helpers -------------------------------------------------------------
    def send(self, msg: wire.Message) -> None:
        t = self.transport
        if t is None or self.closing:
            return
        if t.get_write_buffer_size() > MAX_OUTPUT:
            log.warning("closing connection from pid %d: %d bytes of replies left unread (it asks without reading)",
                        self.pid, t.get_write_buffer_size())
            self.closing = True
            t.abort()
            return
        t.write(wire.encode(msg))

    def fail(self, code: str, message: str) -> None:
        """Send an ERROR and close this connection (the daemon keeps serving)."""
        self.send(wire.Error(code, message))
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def hello_done(self, role: str) -> None:
        self.role = role
        self._cancel_timer()
        if role == wire.Role.OBSERVER:
            self.release_process()  # only a rank's process is ever signalled
            self._timer = asyncio.get_running_loop().call_later(self.daemon.config.observer_idle_timeout,
                                                                self._idle_check)

    def touch(self, now: float) -> None:
        self.last_active = now

    def take_process(self) -> ProcessHandle | None:
        """Hand the pinned process to the daemon (the rank's resources own it from now on)."""
        proc, self.process = self.process, None
        return proc

    def release_process(self) -> None:
        if self.process is not None:
            self.process.close()
            self.process = None

    def unread_bytes(self) -> int:
        """Bytes the peer sent that the daemon has not read yet (FIONREAD)."""
        t = self.transport
        if t is None or self.closing:
            return 0
        try:
            fd = t.get_extra_info("socket").fileno()
            return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])
        except (OSError, AttributeError, ValueError):
            return 0

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _hello_expired(self) -> None:
        self._timer = None
        if self.role is None and not self.closing:
            limit = self.daemon.config.handshake_timeout
            log.warning("closing connection from pid %d: no handshake within %.1fs", self.pid, limit)
            self.fail(wire.ErrorCode.PROTOCOL, f"no HELLO within {limit:.1f}s")

    def _idle_check(self) -> None:
        """An observer that asks nothing for observer_idle_timeout is closed (it holds a descriptor)."""
        self._timer = None
        if self.closing or self.role != wire.Role.OBSERVER:
            return
        limit = self.daemon.config.observer_idle_timeout
        idle = self.daemon.clock.now() - self.last_active
        if idle < limit:
            self._timer = asyncio.get_running_loop().call_later(limit - idle, self._idle_check)
            return
        log.info("closing observer connection from pid %d: idle for %.1fs", self.pid, idle)
        self.fail(wire.ErrorCode.PROTOCOL, f"idle for {limit:.1f}s; closed")


class FdReserve:
    """A few descriptors held back so that acting on a hang can open its report, its
    temporary files and the pidfds of the rank's children, whatever the connections
    have used up. Released while a hang is handled, taken again after."""

    def __init__(self, size: int) -> None:
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
        self.exits = ExitWatch()
        self.executor = HangExecutor(
            clock=self.clock,
            stack_dump_signal=config.stack_dump_signal,
            stack_dump_timeout=config.stack_dump_timeout,
            termination_signal=config.rank_termination_signal,
            termination_grace_time=config.termination_grace_time,
            before_kill=self._tell_launcher if launcher_socket else None,
            launcher_response_timeout=config.launcher_response_timeout,
            exits=self.exits,
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
        self.others: dict[Connection, None] = {}
        """Connections that are not the rank's (in handshake, or observers), least recently active first."""
        self.max_connections = config.max_connections
        self._evictions_logged = 0
        self._read_first = 0
        """How many times in a row a passed deadline waited for unread rank input."""
        self.reserve: FdReserve | None = None

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
        self._size_connection_cap(raise_fd_limit())
        self.reserve = FdReserve(FD_RESERVE)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: Connection(self), sock=sock, backlog=socket.SOMAXCONN)
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
        self._server = await asyncio.get_running_loop().create_unix_server(lambda: Connection(self), sock=sock,
                                                                           backlog=socket.SOMAXCONN)

    def _size_connection_cap(self, fd_limit: int) -> None:
        """Keep every connection the cap allows, the reserve and the daemon's own files
        within the descriptor limit: running out would blind the hang path."""
        fits = max(1, (fd_limit - FD_BASELINE - FD_RESERVE) // FDS_PER_CONNECTION)
        if fits < self.max_connections:
            log.warning("max_connections lowered from %d to %d to fit the open-file limit of %d",
                        self.max_connections, fits, fd_limit)
            self.max_connections = fits

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
        self._evictions_logged += 1
        if self._evictions_logged <= MAX_LOGGED_SESSION_ERRORS or self._evictions_logged % 1000 == 0:
            log.warning("connection cap (%d) reached: closing the %s connection from pid %d (%d closed so far)",
                        self.max_connections, "idle observer" if victim.role else "oldest unidentified",
                        victim.pid, self._evictions_logged)
        victim.fail(wire.ErrorCode.BUSY, f"too many connections to this monitor (at most {self.max_connections})")

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
            self._release_process(self.process)
            self.process = None
        remove_socket_file(self.socket_path, self._inode)
        self._close_session_log()
        if self.reserve is not None:
            self.reserve.release()

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
        if conn.role == wire.Role.OBSERVER:
            conn.touch(self.clock.now())
            self.others.pop(conn, None)  # most recently active last
            self.others[conn] = None
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
        if self.rank_conn is not None:
            live = self.rank_conn.pid
            log.warning("refused rank connection from pid %d: rank pid %d is connected", conn.pid, live)
            conn.fail(wire.ErrorCode.BUSY, f"a rank is already connected to this monitor: pid {live}")
            return
        conn.hello_done(msg.role)
        now = self.clock.now()
        self.others.pop(conn, None)
        self.rank_conn = conn
        self.no_rank.clear()
        self.sessions_started += 1
        self.process = conn.take_process()
        self._watch_exit(conn, self.process)
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
        self.error_file = _error_file(msg.info.get("error_file"))
        self.session_dir = self.report_dir
        if self.config.report_dir is None and self.error_file:
            attempt_dir = Path(self.error_file).parent
            problem = private_dir_problem(attempt_dir)
            if problem is None:
                self.session_dir = attempt_dir
            elif os.path.lexists(attempt_dir):
                log.warning("rank %d: not writing into its attempt directory: %s; reports go to %s",
                            msg.rank, problem, self.report_dir)
        if self.session_dir != self.report_dir and self._session_log is None:
            path = self.session_dir / "monitor.log"
            try:
                stream = os.fdopen(open_append(path), "a")
            except OSError as e:
                log.warning("cannot write the monitor log %s: %s", path, e)
            else:
                handler = logging.StreamHandler(stream)
                handler.setFormatter(logging.Formatter(LOG_FORMAT))
                logging.getLogger().addHandler(handler)
                self._session_log = handler

    def _close_session_log(self) -> None:
        if self._session_log is not None:
            logging.getLogger().removeHandler(self._session_log)
            self._session_log.close()
            stream = getattr(self._session_log, "stream", None)
            if stream is not None:
                stream.close()
            self._session_log = None

    def _watch_exit(self, conn: Connection, proc: ProcessHandle | None) -> None:
        """End the session when the rank's process exits, even if the socket stays open
        (a forked child may hold it): an exit is never left to look like a hang."""
        fut = self.exits.exited(proc) if proc is not None else None
        if fut is None:
            return

        def exited(f: "asyncio.Future[None]") -> None:
            if f.cancelled() or conn is not self.rank_conn or self.session is None:
                return
            if self.session.phase is Phase.ACTIVE:
                log.warning("rank %d pid %d exited while its connection is still open (held by a child process?); "
                            "ending its session", self.session.rank, self.session.pid)
                self.disconnected(conn)
                conn.closing = True
                if conn.transport is not None:
                    conn.transport.close()

        fut.add_done_callback(exited)

    def _release_process(self, proc: ProcessHandle) -> None:
        self.exits.forget(proc)
        proc.close()

    def dump_path(self, rank: int, pid: int) -> Path:
        return self.session_dir / f"rank{rank}-pid{pid}-stack.txt"

    def report_path(self, rank: int, pid: int) -> Path:
        return self.session_dir / f"rank{rank}-pid{pid}-hang.json"

    async def _tell_launcher(self, case: HangCase) -> bool:
        from ft_monitor.launcher_link import notify_launcher

        h = case.hang
        assert self.launcher_socket is not None
        notice = HangNotice(
            rank=h.rank,
            pid=h.pid,
            reason=h.reason.value,
            section=h.section,
            message=h.describe(),
            elapsed_s=h.elapsed,
            timeout_s=h.timeout,
            onset_time=to_wall(self.clock, h.onset),
            detected_time=to_wall(self.clock, h.detected_at),
            iteration=h.iteration,
            report=str(case.report_path),
            stack_dump=str(case.dump_path) if case.dump_path else None,
            stack_dump_captured=case.dump_captured,
            error_file=self.error_file,
        )
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
                        session.rank, session.pid, ", ".join(map(printable, session.open_sections)))
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
        now = self.clock.now()
        hang = check(s, now)
        if hang is None:
            self._read_first = 0
            self._arm()
            return
        conn = self.rank_conn
        if conn is not None and self._read_first < MAX_READ_FIRST and conn.unread_bytes() > 0:
            # progress the rank reported may be waiting in the socket (the daemon was
            # stopped, frozen or starved): read it before judging
            self._read_first += 1
            self._timer_at = now
            self._timer = asyncio.get_running_loop().call_later(READ_FIRST_DELAY, self._on_timer)
            return
        self._read_first = 0
        s.mark_hung()
        self.hangs.append(hang)
        assert self.process is not None
        case = HangCase(hang, self.process, self.report_path(hang.rank, hang.pid),
                        self.dump_path(hang.rank, hang.pid))
        self._spawn(self._handle_hang(case))

    async def _handle_hang(self, case: HangCase) -> None:
        self._handling.add(case.process)
        if self.reserve is not None:
            self.reserve.release()  # descriptors for the report, temporary files and pidfds
        try:
            await self.executor.handle(case)
        finally:
            self._handling.discard(case.process)
            if self.process is not case.process:  # the hung rank's connection is gone
                self._release_process(case.process)
            if self.rank_conn is None:
                self._close_session_log()
            if self.reserve is not None and not self._handling:
                self.reserve.fill()

    # -- disconnects -----------------------------------------------------------
    def disconnected(self, conn: Connection) -> None:
        """A connection closed; for the rank's: its session ends (also on GOODBYE, or
        when its process exits)."""
        self.others.pop(conn, None)
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
                self._release_process(proc)
            self._close_session_log()
        elif phase is Phase.HUNG:
            log.info("rank %d pid %d (hung) disconnected", s.rank, s.pid)
            if proc is not None and proc not in self._handling:  # else its hang task closes it
                self._release_process(proc)
        else:
            assert proc is not None
            self._spawn(self._report_exit(s, proc))

    async def _report_exit(self, s: Session, proc: ProcessHandle) -> None:
        """A rank that went away without GOODBYE: it exited (or closed its socket); not a hang."""
        await self.exits.wait(proc, 1.0)
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
        self._release_process(proc)
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

    def on_ignored(sig: signal.Signals) -> None:
        log.warning("received %s; ignored (stop the monitor with SIGTERM, SIGINT, SIGHUP or SIGQUIT)", sig.name)

    installed = []
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
        installed.append(sig)
    for sig in IGNORED_SIGNALS:
        loop.add_signal_handler(sig, on_ignored, sig)
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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
"""Each stops the daemon in order: with `serve -- CMD`, CMD is terminated first, never
left running unmonitored (SIGHUP arrives when a terminal closes)."""
IGNORED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
"""Their default action would kill the daemon and orphan `serve -- CMD`'s command."""


def _error_file(value: object) -> str | None:
    """The rank's torchelastic error file from its HELLO, if it is a usable absolute path."""
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        return None
    if len(os.fsencode(value)) > MAX_PATH_BYTES or any(len(os.fsencode(p)) > 255 for p in value.split("/")):
        return None
    return value


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
