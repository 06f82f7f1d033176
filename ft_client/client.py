"""RankMonitorClient: what a training process calls to report progress.

The API follows nvidia-resiliency-ext's ``RankMonitorClient`` so its users can
switch by changing an import. The client never harms training: events are one
non-blocking send, requests are bounded by a timeout, and if the monitor goes
away the client logs one warning and carries on (or raises, if the monitor's
config says ``on_monitor_lost: raise``). Thread-safe.

What is sent: heartbeats always; a section's open/close only when the monitor
can act on it (`ft_client.timeouts.section_needs_ipc`); sections not listed in
rank_section_timeouts cost no IPC at all.

Where the monitor hands over a progress record (a shared-memory page, see
`ft_client.record`), progress is a few stores into it, with no syscall: each
monitored section is registered once over the socket (SECTION_SLOT) and then
opens and closes in its slot (a close by `end_section` also counts the section
and adds its time, so the monitor counts every step however seldom it reads);
heartbeats and the iteration are stored too. The
socket carries the rest (and every progress report where there is no record, or
the monitor's config says ``progress_record: false``). Either way, while an
in-process restart unwinds nothing is reported, and the first progress after
re-entry sends REENTERED over the socket before it is stored; re-entry starts a
new epoch of the record, so the sections abandoned while unwinding read as closed.

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
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

from ft_client import env, exit_teardown, exiting, record, wire
from ft_client.errors import MonitorBrokenError, MonitorClosedError, RankMonitorClientError
from ft_client.parent_death import die_with_parent
from ft_client.session_info import SessionInfo, SessionInfoError
from ft_client.stackdump import StackDumper
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
from ft_client.transport import Transport, TransportBrokenError, TransportError, connect
from ft_client.workload import WorkloadAction, WorkloadControlRequest

if TYPE_CHECKING:  # loaded when first used: with in-process restarts only (import time)
    import logging

    from ft_client.control import ControlLink
    from ft_client.inprocess import events


class _Log:
    """The "ft_client" logger, looked up when a first line is logged: importing logging costs
    a bare interpreter about 3 ms, and the client logs only when something is wrong."""

    def __getattr__(self, name: str) -> Any:
        import logging

        return getattr(logging.getLogger("ft_client"), name)


log = cast("logging.Logger", _Log())

F = TypeVar("F", bound=Callable[..., Any])

CONNECT_TIMEOUT = 10.0
REFUSAL_POLL = 0.25
"""Seconds between the record watcher's looks for a refusal a request took aside."""
RECONNECT_INTERVAL = 1.0
"""Seconds before the first attempt to reach a lost monitor again; doubled after each
failed attempt up to RECONNECT_MAX_INTERVAL. Attempts run on a background thread."""
RECONNECT_MAX_INTERVAL = 8.0
ITERATION_REPORT_INTERVAL = 0.2
"""Seconds between iteration reports to the monitor (the launcher's progress tracking)."""
_UNSENT = -1
"""`_open` route of a section the monitor was not told about."""
_SOCKET = -2
"""`_open` route of a section reported over the socket; a route >= 0 is a record slot (as the
index of its SEQ word, `record.slot_word`)."""
EXITING_LOCK_WAIT = 1.0
"""Seconds the uncaught-exception hook waits for the client's lock before it gives up on EXITING."""
_now_ns = time.monotonic_ns
_HB_SEQ, _HB_AT, _ITERATION = record.W_HB_SEQ, record.W_HB_AT, record.W_ITERATION
_OPENED_AT, _CLOSED_AT, _CLOSES, _SUM_NS = record.OPENED_AT, record.CLOSED_AT, record.CLOSES, record.SUM_NS


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
        self._mono = clock is time.monotonic
        """The clock is the default: one monotonic_ns() read serves the record and the learning."""
        self._lock = threading.RLock()
        self._state = ConnState.NOT_INITIALIZED
        self._transport: Transport | None = None
        self._lost_reason: str | None = None
        self._lost_cause: TransportError | None = None
        """What broke the connection (the cause of MonitorBrokenError raised while LOST)."""
        self._request_timeout = CONNECT_TIMEOUT
        self._reconnector: threading.Thread | None = None
        self._stop_reconnecting = threading.Event()
        self._forked_warned = False
        self._timeouts = Timeouts()
        self._ipc: frozenset[str] = frozenset()
        self._open: dict[str, int] = {}
        """Open section -> how the monitor was told: _UNSENT, _SOCKET or its record slot."""
        self._record: record.RecordWriter | None = None
        """The progress record, while connected to a monitor that handed one over."""
        self._slots: dict[str, int] = {}
        """Section -> its slot in the current record (registered with SECTION_SLOT), as the
        index of the slot's SEQ word (`record.slot_word`): what the hot path stores at."""
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
        self._restart: events.Restart | Literal[True] | None = None  # True: unwinding; a Restart: re-entering
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
            self._calc = TimeoutsRecorder(
                (n for n in configured.rank_section_timeouts if n != WARMUP_SECTION), self._safety_factor
            )
            self._calc.start(self._clock())
            if self._to_load is not None:  # load_state_dict() came first: push at the handshake
                from ft_client.state_dict import overlay_learned

                loaded, self._to_load = self._to_load, None
                self.set_timeouts(overlay_learned(self._timeouts, loaded))
            from ft_client.inprocess import events

            events.add_restart_listener(self._restart_hook)
            exiting.watch(self)
            exit_teardown.install()
            _die_with_launcher()

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

    def _take_record(self, transport: Transport, info: SessionInfo, fd: int | None, asked_ns: int) -> None:
        """Map the progress record passed with HELLO_OK, if any; one that cannot be used is
        declined (RECORD_DECLINED, with why) and progress goes through the socket."""
        self._record = None
        self._slots = {}
        if info.record is None and fd is None:
            return
        from ft_client.record_open import open_record

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
        from ft_client.control import ControlLink

        try:
            self._control = ControlLink(self._path, self.rank, self._request_timeout)
        except (TransportError, OSError) as e:
            log.warning("rank %d: cannot open the control connection to the monitor (%s); %s", self.rank, e,
                        "a hang will stop the rank instead of restarting it in-process" if info.on_hang == "inprocess"
                        else "a hang's roll call will have no Flight Recorder trace of this rank")

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
            if self._record is not None:
                self._record.reset(_now_ns())  # a new epoch: what was open while unwinding reads as closed

    def _restart_gate(self, t: Transport | None) -> bool:
        """Called by progress calls while a restart is under way: True to report nothing
        (unwinding); after re-entry, the first call sends REENTERED and goes on."""
        restart = self._restart
        if restart is True:
            return True
        self._restart = None
        if restart is not None:  # an events.Restart
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
                        from ft_client.state_dict import overlay_learned

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

    def _exiting(self, reason: str) -> None:
        """An uncaught exception ends the process (ft_client.exiting): the monitor stops timing it.
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

    # -- progress --------------------------------------------------------------
    # Each call takes the lock explicitly (cheaper than `with`, which matters at a few
    # hundred nanoseconds a call). With a record and no restart under way, the fast path
    # is: learn, store. Otherwise the transport is checked (raising before init), the
    # restart gate applied, and the event sent or stored.
    def send_heartbeat(self) -> None:
        lock = self._lock
        lock.acquire()
        try:
            rec = self._record
            if rec is not None and self._restart is None:  # the fast path: learn, store
                now = _now_ns()
                self._calc.on_heartbeat(now * 1e-9 if self._mono else self._clock())
                w = rec.words  # RecordWriter.heartbeat, inlined: this runs at every call
                seq = rec.hb_seq + 1
                w[_HB_SEQ] = seq
                w[_HB_AT] = now
                w[_HB_SEQ] = rec.hb_seq = seq + 1
                if self._sync_sections:
                    self._confirm()
                return
            t = self._transport or self._not_connected()
            if self._restart is not None and self._restart_gate(t):
                return
            self._calc.on_heartbeat(self._clock())
            rec = self._record
            if rec is not None:
                rec.heartbeat(_now_ns())
                if self._sync_sections:
                    self._confirm()
            elif self._transport is not None:
                self._event(self._transport, wire.HEARTBEAT_FRAME)
        finally:
            lock.release()

    def start_section(self, section: str) -> None:
        name = section
        lock = self._lock
        lock.acquire()
        try:
            if name in self._open:
                raise RankMonitorClientError(f"section {name!r} is already open; end_section({name!r}) first")
            rec = self._record
            if rec is not None and self._restart is None:
                now = _now_ns()
                self._calc.on_section_open(name, now * 1e-9 if self._mono else self._clock())
                slot = self._slots.get(name)
                if slot is not None:  # the fast path: a registered section
                    self._open[name] = slot
                    w, seqs = rec.words, rec.seqs  # RecordWriter.open_word, inlined: this runs at every call
                    seq = seqs[slot] + 1
                    w[slot] = seq
                    w[slot + _OPENED_AT] = now
                    w[slot] = seqs[slot] = seq + 1
                    if self._sync_sections:
                        self._confirm()
                    return
            else:
                t = self._transport or self._not_connected()
                if self._restart is not None and self._restart_gate(t):
                    self._open[name] = _UNSENT
                    return
                self._calc.on_section_open(name, self._clock())
            self._open[name] = _UNSENT
            if name not in self._ipc:
                return
            rec = self._record
            if rec is not None:
                slot = self._slots.get(name)
                if slot is None:
                    slot = self._register_slot(name)
                if slot is not None and self._record is rec:
                    self._open[name] = slot
                    rec.open_word(slot, _now_ns())
                    if self._sync_sections:
                        self._confirm()
                    return
            t = self._transport
            if t is not None:
                self._open[name] = _SOCKET
                frame = self._open_frames.get(name)
                if frame is None:
                    frame = self._open_frames[name] = self._section_frame(name, wire.section_open_frame)
                self._event(t, frame)
        finally:
            lock.release()

    def end_section(self, section: str) -> None:
        name = section
        lock = self._lock
        lock.acquire()
        try:
            route = self._open.pop(name, None)
            if route is None:
                raise RankMonitorClientError(f"section {name!r} is not open; start_section({name!r}) first")
            rec = self._record
            if rec is not None and self._restart is None:  # the fast path: learn, store
                now_ns = _now_ns()
                self._calc.on_section_close(name, now_ns * 1e-9 if self._mono else self._clock())
                w = rec.words
                if route >= 0:  # RecordWriter.close_word, inlined: this runs at every call
                    seqs = rec.seqs
                    seq = seqs[route] + 1
                    w[route] = seq
                    w[route + _CLOSED_AT] = now_ns
                    w[route + _CLOSES] += 1  # counted by the rank: the monitor's reads may miss it
                    w[route + _SUM_NS] += now_ns - w[route + _OPENED_AT]
                    w[route] = seqs[route] = seq + 1
                if name == STEP_SECTION:
                    self._iteration += 1
                    w[_ITERATION] = self._iteration
                if route == _SOCKET:
                    self._send_close(name)
                elif route >= 0 and self._sync_sections:
                    self._confirm()
                return
            t = self._transport or self._not_connected()
            if self._restart is not None and self._restart_gate(t):
                return
            now = self._clock()
            self._calc.on_section_close(name, now)
            step = name == STEP_SECTION
            if step:
                self._iteration += 1
            rec = self._record
            if rec is not None:  # REENTERED was just sent
                if route >= 0:
                    rec.close_word(route, _now_ns())
                if step:
                    rec.words[record.W_ITERATION] = self._iteration
                if route == _SOCKET:
                    self._send_close(name)
                elif route >= 0 and self._sync_sections:
                    self._confirm()
                return
            t = self._transport
            if t is None:
                return
            if route == _SOCKET:
                self._send_close(name)
            if step and now - self._iteration_sent_at >= ITERATION_REPORT_INTERVAL:
                self._iteration_sent_at = now
                self._event(t, wire.encode(wire.Iteration(self._iteration)))
        finally:
            lock.release()

    def _send_close(self, name: str) -> None:
        t = self._transport
        if t is None:
            return
        frame = self._close_frames.get(name)
        if frame is None:
            frame = self._close_frames[name] = self._section_frame(name, wire.section_close_frame)
        self._event(t, frame)

    def end_all_sections(self) -> None:
        """Close every open section, here and in the monitor."""
        with self._lock:
            t = self._transport or self._not_connected()
            routes = list(self._open.values())
            self._open.clear()
            if self._restart is not None and self._restart_gate(t):
                return
            self._calc.on_close_all(self._clock())
            rec = self._record
            if rec is not None:
                now = _now_ns()
                for route in routes:
                    if route >= 0:
                        rec.abandon_word(route, now)  # as CLOSE_ALL: closed, not counted as completed
                if _SOCKET not in routes:
                    if self._sync_sections:
                        self._confirm()
                    return
            if t is not None:
                self._event(t, _CLOSE_ALL_FRAME)

    def _register_slot(self, name: str) -> int | None:
        """Give a monitored section a slot of the record and tell the monitor (once per
        record); its SEQ word, or None when every slot is taken (the section reports
        through the socket)."""
        t = self._transport
        if len(self._slots) >= record.SLOTS or t is None:
            return None
        slot = len(self._slots)
        try:
            frame = wire.encode(wire.SectionSlot(name, slot))
        except wire.ProtocolError as e:
            raise RankMonitorClientError(f"bad section name {name!r}: {e}") from e
        self._event(t, frame)
        if self._record is None:  # the monitor went away meanwhile
            return None
        word = self._slots[name] = record.slot_word(slot)
        return word

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
        """Adopt new timeouts; tell the monitor about open sections it now needs to know
        (opened now, as far as it can tell)."""
        self._timeouts = timeouts
        self._ipc = frozenset(n for n in timeouts.rank_section_timeouts if section_needs_ipc(n, timeouts))
        for name, route in list(self._open.items()):
            t = self._transport
            if route != _UNSENT or name not in self._ipc or t is None:
                continue
            rec = self._record
            slot = self._slots.get(name) if rec is not None else None
            if rec is not None and slot is None:
                slot = self._register_slot(name)
            if rec is not None and slot is not None and self._record is rec:
                self._open[name] = slot
                rec.open_word(slot, _now_ns())
            else:
                self._open[name] = _SOCKET
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
        from ft_client.state_dict import to_state_dict

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
        from ft_client.state_dict import from_state_dict, overlay_learned  # checkpoints only: loaded when used

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
        """The client is in a call on this thread (its lock held: an interrupt raised there,
        even between the lock's acquire and the ``try`` that releases it, could leave the
        lock held or a record group half-stored), or its main connection is mid-frame or
        mid-request (an interrupt would cut a frame in two or leave a reply unread)."""
        client = self._client()
        if client is None:
            return False
        if client._lock._is_owned():  # type: ignore[attr-defined]  # RLock's own, as threading.Condition uses it
            return True
        t = client._transport
        return t is not None and t.io_busy()

def _watch_hangup(client: weakref.ref[RankMonitorClient], t: Transport) -> None:
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


_CLOSE_ALL_FRAME = wire.encode(wire.SECTION_CLOSE_ALL)
