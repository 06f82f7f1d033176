"""``/metrics`` over HTTP for ft-launcher: one asyncio loop in one thread, capped and timed.

prometheus-client's own server (``start_http_server``) gives every connection a thread
and reads the request without a timeout. Anyone who could reach the port (another local
user, with the default ``127.0.0.1``) held idle connections until the launcher had 1024
descriptors and a thousand threads; at the next hang the launcher died of EMFILE instead
of restarting the job (issue 24, item 3). Here:

* **one thread** (``ft-metrics-http``) runs an asyncio loop; a connection is one socket the
  loop watches (``add_reader``/``add_writer``), never a thread; it is set up and closed in the
  accept itself, so the endpoint never holds more than its cap plus the one just accepted;
* **a connection cap** sized from RLIMIT_NOFILE (`connection_cap`, metrics_admission.py). The
  endpoint accepts its connections itself rather than through ``loop.create_server``: asyncio's
  server accepts up
  to ``backlog`` sockets per wake-up and gives each a transport a turn or two later, so a
  flood kept several bursts of accepted sockets open (the launcher's flood test once saw 171
  descriptors over its baseline with a cap of 64);
* **room for the scrapes at the cap** (issue 38: a 200-connection slowloris of another local
  user left 0 of 15 of the launcher's own user's scrapes answered, the cap being full of
  connections that never finished their request). What a new connection already sent is read
  in the accept: a complete request is answered there, without a slot if the answer goes out
  at once. One that must be held takes the slot of a connection that is slow (still waiting
  for its request head, or not taking its answer within `ANSWER_STALL_S`), chosen by
  `eviction_victim` (pure, metrics_admission.py): another user's before the launcher's own
  user's, the user holding the most connections first, the one waiting longest first. The owner
  of a local peer's socket is asked of the kernel (`PeerUids`, sock_diag netlink,
  metrics_peer.py); a connection of the launcher's own uid is never closed for another uid's.
  Only where nothing may give way is the new connection closed at once
  (``ft_metrics_connections_refused_total``);
* **deadlines**: the whole request head must arrive within ``read_timeout`` of the accept
  (a slowloris is cut there, not reset by each byte), and the answer must be taken within
  ``write_timeout``; one request per connection (``Connection: close``);
* **a bounded request**: the head (request line and headers) is at most
  `MAX_REQUEST_BYTES`; a body is never read; the head is parsed and answered by
  metrics_request.py (pure): prometheus-client's exposition, ``GET``/``HEAD`` of ``/`` and
  ``/metrics``, 404 for other paths, 405 for other methods, no gzip;
* `MetricsServer.stop` closes the listener and every connection and ends the thread.

The listening socket, the descriptor counts and a connection's state are metrics_sockets.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import struct
import threading
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ft_client.errors import FtError
from ft_monitor.launcher.telemetry.metrics_admission import ANSWER_STALL_S, connection_cap, eviction_victim
from ft_monitor.launcher.telemetry.metrics_peer import PeerUids
from ft_monitor.launcher.telemetry.metrics_request import (
    MAX_REQUEST_BYTES,
    HttpRequestError,
    Request,
    error_response,
    parse_request,
    respond,
    response,
)
from ft_monitor.launcher.telemetry.metrics_sockets import Connection, fd_limit, listening_socket, open_fds

log = logging.getLogger("ft_monitor.launcher")

READ_TIMEOUT_S = 5.0
"""From the accept to the end of the request head."""
WRITE_TIMEOUT_S = 10.0
"""From the answer to the peer having taken it."""
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


class MetricsServerError(FtError, OSError):
    """The /metrics server did not start (an OSError, as a port in use is: ft-launcher exits 2)."""


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
        self._conns: dict[int, Connection] = {}
        self._own_uid = os.geteuid()
        self._logged: set[str] = set()
        sock = listening_socket(address, port)
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
        c = Connection(sock, now, self._uids.uid(sock))
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

    def _on_readable(self, c: Connection) -> None:
        self._receive(c)
        if c.closed or c.out is None:
            return
        self._loop.remove_reader(c.fd)
        c.reading = False
        if c.timer is not None:
            c.timer.cancel()
        c.timer = self._loop.call_later(self.write_timeout, self._expired, c)
        self._on_writable(c)

    def _on_writable(self, c: Connection) -> None:
        self._send(c)
        if not c.closed and not c.writing:
            self._loop.add_writer(c.fd, self._on_writable, c)
            c.writing = True

    def _receive(self, c: Connection) -> None:
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

    def _ready(self, c: Connection, answer: bytes) -> None:
        c.buf = bytearray()
        c.out = memoryview(answer)
        c.answered_at = self._loop.time()

    def _send(self, c: Connection) -> None:
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

    def _expired(self, c: Connection) -> None:
        c.timer = None
        self.timed_out += 1
        self._close(c, abort=True)

    def _close(self, c: Connection, abort: bool = False) -> None:
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
            return response(500, b"the metrics could not be collected\n")

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
