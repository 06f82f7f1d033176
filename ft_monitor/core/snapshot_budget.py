"""How much snapshot memory a monitor may hold: the budget's decision (pure).

A monitor holds, for its rank's in-memory snapshots (`ft_client.snapshot`), at most two
pairs of memory files: the rank's own snapshot (kind ``own``) and the copy of another
rank's that this rank keeps for node loss (kind ``peer``). A request (a `snapshot` HELLO,
docs/protocol.md "Snapshots (role snapshot)") names a kind and the capacity each of the
pair's two buffers must have at least. The monitor makes the pair, or grows both of its
buffers in place; it never shrinks one and never makes one anew (the newest complete
snapshot must survive the growth).

`decide` says whether that may happen, from numbers alone: the setting
(``snapshot_max_bytes``), what the monitor holds, what the host has (``MemAvailable`` and
``MemTotal``, read by the daemon). Only the growth counts: a pair asked again at the size
it has costs nothing. The daemon (daemon/snapshot_memory.py) reads the numbers and acts.

A grant is reserved when it is made: the daemon allocates the buffers' pages
(``fallocate``), so the host's MemAvailable drops at once and the next decision, this
monitor's or another's on the same host, sees the memory gone. What that can come to is
worded here too, from numbers and the error's text alone: `reservation_refusal` (the pages
could not be allocated: the grant is refused) and `reserve_eaten` (MemAvailable, read again
once the pages are allocated, is under the reserve: two monitors decided at the same
moment, or something else took memory meanwhile; the grant stands, the log says so).
"""

from __future__ import annotations

from dataclasses import dataclass

PAGE_SIZE = 4096
"""Capacities are whole pages."""
BUFFERS = 2
"""Buffers per pair: double-buffered, so a crash in the middle of a write leaves the other whole."""
KINDS = ("own", "peer")
MIN_RESERVE = 1 << 30
"""Host memory never handed out for snapshots: at least 1 GiB ..."""
RESERVE_DIVISOR = 20
"""... or 5% of MemTotal (MemTotal / 20), whichever is larger."""
SETTING = "snapshot_max_bytes"


def capacity_for(asked: int) -> int:
    """``asked`` bytes rounded up to whole pages."""
    return -(-asked // PAGE_SIZE) * PAGE_SIZE


def host_reserve(mem_total: int | None) -> int:
    """The memory kept free for everything else on the host: max(1 GiB, 5% of MemTotal)."""
    return max(MIN_RESERVE, (mem_total or 0) // RESERVE_DIVISOR)


def size_text(n: int) -> str:
    """A size in binary units, one decimal: ``512.0 MiB``, ``1.5 GiB``; under 1 KiB in bytes."""
    if n < 1024:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            break
    return f"{value:.1f} {unit}"


def _asked_text(kind: str, capacity: int) -> str:
    return f"{BUFFERS} x {size_text(capacity)} of snapshot memory asked ({kind})"


@dataclass(frozen=True, slots=True)
class Decision:
    """What a request comes to."""

    capacity: int
    """Bytes per buffer of the kind's pair once granted (0: none held, none made)."""
    growth: int
    """Bytes the monitor holds more once granted (both buffers together)."""
    refusal: str | None = None
    """Why not, for the log and the ERROR; None: granted."""

    @property
    def ok(self) -> bool:
        return self.refusal is None


def decide(*, kind: str, asked: int, held_capacity: int, held_total: int, limit: int,
           available: int | None, total: int | None) -> Decision:
    """May the ``kind`` pair, now ``held_capacity`` bytes per buffer (0: none), grow to hold
    ``asked`` bytes per buffer, with ``held_total`` bytes held of every kind, the setting's
    ``limit``, and ``available`` bytes of host memory (MemAvailable; None: unknown, not
    checked) of ``total`` (MemTotal)?"""
    capacity = max(capacity_for(asked), held_capacity)
    growth = BUFFERS * (capacity - held_capacity)
    asked_text = _asked_text(kind, capacity)
    if limit == 0:
        return Decision(held_capacity, 0, f"snapshots are off on this monitor: {SETTING} is 0")
    if held_total + growth > limit:
        return Decision(held_capacity, 0, f"{asked_text}, {size_text(held_total)} held; {SETTING} is "
                                          f"{size_text(limit)}")
    if growth and available is not None:
        reserve = host_reserve(total)
        if growth > available - reserve:
            return Decision(held_capacity, 0, f"{asked_text} needs {size_text(growth)} more; the host has "
                                              f"{size_text(available)} available (MemAvailable) and keeps "
                                              f"{size_text(reserve)} in reserve (the larger of 1 GiB and 5% of "
                                              "MemTotal)")
    return Decision(capacity, growth)


def reservation_refusal(*, kind: str, capacity: int, held_capacity: int, error: str) -> str:
    """Why a grant that `decide` allowed is refused after all: allocating the pages of the
    ``kind`` pair's buffers up to ``capacity`` bytes each failed with ``error`` (the OS's
    words: ``Cannot allocate memory``, ``No space left on device``). ``held_capacity``: what
    the pair held before (0: it was being made, and nothing is held)."""
    kept = "the snapshot memory held is kept, with its contents" if held_capacity else "none was made"
    return (f"{_asked_text(kind, capacity)} could not be reserved: the host did not allocate its pages "
            f"(fallocate: {error}); {kept}")


def reserve_eaten(*, available: int | None, total: int | None) -> str | None:
    """Once a grant's pages are allocated, MemAvailable read again (``available``, of
    ``total``): what to log if the host now has less available than the reserve it keeps
    (another monitor granted at the same moment, or something else took memory); None when
    the reserve is whole or the numbers are unknown. The grant stands either way."""
    if available is None:
        return None
    reserve = host_reserve(total)
    if available >= reserve:
        return None
    return (f"the host has {size_text(available)} available (MemAvailable) once this grant's pages are "
            f"allocated, under the {size_text(reserve)} it keeps in reserve: something else took memory since "
            "the decision (another monitor granting at the same moment?); the grant stands")
