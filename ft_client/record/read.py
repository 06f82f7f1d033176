"""Reading a progress record (pure): the seqlock's reader side of ft_client.record.

`decode` turns three copies of a record's first words (taken one after the other: the
sequence words before, the data, the sequence words after) into a `RecordView`: the
header, and every group (the heartbeat, each slot read) that was not being written
during the copies, or None for one that was (torn). Bytes that are not a record of
this layout raise RecordError naming what is wrong. The monitor reads a rank's record
with it (ft_monitor.daemon.record_watch); the rank itself never reads one.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ft_client.record import (
    CLOSED_AT,
    CLOSES,
    MAGIC,
    OPENED_AT,
    SLOT_BASE,
    SLOT_WORDS,
    SLOTS,
    SUM_NS,
    VERSION,
    W_CREATED,
    W_EPOCH,
    W_HB_AT,
    W_HB_SEQ,
    W_ITERATION,
    W_MAGIC,
    W_SLOTS,
    W_VERSION,
    RecordError,
    words_for,
)


@dataclass(frozen=True, slots=True)
class Heartbeats:
    count: int
    at: int
    """The latest heartbeat's time (ns), 0 before the first."""


@dataclass(frozen=True, slots=True)
class SlotState:
    writes: int
    """Opens and closes so far (they alternate, an open first)."""
    opened_at: int
    """The latest open's time (ns), 0 before the first."""
    closed_at: int
    """The latest close's time (ns), 0 before the first."""
    completed: int = 0
    """Closes that completed a section (``end_section``), as the rank counted them: no
    more than `closes`, since a reset's closes and ``end_all_sections`` complete none."""
    completed_ns: int = 0
    """The completed sections' durations (ns), summed by the rank."""

    @property
    def opens(self) -> int:
        return (self.writes + 1) // 2

    @property
    def closes(self) -> int:
        return self.writes // 2

    @property
    def is_open(self) -> bool:
        return bool(self.writes & 1)

    def open_since(self, floor: int) -> int | None:
        """When the running open began, if one runs and began at ``floor`` or later."""
        if self.writes & 1 and self.opened_at >= floor:
            return self.opened_at
        return None


@dataclass(frozen=True, slots=True)
class RecordView:
    """One read of a record: the header and every group that was not being written."""

    created_ns: int
    epoch_ns: int
    iteration: int
    heartbeats: Heartbeats | None
    """None: being written when read (torn); the reader keeps what it knew."""
    slots: tuple[SlotState | None, ...]
    """The first slots read, in slot order; None for one being written."""

    @property
    def torn(self) -> bool:
        return self.heartbeats is None or any(s is None for s in self.slots)


def decode(before: bytes, data: bytes, after: bytes, slots: int = 0) -> RecordView:
    """One read of a record from three copies of its first `words_for(slots)` words,
    taken in this order: the sequence words come from ``before`` and ``after``, the
    data from ``data``. Raises RecordError naming what is wrong for bytes that are
    not a record of this layout (sizes, magic, version, negative counts or times, more
    sections completed than closed); nothing else."""
    if not 0 <= slots <= SLOTS:
        raise RecordError(f"cannot read {slots} slots: a record has {SLOTS}")
    n = words_for(slots)
    size = 8 * n
    for what, buf in (("before", before), ("data", data), ("after", after)):
        if len(buf) < size:
            raise RecordError(f"the {what} copy has {len(buf)} bytes; reading {slots} slot(s) takes {size}")
    fmt = f"={n}q"
    b = struct.unpack_from(fmt, before)
    d = struct.unpack_from(fmt, data)
    a = struct.unpack_from(fmt, after)
    if d[W_MAGIC] != MAGIC or a[W_MAGIC] != MAGIC:
        raise RecordError(f"magic word is {d[W_MAGIC]:#x}, not {MAGIC:#x}: not a progress record")
    if d[W_VERSION] != VERSION:
        raise RecordError(f"layout version {d[W_VERSION]}, expected {VERSION}")
    if d[W_SLOTS] != SLOTS:
        raise RecordError(f"slot count {d[W_SLOTS]}, expected {SLOTS}")
    created, epoch, iteration = d[W_CREATED], d[W_EPOCH], d[W_ITERATION]
    if created <= 0:
        raise RecordError(f"creation time {created} is not a time")
    if epoch < 0:
        raise RecordError(f"epoch {epoch} is negative")
    if iteration < -1:
        raise RecordError(f"iteration {iteration} is below -1")

    def stable(i: int) -> bool:
        seq = b[i]
        if seq < 0 or a[i] < seq:
            raise RecordError(f"sequence word {i} went from {seq} to {a[i]}: sequences only grow")
        return seq == a[i] and not seq & 1

    hb: Heartbeats | None = None
    if stable(W_HB_SEQ):
        count, at = b[W_HB_SEQ] // 2, d[W_HB_AT]
        if at < 0 or (at == 0) != (count == 0):
            raise RecordError(f"{count} heartbeat(s), the last at {at}: a time is >= 0, and set once there is a "
                              "heartbeat")
        hb = Heartbeats(count, at)
    out: list[SlotState | None] = []
    for k in range(slots):
        i = SLOT_BASE + SLOT_WORDS * k
        if not stable(i):
            out.append(None)
            continue
        writes, opened, closed = b[i] // 2, d[i + OPENED_AT], d[i + CLOSED_AT]
        completed, completed_ns = d[i + CLOSES], d[i + SUM_NS]
        if opened < 0 or closed < 0 or (opened == 0) != (writes == 0) or (closed == 0) != (writes < 2):
            raise RecordError(f"slot {k}: {writes} write(s), opened at {opened}, closed at {closed}: times are "
                              ">= 0, and set once the slot was opened (closed)")
        if not 0 <= completed <= writes // 2 or completed_ns < 0 or (completed == 0 and completed_ns != 0):
            raise RecordError(f"slot {k}: {completed} completed section(s) taking {completed_ns} ns in all, in "
                              f"{writes // 2} close(s): a slot completes no more sections than it closes, and "
                              "their summed time is >= 0 (0 for none)")
        out.append(SlotState(writes, opened, closed, completed, completed_ns))
    return RecordView(created, epoch, iteration, hb, tuple(out))
