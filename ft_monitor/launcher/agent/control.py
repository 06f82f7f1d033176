"""The launcher socket: where daemons report hangs and ranks ask for workload actions.

A small threaded Unix-socket server in the launcher process, speaking the same
framed msgpack protocol as the daemons (ft_client.wire). It decides nothing: it
validates each request, acknowledges it, and queues an event for the agent's
monitor loop (`LauncherServer.events`), which acts on it at its next tick
(every --monitor-interval seconds). Peers must have the launcher's uid; a hang
notice is taken only from one of this launcher's monitors and only once every
field checks out (`notices.HangNotice`), a workload request only from a worker
(or a process a worker started). At most MAX_CONNECTIONS are served at once.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import socketserver
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from ft_client import wire
from ft_client.workload import CONFIGURATION_ERROR, WorkloadAction
from ft_monitor.core.notices import HangNotice, NoticeError
from ft_monitor.core.server_log import printable
from ft_monitor.processes.procinfo import peer_credentials

log = logging.getLogger("ft_monitor.launcher")

READ_TIMEOUT = 10.0
MAX_CONNECTIONS = 64
"""Connections served at once (a thread each); more are refused at once."""
MAX_REASON = 4096


class EventKind(Enum):
    HANG = "hang"
    CONTROL = "control"
    CONFIGURATION = "configuration"
    """A rank's own code found the job's configuration unworkable (`ft_client.workload.CONFIGURATION_ERROR`)."""


@dataclass(frozen=True)
class LauncherEvent:
    kind: EventKind
    rank: int
    pid: int
    """The sender's pid (SO_PEERCRED): the monitor's for HANG, the rank's for CONTROL."""
    notice: HangNotice | None = None
    action: WorkloadAction | None = None
    reason: str = ""


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        if not self.server.slots.acquire(blocking=False):
            log.warning("launcher socket: refused a connection: %d already open", MAX_CONNECTIONS)
            self._send(wire.Error(wire.ErrorCode.BUSY, f"too many connections (at most {MAX_CONNECTIONS})"))
            return
        try:
            self._serve()
        finally:
            self.server.slots.release()

    def _serve(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(READ_TIMEOUT)
        cred = peer_credentials(sock)
        if cred.uid != os.geteuid():
            log.warning("launcher socket: refused pid %d with uid %d", cred.pid, cred.uid)
            self._send(wire.Error(wire.ErrorCode.FORBIDDEN, f"peer uid {cred.uid} differs from the launcher's"))
            return
        try:
            hello = wire.read_frame_blocking(self._recv_exact)
            if not isinstance(hello, wire.Hello) or hello.version != wire.PROTOCOL_VERSION:
                self._send(wire.Error(wire.ErrorCode.PROTOCOL, "expected HELLO with protocol version "
                                                               f"{wire.PROTOCOL_VERSION}"))
                return
            self._send(wire.HelloOk(wire.PROTOCOL_VERSION, {"launcher_pid": os.getpid()}))
            while True:
                msg = wire.read_frame_blocking(self._recv_exact)
                self._send(self.server.owner.accept(msg, hello, cred.pid))
        except (EOFError, ConnectionError, TimeoutError, OSError):
            return
        except wire.ProtocolError as e:
            log.warning("launcher socket: closing connection from pid %d: %s", cred.pid, e)
            self._send(wire.Error(wire.ErrorCode.PROTOCOL, str(e)))

    def _recv_exact(self, n: int) -> bytes:
        chunks = []
        while n:
            chunk = self.request.recv(n)
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def _send(self, msg: wire.Message) -> None:
        try:
            self.request.sendall(wire.encode(msg))
        except OSError:
            pass


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    owner: LauncherServer
    slots: threading.BoundedSemaphore


class LauncherServer:
    def __init__(self, path: str) -> None:
        self.path = path
        self.events: queue.Queue[LauncherEvent] = queue.Queue()
        old = os.umask(0o177)
        try:
            self._server = _Server(path, _Handler)
        finally:
            os.umask(old)
        self._server.owner = self
        self._server.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._is_monitor: Callable[[int], bool] = lambda pid: False
        self._is_worker: Callable[[int], bool] = lambda pid: False
        self._thread = threading.Thread(target=self._server.serve_forever, name="ft-launcher-socket", daemon=True)

    def authorize(self, *, monitor: Callable[[int], bool], worker: Callable[[int], bool]) -> None:
        """Who may report hangs (this launcher's monitors) and send workload requests (its workers)."""
        self._is_monitor = monitor
        self._is_worker = worker

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever, so only once it runs
            self._server.shutdown()
        self._server.server_close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def accept(self, msg: wire.Message, hello: wire.Hello, peer_pid: int) -> wire.Message:
        """Validate one request, queue its event, and return the reply (runs on a server thread).
        Nothing is acknowledged before every field and the sender are checked."""
        if isinstance(msg, wire.HangNotice) and hello.role == wire.Role.MONITOR:
            if not self._is_monitor(peer_pid):
                log.warning("launcher socket: refused a hang notice from pid %d, not one of this launcher's monitors",
                            peer_pid)
                return wire.Error(wire.ErrorCode.FORBIDDEN, "hang notices are taken from this launcher's monitors only")
            try:
                notice = HangNotice.from_wire(msg.notice)
            except NoticeError as e:
                log.warning("launcher socket: refused a hang notice from monitor pid %d: %s", peer_pid, printable(e))
                return wire.Error(wire.ErrorCode.BAD_REQUEST, str(e))
            self.events.put(LauncherEvent(EventKind.HANG, notice.rank, peer_pid, notice=notice))
            if notice.action == "inprocess":
                return wire.Ack({"action": "recorded_inprocess_restart"})
            if notice.action == "dump":
                return wire.Ack({"action": "diagnose"})
            return wire.Ack({"action": "stop_and_restart_worker_group"})
        if isinstance(msg, wire.Control) and hello.role == wire.Role.RANK:
            if not self._is_worker(peer_pid):
                log.warning("launcher socket: refused a workload request from pid %d, not a worker of this launcher",
                            peer_pid)
                return wire.Error(wire.ErrorCode.FORBIDDEN, "workload requests are taken from this launcher's "
                                                            "workers only")
            if len(msg.reason) > MAX_REASON:
                return wire.Error(wire.ErrorCode.BAD_REQUEST, f"reason longer than {MAX_REASON} characters")
            if msg.action == CONFIGURATION_ERROR:
                self.events.put(LauncherEvent(EventKind.CONFIGURATION, hello.rank, peer_pid, reason=msg.reason))
                return wire.Ack({"action": CONFIGURATION_ERROR})
            try:
                action = WorkloadAction.parse(msg.action)
            except ValueError as e:
                return wire.Error(wire.ErrorCode.BAD_REQUEST, str(e))
            self.events.put(LauncherEvent(EventKind.CONTROL, hello.rank, peer_pid, action=action, reason=msg.reason))
            return wire.Ack({"action": action.value})
        if isinstance(msg, wire.Ping):
            return wire.PONG
        return wire.Error(wire.ErrorCode.BAD_REQUEST, f"{type(msg).__name__} is not accepted from a {hello.role!r}")

    def drain(self) -> list[LauncherEvent]:
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out
