"""A blocking Unix-socket connection to a monitor daemon, safe for training loops.

Owns the socket and its two kinds of traffic:

* events (fire-and-forget frames: heartbeat, section open/close) go out with one
  ``send(MSG_DONTWAIT)`` syscall and never block. If the daemon is not reading
  (stalled, stopped), unsent bytes wait in a bounded local buffer and go out
  with the next call; past the bound the connection is declared broken.
* requests (handshake, config update, status) are bounded by a timeout on both
  the send and the reply (SO_SNDTIMEO / SO_RCVTIMEO, so no extra poll syscall).

Thread-safe: one lock orders all frames. Raises `TransportBrokenError` when the
daemon went away, stopped answering or sent something malformed (`broken_reason`
says which), `TransportClosedError` when used after `close()`, and
`TransportError` when a connection cannot be made; the caller decides whether that
is fatal (see RankMonitorClient's on_monitor_lost).

Who it talks to is checked, not assumed: the socket path is resolved once
(`resolve_socket_path`: no symlink owned by another user on the way, the socket's
directory ours), and the process that accepted the connection must run as this
user (SO_PEERCRED). Another user who squats a socket directory gets nothing.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import stat
import struct
import threading
import time

from ft_client import wire
from ft_client.errors import FtError
from ft_client.wire.peer import peer_credentials

MAX_PENDING = 1 << 20
"""Bytes of events kept while the daemon does not read, before giving up on it."""
REPLY_SPIN_SECONDS = 200e-6
"""How long a request polls for its reply before blocking (see _recv_spinning)."""


MAX_KERNEL_TIMEOUT = 1e8
"""Seconds; longer request timeouts are clamped to this (struct timeval's range)."""
MAX_SYMLINKS = 40


class TransportError(FtError):
    """A connection to a monitor (or the launcher) could not be made or failed."""


class TransportClosedError(TransportError):
    """Used after this side closed the connection."""


class TransportBrokenError(TransportError):
    """The peer went away, stopped answering in time, or sent something malformed."""


class ConnectTimeoutError(TransportError, TimeoutError):
    """The monitor did not accept the connection in time (its accept queue stayed full)."""


def resolve_socket_path(path: str) -> str:
    """The real path of a monitor socket, refusing a route another user controls.

    Every symlink on the way must belong to this user or root (another user's
    symlink could point us at their impostor daemon), and the directory holding the
    socket must be this user's. Resolve once and reuse the result (reconnections
    then cannot be redirected).
    """
    me = os.geteuid()
    absolute = path if path.startswith("/") else os.path.join(os.getcwd(), path)
    parts = [p for p in absolute.split("/") if p]
    resolved = "/"
    hops = 0
    while parts:
        part = parts.pop(0)
        candidate = os.path.join(resolved, part)
        st = os.lstat(candidate)
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > MAX_SYMLINKS:
                raise TransportError(f"socket path {path}: too many symbolic links")
            if st.st_uid not in (0, me):
                raise TransportError(f"socket path {path} goes through the symbolic link {candidate}, owned by uid "
                                     f"{st.st_uid}, another user: refusing to follow it")
            target = os.readlink(candidate)
            if target.startswith("/"):
                resolved = "/"
            parts = [p for p in target.split("/") if p] + parts
            continue
        if part == "..":
            resolved = os.path.dirname(resolved)
        elif part != ".":
            resolved = candidate
    directory = os.path.dirname(resolved)
    owner = os.stat(directory).st_uid
    if owner != me:
        raise TransportError(f"socket directory {directory} belongs to uid {owner}, not to this user (uid {me}): "
                             "a monitor of yours never serves from there; another user may have taken the path")
    return resolved


def _connect(sock: socket.socket, path: str, timeout: float) -> None:
    """connect(), retried while the daemon's accept queue is full (EAGAIN on Unix sockets)."""
    end = time.monotonic() + timeout
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError as e:
            if time.monotonic() >= end:
                raise ConnectTimeoutError(
                    f"monitor at {path} did not accept the connection within {timeout:.1f}s") from e
            time.sleep(0.001)


def _timeval(seconds: float) -> bytes:
    sec = int(seconds)
    return struct.pack("ll", sec, int((seconds - sec) * 1e6))


class Transport:
    __slots__ = ("path", "timeout", "_sock", "_pending", "_lock", "closed", "broken_reason", "received_fd",
                 "refused")

    def __init__(self, path: str, timeout: float) -> None:
        self.path = resolve_socket_path(path)
        self.timeout = timeout
        self._pending = bytearray()
        self._lock = threading.Lock()
        self.closed = False
        self.broken_reason: str | None = None
        self.received_fd: int | None = None
        """A descriptor the peer passed with a reply read by `request(..., take_fd=True)`
        (SCM_RIGHTS); whoever takes it closes it."""
        self.refused: str | None = None
        """Why the monitor refused this connection's progress record (RECORD_REFUSED, a push
        that may come before a reply or on its own), until the client takes it."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            _connect(sock, self.path, timeout)
            cred = peer_credentials(sock)
            if cred.uid != os.geteuid():
                raise TransportError(f"the monitor at {self.path} runs as uid {cred.uid}, not as this user "
                                     f"(uid {os.geteuid()}): refusing to talk to it (another user may have taken "
                                     "the socket path)")
            sock.settimeout(None)  # blocking mode; bounded by the kernel timeouts below
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.set_timeout(timeout)

    def set_timeout(self, seconds: float) -> None:
        """Bound every later request (send and reply) by ``seconds``: the kernel's
        SO_SNDTIMEO / SO_RCVTIMEO, so no extra syscall per request."""
        self.timeout = seconds
        tv = _timeval(min(seconds, MAX_KERNEL_TIMEOUT))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)

    # -- events ----------------------------------------------------------------
    def io_busy(self) -> bool:
        """A send or a request is under way (another thread's, or the caller's own when a
        signal handler asks)."""
        return self._lock.locked()

    def send_event(self, frame: bytes) -> None:
        """Queue-free fast path: one non-blocking send. Never blocks the caller."""
        with self._lock:
            if self.closed:
                raise self._closed_error()
            if self._pending:
                self._flush_nowait()
                if self._pending:
                    self._buffer(frame)
                    return
            try:
                n = self._sock.send(frame, socket.MSG_DONTWAIT)
            except BlockingIOError:
                n = 0
            except OSError as e:
                self._break(f"monitor connection lost: {e.strerror or e}")
                raise TransportBrokenError(self.broken_reason) from e
            if n < len(frame):
                self._buffer(frame[n:])

    def _flush_nowait(self) -> None:
        try:
            n = self._sock.send(self._pending, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as e:
            self._break(f"monitor connection lost: {e.strerror or e}")
            raise TransportBrokenError(self.broken_reason) from e
        del self._pending[:n]

    def _buffer(self, data: bytes) -> None:
        self._pending += data
        if len(self._pending) > MAX_PENDING:
            self._break(f"monitor has not read {len(self._pending)} bytes of events; it is stalled")
            raise TransportBrokenError(self.broken_reason)

    # -- requests --------------------------------------------------------------
    def request(self, msg: wire.Message, *, take_fd: bool = False) -> wire.Message:
        """Send ``msg`` and return the daemon's reply, within the timeout. With
        ``take_fd``, a descriptor passed with the reply's first bytes is kept in
        `received_fd` (the handshake's progress record)."""
        frame = wire.encode(msg)
        with self._lock:
            if self.closed:
                raise self._closed_error()
            try:
                if self._pending:
                    self._sock.sendall(self._pending)
                    self._pending.clear()
                self._sock.sendall(frame)
                if take_fd:
                    return wire.read_frame_blocking(self._recv_exact_taking_fd)
                while True:  # a push read before the reply is kept for the client
                    reply = wire.read_frame_blocking(self._recv_exact)
                    if not isinstance(reply, wire.RecordRefused):
                        return reply
                    self.refused = reply.reason
            except (BlockingIOError, TimeoutError) as e:
                self._break(f"monitor did not answer within {self.timeout:.1f}s")
                raise TransportBrokenError(self.broken_reason) from e
            except wire.ProtocolError as e:
                self._break(f"monitor sent a malformed reply: {e}")
                raise TransportBrokenError(self.broken_reason) from e
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    self._break(f"monitor did not answer within {self.timeout:.1f}s")
                else:
                    self._break(f"monitor connection lost: {e.strerror or e}")
                raise TransportBrokenError(self.broken_reason) from e

    def _recv_exact(self, n: int) -> bytes:
        chunks = []
        while n:
            chunk = self._recv_spinning(n)
            if not chunk:
                raise TransportBrokenError("monitor closed the connection")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def _recv_exact_taking_fd(self, n: int) -> bytes:
        """As _recv_exact, its first receive with room for one passed descriptor (the
        kernel attaches it to the first byte of the message that carries it)."""
        if self.received_fd is not None:
            return self._recv_exact(n)
        data, fds, flags, _ = socket.recv_fds(self._sock, n, 1)
        if not data:
            for fd in fds:
                os.close(fd)
            raise TransportBrokenError("monitor closed the connection")
        keep = fds[:1]
        for fd in fds[1:]:
            os.close(fd)
        if keep and not flags & socket.MSG_CTRUNC:
            self.received_fd = keep[0]
        else:
            for fd in keep:
                os.close(fd)
            self.received_fd = -1  # nothing (more) to take from this reply
        rest = n - len(data)
        return data + self._recv_exact(rest) if rest else data

    def take_fd(self) -> int | None:
        """The descriptor received with the last `request(..., take_fd=True)` reply, once."""
        fd, self.received_fd = self.received_fd, None
        return fd if fd is not None and fd >= 0 else None

    def _recv_spinning(self, n: int) -> bytes:
        """A reply usually arrives within tens of microseconds: poll for it briefly,
        yielding the CPU, before sleeping in recv(); a sleeping reader pays a wake-up
        (a cross-CPU interrupt) on top of the daemon's work."""
        end = time.perf_counter() + REPLY_SPIN_SECONDS
        while True:
            try:
                return self._sock.recv(n, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() >= end:
                    return self._sock.recv(n)
                os.sched_yield()

    def flush(self) -> None:
        """Send buffered events, blocking up to the timeout."""
        with self._lock:
            if self._pending and not self.closed:
                try:
                    self._sock.sendall(self._pending)
                    self._pending.clear()
                except OSError as e:
                    self._break(f"monitor connection lost: {e.strerror or e}")
                    raise TransportBrokenError(self.broken_reason) from e

    # -- closing ---------------------------------------------------------------
    def _closed_error(self) -> TransportError:
        if self.broken_reason is not None:
            return TransportBrokenError(self.broken_reason)
        return TransportClosedError("connection closed")

    def _break(self, reason: str) -> None:
        self.broken_reason = reason
        self.closed = True
        try:
            self._sock.close()
        except OSError:
            pass

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in receive()
                except OSError:
                    pass
                self._sock.close()

    def receive(self) -> wire.Message:
        """Block until the daemon pushes a message (the control connection's reader
        thread; nothing else reads this connection). Raises TransportError when the
        connection ends or breaks."""
        self.set_timeout(0.0)  # no kernel timeout: pushes come when they come
        try:
            return wire.read_frame_blocking(self._recv_exact_blocking)
        except wire.ProtocolError as e:
            raise TransportBrokenError(f"monitor sent a malformed message: {e}") from e
        except OSError as e:
            raise TransportBrokenError(f"monitor connection lost: {e.strerror or e}") from e

    def _recv_exact_blocking(self, n: int) -> bytes:
        chunks = []
        while n:
            chunk = self._sock.recv(n)
            if not chunk:
                raise TransportBrokenError("monitor closed the connection")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def wait_hangup(self, poll_interval: float = 1.0, *, pushes: bool = False) -> bool:
        """Block until the daemon closes the connection (POLLRDHUP: replies waiting to be read
        do not wake it) or this side closes it: True. For a watcher thread: with a progress
        record the training thread may send nothing for a long time, so it would not notice.
        With ``pushes``, also return (False) once the monitor refused the record (`refused`:
        RECORD_REFUSED read here, or by a request that met it before its reply)."""
        p = select.poll()
        try:
            p.register(self._sock.fileno(), select.POLLRDHUP | (select.POLLIN if pushes else 0))
        except (OSError, ValueError):
            return True
        while not self.closed:
            if pushes and self.refused is not None:
                return False
            try:
                events = p.poll(int(poll_interval * 1000))
            except OSError:
                return True
            if any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in events):
                return True
            if events and pushes:
                self._read_push()
        return True

    def _read_push(self) -> None:
        """Read a RECORD_REFUSED waiting whole on the connection, unless a request is reading
        (it holds the lock and takes the push aside itself). Anything else the monitor sent
        unasked (an ERROR before it closes) is left where it is: the hangup follows."""
        if not self._lock.acquire(blocking=False):
            time.sleep(0.001)  # a request is reading its reply
            return
        try:
            if self.closed:
                return
            try:
                data = self._sock.recv(wire.HEADER_SIZE + MAX_PUSH, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                size = wire.frame_length(data) if len(data) >= wire.HEADER_SIZE else None
                whole = size is not None and len(data) >= wire.HEADER_SIZE + size
                msg = wire.decode_body(data[wire.HEADER_SIZE:wire.HEADER_SIZE + size]) if whole and size else None
            except (OSError, wire.ProtocolError):
                msg = None
            if not isinstance(msg, wire.RecordRefused) or size is None:
                time.sleep(0.01)  # not (yet) a whole push: a reader or the hangup takes it
                return
            self._sock.recv(wire.HEADER_SIZE + size, socket.MSG_DONTWAIT)
            self.refused = msg.reason
        finally:
            self._lock.release()

    def abandon(self) -> None:
        """Close without taking the lock: in a forked child, where another thread of the
        parent may have held it at fork time. Sends nothing."""
        self.closed = True
        self.broken_reason = "abandoned in a forked child"
        try:
            self._sock.close()
        except OSError:
            pass


MAX_PUSH = 4096
"""Bytes a RECORD_REFUSED push may take (the monitor cuts its reason to 512 characters)."""


def connect(path: str, timeout: float, role: str, rank: int, info: dict[str, object] | None = None, *,
            take_fd: bool = False) -> tuple[Transport, wire.HelloOk]:
    """Connect and handshake. Raises TransportError with the daemon's reason on refusal.
    With ``take_fd``, a descriptor the daemon passes with HELLO_OK (the progress record)
    waits in the transport's `take_fd()`."""
    t = Transport(path, timeout)
    try:
        reply = t.request(wire.Hello(wire.PROTOCOL_VERSION, role, rank, info or {}), take_fd=take_fd)
    except TransportError:
        _drop_fd(t)
        t.close()
        raise
    if isinstance(reply, wire.Error):
        _drop_fd(t)
        t.close()
        raise TransportError(f"monitor at {path} refused the connection ({reply.code}): {reply.message}")
    if not isinstance(reply, wire.HelloOk):
        _drop_fd(t)
        t.close()
        raise TransportError(f"monitor at {path} answered HELLO with {type(reply).__name__}")
    return t, reply


def _drop_fd(t: Transport) -> None:
    fd = t.take_fd()
    if fd is not None:
        os.close(fd)
