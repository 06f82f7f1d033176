"""The client's hot path: heartbeats and section opens/closes, stored into the progress
record (a few stores, no syscall) or sent as frames on the socket.

Inlined by hand for speed: each call is one method of the client (a mixin of
`RankMonitorClient`, looked up on its class) that touches the record's words itself.
Keep it so: no call in between, no attribute looked up that a store does not need.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ft_client import record, wire
from ft_client.client.state import ITERATION_REPORT_INTERVAL, ClientState
from ft_client.client.state import SOCKET as _SOCKET
from ft_client.client.state import UNSENT as _UNSENT
from ft_client.errors import RankMonitorClientError
from ft_client.timeouts import STEP_SECTION

F = TypeVar("F", bound=Callable[..., Any])

_now_ns = time.monotonic_ns
_HB_SEQ, _HB_AT, _ITERATION = record.W_HB_SEQ, record.W_HB_AT, record.W_ITERATION
_OPENED_AT, _CLOSED_AT, _CLOSES, _SUM_NS = record.OPENED_AT, record.CLOSED_AT, record.CLOSES, record.SUM_NS
_CLOSE_ALL_FRAME = wire.encode(wire.SECTION_CLOSE_ALL)


class _Section:
    """``client.section(name)``: a context manager that is also a decorator."""

    __slots__ = ("_client", "_name")

    def __init__(self, client: ClientProgress, name: str) -> None:
        self._client = client
        self._name = name

    def __enter__(self) -> None:
        self._client.start_section(self._name)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self._client.end_section(self._name)
        else:  # left by an exception: closed (not timed any more), but not a completed step
            self._client._end_section_unfinished(self._name)

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class ClientProgress(ClientState):
    """`RankMonitorClient`'s progress calls."""

    # -- progress --------------------------------------------------------------
    # Each call takes the lock explicitly (cheaper than `with`, which matters at a few
    # hundred nanoseconds a call). With a record and no restart under way, the fast path
    # is: learn, store. Otherwise the transport is checked (raising before init), the
    # restart gate applied, and the event sent or stored.
    def send_heartbeat(self) -> None:
        lock = self._lock
        lock.acquire()
        try:
            rec = self._record
            if rec is not None and self._restart is None:  # the fast path: learn, store
                now = _now_ns()
                self._calc.on_heartbeat(now * 1e-9 if self._mono else self._clock())
                w = rec.words  # RecordWriter.heartbeat, inlined: this runs at every call
                seq = rec.hb_seq + 1
                w[_HB_SEQ] = seq
                w[_HB_AT] = now
                w[_HB_SEQ] = rec.hb_seq = seq + 1
                if self._sync_sections:
                    self._confirm()
                return
            t = self._transport or self._not_connected()
            if self._restart is not None and self._restart_gate(t):
                return
            self._calc.on_heartbeat(self._clock())
            rec = self._record
            if rec is not None:
                rec.heartbeat(_now_ns())
                if self._sync_sections:
                    self._confirm()
            elif self._transport is not None:
                self._event(self._transport, wire.HEARTBEAT_FRAME)
        finally:
            lock.release()

    def start_section(self, section: str) -> None:
        name = section
        lock = self._lock
        lock.acquire()
        try:
            if name in self._open:
                raise RankMonitorClientError(f"section {name!r} is already open; end_section({name!r}) first")
            rec = self._record
            if rec is not None and self._restart is None:
                now = _now_ns()
                self._calc.on_section_open(name, now * 1e-9 if self._mono else self._clock())
                slot = self._slots.get(name)
                if slot is not None:  # the fast path: a registered section
                    self._open[name] = slot
                    w, seqs = rec.words, rec.seqs  # RecordWriter.open_word, inlined: this runs at every call
                    seq = seqs[slot] + 1
                    w[slot] = seq
                    w[slot + _OPENED_AT] = now
                    w[slot] = seqs[slot] = seq + 1
                    if self._sync_sections:
                        self._confirm()
                    return
            else:
                t = self._transport or self._not_connected()
                if self._restart is not None and self._restart_gate(t):
                    self._open[name] = _UNSENT
                    return
                self._calc.on_section_open(name, self._clock())
            self._open[name] = _UNSENT
            if name not in self._ipc:
                return
            rec = self._record
            if rec is not None:
                slot = self._slots.get(name)
                if slot is None:
                    slot = self._register_slot(name)
                if slot is not None and self._record is rec:
                    self._open[name] = slot
                    rec.open_word(slot, _now_ns())
                    if self._sync_sections:
                        self._confirm()
                    return
            t = self._transport
            if t is not None:
                self._open[name] = _SOCKET
                frame = self._open_frames.get(name)
                if frame is None:
                    frame = self._open_frames[name] = self._section_frame(name, wire.section_open_frame)
                self._event(t, frame)
        finally:
            lock.release()

    def end_section(self, section: str) -> None:
        name = section
        lock = self._lock
        lock.acquire()
        try:
            route = self._open.pop(name, None)
            if route is None:
                raise RankMonitorClientError(f"section {name!r} is not open; start_section({name!r}) first")
            rec = self._record
            if rec is not None and self._restart is None:  # the fast path: learn, store
                now_ns = _now_ns()
                self._calc.on_section_close(name, now_ns * 1e-9 if self._mono else self._clock())
                w = rec.words
                if route >= 0:  # RecordWriter.close_word, inlined: this runs at every call
                    seqs = rec.seqs
                    seq = seqs[route] + 1
                    w[route] = seq
                    w[route + _CLOSED_AT] = now_ns
                    w[route + _CLOSES] += 1  # counted by the rank: the monitor's reads may miss it
                    w[route + _SUM_NS] += now_ns - w[route + _OPENED_AT]
                    w[route] = seqs[route] = seq + 1
                if name == STEP_SECTION:
                    self._iteration += 1
                    w[_ITERATION] = self._iteration
                if route == _SOCKET:
                    self._send_close(name)
                elif route >= 0 and self._sync_sections:
                    self._confirm()
                return
            t = self._transport or self._not_connected()
            if self._restart is not None and self._restart_gate(t):
                return
            now = self._clock()
            self._calc.on_section_close(name, now)
            step = name == STEP_SECTION
            if step:
                self._iteration += 1
            rec = self._record
            if rec is not None:  # REENTERED was just sent
                if route >= 0:
                    rec.close_word(route, _now_ns())
                if step:
                    rec.words[record.W_ITERATION] = self._iteration
                if route == _SOCKET:
                    self._send_close(name)
                elif route >= 0 and self._sync_sections:
                    self._confirm()
                return
            t = self._transport
            if t is None:
                return
            if route == _SOCKET:
                self._send_close(name)
            if step and now - self._iteration_sent_at >= ITERATION_REPORT_INTERVAL:
                self._iteration_sent_at = now
                self._event(t, wire.encode(wire.Iteration(self._iteration)))
        finally:
            lock.release()

    def _send_close(self, name: str) -> None:
        t = self._transport
        if t is None:
            return
        frame = self._close_frames.get(name)
        if frame is None:
            frame = self._close_frames[name] = self._section_frame(name, wire.section_close_frame)
        self._event(t, frame)

    def end_all_sections(self) -> None:
        """Close every open section, here and in the monitor."""
        with self._lock:
            t = self._transport or self._not_connected()
            routes = list(self._open.values())
            self._open.clear()
            if self._restart is not None and self._restart_gate(t):
                return
            self._calc.on_close_all(self._clock())
            rec = self._record
            if rec is not None:
                now = _now_ns()
                for route in routes:
                    if route >= 0:
                        rec.abandon_word(route, now)  # as CLOSE_ALL: closed, not counted as completed
                if _SOCKET not in routes:
                    if self._sync_sections:
                        self._confirm()
                    return
            if t is not None:
                self._event(t, _CLOSE_ALL_FRAME)

    def _register_slot(self, name: str) -> int | None:
        """Give a monitored section a slot of the record and tell the monitor (once per
        record); its SEQ word, or None when every slot is taken (the section reports
        through the socket)."""
        t = self._transport
        if len(self._slots) >= record.SLOTS or t is None:
            return None
        slot = len(self._slots)
        try:
            frame = wire.encode(wire.SectionSlot(name, slot))
        except wire.ProtocolError as e:
            raise RankMonitorClientError(f"bad section name {name!r}: {e}") from e
        self._event(t, frame)
        if self._record is None:  # the monitor went away meanwhile
            return None
        word = self._slots[name] = record.slot_word(slot)
        return word

    def _end_section_unfinished(self, name: str) -> None:
        """A section an exception left (``with client.section("step")`` that raised): closed as
        by end_section, so that it is not timed any more, but a ``step`` left this way is not a
        completed iteration: the count (in the rank, its progress record, and its monitor, which
        counts the closes it sees on the socket and is told the count) stays where it was. Off
        the hot path: end_section is unchanged."""
        before = self._iteration
        self.end_section(name)
        if name != STEP_SECTION or self._iteration != before + 1:
            return
        lock = self._lock
        lock.acquire()
        try:
            self._iteration = before
            rec = self._record
            if rec is not None:
                rec.words[_ITERATION] = before
            elif self._transport is not None:  # the monitor counted the close: the count it should keep
                self._event(self._transport, wire.encode(wire.Iteration(before)))
        finally:
            lock.release()

    def section(self, name: str) -> _Section:
        """``with client.section("step"): ...`` or ``@client.section("step")``."""
        return _Section(self, name)

    @property
    def iteration(self) -> int:
        """Training iterations so far: completed `step` sections, counted on from the
        checkpoint loaded with load_state_dict(). Reported to the monitor at most five
        times a second; the launcher uses it to tell restarts that make progress from ones that don't."""
        return self._iteration

    @staticmethod
    def _section_frame(name: str, build: Callable[[str], bytes]) -> bytes:
        try:
            return build(name)
        except wire.ProtocolError as e:
            raise RankMonitorClientError(f"bad section name {name!r}: {e}") from e
