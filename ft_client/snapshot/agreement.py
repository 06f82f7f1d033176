"""Which step the ranks restore (docs/snapshots.md, "restore", steps 2 and 4).

Every rank's monitor holds up to `SLOTS` complete snapshots: two of the rank's own, two
copies it keeps for a partner rank. The ranks gather what each holds (`gather`, 8 integers
per rank), and `agree` (pure) picks the newest step every rank can restore, from its own
pair or from a copy another monitor keeps, and says who fetches from whom; once every rank
took its snapshot, `confirm` makes sure none failed (a step is never mixed). The
collectives run on the snapshots' gloo side group; torch is imported when they run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SLOTS = 4
"""What a rank's monitor holds, as gathered: slots 0 and 1 are its own pair, 2 and 3 its peer pair."""


@dataclass(frozen=True)
class Held:
    """One complete snapshot a monitor holds: whose (rank) and of which step."""

    rank: int
    step: int


Holdings = tuple[Held | None, ...]
"""What one rank's monitor holds, slot by slot (SLOTS of them)."""


def to_row(h: Holdings) -> list[int]:
    row = []
    for held in (list(h) + [None] * SLOTS)[:SLOTS]:
        row += [-1, -1] if held is None else [held.rank, held.step]
    return row


def from_row(row: list[int]) -> Holdings:
    return tuple(Held(row[2 * i], row[2 * i + 1]) if row[2 * i] >= 0 and row[2 * i + 1] >= 0 else None
                 for i in range(SLOTS))


@dataclass(frozen=True)
class Agreement:
    step: int | None
    fetch: dict[int, tuple[int, int]] = field(default_factory=dict)
    """rank -> (the rank whose monitor holds its snapshot of ``step``, the slot there), for every
    rank that does not hold it in its own pair (it lost its node, or its rank changed)."""
    why: str = ""
    nothing: bool = False
    """No monitor holds any snapshot at all: a fresh start, nothing is wrong."""


def agree(table: list[Holdings]) -> Agreement:
    """The newest step every rank can restore (from its own pair, or a copy another monitor
    keeps), and who fetches from whom (pure)."""
    world = len(table)
    where: dict[int, dict[int, tuple[int, int]]] = {q: {} for q in range(world)}  # rank -> step -> holder, slot
    for holder, row in enumerate(table):
        for slot, held in enumerate(row):
            if held is None or not 0 <= held.rank < world:
                continue
            local = holder == held.rank and slot < 2
            if local or held.step not in where[held.rank]:
                where[held.rank][held.step] = (holder, slot)
    options = [set(where[q]) for q in range(world)]
    common = set.intersection(*options) if options else set()
    if not common:
        missing = [q for q, o in enumerate(options) if not o]
        if len(missing) == world:
            return Agreement(None, {}, "no snapshot was taken yet", nothing=True)
        if missing:
            why = f"no monitor holds a snapshot of rank(s) {', '.join(map(str, missing[:8]))}"
        else:
            why = "no step is held for every rank: " + "; ".join(
                f"rank {q}: {sorted(o)}" for q, o in list(enumerate(options))[:8])
        return Agreement(None, {}, why)
    step = max(common)
    fetch = {q: where[q][step] for q in range(world) if where[q][step] != (q, 0) and where[q][step] != (q, 1)}
    return Agreement(step, fetch)


def agree_alone(held: Holdings, rank: int) -> Agreement:
    """Without a process group: this rank's own newest complete snapshot."""
    steps = [h.step for h in held[:2] if h is not None and h.rank == rank]
    if not steps:
        return Agreement(None, {}, "no complete snapshot of this rank", nothing=all(h is None for h in held))
    return Agreement(max(steps))


def gather(side: Any, held: Holdings, world: int) -> Agreement:
    """`agree` over what every rank's monitor holds (a collective on the ``side`` group)."""
    import torch
    import torch.distributed as dist

    out = [torch.zeros(2 * SLOTS, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(out, torch.tensor(to_row(held), dtype=torch.int64), group=side)
    return agree([from_row([int(v) for v in row.tolist()]) for row in out])


def confirm(side: Any, failure: str, same: int = 0) -> str:
    """Every rank took its snapshot, or none restores (a step is never mixed): ``failure``, this
    rank's, or the line saying another rank failed; "" when all took theirs. ``same`` (below 2^62)
    must be the same number on every rank too (what the ranks will do next together: the device
    meshes they make for their DTensors). A collective."""
    import torch
    import torch.distributed as dist

    ok = torch.tensor([0 if failure else 1, same, -same], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=side)
    least, most = int(ok[1].item()), -int(ok[2].item())
    if failure:
        return failure
    if int(ok[0].item()) != 1:
        return "another rank could not take its snapshot of the agreed step"
    if least != most:
        return ("the ranks would make different device meshes for their DTensors from what their snapshots "
                "recorded (DTensors on meshes of part of the ranks?): pass the state to restore(like=...)")
    return ""
