"""One client connection to the daemon: frames in, messages to the host, replies out.

The socket protocol only: decoding frames, the handshake deadline, an idle
observer's deadline, write-side flow control, and the pinned peer process until
the host takes it. What a message means is the host's (`ConnectionHost`, which
`daemon.MonitorDaemon` implements); a malformed frame closes this connection
with a logged reason and the host keeps serving.

The peer's process is pinned (pidfd) when it connects, so a HELLO sent after
that process exited cannot make the daemon watch a process that reused its pid.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import socket
import struct
import termios
from collections.abc import Sequence
from typing import Protocol

from ft_client import wire
from ft_monitor.daemon.clock import Clock, Timer
from ft_monitor.processes.procinfo import ProcessHandle, peer_credentials, peer_pidfd

log = logging.getLogger("ft_monitor.server")

OUTPUT_HIGH_WATER = 256 * 1024
"""Unsent reply bytes at which the daemon stops reading a peer's requests."""
MAX_OUTPUT = 1024 * 1024
"""Unsent reply bytes at which a peer that asks and never reads is dropped."""


class ConnectionLimits(Protocol):
    @property
    def handshake_timeout(self) -> float: ...
    @property
    def observer_idle_timeout(self) -> float: ...


class ConnectionHost(Protocol):
    """What a connection needs from the daemon (its only edge back to it)."""

    @property
    def clock(self) -> Clock: ...
    @property
    def config(self) -> ConnectionLimits: ...
    def admit(self, conn: Connection) -> None: ...
    def dispatch(self, conn: Connection, msg: wire.Message) -> None: ...
    def after_batch(self, conn: Connection) -> None: ...
    def disconnected(self, conn: Connection) -> None: ...


class Connection(asyncio.Protocol):
    def __init__(self, host: ConnectionHost) -> None:
        self.host = host
        self.decoder = wire.FrameDecoder()
        self.transport: asyncio.Transport | None = None
        self.pid = 0
        self.uid = -1
        self.role: str | None = None
        self.closing = False
        self.process: ProcessHandle | None = None
        """The peer's process, pinned at connect; handed to the host if it becomes the rank."""
        self.last_active = 0.0
        self._timer: Timer | None = None

    # -- asyncio.Protocol ----------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport subclasses
        self.transport.set_write_buffer_limits(high=OUTPUT_HIGH_WATER)  # type: ignore[union-attr]
        sock = transport.get_extra_info("socket")
        cred = peer_credentials(sock)
        self.pid, self.uid = cred.pid, cred.uid
        self.last_active = self.host.clock.now()
        if cred.uid != os.geteuid():
            log.warning("refused connection from pid %d: uid %d is not the monitor's uid %d",
                        cred.pid, cred.uid, os.geteuid())
            self.fail(wire.ErrorCode.FORBIDDEN, f"peer uid {cred.uid} differs from the monitor's uid {os.geteuid()}")
            return
        if cred.pid > 0:
            fd = peer_pidfd(sock)  # the very process that connected, even if its pid is reused by now
            self.process = ProcessHandle.adopt(cred.pid, fd) if fd is not None else ProcessHandle.open(cred.pid)
        self._timer = self.host.clock.call_later(self.host.config.handshake_timeout, self._hello_expired)
        self.host.admit(self)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        host = self.host
        try:
            for msg in self.decoder.feed(data):
                host.dispatch(self, msg)
                if self.closing:
                    return
        except wire.ProtocolError as e:
            log.warning("closing connection from pid %d: protocol error: %s", self.pid, e)
            self.fail(wire.ErrorCode.PROTOCOL, str(e))
            return
        host.after_batch(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.decoder.buffered and not self.closing:
            log.warning("connection from pid %d closed in the middle of a frame (%d bytes unread)",
                        self.pid, self.decoder.buffered)
        self.closing = True
        self._cancel_timer()
        self.host.disconnected(self)
        self.release_process()

    def pause_writing(self) -> None:
        """Replies pile up unread: read no more requests until they drain."""
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closing:
            self.transport.resume_reading()

    # -- for the host ----------------------------------------------------------
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

    def send_with_fd(self, msg: wire.Message, fd: int | Sequence[int]) -> bool:
        """Send ``msg`` with descriptor ``fd`` (or the descriptors, in order) attached to its
        first byte (SCM_RIGHTS), straight on the socket: the event loop's transport cannot pass
        descriptors, and doing it beside the transport keeps the stream's order only while
        nothing waits in the transport (a handshake's reply is a connection's first output).
        Returns False, having sent nothing, when it cannot be done; a part the socket did not
        take goes through the transport. The caller keeps its descriptors (the peer gets copies)."""
        fds = [fd] if isinstance(fd, int) else list(fd)
        t = self.transport
        if t is None or self.closing or t.get_write_buffer_size():
            return False
        raw = t.get_extra_info("socket")
        if raw is None:
            return False
        frame = wire.encode(msg)
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=raw.fileno())
        except OSError:
            return False
        try:
            sent = socket.send_fds(sock, [frame], fds, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except OSError as e:
            log.warning("cannot pass %s to pid %d: %s", "a descriptor" if len(fds) == 1 else f"{len(fds)} descriptors",
                        self.pid, e.strerror or e)
            return False
        finally:
            sock.detach()
        if sent < len(frame):
            t.write(frame[sent:])
        return True

    def fail(self, code: str, message: str) -> None:
        """Send an ERROR and close this connection (the daemon keeps serving)."""
        self.send(wire.Error(code, message))
        self.close()

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def hello_done(self, role: str) -> None:
        self.role = role
        self._cancel_timer()
        if role == wire.Role.OBSERVER:
            self.release_process()  # only a rank's process is ever signalled
            self._timer = self.host.clock.call_later(self.host.config.observer_idle_timeout, self._idle_check)

    def touch(self, now: float) -> None:
        self.last_active = now

    def take_process(self) -> ProcessHandle | None:
        """Hand the pinned process over (the rank's resources own it from now on)."""
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

    # -- timers ----------------------------------------------------------------
    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _hello_expired(self) -> None:
        self._timer = None
        if self.role is None and not self.closing:
            limit = self.host.config.handshake_timeout
            log.warning("closing connection from pid %d: no handshake within %.1fs", self.pid, limit)
            self.fail(wire.ErrorCode.PROTOCOL, f"no HELLO within {limit:.1f}s")

    def _idle_check(self) -> None:
        """An observer that asks nothing for observer_idle_timeout is closed (it holds a descriptor)."""
        self._timer = None
        if self.closing or self.role != wire.Role.OBSERVER:
            return
        limit = self.host.config.observer_idle_timeout
        idle = self.host.clock.now() - self.last_active
        if idle < limit:
            self._timer = self.host.clock.call_later(limit - idle, self._idle_check)
            return
        log.info("closing observer connection from pid %d: idle for %.1fs", self.pid, idle)
        self.fail(wire.ErrorCode.PROTOCOL, f"idle for {limit:.1f}s; closed")
