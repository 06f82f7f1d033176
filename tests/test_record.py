"""The progress record's bytes (ft_client.record): the writer, the seqlock reader, garbage.

Pure tests first: a model of the writer's stores, interleaved with the reader's three
copies at every possible point (hypothesis), must never decode a group in a state the
writer did not leave it in. Then real shared memory: a writer process storing as fast
as it can while this process reads through the monitor's own mapping.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import time
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft_client import record
from ft_client.record import RecordError, RecordWriter, words_for
from ft_client.record.mapped import open_record
from ft_client.record.read import Heartbeats, RecordView, SlotState, decode
from ft_client.session_info import RecordInfo
from ft_monitor.daemon.record_map import RecordMap, create_record

pytestmark = pytest.mark.compat  # also run on the oldest and newest torch (scripts/test-compat)

CREATED = 10**12
SLOTS_READ = 3


def fresh() -> tuple[bytearray, RecordWriter]:
    buf = bytearray(record.SIZE)
    buf[:64] = record.initial_header(CREATED)
    return buf, RecordWriter(memoryview(buf).cast("q"), buf)


def read(buf: bytes | bytearray, slots: int = SLOTS_READ) -> RecordView:
    b = bytes(buf)
    return decode(b, b, b, slots)


# -- the writer and the decoder ------------------------------------------------------------
def test_a_new_record_reads_empty() -> None:
    buf, _ = fresh()
    v = read(buf)
    assert (v.created_ns, v.epoch_ns, v.iteration) == (CREATED, 0, -1)
    assert v.heartbeats == Heartbeats(0, 0) and v.slots == (SlotState(0, 0, 0),) * SLOTS_READ
    assert not v.torn


def test_what_the_writer_stores_reads_back() -> None:
    buf, w = fresh()
    w.heartbeat(CREATED + 5)
    w.heartbeat(CREATED + 9)
    w.open(1, CREATED + 10)
    w.close(1, CREATED + 20)
    w.open(1, CREATED + 30)
    w.open(0, CREATED + 31)
    w.iteration(42)
    v = read(buf)
    assert v.heartbeats == Heartbeats(2, CREATED + 9) and v.iteration == 42
    assert v.slots[1] == SlotState(3, CREATED + 30, CREATED + 20, 1, 10) and v.slots[1].opens == 2
    assert v.slots[1].closes == 1 and v.slots[1].open_since(0) == CREATED + 30
    assert v.slots[0].open_since(CREATED + 32) is None  # opened before the epoch: void
    assert v.slots[2] == SlotState(0, 0, 0) and not v.slots[2].is_open


def test_reset_closes_what_is_open_and_stamps_the_epoch() -> None:
    buf, w = fresh()
    w.open(0, CREATED + 1)
    w.open(2, CREATED + 2)
    w.close(2, CREATED + 3)
    w.reset(CREATED + 100)
    v = read(buf)
    assert v.epoch_ns == CREATED + 100
    assert v.slots[0] == SlotState(2, CREATED + 1, CREATED + 100)  # closed, not counted: it did not complete
    assert v.slots[2] == SlotState(2, CREATED + 2, CREATED + 3, 1, 1)
    assert not w.is_open(0) and not w.is_open(2)


def test_a_group_being_written_reads_as_torn() -> None:
    buf, w = fresh()
    before = bytes(buf)
    w.open(0, CREATED + 1)  # a whole write between the first and the third copy
    v = decode(before, bytes(buf), bytes(buf), 1)
    assert v.slots == (None,) and v.torn and v.heartbeats is not None
    words = memoryview(buf).cast("q")
    words[record.W_HB_SEQ] = 1  # a heartbeat's first store only: odd
    v = read(buf, 1)
    assert v.heartbeats is None


@pytest.mark.parametrize(("word", "value", "error"), [
    (record.W_MAGIC, 7, "magic word"),
    (record.W_VERSION, 1, "layout version 1"),
    (record.W_SLOTS, 3, "slot count 3"),
    (record.W_CREATED, 0, "creation time 0"),
    (record.W_EPOCH, -1, "epoch -1"),
    (record.W_ITERATION, -2, "iteration -2"),
    (record.W_HB_AT, -5, "heartbeat"),
    (record.SLOT_BASE + record.OPENED_AT, 5, "slot 0: 0 write"),
    (record.SLOT_BASE + record.SEQ, -2, "sequence word 12"),
])
def test_bytes_that_are_not_a_record_are_refused_naming_the_problem(word: int, value: int, error: str) -> None:
    buf, _ = fresh()
    memoryview(buf).cast("q")[word] = value
    with pytest.raises(RecordError, match=error):
        read(buf, 1)


def test_a_sequence_that_goes_back_between_copies_is_refused() -> None:
    buf, w = fresh()
    w.heartbeat(CREATED + 1)
    later = bytes(buf)
    memoryview(buf).cast("q")[record.W_HB_SEQ] = 0
    with pytest.raises(RecordError, match="sequences only grow"):
        decode(later, later, bytes(buf), 0)


def test_short_copies_and_slot_counts_out_of_range_are_refused() -> None:
    buf, _ = fresh()
    with pytest.raises(RecordError, match="takes"):
        decode(bytes(buf[:64]), bytes(buf), bytes(buf), 1)
    with pytest.raises(RecordError, match=f"a record has {record.SLOTS}"):
        decode(bytes(buf), bytes(buf), bytes(buf), record.SLOTS + 1)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=8 * words_for(2), max_size=8 * words_for(2)),
       st.binary(min_size=8 * words_for(2), max_size=8 * words_for(2)))
def test_garbage_either_decodes_or_is_refused_never_anything_else(garbage: bytes, other: bytes) -> None:
    buf, _ = fresh()
    head = bytes(buf[:24])  # keep magic, version and slot count sometimes, to reach the deeper checks
    for data in (garbage, head + garbage[24:]):
        for before, after in ((data, data), (data, other), (other, data)):
            try:
                decode(before, data, after, 2)
            except RecordError:
                pass


# -- a model of the writer, interleaved with the reader (hypothesis) -------------------------
def store_trace(ops: list[tuple[str, int]]) -> tuple[list[tuple[int, int]], dict[int, list[tuple[int, int, int]]]]:
    """Every store the writer makes for ``ops`` (as (word, value)), and for each group (by its
    SEQ word) its state after each of its writes: (writes, first data word, second data word)."""
    buf, w = fresh()
    words = memoryview(buf).cast("q")
    trace: list[tuple[int, int]] = []
    states: dict[int, list[tuple[int, int, int]]] = {record.W_HB_SEQ: [(0, 0, 0)]}
    states.update({record.slot_word(k): [(0, 0, 0)] for k in range(SLOTS_READ)})
    t = CREATED
    for kind, slot in ops:
        t += 7
        snapshot = bytes(buf)
        if kind == "hb":
            w.heartbeat(t)
            seq_word = record.W_HB_SEQ
        elif kind == "toggle":
            (w.close if w.is_open(slot) else w.open)(slot, t)
            seq_word = record.slot_word(slot)
        else:
            w.iteration(slot)
            seq_word = -1
        before = memoryview(snapshot).cast("q")
        trace += _stores_of(before, words, seq_word)
        if seq_word >= 0:
            states[seq_word].append((words[seq_word] // 2, words[seq_word + 1], words[seq_word + 2]))
    return trace, states


def _stores_of(before: memoryview, after: memoryview, seq_word: int) -> list[tuple[int, int]]:
    """The stores of one write, in the order the writer makes them: SEQ odd, the data, SEQ even."""
    n = words_for(SLOTS_READ)
    changed = [(i, after[i]) for i in range(n) if after[i] != before[i] and i != seq_word]
    if seq_word < 0:
        return changed
    return [(seq_word, after[seq_word] - 1), *changed, (seq_word, after[seq_word])]


OPS = st.lists(st.tuples(st.sampled_from(["hb", "toggle", "toggle", "iteration"]), st.integers(0, SLOTS_READ - 1)),
               min_size=1, max_size=30)


@settings(max_examples=400, deadline=None)
@given(OPS, st.data())
def test_no_interleaving_of_stores_and_copies_decodes_a_state_the_writer_never_left(
        ops: list[tuple[str, int]], data: st.DataObject) -> None:
    trace, states = store_trace(ops)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(trace)), min_size=3, max_size=3)))
    buf, _ = fresh()
    words = memoryview(buf).cast("q")
    copies: list[bytes] = []
    done = 0
    for cut in cuts:  # the reader's three copies, each taken after `cut` stores
        for i, v in trace[done:cut]:
            words[i] = v
        done = cut
        copies.append(bytes(buf))
    view = decode(copies[0], copies[1], copies[2], SLOTS_READ)
    hb = view.heartbeats
    if hb is not None:
        writes, at, _ = states[record.W_HB_SEQ][hb.count]
        assert (hb.count, hb.at) == (writes, at)
    for k, slot in enumerate(view.slots):
        if slot is not None:
            assert (slot.writes, slot.opened_at, slot.closed_at) == states[record.slot_word(k)][slot.writes]


# -- real shared memory: the client's mapping, the monitor's mapping ---------------------
def handover() -> tuple[RecordWriter, RecordMap]:
    asked = time.monotonic_ns()
    fd, mapping = create_record(time.monotonic_ns())
    writer = open_record(os.dup(fd), RecordInfo(record.VERSION, record.SIZE, record.SLOTS), asked,
                         time.monotonic_ns())
    os.close(fd)
    return writer, mapping


def test_the_monitor_maps_it_read_only_and_sealed_and_the_client_writes_it() -> None:
    writer, mapping = handover()
    writer.heartbeat(time.monotonic_ns())
    writer.open(0, time.monotonic_ns())
    view = decode(*mapping.read(words_for(1)), 1)
    assert view.heartbeats is not None and view.heartbeats.count == 1 and view.slots[0] is not None
    assert view.slots[0].is_open
    with pytest.raises(TypeError):
        mapping._mm[0:1] = b"x"  # type: ignore[index]  # read-only
    mapping.close()


def test_the_client_refuses_a_record_from_another_clock_or_unsealed() -> None:
    info = RecordInfo(record.VERSION, record.SIZE, record.SLOTS)
    fd, mapping = create_record(time.monotonic_ns() - 10**9)  # made "a second before" the handshake
    with pytest.raises(RecordError, match="clock differs"):
        open_record(fd, info, time.monotonic_ns(), time.monotonic_ns())
    mapping.close()
    plain = os.memfd_create("plain")
    os.ftruncate(plain, record.SIZE)
    with pytest.raises(RecordError, match="not sealed"):
        open_record(plain, info, 0, time.monotonic_ns())
    fd, mapping = create_record(time.monotonic_ns())
    with pytest.raises(RecordError, match="version 1"):
        open_record(fd, RecordInfo(1, record.SIZE, record.SLOTS), 0, time.monotonic_ns())
    mapping.close()


def _hammer(writer: RecordWriter, stop_at: float) -> None:
    """Heartbeats and slot toggles as fast as possible, each stamped so that a reader can
    tell from SEQ which value the data word must hold."""
    w = writer
    base = CREATED
    while time.monotonic() < stop_at:
        for _ in range(1000):
            k = w.hb_seq // 2 + 1
            w.heartbeat(base + k * 1000)
            for slot in range(SLOTS_READ):
                n = w.seqs[record.slot_word(slot)] // 2 + 1  # this write's number: odd opens, even closes
                (w.open if n % 2 else w.close)(slot, base + n * 1000 + slot)


def _consistent(view: RecordView) -> tuple[int, int]:
    stable = torn = 0
    hb = view.heartbeats
    if hb is None:
        torn += 1
    else:
        stable += 1
        assert hb.at == (CREATED + hb.count * 1000 if hb.count else 0), hb
    for slot, s in enumerate(view.slots):
        if s is None:
            torn += 1
            continue
        stable += 1
        last_open = s.writes if s.writes % 2 else s.writes - 1
        last_close = s.writes if s.writes % 2 == 0 else s.writes - 1
        assert s.opened_at == (CREATED + last_open * 1000 + slot if last_open > 0 else 0), s
        assert s.closed_at == (CREATED + last_close * 1000 + slot if last_close > 0 else 0), s
    return stable, torn


def _in_child(fn: Callable[[], None]) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        finally:
            os._exit(0)
    return pid


def test_a_writer_process_hammering_the_record_never_shows_the_reader_a_mixed_state() -> None:
    buf = mmap.mmap(-1, record.SIZE)  # shared with the child: the writer's view
    buf[:64] = record.initial_header(CREATED)
    writer = RecordWriter(memoryview(buf).cast("q"), buf)
    reader = RecordMap(buf)
    stop_at = time.monotonic() + 1.0
    pid = _in_child(lambda: _hammer(writer, stop_at))
    stable = torn = reads = 0
    try:
        while time.monotonic() < stop_at:
            view = decode(*reader.read(words_for(SLOTS_READ)), SLOTS_READ)
            s, t = _consistent(view)
            stable, torn, reads = stable + s, torn + t, reads + 1
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert reads > 100 and stable > 0
    assert memoryview(buf).cast("q")[record.W_HB_SEQ] // 2 > 1000  # it did hammer (killed mid-write, maybe)


def test_layout_constants_describe_one_page() -> None:
    assert record.SLOTS == 83 and words_for(record.SLOTS) * 8 <= record.SIZE
    assert struct.calcsize("=8q") == 64 and record.slot_word(0) == record.SLOT_BASE
