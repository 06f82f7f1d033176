"""The wire protocol between a training rank and its monitor daemon.

This module (with the two parts it re-exports, below) owns the bytes: message types,
the msgpack codec, length-prefixed framing, the protocol version and the frame size
cap. It is pure (bytes in, messages out) and has no I/O; both the client and the
daemon import it from here.
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

The protocol lives in three modules: the vocabulary (`ft_client.wire.messages`: constants, types,
roles, error codes, `ProtocolError`, the message dataclasses), the encoder (here: the
client's hot path, `HEARTBEAT_FRAME`, `section_open_frame`, `encode`, one table lookup per
message) and the decoder (`ft_client.wire.decode`: total validation, `FrameDecoder`). This
module re-exports both others' public names (each imported ``X as X``): import
``ft_client.wire``, not its parts.
"""

from __future__ import annotations

from typing import Any

import msgpack

from ft_client.wire.decode import FrameDecoder as FrameDecoder
from ft_client.wire.decode import decode_body as decode_body
from ft_client.wire.decode import frame_length as frame_length
from ft_client.wire.decode import read_frame_blocking as read_frame_blocking
from ft_client.wire.messages import GOODBYE as GOODBYE
from ft_client.wire.messages import HEADER, check_name
from ft_client.wire.messages import HEADER_SIZE as HEADER_SIZE
from ft_client.wire.messages import HEARTBEAT as HEARTBEAT
from ft_client.wire.messages import MAX_FRAME as MAX_FRAME
from ft_client.wire.messages import MAX_NAME_BYTES as MAX_NAME_BYTES
from ft_client.wire.messages import MAX_TIMES as MAX_TIMES
from ft_client.wire.messages import PING as PING
from ft_client.wire.messages import PONG as PONG
from ft_client.wire.messages import PROTOCOL_VERSION as PROTOCOL_VERSION
from ft_client.wire.messages import SECTION_CLOSE_ALL as SECTION_CLOSE_ALL
from ft_client.wire.messages import STATUS as STATUS
from ft_client.wire.messages import Abort as Abort
from ft_client.wire.messages import Ack as Ack
from ft_client.wire.messages import ConfigOk as ConfigOk
from ft_client.wire.messages import Control as Control
from ft_client.wire.messages import DumpReply as DumpReply
from ft_client.wire.messages import DumpRequest as DumpRequest
from ft_client.wire.messages import Error as Error
from ft_client.wire.messages import ErrorCode as ErrorCode
from ft_client.wire.messages import Exiting as Exiting
from ft_client.wire.messages import FrDump as FrDump
from ft_client.wire.messages import Goodbye as Goodbye
from ft_client.wire.messages import HangNotice as HangNotice
from ft_client.wire.messages import Heartbeat as Heartbeat
from ft_client.wire.messages import Hello as Hello
from ft_client.wire.messages import HelloOk as HelloOk
from ft_client.wire.messages import Iteration as Iteration
from ft_client.wire.messages import Message as Message
from ft_client.wire.messages import MsgType as MsgType
from ft_client.wire.messages import Ping as Ping
from ft_client.wire.messages import Pong as Pong
from ft_client.wire.messages import ProtocolError as ProtocolError
from ft_client.wire.messages import RecordDeclined as RecordDeclined
from ft_client.wire.messages import RecordRefused as RecordRefused
from ft_client.wire.messages import Reentered as Reentered
from ft_client.wire.messages import Restarting as Restarting
from ft_client.wire.messages import Role as Role
from ft_client.wire.messages import SectionClose as SectionClose
from ft_client.wire.messages import SectionCloseAll as SectionCloseAll
from ft_client.wire.messages import SectionOpen as SectionOpen
from ft_client.wire.messages import SectionSlot as SectionSlot
from ft_client.wire.messages import Status as Status
from ft_client.wire.messages import StatusReply as StatusReply
from ft_client.wire.messages import UpdateConfig as UpdateConfig
from ft_client.wire.messages import WorkerStarted as WorkerStarted

_HEADER = HEADER
"""Bound here, not imported: CPython compiles ``name.method(...)`` on an imported name as an
attribute load (a bound method per call) and on a module global as a method call."""


def _frame(body: list[Any]) -> bytes:
    payload: bytes = msgpack.packb(body, use_bin_type=True)
    if len(payload) > MAX_FRAME:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds the frame cap of {MAX_FRAME} bytes")
    return _HEADER.pack(len(payload)) + payload


def _named(name: str) -> str:
    check_name(name)
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
    check_name(name)
    return _frame([MsgType.SECTION_OPEN, name])


def section_close_frame(name: str) -> bytes:
    check_name(name)
    return _frame([MsgType.SECTION_CLOSE, name])
