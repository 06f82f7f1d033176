"""Reading the wire protocol: frame bodies decoded into messages, with total validation.

Every field of every message is checked for its type (and range, where it has one)
before a message is built; anything else is a `ProtocolError`, after which the caller
closes the connection. The length prefix is checked against `MAX_FRAME` before a body
is buffered (`frame_length`, the one place that rule is written). `FrameDecoder` is the
incremental reader the daemon's connections use, `read_frame_blocking` the blocking one
of the clients. Import it through `ft_client.wire`, which re-exports it.

Nothing here unpickles or evaluates anything: msgpack with ``raw=False`` and
``strict_map_key=True`` yields only None, bool, int, float, str, bytes, list, dict;
extension types are refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import msgpack

from ft_client.wire.messages import (
    GOODBYE,
    HEADER,
    HEADER_SIZE,
    HEARTBEAT,
    MAX_FRAME,
    MAX_TIMES,
    PING,
    PONG,
    SECTION_CLOSE_ALL,
    STATUS,
    Abort,
    Ack,
    ConfigOk,
    Control,
    DumpReply,
    DumpRequest,
    Error,
    Exiting,
    FrDump,
    HangNotice,
    Hello,
    HelloOk,
    Iteration,
    Message,
    MsgType,
    ProtocolError,
    RecordDeclined,
    RecordRefused,
    Reentered,
    Restarting,
    SectionClose,
    SectionOpen,
    SectionSlot,
    StatusReply,
    UpdateConfig,
    WorkerStarted,
    check_name,
)

_HEADER = HEADER  # a module global, so `_HEADER.unpack_from(...)` is a method call (as ft_client.wire's _HEADER)


def _str(v: object, what: str) -> str:
    if not isinstance(v, str):
        raise ProtocolError(f"{what} must be a string, got {type(v).__name__}")
    return v


def _dict(v: object, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ProtocolError(f"{what} must be a map, got {type(v).__name__}")
    return v


def _int(v: object, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError(f"{what} must be an integer, got {type(v).__name__}")
    return v


def _opt_int(v: object, what: str) -> int | None:
    return None if v is None else _int(v, what)


def _times(v: object) -> dict[str, float]:
    d = _dict(v, "times")
    if len(d) > MAX_TIMES:
        raise ProtocolError(f"times has {len(d)} entries, at most {MAX_TIMES}")
    out: dict[str, float] = {}
    for k, t in d.items():
        if not isinstance(k, str) or isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ProtocolError(f"times entry {k!r:.40}: {t!r:.40} must map a name to a finite number")
        out[k] = float(t)
    return out


def _seconds(v: object, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ProtocolError(f"{what} must be a finite number of seconds >= 0, got {v!r:.40}")
    return float(v)


def _bool(v: object, what: str) -> bool:
    if not isinstance(v, bool):
        raise ProtocolError(f"{what} must be true or false, got {type(v).__name__}")
    return v


def _opt_str(v: object, what: str) -> str | None:
    return None if v is None else _str(v, what)


def _name(v: object) -> str:
    name = _str(v, "section name")
    check_name(name)
    return name


_DECODERS: dict[int, tuple[int, Any]] = {
    # tag: (number of fields after the tag, builder)
    MsgType.HELLO: (4, lambda f: Hello(_int(f[0], "version"), _str(f[1], "role"), _int(f[2], "rank"),
                                       _dict(f[3], "info"))),
    MsgType.HELLO_OK: (2, lambda f: HelloOk(_int(f[0], "version"), _dict(f[1], "session"))),
    MsgType.ERROR: (2, lambda f: Error(_str(f[0], "error code"), _str(f[1], "error message"))),
    MsgType.HEARTBEAT: (0, lambda f: HEARTBEAT),
    MsgType.SECTION_OPEN: (1, lambda f: SectionOpen(_name(f[0]))),
    MsgType.SECTION_CLOSE: (1, lambda f: SectionClose(_name(f[0]))),
    MsgType.SECTION_CLOSE_ALL: (0, lambda f: SECTION_CLOSE_ALL),
    MsgType.UPDATE_CONFIG: (1, lambda f: UpdateConfig(_dict(f[0], "timeouts"))),
    MsgType.CONFIG_OK: (1, lambda f: ConfigOk(_dict(f[0], "timeouts"))),
    MsgType.STATUS: (0, lambda f: STATUS),
    MsgType.STATUS_REPLY: (1, lambda f: StatusReply(_dict(f[0], "status"))),
    MsgType.PING: (0, lambda f: PING),
    MsgType.PONG: (0, lambda f: PONG),
    MsgType.GOODBYE: (0, lambda f: GOODBYE),
    MsgType.EXITING: (1, lambda f: Exiting(_str(f[0], "reason"))),
    MsgType.ITERATION: (1, lambda f: Iteration(_int(f[0], "iteration"))),
    MsgType.CONTROL: (2, lambda f: Control(_str(f[0], "action"), _str(f[1], "reason"))),
    MsgType.HANG_NOTICE: (1, lambda f: HangNotice(_dict(f[0], "notice"))),
    MsgType.ACK: (1, lambda f: Ack(_dict(f[0], "detail"))),
    MsgType.ABORT: (3, lambda f: Abort(_opt_int(f[0], "iteration"), _str(f[1], "reason"),
                                       _opt_int(f[2], "hung_rank"))),
    MsgType.RESTARTING: (1, lambda f: Restarting(_int(f[0], "iteration"))),
    MsgType.REENTERED: (5, lambda f: Reentered(_int(f[0], "iteration"), _str(f[1], "reason"),
                                               _opt_int(f[2], "fault_rank"), _str(f[3], "source"), _times(f[4]))),
    MsgType.WORKER_STARTED: (3, lambda f: WorkerStarted(_int(f[0], "pid"), _int(f[1], "rank"),
                                                        _opt_str(f[2], "error_file"))),
    MsgType.SECTION_SLOT: (2, lambda f: SectionSlot(_name(f[0]), _int(f[1], "slot"))),
    MsgType.RECORD_DECLINED: (1, lambda f: RecordDeclined(_str(f[0], "reason"))),
    MsgType.RECORD_REFUSED: (1, lambda f: RecordRefused(_str(f[0], "reason"))),
    MsgType.DUMP_REQUEST: (3, lambda f: DumpRequest(_int(f[0], "incident"), _seconds(f[1], "timeout"),
                                                    _bool(f[2], "flight_recorder"))),
    MsgType.DUMP_REPLY: (1, lambda f: DumpReply(_dict(f[0], "snapshot"))),
    MsgType.FR_DUMP: (1, lambda f: FrDump(_str(f[0], "path"))),
}


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def decode_body(body: bytes | memoryview) -> Message:
    """Decode one frame body (without its length prefix) into a message."""
    try:
        # Extension types are refused; the timestamp extension (-1) becomes a plain float.
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True, ext_hook=_reject_ext, timestamp=1)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"body is not valid msgpack: {type(e).__name__}: {e}") from e
    if not isinstance(obj, list) or not obj:
        raise ProtocolError(f"body must be a non-empty array, got {type(obj).__name__}")
    tag = obj[0]
    spec = _DECODERS.get(tag) if isinstance(tag, int) and not isinstance(tag, bool) else None
    if spec is None:
        raise ProtocolError(f"unknown message type {tag!r}")
    nfields, build = spec
    if len(obj) != nfields + 1:
        raise ProtocolError(f"{MsgType(tag).name} takes {nfields} field(s), got {len(obj) - 1}")
    msg: Message = build(obj[1:])
    return msg


def frame_length(header: bytes | bytearray, offset: int = 0) -> int:
    """The body length a frame's prefix announces, checked against MAX_FRAME (the one
    place the rule is written: the decoder, blocking readers and the launcher link use it)."""
    (size,) = _HEADER.unpack_from(header, offset)
    if size == 0 or size > MAX_FRAME:
        raise ProtocolError(f"frame length {size} outside 1..{MAX_FRAME}")
    return int(size)


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, get whole messages out.

    Raises ProtocolError on the first bad frame; the caller closes the
    connection. The length prefix is checked against MAX_FRAME before any
    body bytes are buffered, so an oversized frame costs nothing to refuse.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> Iterator[Message]:
        buf = self._buf
        buf += data
        pos = 0
        end = len(buf)
        try:
            while end - pos >= HEADER_SIZE:
                size = frame_length(buf, pos)
                stop = pos + HEADER_SIZE + size
                if stop > end:
                    break
                msg = decode_body(bytes(buf[pos + HEADER_SIZE : stop]))
                pos = stop
                yield msg
        finally:
            if pos:
                del buf[:pos]


def read_frame_blocking(recv_exact: Any) -> Message:
    """Read one message with ``recv_exact(n) -> bytes`` (blocking helpers in clients)."""
    return decode_body(recv_exact(frame_length(recv_exact(HEADER_SIZE))))
