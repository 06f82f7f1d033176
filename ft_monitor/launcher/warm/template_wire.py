"""The bytes between the launcher and its worker template: one frame each way per connection.

A frame is a 4-byte big-endian length and that many bytes of msgpack (a map); descriptors
travel with a frame's first byte (SCM_RIGHTS). Decoding refuses extension types and yields
only None, bool, int, float, str, bytes, list and dict, as ``ft_client.wire`` does; what the
maps may hold is `ft_monitor.core.template_request`'s business. Blocking sockets with a
timeout on both sides: the template is single-threaded and serves one connection at a time.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

import msgpack

from ft_client.errors import FtError

MAX_FRAME = 1 << 20
"""Largest body, in bytes: a spawn request carries the worker's whole environment."""
MAX_FDS = 2
_HEADER = struct.Struct(">I")


class TemplateError(FtError, RuntimeError):
    """The worker template cannot serve: it did not start, exited, broke the protocol or did
    not answer in time (the launcher starts its workers the normal way)."""


class TemplateRefused(TemplateError):
    """The worker template refused a request; ``why`` is its one-line reason."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def _reject_ext(code: int, data: bytes) -> Any:
    raise TemplateError(f"msgpack extension type {code} is not allowed")


def encode(obj: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise TemplateError(f"a frame of {len(body)} bytes is over the limit of {MAX_FRAME}")
    return _HEADER.pack(len(body)) + body


def decode(body: bytes) -> object:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True, ext_hook=_reject_ext,
                               timestamp=1)
    except TemplateError:
        raise
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise TemplateError(f"not valid msgpack: {type(e).__name__}: {e}") from e


def send(sock: socket.socket, obj: dict[str, Any], fds: Sequence[int] = ()) -> None:
    frame = encode(obj)
    sent = socket.send_fds(sock, [frame], list(fds)) if fds else sock.send(frame)
    if sent < len(frame):
        sock.sendall(frame[sent:])


def _read(sock: socket.socket, n: int, fds: list[int] | None) -> bytes:
    """``n`` bytes; with ``fds``, the descriptors attached to the first (SCM_RIGHTS) go there."""
    data = b""
    while len(data) < n:
        if not data and fds is not None:
            chunk, got, _flags, _ = socket.recv_fds(sock, n, MAX_FDS)
            fds.extend(got)
        else:
            chunk = sock.recv(n - len(data))
        if not chunk:
            raise TemplateError(f"the connection closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def receive(sock: socket.socket) -> tuple[object, list[int]]:
    """One frame's decoded body and the descriptors that came with it (the caller owns them;
    on an error they are closed here)."""
    fds: list[int] = []
    try:
        (size,) = _HEADER.unpack(_read(sock, _HEADER.size, fds))
        if size == 0 or size > MAX_FRAME:
            raise TemplateError(f"frame length {size} outside 1..{MAX_FRAME}")
        return decode(_read(sock, size, None)), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
