"""``/metrics`` over HTTP for ft-launcher: one asyncio loop in one thread, capped and timed.

prometheus-client's own server (``start_http_server``) gives every connection a thread
and reads the request without a timeout. Anyone who could reach the port (another local
user, with the default ``127.0.0.1``) held idle connections until the launcher had 1024
descriptors and a thousand threads; at the next hang the launcher died of EMFILE instead
of restarting the job (issue 24, item 3). Here:

* **one thread** (``ft-metrics-http``) runs an asyncio loop; a connection is one socket the
  loop watches (``add_reader``/``add_writer``), never a thread; it is set up and closed in the
  accept itself, so the endpoint never holds more than its cap plus the one just accepted;
* **a connection cap** sized from RLIMIT_NOFILE (`connection_cap`). The endpoint accepts its
  connections itself rather than through ``loop.create_server``: asyncio's server accepts up
  to ``backlog`` sockets per wake-up and gives each a transport a turn or two later, so a
  flood kept several bursts of accepted sockets open (the launcher's flood test once saw 171
  descriptors over its baseline with a cap of 64);
* **room for the scrapes at the cap** (issue 38: a 200-connection slowloris of another local
  user left 0 of 15 of the launcher's own user's scrapes answered, the cap being full of
  connections that never finished their request). What a new connection already sent is read
  in the accept: a complete request is answered there, without a slot if the answer goes out
  at once. One that must be held takes the slot of a connection that is slow (still waiting
  for its request head, or not taking its answer within `ANSWER_STALL_S`), chosen by
  `eviction_victim` (pure): another user's before the launcher's own user's, the user holding
  the most connections first, the one waiting longest first. The owner of a local peer's
  socket is asked of the kernel (`PeerUids`, sock_diag netlink); a connection of the
  launcher's own uid is never closed for another uid's. Only where nothing may give way is the
  new connection closed at once (``ft_metrics_connections_refused_total``);
* **deadlines**: the whole request head must arrive within ``read_timeout`` of the accept
  (a slowloris is cut there, not reset by each byte), and the answer must be taken within
  ``write_timeout``; one request per connection (``Connection: close``);
* **a bounded request**: the head (request line and headers) is at most
  `MAX_REQUEST_BYTES`; a body is never read;
* the exposition is prometheus-client's (`choose_encoder` on the request's ``Accept``,
  so Prometheus can ask for OpenMetrics); ``GET``/``HEAD`` of ``/`` and ``/metrics``, 404
  for other paths, 405 for other methods, no gzip;
* `MetricsServer.stop` closes the listener and every connection and ends the thread.

The request head is untrusted: `parse_request` turns any bytes into a `Request` or an
`HttpRequestError` and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest
from prometheus_client.registry import Collector

from ft_client.errors import FtError

log = logging.getLogger("ft_monitor.launcher")

MAX_CONNECTIONS = 64
"""The most connections served at once, whatever the descriptor limit allows."""
RESTART_FD_RESERVE = 256
"""Descriptors the endpoint never takes: what the launcher needs beyond those it holds when
the endpoint starts, to stop and start the job again (each worker's pipes, log files and
pidfd, its monitor's connection and pidfd, torch's store and rendezvous sockets, the hang
report and dumps it reads). A two-rank job's launcher holds about 20 once its workers run
(19 in tests/test_metrics_http.py's flood test), so 256 leaves room for many more ranks and
for what a restart opens before it closes the old ones."""
MAX_REQUEST_BYTES = 8192
"""The request line and headers together (Prometheus sends about 300 bytes)."""
READ_TIMEOUT_S = 5.0
"""From the accept to the end of the request head."""
WRITE_TIMEOUT_S = 10.0
"""From the answer to the peer having taken it."""
ANSWER_STALL_S = 1.0
"""An answer not taken this long after it was ready (a peer that reads slowly or not at all):
its connection may give way to a new one at the cap (`eviction_victim`)."""
ACCEPT_BATCH = 64
"""Accepts per wake-up of the listener, so that a flood of connects leaves turns for the answers."""
LISTEN_BACKLOG = 1024
"""Connections the kernel completes and queues for the accept (no descriptor of ours until then):
room for a scrape beside a flood of connects, whose SYN would otherwise be dropped at a full
queue and sent again only a second later."""
RECV_BYTES = 65536
"""What one read of a connection takes (more than `MAX_REQUEST_BYTES`)."""
ACCEPT_RETRY_S = 1.0
"""How long the listener rests after an accept failed for want of descriptors or memory."""

_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_METRICS_PATHS = ("/", "/metrics")
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 505: "HTTP Version Not Supported"}


class MetricsServerError(FtError, OSError):
    """The /metrics server did not start (an OSError, as a port in use is: ft-launcher exits 2)."""


class HttpRequestError(FtError, ValueError):
    """A request head that is not one we answer; ``status`` is the HTTP status to send."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    """The target without its query (the query is ignored)."""
    accept: str
    """The Accept header(s), joined with ``,``; empty when none was sent."""


def _is_token(s: str) -> bool:
    return bool(s) and all(c in _TOKEN for c in s)


def parse_request(head: bytes) -> Request:
    """The request in ``head`` (the bytes up to and including the blank line), or
    `HttpRequestError`; nothing else is raised, whatever the bytes (pure)."""
    if len(head) > MAX_REQUEST_BYTES:
        raise HttpRequestError(431, f"request head of {len(head)} bytes; at most {MAX_REQUEST_BYTES}")
    if not head.endswith(b"\r\n\r\n"):
        raise HttpRequestError(400, "the request head does not end with an empty line")
    text = head[:-4].decode("latin-1")  # every byte decodes; non-ASCII is refused below where it matters
    request_line, *header_lines = text.split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3:
        raise HttpRequestError(400, "the request line is not METHOD TARGET VERSION")
    method, target, version = parts
    if not _is_token(method):
        raise HttpRequestError(400, "the method is not a token")
    if len(version) != 8 or not version.startswith("HTTP/") or not version[5:6].isdigit() \
            or version[6] != "." or not version[7].isdigit():
        raise HttpRequestError(400, "the version is not HTTP/x.y")
    if version[5] != "1":
        raise HttpRequestError(505, f"{version} is not supported; use HTTP/1.0 or HTTP/1.1")
    if not target.startswith("/") or not target.isascii() or not target.isprintable():
        raise HttpRequestError(400, "the target is not an absolute path")
    accept: list[str] = []
    for line in header_lines:
        name, sep, value = line.partition(":")
        if not sep or not _is_token(name):
            raise HttpRequestError(400, "a header line is not NAME: VALUE")
        if name.lower() == "accept":
            accept.append(value.strip(" \t"))
    return Request(method, target.split("?", 1)[0], ",".join(accept))


def _encoder(accept: str) -> tuple[Callable[[CollectorRegistry], bytes], str]:
    """prometheus-client's choice of format for ``accept``; its text format where the header
    cannot be understood (choose_encoder parses versions it does not check)."""
    try:
        return choose_encoder(accept)
    except Exception:  # noqa: BLE001 - an untrusted header must not decide whether we answer
        return generate_latest, CONTENT_TYPE_PLAIN_0_0_4


def _response(status: int, body: bytes, headers: tuple[tuple[str, str], ...] = (),
              content_type: str = "text/plain; charset=utf-8", send_body: bool = True) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}", f"Content-Type: {content_type}",
             f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body if send_body else b"")


def respond(request: Request, reg: CollectorRegistry) -> bytes:
    """The whole response to ``request``: the metrics of ``reg`` for GET and HEAD of ``/`` and
    ``/metrics``, else 404 or 405."""
    if request.method not in ("GET", "HEAD"):
        return _response(405, b"use GET or HEAD\n", (("Allow", "GET, HEAD"),))
    if request.path not in _METRICS_PATHS:
        return _response(404, b"not found; the metrics are at /metrics\n", send_body=request.method == "GET")
    encoder, content_type = _encoder(request.accept)
    return _response(200, encoder(reg), content_type=content_type, send_body=request.method == "GET")


def error_response(e: HttpRequestError) -> bytes:
    return _response(e.status, f"{e}\n".encode("latin-1", "replace"))


def open_fds() -> int:
    """Descriptors open in this process now (0 where /proc cannot say)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    except OSError:
        return 0


def fd_limit() -> int:
    """The soft RLIMIT_NOFILE (what EMFILE is measured against)."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return 1024
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_cap(limit: int, open_now: int, wanted: int = MAX_CONNECTIONS,
                   reserve: int = RESTART_FD_RESERVE) -> int:
    """How many connections the endpoint may hold (pure): what is left of ``limit`` after the
    descriptors open now, the restart reserve and the one socket accepted over the cap before
    it is closed; at most ``wanted``, at least 1."""
    return max(1, min(wanted, limit - open_now - reserve - 1))


def _listening_socket(address: str, port: int) -> socket.socket:
    """Bound here, in the caller's thread, so that a port in use is an OSError at start."""
    infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


# -- which connection gives way at the cap (pure) --------------------------------------------------
@dataclass(frozen=True, slots=True)
class Held:
    """What `eviction_victim` sees of a connection the endpoint holds."""

    accepted_at: float
    answered_at: float | None
    """When its answer was ready; None while its request head is still awaited."""
    uid: int | None
    """The owner of the peer's socket (a peer on this host, `PeerUids`); None: not known."""


def eviction_victim(held: Sequence[Held], newcomer_uid: int | None, own_uid: int, now: float,
                    stall_s: float = ANSWER_STALL_S) -> int | None:
    """The index in ``held`` of the connection to close so that a new connection (of peer uid
    ``newcomer_uid``) can be served, the endpoint being at its cap; None: none may be closed,
    the new one is refused (pure; ``now`` is the loop's clock, as ``held``'s times).

    * a connection of the launcher's own uid (``own_uid``) is never closed for another uid's
      (or an unknown peer's); a new one of the launcher's uid may close any other uid's;
    * otherwise only a connection that is still waiting for its request head, or whose answer
      has not been taken within ``stall_s``, may be closed: a complete request from a peer that
      reads its answer is always served;
    * among those: another uid's before the launcher's own, then the uid holding the most
      connections (a flood pays for itself before a lone scraper does), then one waiting for
      its head before a stalled answer before a fresh one, then the one waiting longest
      (from its accept, or from its answer)."""
    own_newcomer = newcomer_uid is not None and newcomer_uid == own_uid
    counts = Counter(h.uid for h in held)
    best: tuple[bool, int, int, float, int] | None = None
    for i, h in enumerate(held):
        own = h.uid is not None and h.uid == own_uid
        if own and not own_newcomer:
            continue
        if h.answered_at is None:
            phase, since = 0, h.accepted_at
        elif now - h.answered_at >= stall_s:
            phase, since = 1, h.answered_at
        elif own_newcomer and not own:
            phase, since = 2, h.answered_at
        else:
            continue
        key = (own, -counts[h.uid], phase, since, i)
        if best is None or key < best:
            best = key
    return None if best is None else best[-1]


# -- whose socket is the peer's (sock_diag netlink) ------------------------------------------------
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG = struct.Struct("=IHHII")
"""nlmsghdr: length, type, flags, sequence, port id."""
_DIAG_REQ = struct.Struct("=BBBxI")
"""inet_diag_req_v2 before its socket id: family, protocol, extensions, pad, states."""
_DIAG_MSG = struct.Struct("=BBBB")
"""inet_diag_msg before its socket id: family, state, timer, retransmits."""
_SOCKID_PORTS = struct.Struct(">HH")
_SOCKID_TAIL = struct.Struct("=III")
"""inet_diag_sockid after the addresses: interface, cookie (INET_DIAG_NOCOOKIE: any)."""
_DIAG_UID_INODE = struct.Struct("=II")
_DIAG_UID_OFFSET = _DIAG_MSG.size + 48 + 12
"""inet_diag_msg: header, socket id (48 bytes), expires, rqueue, wqueue, then uid and inode."""
_TCP_LISTEN = 10


def diag_request(family: int, peer: tuple[Any, ...], local: tuple[Any, ...], seq: int) -> bytes:
    """A sock_diag request for the one TCP socket whose own address is ``peer`` and whose peer is
    ``local`` (the other end of a connection we accepted: getpeername, getsockname); ValueError
    or OSError for an address it cannot be made for (pure)."""
    src = socket.inet_pton(family, peer[0]).ljust(16, b"\0")
    dst = socket.inet_pton(family, local[0]).ljust(16, b"\0")
    body = (_DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF) + _SOCKID_PORTS.pack(peer[1], local[1])
            + src + dst + _SOCKID_TAIL.pack(0, 0xFFFFFFFF, 0xFFFFFFFF))
    return _NLMSG.pack(_NLMSG.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, seq, 0) + body


def diag_uid(reply: bytes, seq: int, peer_port: int, local_port: int) -> int | None:
    """The socket owner's uid in the kernel's ``reply`` to request ``seq``; None for anything
    else: an error (no such socket: the peer is on another host or in another network
    namespace), a reply to another request, a socket with other ports, a listener, or a socket
    no process holds (a timewait or request minisock, whose uid the kernel reports as 0) (pure)."""
    off = 0
    while off + _NLMSG.size <= len(reply):
        length, kind, _, rseq, _ = _NLMSG.unpack_from(reply, off)
        if length < _NLMSG.size or off + length > len(reply):
            return None
        if rseq == seq:
            msg = off + _NLMSG.size
            if kind != _SOCK_DIAG_BY_FAMILY or length < _NLMSG.size + _DIAG_UID_OFFSET + _DIAG_UID_INODE.size:
                return None
            _, state, _, _ = _DIAG_MSG.unpack_from(reply, msg)
            sport, dport = _SOCKID_PORTS.unpack_from(reply, msg + _DIAG_MSG.size)
            uid, inode = _DIAG_UID_INODE.unpack_from(reply, msg + _DIAG_UID_OFFSET)
            if sport != peer_port or dport != local_port or state == _TCP_LISTEN or inode == 0:
                return None
            return int(uid)
        off += (length + 3) & ~3
    return None


class PeerUids:
    """The uid owning the other end of an accepted TCP connection whose peer is on this host, asked
    of the kernel for that one socket (NETLINK_SOCK_DIAG, as ``ss`` does; no scan of
    /proc/net/tcp, whose size another user could inflate). None where it cannot say: a peer on
    another host, no netlink (not Linux, a sandbox), any error. One descriptor, opened here."""

    def __init__(self) -> None:
        self._seq = 0
        self._sock: socket.socket | None = None
        try:
            self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG)
            self._sock.setblocking(False)
        except (OSError, AttributeError):
            if self._sock is not None:
                self._sock.close()
            self._sock = None

    def uid(self, conn: socket.socket) -> int | None:
        if self._sock is None or conn.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        try:
            peer, local = conn.getpeername(), conn.getsockname()
            request = diag_request(conn.family, peer, local, self._seq)
            while True:  # a reply left behind by an earlier error
                try:
                    self._sock.recv(65536)
                except BlockingIOError:
                    break
            self._sock.send(request)
            for _ in range(4):  # the kernel answers within the send
                found = diag_uid(self._sock.recv(65536), self._seq, int(peer[1]), int(local[1]))
                if found is not None:
                    return found
        except (OSError, ValueError):
            pass
        return None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


# -- one connection -----------------------------------------------------------------------------------
class _Connection:
    """One connection: its request head read within the read deadline, one answer sent within
    the write deadline, closed. The server reads and writes it itself (non-blocking, with the
    loop's add_reader and add_writer): it is set up, and closed, at once, in the accept."""

    __slots__ = ("sock", "fd", "accepted_at", "answered_at", "uid", "buf", "out", "timer",
                 "reading", "writing", "closed")

    def __init__(self, sock: socket.socket, accepted_at: float, uid: int | None) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.accepted_at = accepted_at
        self.answered_at: float | None = None
        self.uid = uid
        self.buf = bytearray()
        self.out: memoryview | None = None
        """The answer's part not yet sent; None until the request head is complete."""
        self.timer: asyncio.TimerHandle | None = None
        self.reading = self.writing = self.closed = False

    def held(self) -> Held:
        return Held(self.accepted_at, self.answered_at, self.uid)


class _ServerStats(Collector):
    """The endpoint's own counters, beside the job's metrics."""

    def __init__(self, server: MetricsServer) -> None:
        self.server = server

    def collect(self) -> Any:
        s = self.server
        cap = GaugeMetricFamily("ft_metrics_connections_max", "Connections /metrics serves at once (sized from "
                                "the launcher's descriptor limit).")
        cap.add_metric([], s.max_connections)
        yield cap
        for name, text, value in (
                ("ft_metrics_connections_accepted", "Connections to /metrics admitted.", s.accepted),
                ("ft_metrics_connections_refused", "Connections to /metrics closed at once: the cap was reached "
                 "and no connection could give way.", s.refused),
                ("ft_metrics_connections_evicted", "Connections to /metrics closed to make room for a new one at "
                 "the cap (waiting for their request head, or not taking their answer).", s.evicted),
                ("ft_metrics_connections_timed_out", "Connections to /metrics closed at their read or write "
                 "deadline.", s.timed_out)):
            c = CounterMetricFamily(name, text)
            c.add_metric([], value)
            yield c


class MetricsServer:
    """``/metrics`` of ``reg`` on ``address:port``, served by one thread (``ft-metrics-http``).

    ``max_connections`` None: `connection_cap` of the descriptor limit and the descriptors open
    once the listener is bound. ``answer_stall``: see `eviction_victim`. The endpoint's own
    counters are registered in ``reg`` (so the textfile has them too). Bind errors are raised
    here, as OSError."""

    def __init__(self, reg: CollectorRegistry, address: str, port: int, *, max_connections: int | None = None,
                 read_timeout: float = READ_TIMEOUT_S, write_timeout: float = WRITE_TIMEOUT_S,
                 answer_stall: float = ANSWER_STALL_S) -> None:
        self.reg = reg
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.answer_stall = answer_stall
        self.accepted = self.refused = self.evicted = self.timed_out = 0
        self._conns: dict[int, _Connection] = {}
        self._own_uid = os.geteuid()
        self._logged: set[str] = set()
        sock = _listening_socket(address, port)
        self._uids = PeerUids()
        self.max_connections = max_connections if max_connections is not None else \
            connection_cap(fd_limit(), open_fds())
        self.port = int(sock.getsockname()[1])
        host = f"[{address}]" if ":" in address else address
        self.url = f"http://{host}:{self.port}/metrics"
        self._loop = asyncio.new_event_loop()
        self._stopping: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(sock,), name="ft-metrics-http", daemon=True)
        self._thread.start()
        if not self._started.wait(30.0) or self._error is not None:
            self.stop()
            raise MetricsServerError(f"the /metrics server did not start: {self._error or 'no answer within 30 s'}")
        reg.register(_ServerStats(self))

    @property
    def connections(self) -> int:
        """Connections held now."""
        return len(self._conns)

    def _log_once(self, what: str, message: str, *args: object) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(message, *args)

    # -- on the loop's thread ------------------------------------------------------------------
    def _on_listener_readable(self, sock: socket.socket) -> None:
        """Accept what waits (at most `ACCEPT_BATCH`), each to `_admit` (closed and counted while stopping)."""
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as e:
                self._rest_listener(sock, e)
                return
            if self._stopping is None or self._stopping.is_set():
                conn.close()
                self.refused += 1
                continue
            try:
                self._admit(conn)
            except Exception:  # noqa: BLE001 - a bug here must cost one connection, not the listener
                log.exception("ft-launcher: /metrics could not take a connection")
                if all(c.sock is not conn for c in self._conns.values()):
                    conn.close()

    def _admit(self, sock: socket.socket) -> None:
        """A connection just accepted: what it already sent is read (a quick client's whole request,
        often: then it is answered here, and closed if the answer went out at once). If it must be
        held and the cap is reached, `eviction_victim` chooses a connection to close for it, or it is
        closed (refused). The endpoint never holds more than the cap, plus this one for a moment."""
        now = self._loop.time()
        try:
            sock.setblocking(False)
        except OSError:
            sock.close()
            self.refused += 1
            return
        c = _Connection(sock, now, self._uids.uid(sock))
        self.accepted += 1  # counted in its own answer, as it is in the next ones
        self._receive(c)
        if c.out is not None and not c.closed:
            self._send(c)
        if not c.closed and len(self._conns) >= self.max_connections:
            held = list(self._conns.values())
            victim = eviction_victim([h.held() for h in held], c.uid, self._own_uid, now, self.answer_stall)
            if victim is None:
                self._close(c, abort=True)
                self.accepted -= 1
                self.refused += 1
                self._log_once("refused", "ft-launcher: /metrics has %d connections open, its cap, and none can give "
                               "way; further ones are closed at once and counted "
                               "(ft_metrics_connections_refused_total)", self.max_connections)
                return
            gone = held[victim]
            self._close(gone, abort=True)
            self.evicted += 1
            self._log_once("evicted", "ft-launcher: /metrics has %d connections open, its cap; each new one now "
                           "closes one that is slow to send its request or take its answer, another user's first "
                           "(ft_metrics_connections_evicted_total); the first closed was of uid %s",
                           self.max_connections, "unknown" if gone.uid is None else gone.uid)
        if c.closed:
            return
        self._conns[c.fd] = c
        if c.out is None:
            c.timer = self._loop.call_later(self.read_timeout, self._expired, c)
            self._loop.add_reader(c.fd, self._on_readable, c)
            c.reading = True
        else:
            c.timer = self._loop.call_later(self.write_timeout, self._expired, c)
            self._loop.add_writer(c.fd, self._on_writable, c)
            c.writing = True

    def _on_readable(self, c: _Connection) -> None:
        self._receive(c)
        if c.closed or c.out is None:
            return
        self._loop.remove_reader(c.fd)
        c.reading = False
        if c.timer is not None:
            c.timer.cancel()
        c.timer = self._loop.call_later(self.write_timeout, self._expired, c)
        self._on_writable(c)

    def _on_writable(self, c: _Connection) -> None:
        self._send(c)
        if not c.closed and not c.writing:
            self._loop.add_writer(c.fd, self._on_writable, c)
            c.writing = True

    def _receive(self, c: _Connection) -> None:
        """Read what arrived; once the head is complete (or refused), ``c.out`` is the answer. A
        peer that closed or reset gets nothing more: closed."""
        try:
            data = c.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(c)
            return
        if not data:
            self._close(c)
            return
        c.buf += data
        end = c.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(c.buf) > MAX_REQUEST_BYTES:
                self._ready(c, error_response(HttpRequestError(431, f"request head over {MAX_REQUEST_BYTES} bytes")))
            return
        try:
            request = parse_request(bytes(c.buf[:end + 4]))
        except HttpRequestError as e:
            self._ready(c, error_response(e))
            return
        self._ready(c, self._respond(request))

    def _ready(self, c: _Connection, answer: bytes) -> None:
        c.buf = bytearray()
        c.out = memoryview(answer)
        c.answered_at = self._loop.time()

    def _send(self, c: _Connection) -> None:
        """Send what the socket takes of the answer; all of it taken: closed (the kernel sends the
        rest, then the FIN)."""
        assert c.out is not None
        try:
            sent = c.sock.send(c.out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(c)
            return
        c.out = c.out[sent:]
        if not c.out:
            self._close(c)

    def _expired(self, c: _Connection) -> None:
        c.timer = None
        self.timed_out += 1
        self._close(c, abort=True)

    def _close(self, c: _Connection, abort: bool = False) -> None:
        """Closed now, its descriptor freed (``abort``: an answer not yet taken is dropped, with a
        reset, rather than left to the kernel to send)."""
        if c.closed:
            return
        c.closed = True
        if c.reading:
            self._loop.remove_reader(c.fd)
        if c.writing:
            self._loop.remove_writer(c.fd)
        if c.timer is not None:
            c.timer.cancel()
        if abort and c.out is not None and c.out:
            with contextlib.suppress(OSError):
                c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.sock.close()
        if self._conns.get(c.fd) is c:
            del self._conns[c.fd]

    def _rest_listener(self, sock: socket.socket, e: OSError) -> None:
        """An accept that failed for another reason than an empty queue: for want of descriptors
        or memory the listener rests `ACCEPT_RETRY_S` (Linux keeps saying it is readable);
        anything else is logged and the next wake-up tries again."""
        self._log_once("accept", "ft-launcher: /metrics could not accept a connection: %s", e)
        if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            self._loop.remove_reader(sock.fileno())
            self._loop.call_later(ACCEPT_RETRY_S, self._listen, sock)

    def _listen(self, sock: socket.socket) -> None:
        if self._stopping is not None and not self._stopping.is_set() and sock.fileno() >= 0:
            self._loop.add_reader(sock.fileno(), self._on_listener_readable, sock)

    def _respond(self, request: Request) -> bytes:
        try:
            return respond(request, self.reg)
        except Exception:  # noqa: BLE001 - a collector's bug is one 500, not the end of the endpoint
            log.exception("ft-launcher: /metrics could not be collected")
            return _response(500, b"the metrics could not be collected\n")

    def _run(self, sock: socket.socket) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve(sock))
        except BaseException as e:  # noqa: BLE001 - reported to the starting thread, or logged
            if not self._started.is_set():
                self._error = e
            else:
                log.exception("ft-launcher: the /metrics server stopped")
        finally:
            for c in list(self._conns.values()):
                self._close(c, abort=True)
            sock.close()
            self._uids.close()
            self._started.set()
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _serve(self, sock: socket.socket) -> None:
        self._stopping = asyncio.Event()
        sock.listen(LISTEN_BACKLOG)
        self._listen(sock)
        self._started.set()
        try:
            await self._stopping.wait()
        finally:
            self._loop.remove_reader(sock.fileno())
            for c in list(self._conns.values()):
                self._close(c, abort=True)

    # -- from any thread -----------------------------------------------------------------------
    def stop(self) -> None:
        """Close the listener and every connection, end the thread (bounded: 5 s)."""
        if self._thread.is_alive() and not self._loop.is_closed():
            stopping = self._stopping
            if stopping is not None:
                try:
                    self._loop.call_soon_threadsafe(stopping.set)
                except RuntimeError:  # the loop closed in between
                    pass
        self._thread.join(5.0)
        if self._thread.is_alive():
            log.warning("ft-launcher: the /metrics thread did not end within 5 s")
