"""RankMonitorClient: what a training process calls to report progress.

The API follows nvidia-resiliency-ext's ``RankMonitorClient`` so its users can
switch by changing an import. The client never harms training: events are one
non-blocking send, requests are bounded by a timeout, and if the monitor goes
away the client logs one warning and carries on (or raises, if the monitor's
config says ``on_monitor_lost: raise``). Thread-safe.

What is sent: heartbeats always; a section's open/close only when the monitor
can act on it (`ft_client.timeouts.section_needs_ipc`); sections not listed in
rank_section_timeouts cost no IPC at all.

The connection is in one of the states of `ConnState`::

    NOT_INITIALIZED --init_workload_monitoring()--> CONNECTED
    CONNECTED --monitor gone (send/request failed)--> LOST --reconnected--> CONNECTED
    CONNECTED | LOST --shutdown_workload_monitoring()--> SHUT_DOWN --init...--> CONNECTED
    any --os.fork(), in the child--> FORKED_CHILD

While LOST, a background thread (never the training thread) tries the monitor's
socket again with a growing interval; progress calls return at once meanwhile.
In a forked child (a data-loader worker) the client is detached: it sends nothing
and every progress call does nothing, so a child can neither keep a dead or hung
rank's session alive nor speak for it.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from enum import Enum
from typing import Any, TypeVar

from ft_client import env, wire
from ft_client.control import ControlLink
from ft_client.errors import MonitorBrokenError, MonitorClosedError, RankMonitorClientError
from ft_client.inprocess import events
from ft_client.parent_death import die_with_parent
from ft_client.session_info import SessionInfo, SessionInfoError
from ft_client.stackdump import StackDumper
from ft_client.state_dict import from_state_dict, overlay_learned, to_state_dict
from ft_client.sync import max_across_ranks
from ft_client.timeouts import (
    STEP_SECTION,
    WARMUP_SECTION,
    HeartbeatTimeouts,
    SectionTimeouts,
    Timeouts,
    TimeoutsError,
    section_needs_ipc,
)
from ft_client.timeouts_calc import (
    DEFAULT_SAFETY_FACTOR,
    NotEnoughDataError,
    Observations,
    TimeoutsRecorder,
    hb_not_ready,
    learn_hb_timeouts,
    learn_section_timeouts,
    sections_not_ready,
)
from ft_client.transport import Transport, TransportError, connect
from ft_client.workload import WorkloadAction, WorkloadControlRequest

log = logging.getLogger("ft_client")

F = TypeVar("F", bound=Callable[..., Any])

CONNECT_TIMEOUT = 10.0
RECONNECT_INTERVAL = 1.0
"""Seconds before the first attempt to reach a lost monitor again; doubled after each
failed attempt up to RECONNECT_MAX_INTERVAL. Attempts run on a background thread."""
RECONNECT_MAX_INTERVAL = 8.0
ITERATION_REPORT_INTERVAL = 0.2
"""Seconds between iteration reports to the monitor (the launcher's progress tracking)."""


class _Section:
    """``client.section(name)``: a context manager that is also a decorator."""

    __slots__ = ("_client", "_name")

    def __init__(self, client: RankMonitorClient, name: str) -> None:
        self._client = client
        self._name = name

    def __enter__(self) -> None:
        self._client.start_section(self._name)

    def __exit__(self, *exc: object) -> None:
        self._client.end_section(self._name)

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class ConnState(Enum):
    NOT_INITIALIZED = "not initialized"
    CONNECTED = "connected"
    LOST = "lost"
    SHUT_DOWN = "shut down"
    FORKED_CHILD = "forked child"


_clients: weakref.WeakSet[RankMonitorClient] = weakref.WeakSet()


def _detach_clients_in_child() -> None:
    for client in list(_clients):
        client._detach_in_child()


os.register_at_fork(after_in_child=_detach_clients_in_child)


class RankMonitorClient:
    """Client of one rank's monitor daemon.

    ``socket_path`` defaults to ``$FT_RANK_MONITOR_IPC_SOCKET``; ``clock`` (monotonic
    seconds) is injectable for tests.
    """

    def __init__(self, socket_path: str | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        try:
            rank = env.rank_from_env()
        except ValueError as e:
            raise RankMonitorClientError(str(e)) from e
        self._socket_path = socket_path
        self._clock = clock
        self._lock = threading.RLock()
        self._state = ConnState.NOT_INITIALIZED
        self._transport: Transport | None = None
        self._lost_reason: str | None = None
        self._request_timeout = CONNECT_TIMEOUT
        self._reconnector: threading.Thread | None = None
        self._stop_reconnecting = threading.Event()
        self._forked_warned = False
        self._timeouts = Timeouts()
        self._ipc: frozenset[str] = frozenset()
        self._open: dict[str, bool] = {}  # open section -> whether the monitor was told
        self._open_frames: dict[str, bytes] = {}
        self._close_frames: dict[str, bytes] = {}
        self._sync_sections = False
        self._raise_on_lost = False
        self._dumper = StackDumper()
        self._calc = TimeoutsRecorder()
        self._observed = Observations()  # as agreed by the last cross-rank reduction
        self._safety_factor = DEFAULT_SAFETY_FACTOR
        self._min_learned = 0.0
        self._to_load: Timeouts | None = None  # learned values loaded before init
        self._loaded: Timeouts | None = None  # what the last load_state_dict() loaded
        self._num_warmup_iters: int | None = None
        self._iteration = 0  # completed `step` sections, across runs (kept in state_dict)
        self._iteration_sent_at = -ITERATION_REPORT_INTERVAL
        self._path = ""
        self._control: ControlLink | None = None
        self._restart: events.Restart | None | bool = None
        """In-process restart under way: True between the Wrapper's abort and its re-entry
        (progress calls then report nothing: the rank is unwinding); the `events.Restart`
        after re-entry until the first progress call reports it (REENTERED); else None."""
        self._restart_hook = _RestartHook(self)
        self.rank = rank
        _clients.add(self)

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
            self._num_warmup_iters = num_warmup_iters
            if self._state is ConnState.FORKED_CHILD:
                raise MonitorClosedError("this process is a fork of the rank; its client stays with the rank")
            if self._state in (ConnState.CONNECTED, ConnState.LOST):
                raise RankMonitorClientError("workload monitoring is already initialized")
            path = socket_path or self._socket_path or os.environ.get(env.RANK_MONITOR_SOCKET)
            if not path:
                raise RankMonitorClientError(
                    f"no monitor socket: set {env.RANK_MONITOR_SOCKET} (ft-launcher and `ft-monitor serve -- CMD` "
                    "set it) or pass socket_path="
                )
            try:
                transport, hello = connect(path, CONNECT_TIMEOUT, wire.Role.RANK, self.rank,
                                           _hello_info(self._num_warmup_iters))
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
            configured = self._adopt(transport, hello)
            self._calc = TimeoutsRecorder(
                (n for n in configured.rank_section_timeouts if n != WARMUP_SECTION), self._safety_factor
            )
            self._calc.start(self._clock())
            if self._to_load is not None:  # load_state_dict() came first: push at the handshake
                loaded, self._to_load = self._to_load, None
                self.set_timeouts(overlay_learned(self._timeouts, loaded))
            events.add_restart_listener(self._restart_hook)
            _die_with_launcher()

    def _adopt(self, transport: Transport, hello: wire.HelloOk) -> Timeouts:
        """Take a new connection's session (config from the monitor); return its configured timeouts."""
        try:
            info = SessionInfo.from_wire(hello.session)
        except SessionInfoError:
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
        self._safety_factor = info.safety_factor
        self._min_learned = info.min_learned_timeout
        self._set_timeouts(configured)
        if info.stack_dump_path:
            try:
                self._dumper.enable(info.stack_dump_signal, info.stack_dump_path)
            except OSError as e:
                log.warning("rank %d: cannot open stack dump file %s: %s", self.rank, info.stack_dump_path, e)
        self._open_control(info)
        return configured

    def _open_control(self, info: SessionInfo) -> None:
        """With ``on_hang: inprocess``, open the control connection the monitor pushes ABORT on;
        with the Flight Recorder on, the one it asks for the trace on in a roll call."""
        if self._control is not None:
            self._control.close()
            self._control = None
        if info.on_hang != "inprocess" and not info.flight_recorder:
            return
        try:
            self._control = ControlLink(self._path, self.rank, self._request_timeout)
        except (TransportError, OSError) as e:
            log.warning("rank %d: cannot open the control connection to the monitor (%s); a hang will stop the "
                        "rank instead of restarting it in-process", self.rank, e)

    def _aborting(self, iteration: int) -> None:
        """An in-process Wrapper leaves the training function after a fault (any thread):
        the monitor is told (RESTARTING) and stops timing this rank, and progress calls
        made while the rank unwinds are not reported."""
        with self._lock:
            self._restart = True
            t = self._transport
            if t is not None:
                self._event(t, wire.encode(wire.Restarting(iteration)))

    def _entering(self, restart: events.Restart) -> None:
        """The Wrapper calls the training function again: sections opened before the fault
        are gone, partial intervals are not learned from, and the first progress call
        tells the monitor the rank is back (REENTERED)."""
        with self._lock:
            self._open.clear()
            self._calc.start(self._clock())
            self._restart = restart

    def _restart_gate(self, t: Transport | None) -> bool:
        """Called by progress calls while a restart is under way: True to report nothing
        (unwinding); after re-entry, the first call sends REENTERED and goes on."""
        restart = self._restart
        if restart is True:
            return True
        self._restart = None
        if isinstance(restart, events.Restart):
            restart.progress()
            if t is not None:
                f = restart.fault
                self._event(t, wire.encode(wire.Reentered(restart.iteration, f.reason, f.rank, f.source,
                                                          dict(restart.times))))
        return False

    def _reconnect_loop(self) -> None:
        """Background thread while LOST: try the monitor's socket again, waiting
        RECONNECT_INTERVAL, then twice as long after each failure (at most
        RECONNECT_MAX_INTERVAL). A restarted monitor gets this rank's learned timeouts,
        open sections and iteration back. The training thread never waits on this."""
        interval = RECONNECT_INTERVAL
        while not self._stop_reconnecting.wait(interval):
            interval = min(interval * 2, RECONNECT_MAX_INTERVAL)
            try:
                transport, hello = connect(self._path, self._request_timeout, wire.Role.RANK, self.rank,
                                           _hello_info(self._num_warmup_iters))
            except (TransportError, OSError):
                continue
            with self._lock:
                if self._state is not ConnState.LOST or self._stop_reconnecting.is_set():
                    transport.close()
                    return
                mine = self._timeouts
                self._open = dict.fromkeys(self._open, False)
                try:
                    configured = self._adopt(transport, hello)  # re-sends opens the monitor must know about
                    if mine.learned:
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
            events.remove_restart_listener(self._restart_hook)
            self._restart = None

    # -- progress --------------------------------------------------------------
    def send_heartbeat(self) -> None:
        with self._lock:
            t = self._transport or self._not_connected()
            if self._restart is not None and self._restart_gate(t):
                return
            self._calc.on_heartbeat(self._clock())
            if t is not None:
                self._event(t, wire.HEARTBEAT_FRAME)

    def start_section(self, section: str) -> None:
        name = section
        with self._lock:
            if name in self._open:
                raise RankMonitorClientError(f"section {name!r} is already open; end_section({name!r}) first")
            t = self._transport or self._not_connected()
            if self._restart is not None and self._restart_gate(t):
                self._open[name] = False
                return
            self._calc.on_section_open(name, self._clock())
            send = t is not None and name in self._ipc
            self._open[name] = send
            if send:
                frame = self._open_frames.get(name)
                if frame is None:
                    frame = self._open_frames[name] = self._section_frame(name, wire.section_open_frame)
                self._event(t, frame)  # type: ignore[arg-type]

    def end_section(self, section: str) -> None:
        name = section
        with self._lock:
            sent = self._open.pop(name, None)
            if sent is None:
                raise RankMonitorClientError(f"section {name!r} is not open; start_section({name!r}) first")
            t = self._transport or self._not_connected()
            if self._restart is not None and self._restart_gate(t):
                return
            now = self._clock()
            self._calc.on_section_close(name, now)
            if name == STEP_SECTION:
                self._iteration += 1
            if t is None:
                return
            if sent:
                frame = self._close_frames.get(name)
                if frame is None:
                    frame = self._close_frames[name] = self._section_frame(name, wire.section_close_frame)
                self._event(t, frame)
            if name == STEP_SECTION and now - self._iteration_sent_at >= ITERATION_REPORT_INTERVAL:
                self._iteration_sent_at = now
                self._event(t, wire.encode(wire.Iteration(self._iteration)))

    def end_all_sections(self) -> None:
        """Close every open section, here and in the monitor."""
        with self._lock:
            t = self._transport or self._not_connected()
            self._open.clear()
            if self._restart is not None and self._restart_gate(t):
                return
            self._calc.on_close_all(self._clock())
            if t is not None:
                self._event(t, _CLOSE_ALL_FRAME)

    def section(self, name: str) -> _Section:
        """``with client.section("step"): ...`` or ``@client.section("step")``."""
        return _Section(self, name)

    # -- timeouts --------------------------------------------------------------
    @property
    def hb_timeouts(self) -> HeartbeatTimeouts:
        return self._timeouts.hb

    @property
    def section_timeouts(self) -> SectionTimeouts:
        return self._timeouts.sections

    @property
    def loaded_hb_timeouts(self) -> HeartbeatTimeouts | None:
        """The heartbeat timeouts the last `load_state_dict()` read (None before one); in
        force once there is a monitor (`hb_timeouts`)."""
        return None if self._loaded is None else self._loaded.hb

    @property
    def loaded_section_timeouts(self) -> SectionTimeouts | None:
        """As `loaded_hb_timeouts`, for the section timeouts."""
        return None if self._loaded is None else self._loaded.sections

    @property
    def iteration(self) -> int:
        """Training iterations so far: completed `step` sections, counted on from the
        checkpoint loaded with load_state_dict(). Reported to the monitor at most five
        times a second; the launcher uses it to tell restarts that make progress from ones that don't."""
        return self._iteration

    @property
    def timeouts(self) -> Timeouts:
        """Every timeout in force, with which were learned."""
        return self._timeouts

    def set_timeouts(self, timeouts: Timeouts) -> Timeouts:
        """Put ``timeouts`` in force in the monitor (request/reply); returns what the monitor holds."""
        with self._lock:
            t = self._transport
            if t is None:
                raise self._not_connected_error()
            try:
                reply = t.request(wire.UpdateConfig(timeouts.to_wire()))
            except TransportError as e:
                self._lost(e, raising=False)
                raise MonitorBrokenError(f"cannot update timeouts: {e}") from e
            if isinstance(reply, wire.Error):
                raise RankMonitorClientError(f"monitor rejected the timeouts ({reply.code}): {reply.message}")
            if not isinstance(reply, wire.ConfigOk):
                raise RankMonitorClientError(f"monitor answered UPDATE_CONFIG with {type(reply).__name__}")
            try:
                self._set_timeouts(Timeouts.from_wire(reply.timeouts))
            except TimeoutsError as e:
                raise RankMonitorClientError(f"monitor sent invalid timeouts: {e}") from e
            return self._timeouts

    def _set_timeouts(self, timeouts: Timeouts) -> None:
        """Adopt new timeouts; tell the monitor about open sections it now needs to know."""
        self._timeouts = timeouts
        self._ipc = frozenset(n for n in timeouts.rank_section_timeouts if section_needs_ipc(n, timeouts))
        t = self._transport
        for name, sent in list(self._open.items()):
            if not sent and name in self._ipc and t is not None:
                self._open[name] = True
                self._event(t, wire.section_open_frame(name))

    # -- learned timeouts ------------------------------------------------------
    def calculate_and_set_hb_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        """Learn the heartbeat timeouts from what this run observed and put them in force.

        A collective when torch.distributed is initialized: every rank must call
        it, and all end with the same timeouts (element-wise MAX over ranks).
        Returns False when there is not enough data and ``skip_if_not_ready``;
        otherwise raises NotEnoughDataError saying what is missing.
        """
        obs = self._reduce_observations()
        reason = hb_not_ready(obs)
        if reason is not None:
            if skip_if_not_ready:
                return False
            raise NotEnoughDataError(reason)
        self._apply_learned(learn_hb_timeouts(self._timeouts, obs, self._safety_factor, self._min_learned))
        return True

    def calculate_and_set_section_timeouts(
        self,
        selected_sections: list[str] | None = None,
        calc_out_of_section: bool = True,
        skip_if_not_ready: bool = False,
    ) -> bool:
        """Learn section timeouts (all listed ones, or ``selected_sections``) and, with
        ``calc_out_of_section``, the out-of-section timeout. Collective, like
        calculate_and_set_hb_timeouts."""
        obs = self._reduce_observations()
        try:
            reason = sections_not_ready(self._timeouts, obs, selected_sections, calc_out_of_section)
        except ValueError as e:
            raise RankMonitorClientError(str(e)) from e
        if reason is not None:
            if skip_if_not_ready:
                return False
            raise NotEnoughDataError(reason)
        self._apply_learned(
            learn_section_timeouts(self._timeouts, obs, self._safety_factor, selected_sections, calc_out_of_section,
                                   self._min_learned)
        )
        return True

    def _reduce_observations(self) -> Observations:
        if not self.is_initialized:
            raise self._not_connected_error()
        with self._lock:
            vector = self._calc.export_vector(self._clock())
        reduced = max_across_ranks(vector)  # outside the lock: other threads keep reporting
        with self._lock:
            self._observed = self._calc.import_vector(reduced)
            return self._observed

    def _apply_learned(self, timeouts: Timeouts) -> None:
        if self._transport is None:  # monitor lost (and on_monitor_lost=warn): keep them locally
            self._set_timeouts(timeouts)
            return
        self.set_timeouts(timeouts)

    def state_dict(self) -> dict[str, Any]:
        """Learned timeouts and the observations behind them: plain JSON data, the same
        on every rank after a calculate_and_set_* call. Put it in the checkpoint."""
        with self._lock:
            # every listed section appears (null until observed), so the layout is known
            # from the config alone: torch.distributed.checkpoint loads into this layout
            listed = {n: None for n in self._timeouts.rank_section_timeouts if n != WARMUP_SECTION}
            observed = replace(self._observed, sections={**listed, **self._observed.sections})
            return to_state_dict(self._timeouts, observed, self._safety_factor, self._iteration)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put learned timeouts from a checkpoint in force (before or after
        init_workload_monitoring()). Accepts this client's format and the
        ``{"current_timeouts": ...}`` dict of nvidia-resiliency-ext."""
        try:
            loaded = from_state_dict(state)
        except ValueError as e:
            raise RankMonitorClientError(f"cannot load the ft state_dict: {e}") from e
        with self._lock:
            self._loaded = loaded.timeouts
            self._observed = loaded.observations
            self._iteration = loaded.iteration
            if self._transport is None:
                if self._state is ConnState.LOST:
                    self._set_timeouts(overlay_learned(self._timeouts, loaded.timeouts))
                else:
                    self._to_load = loaded.timeouts
                return
            self.set_timeouts(overlay_learned(self._timeouts, loaded.timeouts))

    # -- workload control ------------------------------------------------------
    def send_workload_control_request(
        self, req: WorkloadControlRequest | WorkloadAction | str, description: str = ""
    ) -> None:
        """Ask ft-launcher to act now: Continue, ExcludeThisNode or ShutdownWorkload.

        Goes straight to the launcher ($FT_LAUNCHER_IPC_SOCKET), request/reply;
        returns once the launcher has accepted it.
        """
        if isinstance(req, WorkloadControlRequest):
            action, description = req.action, req.description or description
        else:
            action = WorkloadAction.parse(req)
        path = os.environ.get(env.LAUNCHER_SOCKET)
        if not path:
            raise RankMonitorClientError(
                f"no launcher socket: {env.LAUNCHER_SOCKET} is not set (run under ft-launcher to use workload control)"
            )
        try:
            t, _ = connect(path, CONNECT_TIMEOUT, wire.Role.RANK, self.rank)
        except (TransportError, OSError) as e:
            raise RankMonitorClientError(f"cannot reach the launcher at {path}: {e}") from e
        try:
            reply = t.request(wire.Control(action.value, description))
        except TransportError as e:
            raise RankMonitorClientError(f"launcher did not accept {action.value}: {e}") from e
        finally:
            t.close()
        if not isinstance(reply, wire.Ack):
            raise RankMonitorClientError(f"launcher refused {action.value}: {reply}")

    # -- internals -------------------------------------------------------------
    @staticmethod
    def _section_frame(name: str, build: Callable[[str], bytes]) -> bytes:
        try:
            return build(name)
        except wire.ProtocolError as e:
            raise RankMonitorClientError(f"bad section name {name!r}: {e}") from e

    def _event(self, t: Transport, frame: bytes) -> None:
        try:
            t.send_event(frame)
            if self._sync_sections:
                reply = t.request(wire.PING)
                if not isinstance(reply, wire.Pong):
                    raise RankMonitorClientError(f"monitor answered PING with {reply!r}")
        except TransportError as e:
            self._lost(e)

    def _why_not_connected(self) -> str:
        if self._state is ConnState.LOST:
            return f"the monitor connection was lost: {self._lost_reason}"
        if self._state is ConnState.FORKED_CHILD:
            return "this process is a fork of the rank; the rank's client does nothing here"
        return "workload monitoring is not initialized: call init_workload_monitoring() first"

    def _not_connected_error(self) -> RankMonitorClientError:
        """Lost: the monitor broke the connection; otherwise it was closed on this side."""
        why = self._why_not_connected()
        return MonitorBrokenError(why) if self._state is ConnState.LOST else MonitorClosedError(why)

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

    def _mark_lost(self, reason: str) -> None:
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
        self._mark_lost(reason)
        if self._raise_on_lost and raising:
            raise MonitorBrokenError(f"rank {self.rank}: {reason}") from e
        log.warning("rank %d: %s; training continues without hang detection until the monitor is back",
                    self.rank, reason)


class _RestartHook:
    """The client's `events.RestartListener`, holding it weakly (a listener must not keep a
    dropped client alive)."""

    __slots__ = ("_client",)

    def __init__(self, client: RankMonitorClient) -> None:
        self._client = weakref.ref(client)

    def aborting(self, iteration: int) -> None:
        client = self._client()
        if client is not None:
            client._aborting(iteration)

    def entering(self, restart: events.Restart) -> None:
        client = self._client()
        if client is not None:
            client._entering(restart)

    def busy(self) -> bool:
        """The client's main connection is mid-frame or mid-request (an interrupt raised
        then would cut a frame in two or leave a reply unread)."""
        client = self._client()
        t = client._transport if client is not None else None
        return t is not None and t.io_busy()


def _hello_info(num_warmup_iters: int | None = None) -> dict[str, Any]:
    info: dict[str, Any] = {"pid": os.getpid(), "local_rank": os.environ.get(env.LOCAL_RANK),
                            "restart": os.environ.get(env.RESTART_COUNT), "error_file": os.environ.get(env.ERROR_FILE)}
    if num_warmup_iters is not None:
        info["num_warmup_iters"] = num_warmup_iters
    return info


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


_CLOSE_ALL_FRAME = wire.encode(wire.SECTION_CLOSE_ALL)
