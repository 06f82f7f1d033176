"""A progress record applied to a session (ft_monitor.core.record_sync): pure, plain numbers.

The central property: whatever the rank did between two reads, once a read is
applied the session is under exactly the deadlines it would be under had every
event come over the socket, stamped with the same times (hypothesis, against a
session fed event by event).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft_client import record
from ft_client.record import RecordError, RecordWriter
from ft_client.record.read import RecordView, decode
from ft_client.timeouts import Timeouts
from ft_monitor.core.policy import Reason, check, deadlines
from ft_monitor.core.policy import iteration_now as policy_iteration_now
from ft_monitor.core.record_sync import MAX_TICK, MIN_TICK, RecordSync, tick_for
from ft_monitor.core.section_stats import SectionStats
from ft_monitor.core.state import Phase, Session

S = 1_000_000_000  # ns per second
T0 = 1000.0
CREATED = int(T0 * S)
NAMES = ("step", "data", "ckpt")


def timeouts(**kw: Any) -> Timeouts:
    base: dict[str, Any] = {"rank_heartbeat_timeout": 5.0, "initial_rank_heartbeat_timeout": 20.0,
                            "rank_section_timeouts": {"step": 3.0, "data": 1.0, "ckpt": None, "warmup": 9.0},
                            "rank_out_of_section_timeout": 4.0}
    base.update(kw)
    return Timeouts.from_wire(base)


def session(**kw: Any) -> Session:
    return Session(rank=0, pid=1, started_at=T0, timeouts=timeouts(**kw), num_warmup_iterations=2)


class Rank:
    """The rank's side: a writer over plain memory, times in seconds on the shared clock."""

    def __init__(self) -> None:
        self.buf = bytearray(record.SIZE)
        self.buf[:64] = record.initial_header(CREATED)
        self.w = RecordWriter(memoryview(self.buf).cast("q"), self.buf)
        self.sync = RecordSync(CREATED)
        for slot, name in enumerate(NAMES):
            assert self.sync.register(name, slot) is None

    def hb(self, t: float) -> None:
        self.w.heartbeat(round(t * S))

    def open(self, name: str, t: float) -> None:
        self.w.open(NAMES.index(name), round(t * S))

    def close(self, name: str, t: float) -> None:
        self.w.close(NAMES.index(name), round(t * S))

    def view(self) -> RecordView:
        b = bytes(self.buf)
        return decode(b, b, b, len(NAMES))

    def apply(self, s: Session, now: float) -> Any:
        return self.sync.apply(s, self.view(), now)


def test_a_heartbeat_counts_from_the_time_the_rank_stamped_not_from_the_read() -> None:
    r, s = Rank(), session(rank_out_of_section_timeout=None)
    r.hb(T0 + 1.0)
    r.apply(s, T0 + 1.02)
    assert s.last_heartbeat == T0 + 1.0 and s.heartbeats == 1
    assert check(s, T0 + 5.999) is None
    hang = check(s, T0 + 6.0)
    assert hang is not None and hang.reason is Reason.HEARTBEAT and hang.onset == T0 + 1.0


def test_an_open_section_is_timed_from_its_open_and_a_close_stops_it() -> None:
    r, s = Rank(), session()
    r.open("data", T0 + 2.0)
    applied = r.apply(s, T0 + 2.01)
    assert list(s.open_sections) == ["data"] and s.open_sections["data"].opened_at == T0 + 2.0
    assert applied.closed == []
    r.close("data", T0 + 2.5)
    applied = r.apply(s, T0 + 2.51)
    assert s.open_sections == {} and applied.closed == [("data", 1, 0.5)]
    assert s.out_of_section_since == T0 + 2.5


def test_steps_between_two_reads_are_all_counted_and_the_warm_up_ends_on_time() -> None:
    r, s = Rank(), session()
    t = T0
    for _ in range(3):  # three steps between two reads; the third is past the 2 warm-up steps
        t += 0.1
        r.open("step", t)
        t += 0.1
        r.close("step", t)
    r.open("step", t + 0.1)
    r.apply(s, t + 0.2)
    assert s.steps_started == 4 and s.steps_closed == 3
    assert s.open_sections["step"].timeout == 3.0 and not s.open_sections["step"].warmup


def test_the_first_steps_get_the_warm_up_timeout() -> None:
    r, s = Rank(), session()
    r.open("step", T0 + 0.1)
    r.apply(s, T0 + 0.2)
    assert s.open_sections["step"].warmup and s.open_sections["step"].timeout == 9.0


def test_a_section_closed_and_opened_again_between_reads_is_timed_from_the_new_open() -> None:
    r, s = Rank(), session()
    r.open("data", T0 + 1.0)
    r.apply(s, T0 + 1.1)
    r.close("data", T0 + 1.5)
    r.open("data", T0 + 1.6)
    applied = r.apply(s, T0 + 1.7)
    assert s.open_sections["data"].opened_at == T0 + 1.6 and applied.closed == [("data", 1, 0.5)]
    assert check(s, T0 + 2.59) is None and check(s, T0 + 2.6) is not None


def test_a_new_epoch_voids_what_was_open_before_it() -> None:
    r, s = Rank(), session()
    r.open("data", T0 + 1.0)
    r.apply(s, T0 + 1.1)
    s.begin_restart(T0 + 1.2, 30.0)  # the monitor's verdict, or the rank's RESTARTING
    r.hb(T0 + 1.3)  # stores while unwinding do not happen (the client's gate); a stale one is ignored anyway
    r.w.reset(int((T0 + 2.0) * S))  # re-entry: the client closes what it abandoned, stamps the epoch
    r.apply(s, T0 + 2.1)  # still RESTARTING: nothing is taken
    assert s.phase is Phase.RESTARTING and s.last_heartbeat is None
    s.reentered(1, T0 + 2.2)  # REENTERED came over the socket
    r.apply(s, T0 + 2.3)
    assert s.open_sections == {} and s.last_heartbeat is None, "stale progress applied after re-entry"
    r.hb(T0 + 2.4)
    r.open("data", T0 + 2.5)
    r.apply(s, T0 + 2.6)
    assert s.last_heartbeat == T0 + 2.4 and s.open_sections["data"].opened_at == T0 + 2.5


def test_an_open_stamped_before_the_epoch_reads_as_closed_even_if_the_slot_says_open() -> None:
    buf = bytearray(record.SIZE)
    buf[:64] = record.initial_header(CREATED)
    w = RecordWriter(memoryview(buf).cast("q"), buf)
    w.open(0, CREATED + S)
    memoryview(buf).cast("q")[record.W_EPOCH] = CREATED + 2 * S  # an epoch without the closes
    sync, s = RecordSync(CREATED), session()
    sync.register("step", 0)
    b = bytes(buf)
    sync.apply(s, decode(b, b, b, 1), T0 + 3)
    assert s.open_sections == {}


def test_only_an_active_session_takes_progress_but_the_iteration_is_taken_in_any_phase() -> None:
    r, s = Rank(), session()
    s.mark_hung()
    r.hb(T0 + 1)
    r.w.iteration(7)
    applied = r.apply(s, T0 + 1.1)
    assert s.heartbeats == 0 and s.iteration == 7 and applied.iteration == 7
    assert r.apply(s, T0 + 1.2).iteration is None  # unchanged


def test_a_torn_group_keeps_what_was_known() -> None:
    r, s = Rank(), session()
    r.open("data", T0 + 1)
    r.apply(s, T0 + 1.1)
    before = bytes(r.buf)
    r.close("data", T0 + 1.2)
    sync_view = decode(before, bytes(r.buf), bytes(r.buf), len(NAMES))
    assert sync_view.slots[1] is None
    r.sync.apply(s, sync_view, T0 + 1.3)
    assert "data" in s.open_sections


@pytest.mark.parametrize(("store", "error"), [
    (lambda r: r.hb(T0 + 60), "the last heartbeat is stamped 59.000 s in the future"),
    (lambda r: r.open("data", T0 - 5), "stamped 5.000 s before the record was made"),
    (lambda r: memoryview(r.buf).cast("q").__setitem__(record.W_CREATED, CREATED + 1), "creation time changed"),
    (lambda r: memoryview(r.buf).cast("q").__setitem__(record.W_EPOCH, CREATED + 100 * S), "epoch is stamped"),
])
def test_what_no_correct_writer_stores_is_refused(store: Any, error: str) -> None:
    r, s = Rank(), session()
    store(r)
    with pytest.raises(RecordError, match=error):
        r.apply(s, T0 + 1.0)


def test_times_and_counts_that_go_back_are_refused() -> None:
    r, s = Rank(), session()
    r.hb(T0 + 1.0)
    r.apply(s, T0 + 1.1)
    memoryview(r.buf).cast("q")[record.W_HB_AT] = int((T0 + 0.5) * S)
    with pytest.raises(RecordError, match="the last heartbeat went back by 0.5"):
        r.apply(s, T0 + 1.2)
    r2, s2 = Rank(), session()
    r2.open("data", T0 + 1)
    r2.close("data", T0 + 2)
    r2.apply(s2, T0 + 3)
    memoryview(r2.buf).cast("q")[record.slot_word(1)] = 2  # one write instead of two
    memoryview(r2.buf).cast("q")[record.slot_word(1) + record.CLOSED_AT] = 0
    memoryview(r2.buf).cast("q")[record.slot_word(1) + record.CLOSES] = 0
    memoryview(r2.buf).cast("q")[record.slot_word(1) + record.SUM_NS] = 0
    with pytest.raises(RecordError, match="open count went back|closing went back|completed count or time went back"):
        r2.apply(s2, T0 + 3)


def test_registering_slots() -> None:
    sync = RecordSync(CREATED)
    assert sync.register("step", 0) is None and sync.register("step", 0) is None  # idempotent
    assert sync.register("data", 0) == "section 'data': slot 0 is section 'step''s"
    assert sync.register("step", 1) == "section 'step' has slot 0 already"
    assert sync.register("x", record.SLOTS) == f"section 'x': slot {record.SLOTS} is outside 0..{record.SLOTS - 1}"
    assert sync.register("x", -1) is not None and sync.slots_in_use == 1


def test_the_tick_follows_the_smallest_timeout_within_bounds() -> None:
    assert tick_for(Timeouts()) is None
    assert tick_for(timeouts()) == MAX_TICK
    assert tick_for(timeouts(rank_section_timeouts={"data": 0.2})) == pytest.approx(0.01)
    assert tick_for(timeouts(rank_section_timeouts={"data": 0.001})) == MIN_TICK
    assert tick_for(Timeouts(), startup_timeout=0.1) == pytest.approx(0.005)


# -- the record path gives the socket path's deadlines (hypothesis) ------------------------
EVENTS = st.lists(st.tuples(st.sampled_from(["hb", "toggle:step", "toggle:data", "toggle:ckpt", "read"]),
                            st.integers(1, 400)), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(EVENTS)
def test_after_each_read_the_deadlines_are_those_of_every_event_sent_over_the_socket(
        events: list[tuple[str, int]]) -> None:
    r, via_record, via_socket = Rank(), session(), session()
    is_open: set[str] = set()
    counted: dict[str, list[float]] = {"record": [0, 0.0], "socket": [0, 0.0]}
    t_ns = CREATED
    t = T0
    for what, ms in events:
        t_ns += ms * 1_000_000
        t = t_ns / S  # the time both paths see: the record stores t_ns, the socket path takes t
        if what == "hb":
            r.hb(t)
            via_socket.heartbeat(t)
        elif what.startswith("toggle:"):
            name = what.split(":")[1]
            if name in is_open:
                is_open.discard(name)
                r.close(name, t)
                took = via_socket.close_section(name, t)
                assert took is not None
                counted["socket"][0] += 1
                counted["socket"][1] += took
            else:
                is_open.add(name)
                r.open(name, t)
                via_socket.open_section(name, t)
        else:
            for _, n, total in r.apply(via_record, t).closed:
                counted["record"][0] += n
                counted["record"][1] += total
            assert sorted(deadlines(via_record), key=repr) == sorted(deadlines(via_socket), key=repr)
            assert via_record.steps_started == via_socket.steps_started
            assert via_record.steps_closed == via_socket.steps_closed
            assert via_record.heartbeats == via_socket.heartbeats
            assert counted["record"][0] == counted["socket"][0]  # every close, however many between reads
            assert counted["record"][1] == pytest.approx(counted["socket"][1], abs=1e-6)
    r.apply(via_record, t)
    assert sorted(deadlines(via_record), key=repr) == sorted(deadlines(via_socket), key=repr)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, record.words_for(len(NAMES)) - 1), st.integers(-2**63, 2**63 - 1)),
                max_size=8))
def test_a_record_scribbled_over_is_applied_or_refused_never_anything_else(scribbles: list[tuple[int, int]]) -> None:
    r, s = Rank(), session()
    r.open("step", T0 + 1)
    r.hb(T0 + 1.5)
    r.apply(s, T0 + 2)
    words = memoryview(r.buf).cast("q")
    for i, v in scribbles:
        words[i] = v
    try:
        r.apply(s, T0 + 3)
    except RecordError:
        pass


def test_the_iteration_is_taken_after_the_steps_it_counts() -> None:
    """The first report of a session sets iteration_base (= report - steps closed before it):
    a step and the iteration it completed, read together, give the iteration it started from."""
    r, s = Rank(), session()
    r.open("step", T0 + 1)
    r.close("step", T0 + 2)
    r.w.iteration(11)  # resumed from a checkpoint at 10: the first step makes it 11
    r.apply(s, T0 + 3)
    assert s.iteration == 11 and s.steps_closed == 1 and s.iteration_base == 10


def test_an_iteration_read_with_a_torn_slot_waits_for_the_next_read() -> None:
    r, s = Rank(), session()
    r.open("step", T0 + 1)
    r.apply(s, T0 + 1.5)
    before = bytes(r.buf)
    r.close("step", T0 + 2)
    r.w.iteration(11)
    view = decode(before, bytes(r.buf), bytes(r.buf), len(NAMES))  # the step's slot torn
    assert view.slots[0] is None
    assert r.sync.apply(s, view, T0 + 3).iteration is None and s.iteration is None
    r.apply(s, T0 + 3.1)
    assert s.iteration == 11 and s.iteration_base == 10


# -- counts are the rank's, not the reads' ------------------------------------------------------
def test_steps_far_shorter_than_the_tick_are_all_counted_with_their_time() -> None:
    """200 steps of 1 ms, the record read every 25 ms (the longest tick): every step is
    counted and its time summed, as the socket would have, though most come and go
    between two reads; the section statistics file them at their mean."""
    r, s = Rank(), session(rank_section_timeouts={"step": 30.0})
    stats = SectionStats()
    t = T0
    next_read = T0 + MAX_TICK
    for i in range(200):
        r.open("step", t)
        r.close("step", t + 0.001)
        r.w.iteration(i + 1)
        t += 0.002
        if t >= next_read:
            for name, n, total in r.apply(s, t).closed:
                stats.record_many(name, n, total)
            next_read += MAX_TICK
    for name, n, total in r.apply(s, t).closed:
        stats.record_many(name, n, total)
    step = stats.get("step")
    assert step is not None and step.count == 200 and sum(step.buckets) == 200
    assert step.sum_s == pytest.approx(0.2, abs=1e-6) and step.median_recent() == pytest.approx(0.001)
    assert s.steps_closed == 200 and s.iteration == 200 and s.iteration_base == 0
    assert policy_iteration_now(s) == 200


def test_closes_that_complete_nothing_are_not_counted() -> None:
    """``end_all_sections`` and a reset's closes close a slot without completing a section
    (the socket's CLOSE_ALL counts none either)."""
    r, s = Rank(), session()
    r.open("step", T0 + 1)
    r.w.abandon_word(record.slot_word(0), round((T0 + 2) * S))  # end_all_sections
    r.open("data", T0 + 3)
    r.w.reset(round((T0 + 4) * S))
    view = r.view()
    assert view.slots[0] is not None and (view.slots[0].closes, view.slots[0].completed) == (1, 0)
    applied = r.apply(s, T0 + 5)
    assert applied.closed == [] and s.steps_closed == 0


def test_what_the_rank_completes_outside_an_active_session_is_passed_over() -> None:
    """As the socket's closes are while a session is hung or restarting: not counted then,
    nor later."""
    r, s = Rank(), session()
    r.open("step", T0 + 1)
    r.close("step", T0 + 1.5)
    assert r.apply(s, T0 + 2).closed == [("step", 1, 0.5)]
    s.mark_hung()
    r.open("step", T0 + 3)
    r.close("step", T0 + 3.25)
    assert r.apply(s, T0 + 4).closed == [] and s.steps_closed == 1
    s.phase = Phase.ACTIVE
    r.open("step", T0 + 5)
    r.close("step", T0 + 5.75)
    assert r.apply(s, T0 + 6).closed == [("step", 1, 0.75)] and s.steps_closed == 2


@pytest.mark.parametrize(("completed", "sum_ns", "error"), [
    (0, 0, "completed count or time went back"),
    (1, 0, "completed count or time went back"),
    (1, 10**15, "cannot have taken"),
])
def test_counts_that_go_back_or_cannot_be_are_refused(completed: int, sum_ns: int, error: str) -> None:
    r, s = Rank(), session()
    r.open("data", T0 + 1)
    r.close("data", T0 + 2)
    r.apply(s, T0 + 3)
    words = memoryview(r.buf).cast("q")
    words[record.slot_word(1) + record.CLOSES] = completed
    words[record.slot_word(1) + record.SUM_NS] = sum_ns
    with pytest.raises(RecordError, match=error):
        r.apply(s, T0 + 3)


def test_an_iteration_read_before_its_step_slot_was_registered_is_mended_by_the_next_read() -> None:
    """The rank sends SECTION_SLOT, then stores its first step and iteration; a tick may read
    the record before the daemon has read the SECTION_SLOT: the iteration comes without the
    step that made it. The read after the registration pairs them again."""
    r, s = Rank(), session(rank_section_timeouts={"step": 30.0})
    r.sync = RecordSync(CREATED)  # nothing registered yet
    r.open("step", T0 + 1)
    r.close("step", T0 + 1.5)
    r.w.iteration(11)
    r.apply(s, T0 + 2)
    assert s.iteration == 11 and s.steps_closed == 0
    assert r.sync.register("step", 0) is None
    r.apply(s, T0 + 2.1)
    assert s.steps_closed == 1 and policy_iteration_now(s) == 11 and s.iteration_base == 10
    for i in range(3):
        r.open("step", T0 + 3 + i)
        r.close("step", T0 + 3.5 + i)
        r.w.iteration(12 + i)
    r.apply(s, T0 + 7)
    assert s.steps_closed == 4 and policy_iteration_now(s) == 14 and s.iteration_base == 10
