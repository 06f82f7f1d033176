"""The client's connection to its rank's monitor, from HELLO to GOODBYE: connecting and
taking the session (config, progress record, stack dump, control link), noticing a monitor
that went away and reconnecting from a background thread, the fork guard (a forked child
is detached), and the sends and requests every other part goes through."""

from __future__ import annotations

import os
import signal
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, cast

from ft_client import env, record, wire
from ft_client.client import exiting
from ft_client.client.state import CONNECT_TIMEOUT, ClientState, ConnState
from ft_client.client.state import UNSENT as _UNSENT
from ft_client.errors import MonitorBrokenError, MonitorClosedError, RankMonitorClientError
from ft_client.session_info import SessionInfo, SessionInfoError
from ft_client.startup import exit_teardown, loaded_modules
from ft_client.startup.parent_death import die_with_parent
from ft_client.timeouts import Timeouts
from ft_client.wire.transport import Transport, TransportBrokenError, TransportError, connect

if TYPE_CHECKING:  # loaded when first used
    import logging


class _Log:
    """The "ft_client" logger, looked up when a first line is logged: importing logging costs
    a bare interpreter about 3 ms, and the client logs only when something is wrong."""

    def __getattr__(self, name: str) -> Any:
        from ft_client import logs

        return getattr(logs.logger("ft_client"), name)


log = cast("logging.Logger", _Log())

REFUSAL_POLL = 0.25
"""Seconds between the record watcher's looks for a refusal a request took aside."""
RECONNECT_INTERVAL = 1.0
"""Seconds before the first attempt to reach a lost monitor again; doubled after each
failed attempt up to RECONNECT_MAX_INTERVAL. Attempts run on a background thread."""
RECONNECT_MAX_INTERVAL = 8.0
EXITING_LOCK_WAIT = 1.0
"""Seconds the uncaught-exception hook waits for the client's lock before it gives up on EXITING."""
_now_ns = time.monotonic_ns

_clients: weakref.WeakSet[ClientLink] = weakref.WeakSet()


def _detach_clients_in_child() -> None:
    for client in list(_clients):
        client._detach_in_child()


os.register_at_fork(after_in_child=_detach_clients_in_child)


def track_forks(client: ClientLink) -> None:
    """Detach ``client`` in a child forked from this process (`ClientLink._detach_in_child`)."""
    _clients.add(client)


class ClientLink(ClientState):
    """`RankMonitorClient`'s connection lifecycle."""

    # -- lifecycle -------------------------------------------------------------
    @property
    def is_initialized(self) -> bool:
        return self._state in (ConnState.CONNECTED, ConnState.LOST)

    @property
    def connection_state(self) -> ConnState:
        return self._state

    @property
    def lost_reason(self) -> str | None:
        """Why the monitor connection was lost (while LOST), else None."""
        return self._lost_reason if self._state is ConnState.LOST else None

    def init_workload_monitoring(self, num_warmup_iters: int | None = None, *,
                                 socket_path: str | None = None) -> None:
        """Connect to the rank's monitor, receive its config, arm the stack dump.

        ``num_warmup_iters``: the first steps timed with the `warmup` section's timeout (as
        nvidia-resiliency-ext's argument); None: the monitor's ``num_warmup_iterations``."""
        if num_warmup_iters is not None and (isinstance(num_warmup_iters, bool) or not isinstance(
                num_warmup_iters, int) or not 0 <= num_warmup_iters <= env.MAX_RANK):
            raise RankMonitorClientError(
                f"num_warmup_iters = {num_warmup_iters!r:.60}: must be a whole number >= 0 or None (a socket path "
                "goes in socket_path= or RankMonitorClient(socket_path))")
        with self._lock:
            if self._state is ConnState.FORKED_CHILD:
                raise MonitorClosedError("this process is a fork of the rank; its client stays with the rank")
            if self._state in (ConnState.CONNECTED, ConnState.LOST):
                raise RankMonitorClientError("workload monitoring is already initialized")
            self._num_warmup_iters = num_warmup_iters
            path = socket_path or self._socket_path or os.environ.get(env.RANK_MONITOR_SOCKET)
            if not path:
                raise RankMonitorClientError(
                    f"no monitor socket: set {env.RANK_MONITOR_SOCKET} (ft-launcher and `ft-monitor serve -- CMD` "
                    "set it) or pass socket_path="
                )
            asked = _now_ns()
            try:
                transport, hello = connect(path, CONNECT_TIMEOUT, wire.Role.RANK, self.rank,
                                           _hello_info(self._num_warmup_iters), take_fd=True)
            except FileNotFoundError as e:
                raise RankMonitorClientError(
                    f"no monitor listens at {path} (from {self._path_origin(socket_path)}): the socket file does not "
                    "exist. Start `ft-monitor serve --socket PATH` first"
                ) from e
            except ConnectionRefusedError as e:
                raise RankMonitorClientError(
                    f"no monitor listens at {path} (from {self._path_origin(socket_path)}): connection refused"
                ) from e
            except (TransportError, OSError) as e:
                raise RankMonitorClientError(f"cannot connect to the monitor at {path}: {e}") from e
            self._path = transport.path  # resolved once: reconnections cannot be redirected
            configured = self._adopt(transport, hello, asked)
            self._calc = self._learner.recorder(configured, self._clock())
            loaded, refused = self._learner.take_pending()
            if refused is not None:
                log.warning("rank %d: the learned timeouts loaded before the monitor connected are not put in "
                            "force: %s", self.rank, refused)
            if loaded is not None:  # load_state_dict() came first: push at the handshake
                from ft_client.learning.state_dict import overlay_learned

                self.set_timeouts(overlay_learned(self._timeouts, loaded))
            from ft_client.inprocess import events

            events.add_restart_listener(self._restart_hook)
            exiting.watch(self)
            exit_teardown.install()
            _die_with_launcher()
            loaded_modules.report()  # --ft-preload auto: what the launcher's worker template should import

    def _adopt(self, transport: Transport, hello: wire.HelloOk, asked_ns: int) -> Timeouts:
        """Take a new connection's session (config from the monitor, its progress record);
        return its configured timeouts. ``asked_ns``: when the HELLO was sent."""
        fd = transport.take_fd()
        try:
            info = SessionInfo.from_wire(hello.session)
        except SessionInfoError:
            if fd is not None:
                os.close(fd)
            transport.close()
            raise
        configured = info.timeouts
        self._transport = transport
        self._state = ConnState.CONNECTED
        self._lost_reason = None
        self._sync_sections = not info.skip_section_response
        self._raise_on_lost = info.on_monitor_lost == "raise"
        self._request_timeout = info.client_request_timeout
        transport.set_timeout(self._request_timeout)
        self._take_record(transport, info, fd, asked_ns)
        self._learner.adopt(info.safety_factor, info.min_learned_timeout, info.num_warmup_iterations)
        self._set_timeouts(configured)
        if info.stack_dump_path:
            try:
                self._dumper.enable(info.stack_dump_signal, info.stack_dump_path)
            except OSError as e:
                log.warning("rank %d: cannot open stack dump file %s: %s", self.rank, info.stack_dump_path, e)
        self._open_control(info)
        return configured

    def _take_record(self, transport: Transport, info: SessionInfo, fd: int | None, asked_ns: int) -> None:
        """Map the progress record passed with HELLO_OK, if any; one that cannot be used is
        declined (RECORD_DECLINED, with why) and progress goes through the socket."""
        self._record = None
        self._slots = {}
        if info.record is None and fd is None:
            return
        from ft_client.record.mapped import open_record

        if fd is None:
            problem = "HELLO_OK describes a progress record but no descriptor came with it"
        elif info.record is None:
            os.close(fd)
            problem = "a descriptor came with HELLO_OK, which describes no progress record"
        else:
            try:
                self._record = open_record(fd, info.record, asked_ns, _now_ns())
            except (record.RecordError, OSError) as e:
                problem = str(e)
            else:
                threading.Thread(target=_watch_hangup, args=(weakref.ref(self), transport), name="ft-client-watch",
                                 daemon=True).start()
                return
        log.warning("rank %d: cannot use the monitor's progress record (%s); reporting progress through the socket",
                    self.rank, problem)
        self._event(transport, wire.encode(wire.RecordDeclined(problem)))

    def _monitor_hung_up(self, t: Transport) -> None:
        """The monitor closed ``t`` (seen by the watcher thread: with a progress record the
        training thread may never touch the socket): reconnect, or make the next progress
        call raise with ``on_monitor_lost: raise``."""
        with self._lock:
            if self._transport is t and self._state is ConnState.CONNECTED and not t.closed:
                e = TransportBrokenError("monitor closed the connection")
                if self._raise_on_lost:
                    self._mark_lost(str(e), e)  # the next call raises MonitorBrokenError from it
                else:
                    self._lost(e, raising=False)

    def _record_refused(self, t: Transport) -> None:
        """The monitor refused this rank's progress record (RECORD_REFUSED, seen by the watcher
        thread): it reads it no more, so progress goes through the socket from now on, as
        when the rank declines a record at the handshake. The sections open in the record
        are opened again on the socket (the monitor forgot them) and the iteration is sent."""
        with self._lock:
            if self._transport is not t or self._record is None or t.closed:
                return
            log.warning("rank %d: the monitor refused this rank's progress record (%s); reporting progress through "
                        "the socket", self.rank, (t.refused or "")[:512])
            self._record = None
            self._slots = {}
            self._open = {name: _UNSENT if route >= 0 else route for name, route in self._open.items()}
            self._set_timeouts(self._timeouts)  # sends the opens the monitor must know about
            if self._transport is t:
                self._event(t, wire.encode(wire.Iteration(self._iteration)))

    def _open_control(self, info: SessionInfo) -> None:
        """With ``on_hang: inprocess``, open the control connection the monitor pushes ABORT on;
        with the Flight Recorder on, the one it asks for the trace on in a roll call."""
        if self._control is not None:
            self._control.close()
            self._control = None
        if info.on_hang != "inprocess" and not info.flight_recorder:
            return
        from ft_client.client.control import ControlLink

        try:
            self._control = ControlLink(self._path, self.rank, self._request_timeout)
        except (TransportError, OSError) as e:
            log.warning("rank %d: cannot open the control connection to the monitor (%s); %s", self.rank, e,
                        "a hang will stop the rank instead of restarting it in-process" if info.on_hang == "inprocess"
                        else "a hang's roll call will have no Flight Recorder trace of this rank")

    def _reconnect_loop(self) -> None:
        """Background thread while LOST: try the monitor's socket again, waiting
        RECONNECT_INTERVAL, then twice as long after each failure (at most
        RECONNECT_MAX_INTERVAL). A restarted monitor gets this rank's learned timeouts,
        open sections and iteration back. The training thread never waits on this."""
        interval = RECONNECT_INTERVAL
        while not self._stop_reconnecting.wait(interval):
            interval = min(interval * 2, RECONNECT_MAX_INTERVAL)
            asked = _now_ns()
            try:
                transport, hello = connect(self._path, self._request_timeout, wire.Role.RANK, self.rank,
                                           _hello_info(self._num_warmup_iters), take_fd=True)
            except (TransportError, OSError):
                continue
            with self._lock:
                if self._state is not ConnState.LOST or self._stop_reconnecting.is_set():
                    fd = transport.take_fd()
                    if fd is not None:
                        os.close(fd)
                    transport.close()
                    return
                mine = self._timeouts
                self._open = dict.fromkeys(self._open, _UNSENT)
                try:
                    configured = self._adopt(transport, hello, asked)  # re-sends opens the monitor must know about
                    if mine.learned:
                        from ft_client.learning.state_dict import overlay_learned

                        self.set_timeouts(overlay_learned(configured, mine))
                    if self._transport is not None:
                        self._event(self._transport, wire.encode(wire.Iteration(self._iteration)))
                except RankMonitorClientError as e:
                    log.warning("rank %d: reconnecting to the monitor at %s failed: %s", self.rank, self._path, e)
                    if self._state is not ConnState.LOST:
                        self._mark_lost(str(e))
                    continue
                if self._state is ConnState.CONNECTED:  # type: ignore[comparison-overlap]  # set by _adopt
                    log.warning("rank %d: reconnected to the monitor at %s; hang detection resumed",
                                self.rank, self._path)
                    return

    def _start_reconnecting(self) -> None:
        t = self._reconnector
        if t is not None and t.is_alive():
            return
        self._stop_reconnecting.clear()
        self._reconnector = threading.Thread(target=self._reconnect_loop, name="ft-client-reconnect", daemon=True)
        self._reconnector.start()

    def _stop_reconnector(self) -> None:
        self._stop_reconnecting.set()
        t = self._reconnector
        self._reconnector = None
        if t is not None and t is not threading.current_thread():
            t.join(self._request_timeout + 1.0)

    def _detach_in_child(self) -> None:
        """After os.fork(), in the child: drop the rank's connection without a word (the
        parent still owns the session), stop dumping stacks, and ignore progress calls."""
        self._lock = threading.RLock()  # another thread may have held the parent's at fork time
        self._record = None  # not mapped here (MADV_DONTFORK): the rank's progress is the rank's
        if self._transport is not None:
            self._transport.abandon()
        self._transport = None
        self._reconnector = None
        self._stop_reconnecting = threading.Event()
        self._dumper.abandon()
        if self._control is not None:
            self._control.abandon()
            self._control = None
        self._state = ConnState.FORKED_CHILD

    def _path_origin(self, arg: str | None) -> str:
        if arg or self._socket_path:
            return "socket_path argument"
        return f"${env.RANK_MONITOR_SOCKET}"

    def shutdown_workload_monitoring(self) -> None:
        """Tell the monitor this rank is done (not a hang, not a crash) and disconnect."""
        if self._state is ConnState.FORKED_CHILD:
            return
        self._stop_reconnector()
        with self._lock:
            self._record = None
            t = self._transport
            if t is not None:
                try:
                    t.send_event(wire.encode(wire.Iteration(self._iteration)))
                    t.send_event(wire.encode(wire.GOODBYE))
                    t.flush()
                except TransportError:
                    pass
                t.close()
            self._transport = None
            self._lost_reason = None
            if self._state is not ConnState.NOT_INITIALIZED:
                self._state = ConnState.SHUT_DOWN
            self._open.clear()
            self._dumper.disable()
            if self._control is not None:
                self._control.close()
                self._control = None
            from ft_client.inprocess import events

            events.remove_restart_listener(self._restart_hook)
            self._restart = None
        exiting.unwatch(self)

    def _exit_shutdown(self) -> None:
        """The interpreter exits normally with this client still connected (ft_client.client.exiting):
        what `shutdown_workload_monitoring` does, unless a thread holds the client's lock for
        EXITING_LOCK_WAIT (then the monitor learns of the exit when the connection closes)."""
        if self._state is not ConnState.CONNECTED or not self._lock.acquire(timeout=EXITING_LOCK_WAIT):
            return
        try:
            self.shutdown_workload_monitoring()
        finally:
            self._lock.release()

    def _exiting(self, reason: str) -> None:
        """An uncaught exception ends the process (ft_client.client.exiting): the monitor stops timing it.
        Bounded: a thread that holds the client's lock (a reconnection) never keeps the process
        from exiting; then the monitor learns of the exit when the connection closes."""
        if not self._lock.acquire(timeout=EXITING_LOCK_WAIT):
            return
        try:
            t = self._transport
            if t is None or self._state is not ConnState.CONNECTED:
                return
            try:
                t.send_event(wire.encode(wire.Exiting(reason)))
                t.flush()
            except TransportError:
                pass
        finally:
            self._lock.release()

    # -- sends and requests (every part's) and a lost monitor ------------------
    def _event(self, t: Transport, frame: bytes) -> None:
        try:
            t.send_event(frame)
        except TransportError as e:
            self._lost(e)
            return
        if self._sync_sections:
            self._confirm()

    def _confirm(self) -> None:
        """``skip_section_response: false``: a PING round trip after a progress report (the
        monitor reads the record, and the messages before the PING, before it answers)."""
        t = self._transport
        if t is None:
            return
        try:
            reply = t.request(wire.PING)
        except TransportError as e:
            self._lost(e)
            return
        if not isinstance(reply, wire.Pong):
            raise RankMonitorClientError(f"monitor answered PING with {reply!r}")

    def _why_not_connected(self) -> str:
        if self._state is ConnState.LOST:
            return f"the monitor connection was lost: {self._lost_reason}"
        if self._state is ConnState.FORKED_CHILD:
            return "this process is a fork of the rank; the rank's client does nothing here"
        return "workload monitoring is not initialized: call init_workload_monitoring() first"

    def _not_connected_error(self) -> RankMonitorClientError:
        """Lost: the monitor broke the connection; otherwise it was closed on this side."""
        why = self._why_not_connected()
        if self._state is not ConnState.LOST:
            return MonitorClosedError(why)
        error = MonitorBrokenError(why)
        error.__cause__ = self._lost_cause  # as `raise ... from cause` would
        return error

    def _not_connected(self) -> Transport | None:
        """No transport. Before init (or after shutdown, or when configured to raise): an
        error. While LOST: carry on (the reconnector is at work). In a forked child:
        nothing to do (warned once)."""
        state = self._state
        if state is ConnState.LOST and not self._raise_on_lost:
            return None
        if state is ConnState.FORKED_CHILD:
            if not self._forked_warned:
                self._forked_warned = True
                log.warning("rank %d: RankMonitorClient used in a forked child (pid %d); its progress calls do "
                            "nothing here: the rank's monitor watches the rank itself", self.rank, os.getpid())
            return None
        raise self._not_connected_error()

    def _mark_lost(self, reason: str, cause: TransportError | None = None) -> None:
        self._record = None  # the next monitor hands over a record of its own
        self._lost_cause = cause
        if self._transport is not None:
            self._transport.close()
        self._transport = None
        self._state = ConnState.LOST
        self._lost_reason = reason
        if not self._raise_on_lost:
            self._start_reconnecting()

    def _lost(self, e: TransportError, raising: bool = True) -> None:
        """The monitor went away: warn once and keep training, or raise if configured."""
        reason = str(e)
        self._mark_lost(reason, e)
        if self._raise_on_lost and raising:
            raise MonitorBrokenError(f"rank {self.rank}: {reason}") from e
        log.warning("rank %d: %s; training continues without hang detection until the monitor is back",
                    self.rank, reason)


def _watch_hangup(client: weakref.ref[ClientLink], t: Transport) -> None:
    """The watcher thread of one connection with a record (holding the client weakly): the
    monitor's hangup, and its refusal of the record (then only the hangup)."""
    if not t.wait_hangup(REFUSAL_POLL, pushes=True):
        c = client()
        if c is not None:
            c._record_refused(t)
        del c
        t.wait_hangup()
    c = client()
    if c is not None:
        c._monitor_hung_up(t)


def _hello_info(num_warmup_iters: int | None = None) -> dict[str, Any]:
    info: dict[str, Any] = {"pid": os.getpid(), "local_rank": os.environ.get(env.LOCAL_RANK),
                            "restart": os.environ.get(env.RESTART_COUNT), "error_file": os.environ.get(env.ERROR_FILE)}
    if num_warmup_iters is not None:
        info["num_warmup_iters"] = num_warmup_iters
    if _RECORD_PROBLEM is None:
        info["record"] = record.VERSION  # this client can write a progress record of this layout
    return info


_RECORD_PROBLEM = record.supported()


def _die_with_launcher() -> None:
    """Under ft-launcher, exit (SIGTERM) if the launcher itself is killed: a worker whose
    launcher is gone can only hold its GPU. Linux only; best effort."""
    launcher_pid = os.environ.get(env.LAUNCHER_PID)
    if not launcher_pid or not launcher_pid.isdigit() or os.getppid() != int(launcher_pid):
        return
    if not die_with_parent(signal.SIGTERM):
        return
    if os.getppid() != int(launcher_pid):  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)
