"""The wire protocol's vocabulary: its version, the frame cap, message types, roles and
error codes, `ProtocolError`, and one frozen dataclass per message (the `Message` union).

Pure data: no I/O, no msgpack. `ft_client.wire` is the module to import (it re-exports
these names, and encodes); `ft_client.wire.decode` reads frames back into these
messages. The protocol itself, frame by frame, is described in `ft_client.wire`'s
docstring and, normatively, in docs/protocol.md.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from ft_client.errors import FtError
from ft_client.names import MAX_SECTION_NAME_BYTES, section_name_problem

PROTOCOL_VERSION = 2
MAX_FRAME = 64 * 1024
"""Largest body accepted, in bytes. Checked on the length prefix, before decoding."""
MAX_NAME_BYTES = MAX_SECTION_NAME_BYTES
"""Longest section name, in UTF-8 bytes (the rule is ft_client.names')."""

HEADER = struct.Struct(">I")
"""A frame's length prefix: 4 bytes, big-endian, unsigned."""
HEADER_SIZE = HEADER.size


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


def check_name(name: str) -> None:
    """Raise ProtocolError if ``name`` breaks the section-name rule (ft_client.names)."""
    problem = section_name_problem(name)
    if problem is not None:
        raise ProtocolError(problem)
