"""The ``/metrics`` endpoint's HTTP: the request head read, the response written (pure).

The request head is untrusted: `parse_request` turns any bytes into a `Request` or an
`HttpRequestError` and nothing else; the head (request line and headers) is at most
`MAX_REQUEST_BYTES`, a body is never read. `respond` answers ``GET``/``HEAD`` of ``/`` and
``/metrics`` with prometheus-client's exposition (`choose_encoder` on the request's ``Accept``,
so Prometheus can ask for OpenMetrics), 404 for other paths, 405 for other methods, no gzip;
one request per connection (``Connection: close``). The server (metrics_http.py) reads and
writes the bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest

from ft_client.errors import FtError

MAX_REQUEST_BYTES = 8192
"""The request line and headers together (Prometheus sends about 300 bytes)."""

_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_METRICS_PATHS = ("/", "/metrics")
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 505: "HTTP Version Not Supported"}


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


def response(status: int, body: bytes, headers: tuple[tuple[str, str], ...] = (),
             content_type: str = "text/plain; charset=utf-8", send_body: bool = True) -> bytes:
    """The whole response: status line, headers and ``body`` (counted, not sent, for HEAD)."""
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}", f"Content-Type: {content_type}",
             f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body if send_body else b"")


def respond(request: Request, reg: CollectorRegistry) -> bytes:
    """The whole response to ``request``: the metrics of ``reg`` for GET and HEAD of ``/`` and
    ``/metrics``, else 404 or 405."""
    if request.method not in ("GET", "HEAD"):
        return response(405, b"use GET or HEAD\n", (("Allow", "GET, HEAD"),))
    if request.path not in _METRICS_PATHS:
        return response(404, b"not found; the metrics are at /metrics\n", send_body=request.method == "GET")
    encoder, content_type = _encoder(request.accept)
    return response(200, encoder(reg), content_type=content_type, send_body=request.method == "GET")


def error_response(e: HttpRequestError) -> bytes:
    return response(e.status, f"{e}\n".encode("latin-1", "replace"))
