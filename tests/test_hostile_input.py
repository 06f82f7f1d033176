"""Hostile input against a live daemon: garbage bytes, malformed and misplaced messages,
slow and idle peers, floods of sections and connections, bad settings, planted files.

The rule under test (docs/DESIGN.md, Security): a bad peer is dropped with a logged
reason, never the daemon, and a normal client works right after. Most cases share one
daemon (module fixture, handshake timeout 0.5 s); cases that change what the daemon
holds (timeouts pushed by a rank persist) get their own.

Safety: raw "rank" connections here come from the pytest process itself, so the shared
daemon is started with every timeout off and fuzzed traffic never carries UPDATE_CONFIG
as a rank: no deadline can ever arm against pytest's pid.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ft_client import RankMonitorClient, RankMonitorClientError, wire
from ft_monitor import cli
from ft_monitor.config import FIELDS
from ft_monitor.core.state import MAX_OPEN_SECTIONS
from tests.procs import ROOT, Daemon, cleanup_dir, ping, raw_client, short_tmpdir, status, wait_until

HANDSHAKE = 0.5
PID = os.getpid()
e2e = pytest.mark.e2e


# -- helpers ----------------------------------------------------------------------------------


class LogCursor:
    """The part of a daemon's log written after this cursor was made (bytes: the log may
    be read in the middle of a write; decoded leniently)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.start = daemon.log_path.stat().st_size

    def text(self) -> str:
        with open(self.daemon.log_path, "rb") as f:
            f.seek(self.start)
            return f.read().decode("utf-8", "replace")

    def wait(self, needle: str, timeout: float = 10.0) -> str:
        wait_until(lambda: needle in self.text(), timeout, f"{needle!r} in the monitor log")
        return self.text()


def frame(obj: Any) -> bytes:
    return raw_frame(msgpack.packb(obj, use_bin_type=True))


def raw_frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def hello(role: str, version: int = wire.PROTOCOL_VERSION) -> bytes:
    return wire.encode(wire.Hello(version, role, 0 if role == wire.Role.RANK else -1, {}))


HELLO_OBSERVER = hello(wire.Role.OBSERVER)
HELLO_RANK = hello(wire.Role.RANK)


def read_all(s: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


def converse(sock_path: Path, payload: bytes, *, timeout: float = 5.0) -> list[wire.Message]:
    """Send ``payload``, half-close, and return every message the daemon sent before closing."""
    s = raw_client(sock_path)
    s.settimeout(timeout)
    try:
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon closed first (e.g. on the length prefix); read what it said
        data = read_all(s)
    finally:
        s.close()
    return list(wire.FrameDecoder().feed(data))


def read_messages(s: socket.socket, n: int) -> list[wire.Message]:
    """Read exactly ``n`` messages from an open connection (bounded by its timeout)."""
    dec = wire.FrameDecoder()
    out: list[wire.Message] = []
    while len(out) < n:
        chunk = s.recv(1 << 20)
        if not chunk:
            raise AssertionError(f"connection closed after {out}")
        out.extend(dec.feed(chunk))
    return out


def wait_no_rank(sock_path: Path) -> None:
    wait_until(lambda: not status(sock_path)["connected"], 10, "the rank slot to be free")


def normal_client_works(sock_path: Path) -> None:
    """A well-behaved rank connects, reports, is seen by an observer, and leaves cleanly."""
    wait_no_rank(sock_path)
    c = RankMonitorClient(str(sock_path))
    c.init_workload_monitoring()
    try:
        c.send_heartbeat()
        with c.section("step"):
            pass
        st_ = status(sock_path)
        assert st_["connected"] and st_["pid"] == PID, st_
    finally:
        c.shutdown_workload_monitoring()
    assert ping(sock_path)


def assert_unharmed(daemon: Daemon, cursor: LogCursor) -> None:
    assert daemon.proc.poll() is None, daemon.log()
    text = cursor.text()
    for bad in ("Traceback", "Fatal error", "Exception in callback", "exception was never retrieved"):
        assert bad not in text, text
    normal_client_works(daemon.socket)
    timeouts = status(daemon.socket)["timeouts"]
    assert timeouts["rank_section_timeouts"] == {} and timeouts["rank_heartbeat_timeout"] is None, timeouts


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture(scope="module")
def served() -> Iterator[Daemon]:
    d = short_tmpdir()
    daemon = Daemon(d, "--ft-handshake-timeout", str(HANDSHAKE)).wait_ready()
    try:
        yield daemon
    finally:
        daemon.stop()
        cleanup_dir(d)


# -- malformed frames and messages, one by one -------------------------------------------------

P = wire.ErrorCode.PROTOCOL
CASES = [
    # framing
    ("length-over-cap", struct.pack(">I", wire.MAX_FRAME + 1) + b"x" * 64, P, "frame length 65537 outside 1..65536"),
    ("length-u32-max", b"\xff\xff\xff\xff", P, "frame length 4294967295 outside"),
    ("zero-length", struct.pack(">I", 0), P, "frame length 0 outside"),
    ("zero-after-good-frame", HELLO_OBSERVER + struct.pack(">I", 0), P, "frame length 0 outside"),
    # not msgpack, or more than one object
    ("garbage-msgpack", raw_frame(b"\xc1\xc1\xc1"), P, "body is not valid msgpack"),
    ("truncated-msgpack", raw_frame(b"\x93\x01\x01"), P, "body is not valid msgpack"),
    ("trailing-bytes", raw_frame(msgpack.packb([12]) + b"\x00"), P, "body is not valid msgpack"),
    ("array32-claims-4g", raw_frame(b"\xdd\xff\xff\xff\xff\x01"), P, "body is not valid msgpack"),
    ("str32-claims-4g", raw_frame(b"\xdb\xff\xff\xff\xff"), P, "body is not valid msgpack"),
    ("nested-5000-deep", raw_frame(b"\x91" * 5000 + b"\xc0"), P, "body is not valid msgpack"),
    ("non-str-map-key", frame([1, 1, "observer", -1, {1: 2}]), P, "body is not valid msgpack"),
    ("ext-type", frame([1, msgpack.ExtType(5, b"x"), "observer", -1, {}]), P, "msgpack extension type 5 is not allowed"),
    # valid msgpack, wrong shape
    ("map-body", frame({"type": 1}), P, "body must be a non-empty array, got dict"),
    ("empty-array", frame([]), P, "body must be a non-empty array, got list"),
    ("scalar-body", frame(5), P, "body must be a non-empty array, got int"),
    ("hello-arity", frame([1, 1, "observer"]), P, "HELLO takes 4 field(s), got 2"),
    ("hello-version-str", frame([1, "1", "observer", -1, {}]), P, "version must be an integer, got str"),
    ("hello-role-bytes", frame([1, 1, b"observer", -1, {}]), P, "role must be a string, got bytes"),
    ("hello-rank-bool", frame([1, 1, "rank", True, {}]), P, "rank must be an integer, got bool"),
    ("hello-info-list", frame([1, 1, "observer", -1, []]), P, "info must be a map, got list"),
    ("hello-unknown-role", frame([1, wire.PROTOCOL_VERSION, "root", 0, {}]), P, "unknown role 'root'"),
    ("hello-monitor-role", frame([1, wire.PROTOCOL_VERSION, "monitor", 0, {}]), P, "unknown role 'monitor'"),
    # unknown type tags
    ("unknown-tag", frame([99]), P, "unknown message type 99"),
    ("negative-tag", frame([-1]), P, "unknown message type -1"),
    ("string-tag", frame(["HELLO", 1, "observer", -1, {}]), P, "unknown message type 'HELLO'"),
    ("bool-tag", frame([True, 1, "observer", -1, {}]), P, "unknown message type True"),
    ("float-tag", frame([1.0, 1, "observer", -1, {}]), P, "unknown message type 1.0"),
    # messages before HELLO, a second HELLO, replies sent by a client
    ("heartbeat-before-hello", wire.encode(wire.HEARTBEAT), P, "expected HELLO first, got Heartbeat"),
    ("section-before-hello", wire.section_open_frame("step"), P, "expected HELLO first, got SectionOpen"),
    ("status-before-hello", wire.encode(wire.STATUS), P, "expected HELLO first, got Status"),
    ("goodbye-before-hello", wire.encode(wire.GOODBYE), P, "expected HELLO first, got Goodbye"),
    ("reply-before-hello", wire.encode(wire.HelloOk(1, {})), P, "expected HELLO first, got HelloOk"),
    ("second-hello-observer", HELLO_OBSERVER + HELLO_OBSERVER, P, "second HELLO on one connection"),
    ("second-hello-rank", HELLO_RANK + HELLO_RANK, P, "second HELLO on one connection"),
    ("rank-then-observer-hello", HELLO_RANK + HELLO_OBSERVER, P, "second HELLO on one connection"),
    ("reply-type-from-rank", HELLO_RANK + wire.encode(wire.PONG), P, "unexpected Pong from a client"),
    ("hang-notice-from-rank", HELLO_RANK + wire.encode(wire.HangNotice({})), P, "unexpected HangNotice from a client"),
    # section names, from a connected rank
    ("name-257-bytes", HELLO_RANK + frame([5, "x" * 257]), P, "section name must be 1..256 bytes of UTF-8, got 257"),
    ("name-258-utf8-bytes", HELLO_RANK + frame([6, "é" * 129]), P, "section name must be 1..256 bytes of UTF-8, got 258"),
    ("name-64k", HELLO_RANK + frame([5, "x" * 60000]), P, "section name must be 1..256 bytes of UTF-8, got 60000"),
    ("name-empty", HELLO_RANK + frame([5, ""]), P, "section name must be 1..256 bytes of UTF-8, got 0"),
    ("name-not-utf8", HELLO_RANK + raw_frame(b"\x92\x05\xa3\xff\xfe\xfd"), P, "body is not valid msgpack"),
    ("name-lone-surrogate", HELLO_RANK + raw_frame(b"\x92\x05\xa3\xed\xa0\x80"), P, "body is not valid msgpack"),
    ("name-bytes", HELLO_RANK + frame([5, b"step"]), P, "section name must be a string, got bytes"),
    ("name-int", HELLO_RANK + frame([6, 7]), P, "section name must be a string, got int"),
    ("iteration-str", HELLO_RANK + frame([15, "7"]), P, "iteration must be an integer, got str"),
    ("reentered-times-nan", HELLO_RANK + frame([21, 1, "r", None, "exception", {"seen": float("nan")}]), P,
     "times entry 'seen': nan must map a name to a finite number"),
    ("reentered-times-list", HELLO_RANK + frame([21, 1, "r", None, "exception", []]), P, "times must be a map"),
    ("reentered-times-many", HELLO_RANK + frame([21, 1, "r", None, "exception", {str(i): 1.0 for i in range(17)}]),
     P, "times has 17 entries, at most 16"),
    # protocol versions
    ("version-1", hello(wire.Role.OBSERVER, 1), wire.ErrorCode.VERSION, "protocol version 1 is not supported"),
    ("version-0-rank", hello(wire.Role.RANK, 0), wire.ErrorCode.VERSION, "protocol version 0 is not supported"),
    ("version-u64", hello(wire.Role.RANK, 2**64 - 1), wire.ErrorCode.VERSION, f"protocol version {2**64 - 1} is not"),
]

_LOGGED = {
    wire.ErrorCode.PROTOCOL: "closing connection from pid {pid}: protocol error: {reason}",
    wire.ErrorCode.VERSION: "refused pid {pid}: protocol version",
}


@e2e
@pytest.mark.parametrize("payload, code, reason", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_drops_only_the_offender(served: Daemon, payload: bytes, code: str, reason: str) -> None:
    cursor = LogCursor(served)
    msgs = converse(served.socket, payload)
    assert msgs and isinstance(msgs[-1], wire.Error), msgs
    assert msgs[-1].code == code and reason in msgs[-1].message, msgs[-1]
    cursor.wait(_LOGGED[code].format(pid=PID, reason=reason))
    assert_unharmed(served, cursor)


@e2e
def test_wrong_version_log_names_both_versions(served: Daemon) -> None:
    cursor = LogCursor(served)
    msgs = converse(served.socket, hello(wire.Role.RANK, 7))
    assert isinstance(msgs[-1], wire.Error) and msgs[-1].code == wire.ErrorCode.VERSION
    cursor.wait(f"refused pid {PID}: protocol version 7, this monitor speaks {wire.PROTOCOL_VERSION}")
    assert not status(served.socket)["connected"]  # a refused rank never got a session
    assert_unharmed(served, cursor)


@e2e
def test_observer_forbidden_request_is_logged(served: Daemon) -> None:
    cursor = LogCursor(served)
    msgs = converse(served.socket, HELLO_OBSERVER + wire.section_open_frame("step"))
    assert isinstance(msgs[-1], wire.Error) and msgs[-1].code == wire.ErrorCode.FORBIDDEN
    assert "SectionOpen is not allowed for an observer" in msgs[-1].message
    wait_until(lambda: _line_with(cursor, f"pid {PID}", "SectionOpen"), 1.0, "a log line naming the offender")
    assert_unharmed(served, cursor)


@e2e
def test_observer_forbidden_request_drops_only_the_observer(served: Daemon) -> None:
    cursor = LogCursor(served)
    for payload in (wire.encode(wire.HEARTBEAT), wire.encode(wire.UpdateConfig({"rank_heartbeat_timeout": 0.001})),
                    wire.encode(wire.GOODBYE), wire.encode(wire.Control("shutdown", "x"))):
        msgs = converse(served.socket, HELLO_OBSERVER + payload)
        assert isinstance(msgs[-1], wire.Error) and msgs[-1].code == wire.ErrorCode.FORBIDDEN, msgs
    assert_unharmed(served, cursor)  # also checks the observer's UPDATE_CONFIG changed nothing


@e2e
def test_truncated_frame_then_close_leaves_the_daemon_serving(served: Daemon) -> None:
    cursor = LogCursor(served)
    full = wire.encode(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.OBSERVER, -1, {"pad": "x" * 100}))
    for cut in (1, 3, 4, 5, len(full) - 1):
        assert converse(served.socket, full[:cut]) == []  # nothing to answer: the peer left mid-frame
    assert_unharmed(served, cursor)


@e2e
def test_truncated_frame_then_close_is_logged(served: Daemon) -> None:
    cursor = LogCursor(served)
    converse(served.socket, struct.pack(">I", 100) + b"x" * 10)
    wait_until(lambda: _line_with(cursor, f"pid {PID}", "frame"), 1.0, "a log line naming the offender")


def _line_with(cursor: LogCursor, *parts: str) -> bool:
    return any(all(p in line for p in parts) for line in cursor.text().splitlines())


# -- slow and idle peers -----------------------------------------------------------------------


@e2e
def test_connect_and_say_nothing_is_closed_at_the_handshake_timeout(served: Daemon) -> None:
    cursor = LogCursor(served)
    s = raw_client(served.socket)
    start = time.monotonic()
    try:
        data = read_all(s)
    finally:
        s.close()
    took = time.monotonic() - start
    assert HANDSHAKE - 0.05 <= took < HANDSHAKE + 2.0, took
    msgs = list(wire.FrameDecoder().feed(data))
    assert isinstance(msgs[0], wire.Error) and msgs[0].message == f"no HELLO within {HANDSHAKE:.1f}s"
    cursor.wait(f"closing connection from pid {PID}: no handshake within {HANDSHAKE:.1f}s")
    assert_unharmed(served, cursor)


@e2e
def test_slowloris_hello_is_closed_at_the_handshake_timeout(served: Daemon) -> None:
    """One byte every 0.2 s of a valid HELLO: the handshake deadline counts from the
    connection, not from the last byte, so the trickle is cut at 0.5 s."""
    cursor = LogCursor(served)
    payload = wire.encode(wire.Hello(wire.PROTOCOL_VERSION, wire.Role.OBSERVER, -1, {}))
    s = raw_client(served.socket)
    start = time.monotonic()
    sent = 0
    try:
        for byte in payload:
            try:
                s.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 1
            if select_readable(s, 0.2):  # the attacker's pace; stop as soon as the daemon answers
                break
        data = read_all(s)
    finally:
        s.close()
    took = time.monotonic() - start
    assert sent < len(payload), "the whole HELLO got through"
    assert took < HANDSHAKE + 2.0, took
    msgs = list(wire.FrameDecoder().feed(data))
    assert isinstance(msgs[0], wire.Error) and "no HELLO within" in msgs[0].message
    cursor.wait(f"closing connection from pid {PID}: no handshake within {HANDSHAKE:.1f}s")
    assert_unharmed(served, cursor)


def connect_blocking(sock_path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(sock_path))
    except BaseException:
        s.close()
        raise
    s.settimeout(5.0)
    return s


def select_readable(s: socket.socket, timeout: float) -> bool:
    import select

    return bool(select.select([s], [], [], timeout)[0])


# -- floods ------------------------------------------------------------------------------------


@e2e
def test_thousands_of_sections_are_capped_and_the_rank_stays(served: Daemon) -> None:
    """Pinned: past MAX_OPEN_SECTIONS (1024) further opens are ignored and counted (the
    first few logged); the rank stays connected, the first 1024 stay open (and timed)."""
    cursor = LogCursor(served)
    n = 3000
    s = raw_client(served.socket)
    try:
        s.sendall(HELLO_RANK)
        assert isinstance(read_messages(s, 1)[0], wire.HelloOk)
        s.sendall(b"".join(wire.section_open_frame(f"s{i}") for i in range(n)) + wire.encode(wire.STATUS))
        (reply,) = read_messages(s, 1)
        assert isinstance(reply, wire.StatusReply), reply
        opened = [sec["name"] for sec in reply.status["open_sections"]]
        listed = len(opened)
        assert opened == [f"s{i}" for i in range(listed)]  # the STATUS reply lists the first ones, counts the rest
        assert listed + reply.status["open_sections_not_listed"] == MAX_OPEN_SECTIONS
        assert reply.status["events"] == n
        assert reply.status["ignored_messages"] == n - MAX_OPEN_SECTIONS
        warning = f"more than {MAX_OPEN_SECTIONS} sections open at once (ignored)"
        cursor.wait("further such messages are counted, not logged")
        assert cursor.text().count(warning) == 5  # the first few only: a flood must not flood the log
        # closing an ignored one is an ignored error; closing all frees the cap
        s.sendall(wire.section_close_frame(f"s{n - 1}") + wire.encode(wire.SECTION_CLOSE_ALL)
                  + wire.section_open_frame("after") + wire.encode(wire.STATUS))
        (reply,) = read_messages(s, 1)
        assert [sec["name"] for sec in reply.status["open_sections"]] == ["after"]
    finally:
        s.close()
    assert_unharmed(served, cursor)


@e2e
def test_status_works_with_the_maximum_of_open_sections(served: Daemon) -> None:
    s = raw_client(served.socket)
    try:
        s.sendall(HELLO_RANK)
        read_messages(s, 1)
        names = [f"{i:04d}" + "n" * 60 for i in range(MAX_OPEN_SECTIONS)]
        s.sendall(b"".join(wire.section_open_frame(n) for n in names) + wire.encode(wire.STATUS))
        (reply,) = read_messages(s, 1)
        assert isinstance(reply, wire.StatusReply), reply
    finally:
        s.close()
        wait_no_rank(served.socket)


@e2e
def test_200_concurrent_observers_then_a_rank_connects(served: Daemon) -> None:
    cursor = LogCursor(served)
    base = fd_count(served.proc.pid)
    socks: list[socket.socket] = []
    try:
        for _ in range(200):  # all open at once; a blocking connect waits while the backlog (16) is full
            socks.append(connect_blocking(served.socket))
        for s in socks:
            s.sendall(HELLO_OBSERVER)
        for s in socks:
            assert isinstance(read_messages(s, 1)[0], wire.HelloOk)
        assert fd_count(served.proc.pid) >= base + 190  # 200 connections (a few fds of the daemon's may close)
        normal_client_works(served.socket)
        for s in socks:  # every observer is still served
            s.sendall(wire.encode(wire.PING))
        for s in socks:
            assert isinstance(read_messages(s, 1)[0], wire.Pong)
    finally:
        for s in socks:
            s.close()
    wait_until(lambda: fd_count(served.proc.pid) <= base, 10, "the daemon to close the 200 connections")
    assert_unharmed(served, cursor)


@e2e
def test_rank_connect_waits_while_the_accept_backlog_is_full(served: Daemon) -> None:
    import threading

    fillers: list[socket.socket] = []
    result: list[object] = []

    def connect_rank() -> None:
        c = RankMonitorClient(str(served.socket))
        try:
            c.init_workload_monitoring()
            c.shutdown_workload_monitoring()
            result.append("ok")
        except RankMonitorClientError as e:
            result.append(e)

    wait_no_rank(served.socket)
    served.proc.send_signal(signal.SIGSTOP)  # the daemon stops accepting for a moment (a GC pause, a busy loop)
    try:
        while True:  # fill the accept backlog
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(str(served.socket))
            except BlockingIOError:
                s.close()
                break
            fillers.append(s)
        t = threading.Thread(target=connect_rank)
        t.start()
        t.join(0.3)
    finally:
        served.proc.send_signal(signal.SIGCONT)
        for s in fillers:
            s.close()
    t.join(15)
    assert result == ["ok"], result


# -- generated garbage ------------------------------------------------------------------------

_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True)
            | st.text(max_size=12) | st.binary(max_size=12))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
_tags = st.sampled_from([int(t) for t in wire.MsgType] + [0, 19, 255, -1])
_tagged = st.tuples(_tags, st.lists(_values, max_size=5)).map(lambda t: frame([t[0], *t[1]]))
_cut = st.integers(0, 64)


def _is_rank_hello(data: bytes) -> bool:
    try:
        for msg in wire.FrameDecoder().feed(data):
            return isinstance(msg, wire.Hello) and msg.role == wire.Role.RANK
    except wire.ProtocolError:
        pass
    return False


garbage = st.one_of(
    st.binary(min_size=1, max_size=1024),                                      # raw noise
    st.lists(_values, min_size=1, max_size=4).map(lambda vs: b"".join(frame(v) for v in vs)),  # any msgpack
    st.lists(_tagged, min_size=1, max_size=6).map(b"".join),                   # right tags, random fields
    st.tuples(st.lists(_tagged, max_size=6).map(b"".join), st.binary(max_size=64))
    .map(lambda t: HELLO_OBSERVER + t[0] + t[1]),                              # after a valid observer HELLO
    st.tuples(st.lists(_tagged, min_size=1, max_size=4).map(b"".join), _cut)
    .map(lambda t: t[0][: max(1, len(t[0]) - t[1])]),                           # truncated
)


@e2e
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=garbage)
def test_generated_garbage_never_harms_the_daemon(served: Daemon, data: bytes) -> None:
    assume(not _is_rank_hello(data))  # a rank session for pytest's own pid is fuzzed below, without UPDATE_CONFIG
    cursor = LogCursor(served)
    converse(served.socket, data)
    assert served.proc.poll() is None
    assert ping(served.socket)
    assert "Traceback" not in cursor.text() and "Fatal error" not in cursor.text()


_rank_tags = st.sampled_from([t for t in (int(x) for x in wire.MsgType) if t != wire.MsgType.UPDATE_CONFIG] + [99])
_rank_msgs = st.one_of(
    st.sampled_from([wire.HEARTBEAT_FRAME, wire.encode(wire.SECTION_CLOSE_ALL), wire.encode(wire.STATUS),
                     wire.encode(wire.PING), wire.encode(wire.GOODBYE)]),
    st.text(min_size=1, max_size=8).map(wire.section_open_frame),
    st.text(min_size=1, max_size=8).map(wire.section_close_frame),
    st.integers(-(2**63), 2**64 - 1).map(lambda i: wire.encode(wire.Iteration(i))),
    st.tuples(_rank_tags, st.lists(_values, max_size=3)).map(lambda t: frame([t[0], *t[1]])),
    st.binary(min_size=1, max_size=16),
)


@e2e
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(msgs=st.lists(_rank_msgs, min_size=1, max_size=30))
def test_generated_rank_traffic_never_harms_the_daemon(served: Daemon, msgs: list[bytes]) -> None:
    cursor = LogCursor(served)
    wait_no_rank(served.socket)
    converse(served.socket, HELLO_RANK + b"".join(msgs))
    assert served.proc.poll() is None
    wait_no_rank(served.socket)
    text = cursor.text()
    assert "Traceback" not in text and "Fatal error" not in text, text
    assert status(served.socket)["timeouts"]["rank_section_timeouts"] == {}


# -- state a rank pushes must not break the daemon for the next one ---------------------------


@e2e
def test_oversized_timeouts_update_does_not_lock_out_later_ranks(workdir: Path) -> None:
    d = Daemon(workdir, "--ft-handshake-timeout", str(HANDSHAKE)).wait_ready()
    try:
        sections = {f"x{i:04d}": 1000 for i in range(5000)}  # ints on the wire, floats in the echo
        request = wire.encode(wire.UpdateConfig({"rank_section_timeouts": sections}))
        assert len(request) < wire.MAX_FRAME
        s = raw_client(d.socket)
        try:
            s.sendall(HELLO_RANK)
            read_messages(s, 1)
            s.sendall(request)
            (reply,) = read_messages(s, 1)
        finally:
            s.close()
        assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.BAD_REQUEST
        assert "rank_section_timeouts has 5000 sections; at most 256" in reply.message
        # observers and later ranks are still served
        wait_no_rank(d.socket)
        c = RankMonitorClient(str(d.socket))
        c.init_workload_monitoring()
        c.shutdown_workload_monitoring()
    finally:
        d.stop()


# -- wire-level fuzzing with atheris -----------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris is not installed "
                    "(pip install atheris; it ships wheels for CPython on x86-64 Linux)")
def test_atheris_fuzz_wire_decoder(tmp_path: Path) -> None:
    """Coverage-guided fuzzing of FrameDecoder + decode_body: only ProtocolError may escape."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    seeds = [wire.encode(wire.Hello(1, "rank", 0, {"pid": 1})), wire.HEARTBEAT_FRAME,
             wire.section_open_frame("step"), wire.encode(wire.UpdateConfig({"rank_section_timeouts": {"a": 1.0}})),
             wire.encode(wire.StatusReply({"a": [1, 2.5, None, b"x"]})), wire.encode(wire.Iteration(2**40)),
             wire.encode(wire.Control("a", "b")), wire.encode(wire.Error("x", "y"))]
    for i, seed in enumerate(seeds):
        (corpus / f"seed{i}").write_bytes(b"\x05" + seed)
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "fuzz_wire.py"), "-runs=20000", "-max_len=2048",
                          "-timeout=10", "-seed=1", str(corpus)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "Done 20000 runs" in out.stderr, out.stderr[-2000:]


# -- bad settings: one line naming the field, exit code 2 --------------------------------------

BAD: dict[str, list[str]] = {
    "initial_rank_heartbeat_timeout": ["-1", "abc", "inf", "0"],
    "rank_heartbeat_timeout": ["-0.5", "nan"],
    "rank_section_timeouts": ["step:-1", "step", "step:abc", ":5"],
    "rank_out_of_section_timeout": ["0", "forever"],
    "num_warmup_iterations": ["-1", "1.5", "many", str(2**64)],  # 2**64 cannot travel in HELLO_OK
    "safety_factor": ["0.5", "nan", "x"],
    "min_learned_timeout": ["-1", "x"],
    "rank_termination_signal": ["SIGFOO", "STOP", "99"],
    "termination_grace_time": ["-0.1", "inf"],
    "stack_dump_signal": ["SIGFOO", "CONT", "KILL", "TERM",
                          "SEGV", "SIGABRT", "BUS", "FPE", "ILL"],  # faulthandler cannot register these
    "stack_dump_timeout": ["-1", "soon"],
    "report_dir": ["~nosuchuser-ft/reports"],
    "skip_section_response": ["maybe", "2"],
    "log_level": ["LOUD", "-5", str(2**70)],
    "on_monitor_lost": ["explode"],
    "client_request_timeout": ["0", "-1", "x"],
    "launcher_response_timeout": ["-1", "x"],
    "handshake_timeout": ["0", "x"],
    "max_no_progress_cycles": ["-1", "x"],
    "min_progress_iterations": ["-2", "1e3x", str(2**63)],
    "max_connections": ["0", "x", "70000"],
    "observer_idle_timeout": ["0", "-1", "x"],
    "on_hang": ["restart", "", "1"],
    "inprocess_restart_timeout": ["0", "-1", "x"],
    "max_inprocess_restarts": ["-1", "x", "1.5"],
    "metrics_port": ["-1", "65536", "http"],
    "metrics_address": ["", "a b"],
    "metrics_textfile": ["relative.prom", "/tmp/ft.txt"],
    "slow_rank_ratio": ["1", "0.5", "x"],
    "slow_rank_section": [""],
    "startup_timeout": ["0", "-1", "x"],
    "startup_until": ["connect", "1"],
    "process_group_timeout": ["0", "x"],
    "scheduler_grace_time": ["-1", "x"],
    "timeout_check": ["loud", "1"],
    "progress_record": ["maybe", "2", "socket"],
    "flight_recorder_entries": ["-1", "x", "1.5", "2000000"],
    "roll_call_timeout": ["0", "-1", "x"],
    "native_stacks": ["maybe", "2"],
    "snapshot_max_bytes": ["-1", "x", "1.5", "16GiB", str(2**63)],
}
_XFAIL_BAD: dict[tuple[str, str], str] = {}


def test_bad_values_cover_every_field() -> None:
    assert set(BAD) == set(FIELDS)


def _bad_params() -> list[Any]:
    out = []
    for field, values in BAD.items():
        for v in values:
            why = _XFAIL_BAD.get((field, v))
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            out.append(pytest.param(field, v, marks=marks, id=f"{field}={v}"))
    return out


@pytest.mark.parametrize("field, value", _bad_params())
def test_bad_setting_is_one_line_naming_the_field_and_exit_2(
    field: str, value: str, isolated_cli: None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # `serve` validates in a helper process (`ft-monitor --check-serve ...`) when the CLI has one; run that
    # step in-process here (fast), and the whole real entry point once below.
    first = getattr(cli, "CHECK_SERVE", "serve")
    rc = cli.main([first, "--socket", str(tmp_path / "r.sock"), f"--ft-{field.replace('_', '-')}", value])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("ft-monitor: invalid setting") and field in lines[0], lines[0]
    assert not (tmp_path / "r.sock").exists()


@e2e
def test_bad_setting_through_the_real_entry_point(workdir: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "ft_monitor.cli", "serve", "--socket", str(workdir / "r.sock"),
                          "--ft_handshake_timeout", "-3"], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "ft-monitor: invalid setting handshake_timeout = '-3' (from --ft-handshake-timeout): must be a number of "
        "seconds > 0"
    ]


# -- planted files and permissions (extends test_e2e_daemon's symlink and mode checks) --------


def _serve(sock: Path, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ft_monitor.cli", "serve", "--socket", str(sock)],
                          capture_output=True, text=True, timeout=30, cwd=ROOT, **kw)


@e2e
def test_symlink_to_an_existing_file_is_refused_and_the_file_untouched(workdir: Path) -> None:
    victim = workdir / "victim.txt"
    victim.write_text("precious\n")
    os.chmod(victim, 0o644)
    (workdir / "rank0.sock").symlink_to(victim)
    out = _serve(workdir / "rank0.sock")
    assert out.returncode == 1 and "is a symbolic link; refusing to follow it" in out.stderr
    assert victim.read_text() == "precious\n" and (os.stat(victim).st_mode & 0o777) == 0o644
    assert (workdir / "rank0.sock").is_symlink()


@e2e
def test_regular_file_at_the_socket_path_is_refused_and_kept(workdir: Path) -> None:
    (workdir / "rank0.sock").write_text("not a socket")
    out = _serve(workdir / "rank0.sock")
    assert out.returncode == 1 and "exists and is not a socket; refusing to replace it" in out.stderr
    assert (workdir / "rank0.sock").read_text() == "not a socket"


@e2e
def test_symlinked_directory_to_a_shared_one_is_refused(workdir: Path) -> None:
    shared = workdir / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    (workdir / "link").symlink_to(shared)
    out = _serve(workdir / "link" / "r.sock")
    assert out.returncode == 1 and "has mode 0777; it must be 0700" in out.stderr
    assert list(shared.iterdir()) == []


@e2e
def test_group_accessible_directory_is_refused(workdir: Path) -> None:
    d = workdir / "grp"
    d.mkdir()
    os.chmod(d, 0o750)
    out = _serve(d / "r.sock")
    assert out.returncode == 1 and "has mode 0750; it must be 0700" in out.stderr


@e2e
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another uid")
def test_directory_of_another_user_is_refused(workdir: Path) -> None:
    d = workdir / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    out = _serve(d / "r.sock")
    assert out.returncode == 1 and "belongs to uid 65534" in out.stderr


@e2e
def test_modes_hold_under_a_permissive_umask(workdir: Path) -> None:
    sub = workdir / "sub"
    p = subprocess.Popen([sys.executable, "-m", "ft_monitor.cli", "serve", "--socket", str(sub / "r.sock")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, start_new_session=True,
                         umask=0)
    try:
        wait_until(lambda: ping(sub / "r.sock"), 20, "the daemon")
        assert (os.stat(sub).st_mode & 0o777) == 0o700
        assert (os.lstat(sub / "r.sock").st_mode & 0o777) == 0o600
        assert (os.stat(sub / "reports").st_mode & 0o077) == 0, oct(os.stat(sub / "reports").st_mode)
    finally:
        p.terminate()
        p.wait(10)


@e2e
def test_socket_replaced_by_a_symlink_while_serving_is_left_alone_at_shutdown(workdir: Path) -> None:
    d = Daemon(workdir).wait_ready()
    victim = workdir / "victim.txt"
    victim.write_text("precious\n")
    os.unlink(d.socket)
    d.socket.symlink_to(victim)
    assert d.stop() == 0
    assert d.socket.is_symlink() and victim.read_text() == "precious\n"


@e2e
def test_timeouts_update_too_big_for_a_frame_is_refused(workdir: Path) -> None:
    d = Daemon(workdir, "--ft-handshake-timeout", str(HANDSHAKE)).wait_ready()
    try:
        sections = {f"{i:03d}" + "n" * 240: 1000.0 for i in range(256)}  # 256 names of 243 bytes: ~64 KB
        s = raw_client(d.socket)
        try:
            s.sendall(HELLO_RANK)
            read_messages(s, 1)
            s.sendall(wire.encode(wire.UpdateConfig({"rank_section_timeouts": sections})))
            (reply,) = read_messages(s, 1)
        finally:
            s.close()
        assert isinstance(reply, wire.Error) and reply.code == wire.ErrorCode.BAD_REQUEST
        assert "bytes encoded; at most" in reply.message
        wait_no_rank(d.socket)
        c = RankMonitorClient(str(d.socket))  # nothing was put in force: later ranks are served
        c.init_workload_monitoring()
        c.shutdown_workload_monitoring()
    finally:
        d.stop()
