"""A rank's progress record applied to its session (pure: `now` is an argument).

The record (ft_client.record) holds the rank's latest claims: its last heartbeat,
for each registered section slot its latest open and close, its iteration, and
the epoch before which everything is void. `RecordSync` remembers what of it was
applied to the `Session` already and turns each new read (a `RecordView`) into
the session's own events, stamped with the rank's times, in time order: a
heartbeat, a section opened, closed, or opened and closed between two reads.
The session then judges as it does socket events (state.py, policy.py).

It is state-based, not a replay of every store: what reads as open is open,
from the time the rank stamped; opens that happened between two reads are
counted (the warm-up) but only the latest is timed against its deadline.

Counts are exact, not sampled: the rank counts the sections it completes in each
slot and sums their durations (the slot's CLOSES and SUM_NS), and the growth of
those between two reads is what the session's `steps_closed` and the section
statistics take (`Applied.closed`), while the session is ACTIVE, as the socket's
closes are taken; what the rank completed in another phase (hung, restarting,
closing) is passed over, as the socket's closes are then.

What a correct writer on this host cannot claim raises RecordError (the daemon
then stops reading the record, see record_watch.py): a time in the monitor's
future (the rank reads the same CLOCK_MONOTONIC before it stores, the monitor
after it loads), a time before the record was made, a count, time or epoch that
went back, a slot the rank never registered.

`tick_for` is the fine tick on which the monitor reads a record: derived from
the smallest timeout in force, so that an open (or a first heartbeat, or a
close that starts the out-of-section time) is seen well before the deadline it
brings, without waking an idle monitor more than 40 times a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ft_client.record import SLOTS, RecordError
from ft_client.record.read import Heartbeats, RecordView, SlotState
from ft_client.timeouts import STEP_SECTION, Timeouts
from ft_monitor.core.state import Phase, Session, SessionError

SLACK_NS = 1_000_000
"""A time this far past the monitor's clock is still accepted (the float seconds the
monitor's clock is kept in, converted back to nanoseconds)."""
MIN_TICK = 0.001
MAX_TICK = 0.025
TICK_DIVISOR = 20.0


def tick_for(timeouts: Timeouts, startup_timeout: float | None = None) -> float | None:
    """Seconds between reads of a record under ``timeouts``: the smallest one / 20, within
    1 ms .. 25 ms; None when nothing is timed (no read needed until something is)."""
    values = [v for v in (timeouts.initial_rank_heartbeat_timeout, timeouts.rank_heartbeat_timeout,
                          timeouts.rank_out_of_section_timeout, startup_timeout,
                          *timeouts.rank_section_timeouts.values()) if v is not None]
    if not values:
        return None
    return min(MAX_TICK, max(MIN_TICK, min(values) / TICK_DIVISOR))


@dataclass(slots=True)
class Applied:
    """What one read changed, for the daemon's bookkeeping beyond the session."""

    closed: list[tuple[str, int, float]] = field(default_factory=list)
    """(section, sections completed since the last read, their seconds in all), from the
    rank's own counters: every completed section, however many came between two reads."""
    iteration: int | None = None
    """The iteration the rank reported, when it changed."""
    events: int = 0


_CLOSE, _HEARTBEAT, _OPEN = 0, 1, 2
"""Event kinds, in the order applied when two share a time."""


class RecordSync:
    """What the monitor has applied of one rank's record (one per record, one per session)."""

    __slots__ = ("created_ns", "names", "slot_of", "_seen_epoch", "_seen_hb", "_seen", "_hb_count", "_hb_at",
                 "_opens", "_closes", "_held", "_iteration", "_completed")

    def __init__(self, created_ns: int) -> None:
        self.created_ns = created_ns
        self.names: dict[int, str] = {}
        """slot -> section, as the rank registered them (SECTION_SLOT)."""
        self.slot_of: dict[str, int] = {}
        self._seen_epoch = 0
        self._seen_hb = Heartbeats(0, 0)
        self._seen: dict[int, SlotState] = {}
        """The latest stable state read of each registered slot (times and counts only grow)."""
        self._hb_count = 0
        self._hb_at = 0
        """Heartbeats applied to the session: how many, the latest's time (ns)."""
        self._opens: dict[int, int] = {}
        self._closes: dict[int, int] = {}
        self._held: dict[int, int] = {}
        """slot -> the open time (ns) of the section the session holds open from it."""
        self._iteration = -1
        self._completed: dict[int, tuple[int, int]] = {}
        """slot -> (sections completed, their summed ns) taken into account so far."""

    @property
    def slots_in_use(self) -> int:
        """How many slots a read must cover (the highest registered, plus one)."""
        return max(self.names) + 1 if self.names else 0

    def register(self, name: str, slot: int) -> str | None:
        """Section ``name`` reports in ``slot`` from now on; the problem, if it cannot."""
        if not 0 <= slot < SLOTS:
            return f"section {name!r}: slot {slot} is outside 0..{SLOTS - 1}"
        if self.names.get(slot) == name:
            return None
        if slot in self.names:
            return f"section {name!r}: slot {slot} is section {self.names[slot]!r}'s"
        if name in self.slot_of:
            return f"section {name!r} has slot {self.slot_of[name]} already"
        self.names[slot] = name
        self.slot_of[name] = slot
        return None

    # -- one read ------------------------------------------------------------------
    def apply(self, session: Session, view: RecordView, now: float) -> Applied:
        """Apply ``view`` (read at ``now`` on the monitor's clock) to ``session``; only an
        ACTIVE session takes progress, the iteration is taken in any phase. Raises
        RecordError for what a correct writer cannot have stored."""
        self._check(view, round(now * 1e9))
        out = Applied()
        active = session.phase is Phase.ACTIVE
        if active:
            self._apply_progress(session, view, out)
        steps = session.steps_closed
        self._count(session, view, out, active)
        # the iteration after the steps it counts, and not from a read that missed a slot
        if view.iteration >= 0 and not any(
                view.slots[slot] is None for slot in self.names if slot < len(view.slots)):
            changed = view.iteration != self._iteration
            if changed:
                self._iteration = view.iteration
                session.set_iteration(view.iteration)
                out.iteration = view.iteration
            if changed or session.steps_closed != steps:
                # the rank's own iteration and step count, from one read: the session counts on
                # from there. A read can pair them one step apart (a step's slot registered after
                # its iteration was read; the copy's loads are not in address order), and the
                # next read that changes either mends it, the last one included
                session.iteration_base = view.iteration - session.steps_closed
        return out

    def _apply_progress(self, session: Session, view: RecordView, out: Applied) -> None:
        floor = view.epoch_ns
        events: list[tuple[int, int, int, int]] = []
        hb = view.heartbeats
        if hb is not None and hb.count > self._hb_count:
            if hb.at >= floor and hb.at > self._hb_at:
                events.append((hb.at, _HEARTBEAT, -1, hb.count - self._hb_count))
            self._hb_count = hb.count
        for slot, name in self.names.items():
            st = view.slots[slot] if slot < len(view.slots) else None
            if st is not None:
                self._slot_events(session, slot, name, st, floor, events)
        events.sort()
        for at, kind, slot, count in events:
            self._replay(session, at, kind, slot, count, out)

    def _count(self, session: Session, view: RecordView, out: Applied, active: bool) -> None:
        """What the rank completed since the last read, from its counters (torn slots wait
        for the next read); taken by an ACTIVE session, passed over in any other phase."""
        for slot, name in self.names.items():
            st = view.slots[slot] if slot < len(view.slots) else None
            if st is None:
                continue
            count, ns = self._completed.get(slot, (0, 0))
            if st.completed == count:
                continue
            self._completed[slot] = (st.completed, st.completed_ns)
            if not active:
                continue
            n = st.completed - count
            out.closed.append((name, n, (st.completed_ns - ns) / 1e9))
            if name == STEP_SECTION:
                session.steps_closed += n

    def _slot_events(self, session: Session, slot: int, name: str, st: SlotState, floor: int,
                     events: list[tuple[int, int, int, int]]) -> None:
        """The events that take the session from what it holds of ``slot`` to ``st``: (time,
        kind, slot, how many such events it stands for)."""
        new_opens = st.opens - self._opens.get(slot, 0)
        new_closes = st.closes - self._closes.get(slot, 0)
        self._opens[slot] = st.opens
        self._closes[slot] = st.closes
        held = self._held.get(slot)
        cur = session.open_sections.get(name)
        if held is not None and (cur is None or cur.opened_at != held / 1e9):
            del self._held[slot]  # the session let it go (CLOSE_ALL over the socket, a restart)
            held = None
        since = st.open_since(floor)
        if since is not None:
            if held == since:
                return
            if held is not None:  # closed (and maybe opened and closed again) since the last read
                events.append((max(st.closed_at, held), _CLOSE, slot, max(1, new_closes)))
            elif new_closes > 0:  # opens and closes before this open, between two reads (`_count` counts them)
                session.events += new_closes
            events.append((since, _OPEN, slot, max(1, new_opens)))
        elif held is not None:
            if new_opens == 0 or st.opened_at < floor:
                # closed; or abandoned at a reset (an in-process restart): closed at the new epoch
                at = st.closed_at if st.closed_at >= held else max(floor, held)
                events.append((at, _CLOSE, slot, max(1, new_closes)))
            else:  # closed, then opened and closed again since the last read: the latest run is timed
                events.append((st.opened_at, _CLOSE, slot, max(1, new_closes - 1)))
                events.append((st.opened_at, _OPEN, slot, new_opens))
                events.append((st.closed_at, _CLOSE, slot, 1))
        elif new_opens > 0 and cur is None and st.opens and floor <= st.opened_at <= st.closed_at:
            events.append((st.opened_at, _OPEN, slot, new_opens))  # opened and closed between two reads
            events.append((st.closed_at, _CLOSE, slot, max(1, new_closes)))

    def _replay(self, session: Session, at: int, kind: int, slot: int, count: int, out: Applied) -> None:
        t = at / 1e9
        out.events += count
        if kind == _HEARTBEAT:
            session.heartbeat(t)
            session.heartbeats += count - 1
            session.events += count - 1
            self._hb_at = at
            return
        name = self.names[slot]
        step = name == STEP_SECTION
        try:
            if kind == _OPEN:
                if name in session.open_sections:  # opened over the socket before it had a slot
                    session.close_section(name, t)
                if step:
                    session.steps_started += count - 1  # opens between two reads count (warm-up)
                session.open_section(name, t)
                self._held[slot] = at
                session.events += count - 1
            else:  # counted by `_count`, from the rank's counters
                session.close_section(name, t, count=False)
                self._held.pop(slot, None)
                session.events += count - 1
        except SessionError:
            self._held.pop(slot, None)

    # -- what no correct writer stores -------------------------------------------------
    def _check(self, view: RecordView, now_ns: int) -> None:
        limit = now_ns + SLACK_NS
        if view.created_ns != self.created_ns:
            raise RecordError(f"the creation time changed from {self.created_ns} to {view.created_ns} ns")
        self._time("the epoch", view.epoch_ns, self._seen_epoch, limit)
        self._seen_epoch = view.epoch_ns
        hb = view.heartbeats
        if hb is not None:
            if hb.count < self._seen_hb.count:
                raise RecordError(f"the heartbeat count went back from {self._seen_hb.count} to {hb.count}")
            self._time("the last heartbeat", hb.at, self._seen_hb.at, limit)
            self._seen_hb = hb
        for slot, name in self.names.items():
            st = view.slots[slot] if slot < len(view.slots) else None
            if st is None:
                continue
            seen = self._seen.get(slot)
            if seen is not None and st.opens < seen.opens:
                raise RecordError(f"section {name!r} (slot {slot}): its open count went back from {seen.opens} to "
                                  f"{st.opens}")
            if seen is not None and (st.completed < seen.completed or st.completed_ns < seen.completed_ns):
                raise RecordError(f"section {name!r} (slot {slot}): its completed count or time went back from "
                                  f"{seen.completed} ({seen.completed_ns} ns) to {st.completed} ({st.completed_ns} ns)")
            if st.completed_ns > st.completed * max(0, st.closed_at - self.created_ns):
                raise RecordError(f"section {name!r} (slot {slot}): {st.completed} section(s) completed by "
                                  f"{st.closed_at} ns cannot have taken {st.completed_ns} ns since the record was "
                                  f"made at {self.created_ns} ns")
            self._time(f"section {name!r} (slot {slot}) opening", st.opened_at, seen.opened_at if seen else 0, limit)
            self._time(f"section {name!r} (slot {slot}) closing", st.closed_at, seen.closed_at if seen else 0, limit)
            self._seen[slot] = st

    def _time(self, what: str, t: int, before: int, limit: int) -> None:
        if t == 0:
            if before:
                raise RecordError(f"{what} went back from {before} ns to 0")
            return
        if t > limit:
            raise RecordError(f"{what} is stamped {(t - limit + SLACK_NS) / 1e9:.3f} s in the future of the "
                              "monitor's clock")
        if t < self.created_ns:
            raise RecordError(f"{what} is stamped {(self.created_ns - t) / 1e9:.3f} s before the record was made")
        if t < before:
            raise RecordError(f"{what} went back by {(before - t) / 1e9:.6f} s")
