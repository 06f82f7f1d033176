"""The wire protocol between a training rank and its monitor daemon.

This module owns the bytes: message types, the msgpack codec, length-prefixed
framing, the protocol version and the frame size cap. It is pure (bytes in,
messages out) and has no I/O; both the client and the daemon import it from here.
docs/protocol.md is the normative description; keep the two in step.

A frame is a 4-byte big-endian unsigned length followed by that many bytes of
msgpack. The body is an array whose first element is the message type tag::

    HELLO          [1, version, role, rank, info]      request  -> HELLO_OK | ERROR
    HELLO_OK       [2, version, session]               reply
    ERROR          [3, code, message]                  reply (then the daemon may close)
    HEARTBEAT      [4]                                 fire-and-forget
    SECTION_OPEN   [5, name]                           fire-and-forget
    SECTION_CLOSE  [6, name]                           fire-and-forget
    SECTION_CLOSE_ALL [7]                              fire-and-forget
    UPDATE_CONFIG  [8, timeouts]                       request  -> CONFIG_OK | ERROR
    CONFIG_OK      [9, timeouts]                       reply
    STATUS         [10]                                request  -> STATUS_REPLY
    STATUS_REPLY   [11, status]                        reply
    PING           [12]                                request  -> PONG
    PONG           [13]                                reply
    GOODBYE        [14]                                fire-and-forget (clean shutdown)
    ITERATION      [15, iteration]                     fire-and-forget (training progress)
    CONTROL        [16, action, reason]                request  -> ACK | ERROR   (rank -> launcher)
    HANG_NOTICE    [17, notice]                        request  -> ACK | ERROR   (monitor -> launcher)
    ACK            [18, detail]                        reply
    ABORT          [19, iteration, reason, hung_rank]  push (monitor -> rank, control connection)
    RESTARTING     [20, iteration]                     fire-and-forget (rank leaves for an in-process restart)
    REENTERED      [21, iteration, reason, fault_rank, source, times]
                                                       fire-and-forget (rank back, first progress made)
    WORKER_STARTED [22, pid, rank, error_file]         request  -> ACK | ERROR   (launcher -> monitor)
    SECTION_SLOT   [23, name, slot]                    fire-and-forget (this section reports in record slot N)
    RECORD_DECLINED [24, reason]                       fire-and-forget (the rank cannot use its progress record)
    DUMP_REQUEST   [25, incident, timeout, flight_recorder]
                                                       request  -> DUMP_REPLY | ERROR (launcher -> monitor: roll call)
    DUMP_REPLY     [26, snapshot]                      reply
    FR_DUMP        [27, path]                          push (monitor -> rank, control connection)
    EXITING        [28, reason]                        fire-and-forget (the rank's process is on its way out:
                                                       an uncaught exception; it is not timed any more)
    RECORD_REFUSED [29, reason]                        push (monitor -> rank, its connection: the monitor refused
                                                       the rank's progress record; progress goes through the socket)

Roles (HELLO's ``role``): ``rank``, ``observer``, ``control``, ``launcher``, ``monitor`` and
``snapshot``. A ``snapshot`` connection is one HELLO and its reply: HELLO's info is
``{"pid": int, "kind": "own" | "peer", "bytes": int >= 0}`` (the capacity each of the
kind's two buffers must have; 0: what is held, nothing made); HELLO_OK's session is
``{"monitor_pid", "snapshot": {"kind", "buffers": 0 | 2, "bytes": per buffer, "held": all
kinds, "limit"}}`` with the two memfds attached to its first byte (SCM_RIGHTS, buffer 0
then 1) when ``buffers`` is 2; a refusal is ERROR ``bad_request`` (snapshots off, over
``snapshot_max_bytes``, or more than the host has). The monitor closes the connection after
either. docs/protocol.md, "Snapshots (role snapshot)", is the normative text.

Nothing here unpickles or evaluates anything: msgpack with ``raw=False`` and
``strict_map_key=True`` yields only None, bool, int, float, str, bytes, list, dict.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgpack

from ft_client.errors import FtError
from ft_client.names import MAX_SECTION_NAME_BYTES, section_name_problem

PROTOCOL_VERSION = 2
MAX_FRAME = 64 * 1024
"""Largest body accepted, in bytes. Checked on the length prefix, before decoding."""
MAX_NAME_BYTES = MAX_SECTION_NAME_BYTES
"""Longest section name, in UTF-8 bytes (the rule is ft_client.names')."""

_HEADER = struct.Struct(">I")
HEADER_SIZE = _HEADER.size


class MsgType(IntEnum):
    HELLO = 1
    HELLO_OK = 2
    ERROR = 3
    HEARTBEAT = 4
    SECTION_OPEN = 5
    SECTION_CLOSE = 6
    SECTION_CLOSE_ALL = 7
    UPDATE_CONFIG = 8
    CONFIG_OK = 9
    STATUS = 10
    STATUS_REPLY = 11
    PING = 12
    PONG = 13
    GOODBYE = 14
    ITERATION = 15
    CONTROL = 16
    HANG_NOTICE = 17
    ACK = 18
    ABORT = 19
    RESTARTING = 20
    REENTERED = 21
    WORKER_STARTED = 22
    SECTION_SLOT = 23
    RECORD_DECLINED = 24
    DUMP_REQUEST = 25
    DUMP_REPLY = 26
    FR_DUMP = 27
    EXITING = 28
    RECORD_REFUSED = 29


class Role:
    """Who is on the other end of a connection (sent in HELLO)."""

    RANK = "rank"  # the training process; one at a time per daemon
    OBSERVER = "observer"  # `ft-monitor status` and tools: STATUS/PING only
    MONITOR = "monitor"  # a monitor daemon talking to the launcher (HANG_NOTICE)
    CONTROL = "control"  # the rank's second connection: the monitor pushes ABORT and FR_DUMP there
    LAUNCHER = "launcher"  # the launcher that started the monitor: WORKER_STARTED, DUMP_REQUEST
    SNAPSHOT = "snapshot"  # a process asking for the rank's snapshot memory (HELLO_OK passes two memfds)


class ErrorCode:
    """Codes carried by ERROR replies."""

    VERSION = "version"  # protocol version mismatch
    BUSY = "busy"  # a rank is already connected
    FORBIDDEN = "forbidden"  # peer uid differs, or request not allowed for the role
    BAD_REQUEST = "bad_request"  # well-formed frame, unacceptable content
    PROTOCOL = "protocol"  # malformed frame or message; the connection is closed


class ProtocolError(FtError):
    """A frame or message that breaks the protocol. The connection must be closed."""


@dataclass(frozen=True, slots=True)
class Hello:
    version: int
    role: str
    rank: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HelloOk:
    version: int
    session: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Error:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    pass


@dataclass(frozen=True, slots=True)
class SectionOpen:
    name: str


@dataclass(frozen=True, slots=True)
class SectionClose:
    name: str


@dataclass(frozen=True, slots=True)
class SectionCloseAll:
    pass


@dataclass(frozen=True, slots=True)
class UpdateConfig:
    timeouts: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ConfigOk:
    timeouts: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Status:
    pass


@dataclass(frozen=True, slots=True)
class StatusReply:
    status: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Ping:
    pass


@dataclass(frozen=True, slots=True)
class Pong:
    pass


@dataclass(frozen=True, slots=True)
class Goodbye:
    pass


@dataclass(frozen=True, slots=True)
class Exiting:
    """The rank's process is exiting (why, e.g. the uncaught exception): not a hang."""

    reason: str


@dataclass(frozen=True, slots=True)
class Iteration:
    iteration: int


@dataclass(frozen=True, slots=True)
class Control:
    action: str
    reason: str


@dataclass(frozen=True, slots=True)
class HangNotice:
    notice: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Ack:
    detail: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Abort:
    """Monitor -> rank (control connection): restart in-process now."""

    iteration: int | None
    """The in-process (Wrapper) iteration the fault belongs to, as the monitor knows it from
    RESTARTING (0 before any): a rank already past it ignores the ABORT."""
    reason: str
    hung_rank: int | None


@dataclass(frozen=True, slots=True)
class Restarting:
    """Rank -> monitor: a fault was seen; the rank aborts, leaves its training function and
    restarts it in-process as this Wrapper iteration. The monitor times nothing but the
    restart until REENTERED."""

    iteration: int


MAX_TIMES = 16
"""Entries in a REENTERED times map."""


@dataclass(frozen=True, slots=True)
class Reentered:
    """Rank -> monitor: the rank is back in its training function as Wrapper ``iteration``
    and made progress; why it restarted, and when (wall clock) each phase of the restart
    ended (`ft_client.inprocess.timeline`)."""

    iteration: int
    reason: str
    fault_rank: int | None
    source: str
    times: dict[str, float]


@dataclass(frozen=True, slots=True)
class WorkerStarted:
    """Launcher -> monitor: the worker process it just started for this monitor's rank, so
    its start-up is timed before it connects (startup_timeout)."""

    pid: int
    rank: int
    error_file: str | None
    """Its torchelastic error file (its attempt directory), if any."""


@dataclass(frozen=True, slots=True)
class SectionSlot:
    """Rank -> monitor: section ``name`` opens and closes in slot ``slot`` of the progress
    record from now on (ft_client.record); sent once, before the slot's first use."""

    name: str
    slot: int


@dataclass(frozen=True, slots=True)
class RecordDeclined:
    """Rank -> monitor: the rank cannot use the progress record it was handed (why, for the
    monitor's log); its progress comes through this connection."""

    reason: str


@dataclass(frozen=True, slots=True)
class RecordRefused:
    """Monitor -> rank, pushed on the rank's connection: the monitor refused the rank's progress
    record (why); it reads it no more, and the rank reports through this connection from now on."""

    reason: str


@dataclass(frozen=True, slots=True)
class DumpRequest:
    """Launcher -> monitor: the roll call of a hang (docs/hang-handling.md): dump the rank's
    stack, then (``flight_recorder``) have it write its Flight Recorder trace; answer within
    ``timeout`` seconds with DUMP_REPLY."""

    incident: int
    timeout: float
    flight_recorder: bool


@dataclass(frozen=True, slots=True)
class DumpReply:
    """Monitor -> launcher: what was taken (`ft_monitor.core.snapshot.MonitorSnapshot`)."""

    snapshot: dict[str, Any]


@dataclass(frozen=True, slots=True)
class FrDump:
    """Monitor -> rank (control connection): write your Flight Recorder trace to ``path``."""

    path: str


Message = (
    Hello | HelloOk | Error | Heartbeat | SectionOpen | SectionClose | SectionCloseAll
    | UpdateConfig | ConfigOk | Status | StatusReply | Ping | Pong | Goodbye | Exiting | Iteration
    | Control | HangNotice | Ack | Abort | Restarting | Reentered | WorkerStarted
    | SectionSlot | RecordDeclined | RecordRefused
    | DumpRequest | DumpReply | FrDump
)

# Singletons for the messages without fields: decoding them allocates nothing.
HEARTBEAT = Heartbeat()
SECTION_CLOSE_ALL = SectionCloseAll()
STATUS = Status()
PING = Ping()
PONG = Pong()
GOODBYE = Goodbye()


# ---------------------------------------------------------------------------
# Encoding


def _frame(body: list[Any]) -> bytes:
    payload: bytes = msgpack.packb(body, use_bin_type=True)
    if len(payload) > MAX_FRAME:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds the frame cap of {MAX_FRAME} bytes")
    return _HEADER.pack(len(payload)) + payload


def _check_name(name: str) -> None:
    problem = section_name_problem(name)
    if problem is not None:
        raise ProtocolError(problem)


def _named(name: str) -> str:
    _check_name(name)
    return name


def encode(msg: Message) -> bytes:
    """Return the complete frame (length prefix + body) for ``msg``."""
    t = type(msg)
    if t is Heartbeat:
        return HEARTBEAT_FRAME
    if t is SectionOpen:
        return section_open_frame(msg.name)  # type: ignore[union-attr]
    if t is SectionClose:
        return section_close_frame(msg.name)  # type: ignore[union-attr]
    encoder = _ENCODERS.get(t)
    if encoder is None:
        raise TypeError(f"not a wire message: {msg!r}")
    return _frame(encoder(msg))


_ENCODERS: dict[type, Any] = {
    Hello: lambda m: [MsgType.HELLO, m.version, m.role, m.rank, m.info],
    HelloOk: lambda m: [MsgType.HELLO_OK, m.version, m.session],
    Error: lambda m: [MsgType.ERROR, m.code, m.message],
    SectionCloseAll: lambda m: [MsgType.SECTION_CLOSE_ALL],
    UpdateConfig: lambda m: [MsgType.UPDATE_CONFIG, m.timeouts],
    ConfigOk: lambda m: [MsgType.CONFIG_OK, m.timeouts],
    Status: lambda m: [MsgType.STATUS],
    StatusReply: lambda m: [MsgType.STATUS_REPLY, m.status],
    Ping: lambda m: [MsgType.PING],
    Pong: lambda m: [MsgType.PONG],
    Goodbye: lambda m: [MsgType.GOODBYE],
    Exiting: lambda m: [MsgType.EXITING, m.reason],
    Iteration: lambda m: [MsgType.ITERATION, m.iteration],
    Control: lambda m: [MsgType.CONTROL, m.action, m.reason],
    HangNotice: lambda m: [MsgType.HANG_NOTICE, m.notice],
    Ack: lambda m: [MsgType.ACK, m.detail],
    Abort: lambda m: [MsgType.ABORT, m.iteration, m.reason, m.hung_rank],
    Restarting: lambda m: [MsgType.RESTARTING, m.iteration],
    Reentered: lambda m: [MsgType.REENTERED, m.iteration, m.reason, m.fault_rank, m.source, m.times],
    WorkerStarted: lambda m: [MsgType.WORKER_STARTED, m.pid, m.rank, m.error_file],
    SectionSlot: lambda m: [MsgType.SECTION_SLOT, _named(m.name), m.slot],
    RecordDeclined: lambda m: [MsgType.RECORD_DECLINED, m.reason],
    RecordRefused: lambda m: [MsgType.RECORD_REFUSED, m.reason],
    DumpRequest: lambda m: [MsgType.DUMP_REQUEST, m.incident, m.timeout, m.flight_recorder],
    DumpReply: lambda m: [MsgType.DUMP_REPLY, m.snapshot],
    FrDump: lambda m: [MsgType.FR_DUMP, m.path],
}

HEARTBEAT_FRAME = _frame([MsgType.HEARTBEAT])
"""The heartbeat never changes: the client sends this constant."""


def section_open_frame(name: str) -> bytes:
    _check_name(name)
    return _frame([MsgType.SECTION_OPEN, name])


def section_close_frame(name: str) -> bytes:
    _check_name(name)
    return _frame([MsgType.SECTION_CLOSE, name])


# ---------------------------------------------------------------------------
# Decoding


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
    _check_name(name)
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
