"""The shared-memory progress record: its layout, the rank's writer, the pure decoder.

At the handshake a rank's monitor hands it a small record (a sealed memfd passed
over the socket, see docs/protocol.md "The progress record"); from then on the
rank reports heartbeats, section opens and closes and its iteration by storing
into that record, with no syscall, and the monitor reads it on a fine tick and
whenever a deadline comes due. This module owns the bytes, as `wire` owns the
frames: both sides import the layout from here.

Layout, version 2: one page (`SIZE` bytes) of native-endian signed 64-bit words::

    word  0  MAGIC                 written by the monitor; constant
          1  VERSION (2)           written by the monitor; constant
          2  SLOTS                 written by the monitor; constant (section slots below)
          3  CREATED_NS            the monitor's CLOCK_MONOTONIC when it made the record
          4  EPOCH_NS              the rank: when it last reset the record (0: never)
          5  ITERATION             the rank: completed `step` sections (-1: not reported)
          6, 7                     reserved (0)
          8  heartbeat group: SEQ, AT, reserved, reserved
         12  section slot k at 12 + 6k: SEQ, OPENED_AT, CLOSED_AT, CLOSES, SUM_NS, reserved

Every time is the rank's CLOCK_MONOTONIC in nanoseconds. A group (the heartbeat,
or one slot) is guarded by its sequence word, a seqlock with one writer: the rank
makes SEQ odd, stores the data, makes SEQ even again (2 more than before), so
SEQ / 2 counts the group's writes. A reader takes SEQ, then the data, then SEQ
again; equal and even means the data is one consistent state, anything else is a
write in progress (`decode` reports the group as torn, and the reader keeps what
it knew). The heartbeat group's writes are the heartbeats. A slot's writes
alternate open, close, open, ...: an odd number of writes means open, since
OPENED_AT. After an in-process restart the rank closes every slot left open
while it unwound (at the new epoch) and stamps EPOCH_NS, before it reports
anything: what was stamped before EPOCH_NS is void.

Counts are the rank's, not the reader's: the monitor reads on a tick, and sections
shorter than the tick come and go between two reads. So each close by
``end_section`` also adds one to the slot's CLOSES and the section's duration
(CLOSED_AT - OPENED_AT) to its SUM_NS, in the same write; closes that complete no
section (``end_all_sections``, the closes of a reset) do not (`abandon_word`), as
the socket's CLOSE_ALL counts none. The monitor counts steps and fills its
histograms from the growth of CLOSES and SUM_NS between two reads: exactly what
the socket would have counted, however seldom it reads.

Ordering: the writer's stores and the reader's loads must reach memory in the
order the code issues them. x86-64 guarantees that (total store order), and
CPython issues each store of a 64-bit item as one aligned store; other
architectures reorder, so the record is used only on x86-64 (`supported`), and
the socket carries progress elsewhere.

Pure except `RecordWriter`, which stores into a mapping it is given. Reading (the
seqlock's reader side, `decode`) is ft_client.record.read: the monitor's, not the rank's.
"""

from __future__ import annotations

import os
import struct

from ft_client.errors import FtError

VERSION = 2
SIZE = 4096
"""Bytes in a record: one page."""
MAGIC = int.from_bytes(b"ftprog\x00\x01", "little")
WORDS = SIZE // 8

# header
W_MAGIC, W_VERSION, W_SLOTS, W_CREATED, W_EPOCH, W_ITERATION = range(6)
# heartbeat group
W_HB_SEQ, W_HB_AT = 8, 9
# section slots
SLOT_BASE = 12
SLOT_WORDS = 6
SEQ, OPENED_AT, CLOSED_AT, CLOSES, SUM_NS = range(5)
SLOTS = (WORDS - SLOT_BASE) // SLOT_WORDS
"""Section slots in a record (83); sections beyond them report through the socket."""

SUPPORTED_MACHINES = frozenset({"x86_64", "amd64", "AMD64"})


def supported() -> str | None:
    """None where the record can be used; else why not (the socket carries progress)."""
    machine = os.uname().machine
    if machine not in SUPPORTED_MACHINES:
        return (f"this CPU ({machine or 'unknown'}) may reorder memory accesses; the progress record needs "
                "x86-64's store order")
    return None


def slot_word(slot: int) -> int:
    """The first word (SEQ) of section slot ``slot``."""
    return SLOT_BASE + SLOT_WORDS * slot


def words_for(slots: int) -> int:
    """Words a reader copies to see the header, the heartbeat and the first ``slots`` slots."""
    return SLOT_BASE + SLOT_WORDS * slots


def initial_header(created_ns: int) -> bytes:
    """What the monitor writes into a new record before handing it over."""
    return struct.pack("=8q", MAGIC, VERSION, SLOTS, created_ns, 0, -1, 0, 0)


class RecordError(FtError, ValueError):
    """A record that breaks the layout's rules (garbage, or not a record of this version)."""


class RecordWriter:
    """The rank's side: plain stores into the mapping (``words``: the record cast to
    signed 64-bit items), three per event (five per counted close). One writer at a time: the client calls these
    under its lock (and inlines heartbeat, open and close on its hot path, keyed by the
    slot's SEQ word, `slot_word`: keep them in step). The sequence words are shadowed in
    ``seqs`` (indexed by word), so the hot path only stores."""

    __slots__ = ("words", "_keep", "hb_seq", "seqs")

    def __init__(self, words: memoryview, keep: object = None) -> None:
        self.words = words
        self._keep = keep
        """What must outlive the stores (the mmap behind ``words``); never closed
        explicitly: a progress call in another thread may still hold ``words``."""
        self.hb_seq: int = words[W_HB_SEQ]
        self.seqs: list[int] = list(words[:WORDS])
        """The SEQ words' values, at their own index (the other entries are unused)."""

    def heartbeat(self, now_ns: int) -> None:
        w = self.words
        seq = self.hb_seq + 1
        w[W_HB_SEQ] = seq
        w[W_HB_AT] = now_ns
        w[W_HB_SEQ] = self.hb_seq = seq + 1

    def open(self, slot: int, now_ns: int) -> None:
        """Open ``slot`` (closed: the client opens only what it has not open)."""
        self.open_word(slot_word(slot), now_ns)

    def close(self, slot: int, now_ns: int) -> None:
        """Close ``slot`` (open)."""
        self.close_word(slot_word(slot), now_ns)

    def open_word(self, i: int, now_ns: int) -> None:
        """`open` of the slot whose SEQ word is ``i``."""
        w = self.words
        seq = self.seqs[i] + 1
        w[i] = seq
        w[i + OPENED_AT] = now_ns
        w[i] = self.seqs[i] = seq + 1

    def close_word(self, i: int, now_ns: int) -> None:
        """`close` of the slot whose SEQ word is ``i``: a completed section, counted."""
        w = self.words
        seq = self.seqs[i] + 1
        w[i] = seq
        w[i + CLOSED_AT] = now_ns
        w[i + CLOSES] += 1
        w[i + SUM_NS] += now_ns - w[i + OPENED_AT]
        w[i] = self.seqs[i] = seq + 1

    def abandon_word(self, i: int, now_ns: int) -> None:
        """Close the slot whose SEQ word is ``i`` without counting a completed section
        (``end_all_sections``, a reset): CLOSES and SUM_NS stay as they are."""
        w = self.words
        seq = self.seqs[i] + 1
        w[i] = seq
        w[i + CLOSED_AT] = now_ns
        w[i] = self.seqs[i] = seq + 1

    def iteration(self, iteration: int) -> None:
        self.words[W_ITERATION] = iteration

    def reset(self, now_ns: int) -> None:
        """A new epoch (in-process restart): close what is open at ``now_ns``, then void
        everything stamped before it."""
        for slot in range(SLOTS):
            if self.is_open(slot):
                self.abandon_word(slot_word(slot), now_ns)
        self.words[W_EPOCH] = now_ns

    def is_open(self, slot: int) -> bool:
        return bool(self.seqs[slot_word(slot)] & 2)  # an odd number of writes
