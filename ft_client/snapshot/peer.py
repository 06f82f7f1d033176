"""The partner copy (docs/snapshots.md, "The peer copy"; "restore", step 3).

Rank r copies each snapshot to the same local rank on the next node (`partners`), whose
monitor keeps it in its peer pair: `copy_to_partner` runs on the save's background thread,
as an exchange (every rank sends its own and receives its other neighbour's). At restore,
`exchange` moves the snapshots the ranks agreed on to the ranks that lack them: a monitor
that kept a copy sends it, and its rank writes it into its own pair and checks it whole.
Both go through torch.distributed point to point on the snapshots' gloo side group, which
`PEER_TIMEOUT` bounds; torch is imported when they run.
"""

from __future__ import annotations

import datetime
import mmap
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ft_client.errors import MemorySnapshotError
from ft_client.snapshot import format as fmt
from ft_client.snapshot.agreement import Agreement
from ft_client.snapshot.format import HEADER_SIZE, Header
from ft_client.snapshot.memory import OWN, PEER, Buffer, MonitorMemory

if TYPE_CHECKING:
    import torch

PEER_TIMEOUT = datetime.timedelta(seconds=120)
"""The side process group's timeout: a peer transfer (or the agreement) that takes longer fails."""


def partners(rank: int, world: int, local_world: int) -> tuple[int, int] | None:
    """(the rank this one copies its snapshot to, the rank whose copy it keeps): the same local
    rank on the next node and on the previous one; None on a single node."""
    if local_world <= 0 or local_world >= world or world % local_world:
        return None
    return (rank + local_world) % world, (rank - local_world) % world


def local_world(world: int) -> int:
    """Ranks per node, as torchrun says (``LOCAL_WORLD_SIZE``); ``world`` without it."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        return world


def _bytes_view(mm: mmap.mmap, start: int, end: int) -> torch.Tensor:
    import torch

    return torch.frombuffer(mm, dtype=torch.uint8, count=end - start, offset=start)


def _head_tensor(buf: Buffer) -> torch.Tensor:
    """A copy of the buffer's header bytes, to send."""
    import torch

    return torch.frombuffer(bytearray(buf.mm[:fmt.HEAD_BYTES]), dtype=torch.uint8)


def _swap(side: Any, out: torch.Tensor, to: int, into: torch.Tensor, frm: int) -> None:
    """Send ``out`` to rank ``to`` while ``into`` is received from rank ``frm``."""
    import torch.distributed as dist

    reqs: list[Any] = [dist.isend(out, to, group=side), dist.irecv(into, frm, group=side)]
    for r in reqs:
        r.wait()


def copy_to_partner(side: Any, buf: Buffer, memory: MonitorMemory, *, rank: int, world: int, job: str) -> None:
    """Send the complete snapshot in ``buf`` to this rank's partner and keep the one the rank on
    the other side sends in this monitor's peer pair (every rank calls it after the same save)."""
    import torch

    to, frm = partners(rank, world, local_world(world)) or (rank, rank)
    mine = _head_tensor(buf)
    theirs = torch.empty(fmt.HEAD_BYTES, dtype=torch.uint8)
    _swap(side, mine, to, theirs, frm)
    head = fmt.parse_header(theirs.numpy().tobytes())
    if head.rank != frm or head.job != job or head.state != fmt.COMPLETE:
        raise MemorySnapshotError(f"rank {frm} sent a snapshot header of rank {head.rank}, job {head.job!r}")
    own = fmt.parse_header(buf.mm[:fmt.HEAD_BYTES])
    pair = memory.pair(PEER, head.end)
    assert pair is not None
    j = pair.target(job=job)
    dst = pair.buffers[j]
    dst.write_header(Header(**{**head.__dict__, "state": fmt.WRITING}))
    out = _bytes_view(buf.mm, HEADER_SIZE, own.end)
    into = _bytes_view(dst.mm, HEADER_SIZE, head.end)
    _swap(side, out, to, into, frm)
    del out, into
    dst.write_header(head)
    pair.forget_later_steps(dst, head)


def exchange(side: Any, agreement: Agreement, memory: MonitorMemory, *, rank: int, job: str,
             say: Callable[[str], None]) -> None:
    """Move every snapshot of the agreed step that its rank lacks to that rank's own pair (in rank
    order): this rank sends the copies its monitor keeps for others, and takes its own from the
    monitor that keeps it. Every rank calls it with the same agreement."""
    if not agreement.fetch:
        return
    import torch.distributed as dist

    sources = {slot for holder, slot in agreement.fetch.values() if holder == rank}
    for q, (holder, slot) in sorted(agreement.fetch.items()):
        if rank == holder and q != rank:
            src = memory.slot(slot)
            head = fmt.parse_header(src.mm[:fmt.HEAD_BYTES])
            dist.send(_head_tensor(src), q, group=side)
            body = _bytes_view(src.mm, HEADER_SIZE, head.end)
            dist.send(body, q, group=side)
            del body
        elif rank == q:
            _receive(side, memory, holder, slot, agreement.step, sources, rank=rank, job=job, say=say)


def _receive(side: Any, memory: MonitorMemory, holder: int, slot: int, step: int | None, sources: set[int], *,
             rank: int, job: str, say: Callable[[str], None]) -> None:
    import torch
    import torch.distributed as dist

    if holder == rank:  # a copy in this monitor's peer pair (this rank's number changed)
        src = memory.slot(slot)
        head = fmt.parse_header(src.mm[:fmt.HEAD_BYTES])
        raw = bytes(src.mm[:head.end])
    else:
        got = torch.empty(fmt.HEAD_BYTES, dtype=torch.uint8)
        dist.recv(got, holder, group=side)
        head = fmt.parse_header(got.numpy().tobytes())
        raw = b""
    if head.rank != rank or head.step != step:
        raise MemorySnapshotError(f"rank {holder} sent rank {head.rank}'s step {head.step}")
    pair = memory.pair(OWN, head.end)
    assert pair is not None
    free = [i for i in (pair.target(job=job), 1 - pair.target(job=job)) if i not in sources]
    if not free:
        raise MemorySnapshotError("both of this rank's buffers hold snapshots other ranks are taking")
    dst = pair.buffers[free[0]]
    dst.write_header(Header(**{**head.__dict__, "state": fmt.WRITING}))
    if raw:
        dst.mm[HEADER_SIZE:head.end] = raw[HEADER_SIZE:]
    else:
        into = _bytes_view(dst.mm, HEADER_SIZE, head.end)
        dist.recv(into, holder, group=side)
        del into
    dst.write_header(head)
    fmt.check(dst.mm, job=job, rank=rank)
    say(f"ft_client.snapshot: took step {step}'s snapshot ({head.end / 1e6:.1f} MB) from rank "
        f"{holder}'s monitor, which kept a copy of this rank's")
