"""``/metrics`` over HTTP for ft-launcher: one asyncio loop in one thread, capped and timed.

prometheus-client's own server (``start_http_server``) gives every connection a thread
and reads the request without a timeout. Anyone who could reach the port (another local
user, with the default ``127.0.0.1``) held idle connections until the launcher had 1024
descriptors and a thousand threads; at the next hang the launcher died of EMFILE instead
of restarting the job (issue 24, item 3). Here:

* **one thread** (``ft-metrics-http``) runs an asyncio loop; a connection is a protocol
  object and one descriptor, never a thread;
* **a connection cap** sized from RLIMIT_NOFILE (`connection_cap`): over it, a new
  connection is closed at once, in the accept itself, and counted
  (``ft_metrics_connections_refused_total``). The endpoint accepts its connections itself
  rather than through ``loop.create_server``: asyncio's server accepts up to ``backlog``
  sockets per wake-up and gives each a transport a turn or two later, so a flood kept
  several bursts of accepted sockets open before any could be refused (the launcher's flood
  test once saw 171 descriptors over its baseline with a cap of 64). Here an accepted socket
  over the cap is closed before the next accept: the endpoint holds at most the cap plus one;
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
import errno
import logging
import os
import resource
import socket
import threading
from collections.abc import Callable
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
ACCEPT_BATCH = 64
"""Accepts per wake-up of the listener, so that a flood of connects leaves turns for the answers."""
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


class _Connection(asyncio.Protocol):
    """One connection: the head read within the read deadline, one answer, closed."""

    def __init__(self, server: MetricsServer) -> None:
        self.server = server
        self.holds_slot = True
        """Counted in the server's held connections until released (once)."""
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.answered = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.server._live.add(self)
        self.timer = self.server._loop.call_later(self.server.read_timeout, self._expired)

    def data_received(self, data: bytes) -> None:
        if self.answered:
            return
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > MAX_REQUEST_BYTES:
                self._answer(error_response(HttpRequestError(431, f"request head over {MAX_REQUEST_BYTES} bytes")))
            return
        try:
            request = parse_request(bytes(self.buf[:end + 4]))
        except HttpRequestError as e:
            self._answer(error_response(e))
            return
        self._answer(self.server._respond(request))

    def eof_received(self) -> bool:
        return False  # a half-closed peer gets nothing more: close

    def _answer(self, data: bytes) -> None:
        assert self.transport is not None
        self.answered = True
        self.buf.clear()
        self.transport.pause_reading()
        self.transport.write(data)
        self.transport.close()  # after the write is flushed
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.server._loop.call_later(self.server.write_timeout, self._expired)

    def _expired(self) -> None:
        self.server.timed_out += 1
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.server._release(self)


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
                ("ft_metrics_connections_refused", "Connections to /metrics closed at once: the cap was reached.",
                 s.refused),
                ("ft_metrics_connections_timed_out", "Connections to /metrics closed at their read or write "
                 "deadline.", s.timed_out)):
            c = CounterMetricFamily(name, text)
            c.add_metric([], value)
            yield c


class MetricsServer:
    """``/metrics`` of ``reg`` on ``address:port``, served by one thread (``ft-metrics-http``).

    ``max_connections`` None: `connection_cap` of the descriptor limit and the descriptors open
    now. The endpoint's own counters are registered in ``reg`` (so the textfile has them too).
    Bind errors are raised here, as OSError."""

    def __init__(self, reg: CollectorRegistry, address: str, port: int, *, max_connections: int | None = None,
                 read_timeout: float = READ_TIMEOUT_S, write_timeout: float = WRITE_TIMEOUT_S) -> None:
        self.reg = reg
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.max_connections = max_connections if max_connections is not None else \
            connection_cap(fd_limit(), open_fds())
        self.accepted = self.refused = self.timed_out = 0
        self._held = 0
        """Connections admitted and not yet released, their transports made or on the way."""
        self._live: set[_Connection] = set()
        self._starting: set[asyncio.Task[None]] = set()
        self._resource_logged = False
        sock = _listening_socket(address, port)
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
        return len(self._live)

    # -- on the loop's thread ------------------------------------------------------------------
    def _on_listener_readable(self, sock: socket.socket) -> None:
        """Accept what waits (at most `ACCEPT_BATCH`): over the cap, or while stopping, the
        socket is closed here and counted; under it, it is admitted and given a transport."""
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as e:
                self._rest_listener(sock, e)
                return
            if self._stopping is None or self._stopping.is_set() or self._held >= self.max_connections:
                conn.close()
                self.refused += 1
                if self.refused == 1:
                    log.warning("ft-launcher: /metrics has %d connections open, its cap; further ones are "
                                "closed at once and counted (ft_metrics_connections_refused_total)",
                                self.max_connections)
                continue
            self._held += 1
            self.accepted += 1
            task = self._loop.create_task(self._start_connection(conn, _Connection(self)))
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    def _rest_listener(self, sock: socket.socket, e: OSError) -> None:
        """An accept that failed for another reason than an empty queue: for want of descriptors
        or memory the listener rests `ACCEPT_RETRY_S` (Linux keeps saying it is readable);
        anything else is logged and the next wake-up tries again."""
        if not self._resource_logged:
            self._resource_logged = True
            log.warning("ft-launcher: /metrics could not accept a connection: %s", e)
        if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            self._loop.remove_reader(sock.fileno())
            self._loop.call_later(ACCEPT_RETRY_S, self._listen, sock)

    def _listen(self, sock: socket.socket) -> None:
        if self._stopping is not None and not self._stopping.is_set() and sock.fileno() >= 0:
            self._loop.add_reader(sock.fileno(), self._on_listener_readable, sock)

    async def _start_connection(self, conn: socket.socket, protocol: _Connection) -> None:
        try:
            conn.setblocking(False)
            await self._loop.connect_accepted_socket(lambda: protocol, sock=conn)
        except Exception:  # noqa: BLE001 - a peer gone before its transport was made: one socket less
            conn.close()
            self._release(protocol)

    def _release(self, conn: _Connection) -> None:
        self._live.discard(conn)
        if conn.holds_slot:
            conn.holds_slot = False
            self._held -= 1

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
            sock.close()
            self._started.set()
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _serve(self, sock: socket.socket) -> None:
        self._stopping = asyncio.Event()
        sock.listen(self.max_connections)
        self._listen(sock)
        self._started.set()
        try:
            await self._stopping.wait()
        finally:
            self._loop.remove_reader(sock.fileno())
            if self._starting:
                await asyncio.wait(list(self._starting), timeout=5.0)
            for conn in list(self._live):
                if conn.transport is not None:
                    conn.transport.abort()
            for _ in range(100):  # connection_lost runs on the next turns of the loop
                if not self._live:
                    break
                await asyncio.sleep(0)

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
