"""How the daemon uses a rank's progress record (ft_client.record).

* At the handshake (`offer`, `send_hello_ok`): a rank that asks for a record (its
  HELLO info says ``record: 1``) gets one with HELLO_OK, unless the config says
  ``progress_record: false`` or none can be made here (record_map.py says why,
  logged once); HELLO_OK's ``record`` key says which.
* `sync`: read the record (as held: rank_record.py) and apply it to the session
  (record_sync.py). The daemon calls it on the fine tick (`tick`), when a deadline
  comes due, before each message of the rank's (so the socket's order holds: a PONG
  confirms what was stored before the PING), before answering STATUS, and once more
  when the rank's connection closes (what it stored before it exited is counted).
* A record that no correct writer could have left (record_sync's RecordError)
  is read no more: one ERROR line says why, and the rank is told (RECORD_REFUSED
  on its connection), as a rank that cannot use its record tells the monitor at
  the handshake (RECORD_DECLINED): it reports through the socket from then on and
  is judged on what it sends there. The session keeps what it had applied except
  the sections the record held open (the rank opens them again on the socket);
  its heartbeat and out-of-section intervals are timed from the refusal, and a
  hang found with nothing sent since says "record refused". The monitor never
  crashes on a record's content: it reads copies of it, decoded with bounds
  checked.
* SECTION_SLOT registers a section's slot; RECORD_DECLINED (the rank could not
  use the record) drops it, with one WARNING line.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ft_client import record, wire
from ft_client.record import RecordError
from ft_client.session_info import RecordInfo, SessionInfo
from ft_monitor.core.record_sync import tick_for
from ft_monitor.core.server_log import printable
from ft_monitor.core.state import Phase, SessionError
from ft_monitor.daemon.ports import RecordHost
from ft_monitor.daemon.rank_record import RankRecord
from ft_monitor.daemon.record_map import RecordUnavailable, create_record

if TYPE_CHECKING:
    from ft_monitor.daemon.rank import RankResources

log = logging.getLogger("ft_monitor.server")

INFO = RecordInfo(record.VERSION, record.SIZE, record.SLOTS)
_logged: set[str] = set()


# -- the handshake ---------------------------------------------------------------------
def offer(d: RecordHost, info: dict[str, Any]) -> tuple[int, RankRecord] | None:
    """A record for the rank whose HELLO carried ``info``, if it asked and one can be made."""
    asked = info.get("record")
    if not d.config.progress_record or isinstance(asked, bool) or asked != record.VERSION:
        return None
    created = round(d.clock.now() * 1e9)
    try:
        fd, mapping = create_record(created)
    except RecordUnavailable as e:
        reason = str(e)
        if reason not in _logged:
            _logged.add(reason)
            log.warning("no progress record for the ranks of this monitor (%s); their progress goes through the "
                        "socket", reason)
        return None
    return fd, RankRecord(mapping, created)


def send_hello_ok(rank: RankResources, info: SessionInfo, offered: tuple[int, RankRecord] | None) -> None:
    """HELLO_OK to a new rank: with its record attached when one was made, else without."""
    conn = rank.conn
    if offered is not None:
        fd, rr = offered
        try:
            sent = conn.send_with_fd(wire.HelloOk(wire.PROTOCOL_VERSION, info.to_wire()), fd)
        finally:
            os.close(fd)  # the rank holds it now (or nobody does)
        if sent:
            rank.record = rr
            log.info("rank %d pid %d reports progress through a shared-memory record", info.rank, info.pid)
            return
        rr.close()
        reason = "the record could not be passed over the socket (SCM_RIGHTS)"
        if reason not in _logged:
            _logged.add(reason)
            log.warning("no progress record for rank %d pid %d: %s; its progress goes through the socket",
                        info.rank, info.pid, reason)
        info = replace(info, record=None)
    conn.send(wire.HelloOk(wire.PROTOCOL_VERSION, info.to_wire()))


# -- reading ---------------------------------------------------------------------------
def sync(d: RecordHost, rank: RankResources) -> None:
    """Apply what the rank stored since the last read; refuse a record that breaks the rules."""
    rr = rank.record
    if rr is None:
        return
    try:
        applied = rr.apply(rank.session, d.clock.now)
    except RecordError as e:
        refuse(rank, str(e), d.clock.now())
        return
    if applied is None:
        return
    for name, count, total in applied.closed:
        d.section_stats.record_many(name, count, total)
    if applied.iteration is not None and (d.iteration_high is None or applied.iteration > d.iteration_high):
        d.iteration_high = applied.iteration


def refuse(rank: RankResources, reason: str, now: float) -> None:
    """Read the record no more and tell the rank, which reports through the socket from now."""
    s = rank.session
    log.error("rank %d pid %d: its progress record is corrupt (%s); it is read no more: the rank is told and "
              "reports through the socket from now on, judged on what it sends there", s.rank, s.pid, reason)
    rr = rank.record
    s.refuse_record(reason, now, set(rr.sync.names.values()) if rr is not None else set())
    drop(rank)
    rank.conn.send(wire.RecordRefused(reason[:512]))


def drop(rank: RankResources) -> None:
    rr, rank.record = rank.record, None
    if rr is not None:
        rr.close()


def tick(rank: RankResources) -> float | None:
    """Seconds until the record should be read again, or None (no record, or nothing timed now)."""
    if rank.record is None or rank.session.phase is not Phase.ACTIVE:
        return None
    s = rank.session
    startup = s.startup_timeout if s.startup_since is not None else None
    cached = rank.record._tick
    if cached is None or cached[0] is not s.timeouts or cached[1] != startup:
        cached = rank.record._tick = (s.timeouts, startup, tick_for(s.timeouts, startup))
    return cached[2]


# -- the rank's messages about it ----------------------------------------------------------
def section_slot(d: RecordHost, rank: RankResources, msg: wire.SectionSlot) -> None:
    rr = rank.record
    if rr is None:
        return  # declined or refused: the rank's stores are not read
    problem = rr.sync.register(msg.name, msg.slot)
    if problem is not None:
        raise SessionError(problem)
    sync(d, rank)


def declined(d: RecordHost, rank: RankResources, msg: wire.RecordDeclined) -> None:
    if rank.record is None:
        return
    s = rank.session
    log.warning("rank %d pid %d cannot use its progress record (%s); its progress comes through the socket",
                s.rank, s.pid, printable(msg.reason[:512]))
    drop(rank)
