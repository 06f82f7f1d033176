"""In-memory snapshots of a rank's training state, kept by its monitor (docs/snapshots.md).

    from ft_client import snapshot

    got = snapshot.restore()                 # after init_process_group: every rank calls it
    if got is not None:
        step, state = got
        model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
    else:
        ...                                  # the file checkpoint (one line said why)
    for step in range(start, steps):
        train_step()
        if step % 10 == 0:
            snapshot.save(step + 1, {"model": model, "opt": opt, "step": step + 1})
    snapshot.wait()                          # before destroy_process_group(): a partner copy may run

`save` copies the state's tensors into one of two memory files that the rank's monitor
daemon owns (they outlive this process: a `kill -9` loses nothing saved), then finishes
the write off the training thread (layout, checksum, the header that makes it complete)
and, on a job of several nodes, copies it to a partner rank on the next node, whose
monitor keeps it (a lost node loses nothing either). `restore` maps the monitor's
memory (no file is read), checks what it finds (torn writes, checksums, another job's or
another rank's snapshot are refused with the reason), agrees with every other rank on
the newest step all of them hold (so DDP and sharded jobs never mix steps), fetches
from the partner what this rank lost with its node, and returns it; or None, after one
line saying why (first start, a monitor that restarted, memory refused), and the
caller falls back to its file checkpoint.

Nothing another process wrote is unpickled: the layout is msgpack (`snapshot_format`).
"""

from __future__ import annotations

import datetime
import mmap
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ft_client import env, logs, wire
from ft_client import snapshot_format as fmt
from ft_client.errors import MemorySnapshotError
from ft_client.record_open import map_sealed
from ft_client.snapshot_format import HEADER_SIZE, Header, SnapshotFormatError, TensorRef, TensorSpec

if TYPE_CHECKING:
    import torch

log = logs.logger("ft_client.snapshot")

CONNECT_TIMEOUT = 10.0
"""Seconds to reach the monitor and get its reply."""
PEER_TIMEOUT = datetime.timedelta(seconds=120)
"""The side process group's timeout: a peer transfer (or the agreement) that takes longer fails."""
HEADROOM = 1 / 8
"""Buffers are asked for this much more than the state needs, so a state that grows a little
(an optimizer's first step) does not ask again."""
OWN, PEER = "own", "peer"
_MAX_INT = 2**63 - 1


# -- the monitor's memory -----------------------------------------------------------------
class _Buffer:
    """One mapped memory file of the monitor's."""

    def __init__(self, fd: int) -> None:
        self.mm = map_sealed(fd, what="the monitor's snapshot memory", size=f"{HEADER_SIZE}+ byte",
                             size_ok=lambda n: n >= HEADER_SIZE, error=MemorySnapshotError)
        self.size = len(self.mm)

    def header(self) -> Header | None:
        try:
            return fmt.parse_header(self.mm[:fmt.HEAD_BYTES])
        except SnapshotFormatError:
            return None

    def write_header(self, h: Header) -> None:
        self.mm[:fmt.HEAD_BYTES] = h.pack()

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # a tensor still views it: the mapping goes with that tensor
            pass


@dataclass
class _Pair:
    kind: str
    buffers: list[_Buffer]
    capacity: int
    monitor_pid: int | None = None

    def newest(self, *, job: str, rank: int | None = None) -> tuple[int, Header] | None:
        """The buffer holding the newest complete snapshot (by its header only) of ``job``."""
        best: tuple[int, Header] | None = None
        for i, b in enumerate(self.buffers):
            h = b.header()
            if h is None or h.state != fmt.COMPLETE or h.job != job or (rank is not None and h.rank != rank):
                continue
            if best is None or h.generation > best[1].generation:
                best = (i, h)
        return best

    def target(self, *, job: str) -> int:
        """The buffer a new save goes to: never the one holding the newest complete snapshot."""
        newest = self.newest(job=job)
        return 0 if newest is None else 1 - newest[0]

    def next_generation(self) -> int:
        gens = [h.generation for b in self.buffers if (h := b.header()) is not None]
        return max(gens, default=0) + 1

    def close(self) -> None:
        for b in self.buffers:
            b.close()
        self.buffers = []


def _recv_reply(sock: socket.socket) -> tuple[wire.Message, list[int]]:
    """One frame, with the descriptors attached to its first byte."""
    fds: list[int] = []
    data = b""
    first = True
    while True:
        want = wire.HEADER_SIZE if len(data) < wire.HEADER_SIZE else wire.HEADER_SIZE + wire.frame_length(data)
        if len(data) >= want and len(data) >= wire.HEADER_SIZE + 1:
            break
        if first:
            chunk, got, _, _ = socket.recv_fds(sock, want - len(data), 2)
            fds.extend(got)
            first = False
        else:
            chunk = sock.recv(want - len(data))
        if not chunk:
            for fd in fds:
                os.close(fd)
            raise MemorySnapshotError("the monitor closed the connection without a reply")
        data += chunk
    try:
        return wire.decode_body(data[wire.HEADER_SIZE:]), fds
    except wire.ProtocolError as e:
        for fd in fds:
            os.close(fd)
        raise MemorySnapshotError(f"the monitor's reply is malformed: {e}") from e


def open_pair(path: str, kind: str, nbytes: int, rank: int) -> _Pair | None:
    """Ask the monitor at ``path`` for its ``kind`` pair, at least ``nbytes`` each (0: as held);
    None when it holds none. MemorySnapshotError when it refuses (the message is its reason)."""
    hello = wire.Hello(wire.PROTOCOL_VERSION, wire.Role.SNAPSHOT, rank,
                       {"pid": os.getpid(), "kind": kind, "bytes": nbytes})
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(CONNECT_TIMEOUT)
    try:
        try:
            sock.connect(path)
            sock.sendall(wire.encode(hello))
            reply, fds = _recv_reply(sock)
        except OSError as e:
            raise MemorySnapshotError(f"cannot reach the monitor at {path}: {e.strerror or e}") from e
    finally:
        sock.close()
    try:
        if isinstance(reply, wire.Error):
            raise MemorySnapshotError(f"the monitor refused: {reply.message}")
        if not isinstance(reply, wire.HelloOk) or not isinstance(reply.session.get("snapshot"), dict):
            raise MemorySnapshotError(f"the monitor answered {type(reply).__name__}, not a snapshot handover "
                                      "(a monitor older than snapshots?)")
        info = reply.session["snapshot"]
        count, capacity = info.get("buffers"), info.get("bytes")
        if count == 0:
            return None
        if count != 2 or len(fds) != 2 or type(capacity) is not int or capacity < HEADER_SIZE:
            raise MemorySnapshotError(f"the monitor passed {len(fds)} descriptors for {count!r} buffers of "
                                      f"{capacity!r} bytes")
        buffers = [_Buffer(fd) for fd in fds]
        pid = reply.session.get("monitor_pid")
        return _Pair(kind, buffers, min(b.size for b in buffers), pid if type(pid) is int and pid > 0 else None)
    finally:
        for fd in fds:
            os.close(fd)


# -- the state's tree -------------------------------------------------------------------------
_PLAIN = (str, bytes, float, type(None), bool)


def _flatten(obj: Any, path: str, tensors: list[torch.Tensor], depth: int = 0) -> Any:
    """``obj`` with each tensor replaced by a TensorRef (appended to ``tensors``); Stateful objects
    (``state_dict()``) by their state; anything else a snapshot cannot hold refused by path."""
    import torch

    if depth > 100:
        raise MemorySnapshotError(f"{path} is nested over 100 deep")
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.is_quantized or obj.is_nested:
            raise MemorySnapshotError(f"{path} is a {obj.layout} tensor: snapshots hold dense tensors")
        if str(obj.dtype).removeprefix("torch.") not in fmt.ITEMSIZE:
            raise MemorySnapshotError(f"{path} is a tensor of {obj.dtype}, which snapshots do not hold")
        tensors.append(obj.detach())
        return TensorRef(len(tensors) - 1)
    if type(obj) is int:
        if not -(2**63) <= obj <= 2**64 - 1:
            raise MemorySnapshotError(f"{path} = {obj} does not fit 64 bits")
        return obj
    if isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if type(k) not in (str, int):
                raise MemorySnapshotError(f"{path} has a key {k!r} of type {type(k).__name__}: keys are str or int")
            out[k] = _flatten(v, f"{path}[{k!r}]", tensors, depth + 1)
        return out
    if isinstance(obj, list):
        return [_flatten(v, f"{path}[{i}]", tensors, depth + 1) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_flatten(v, f"{path}[{i}]", tensors, depth + 1) for i, v in enumerate(obj))
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict):  # torch.distributed.checkpoint's Stateful: a module, an optimizer, ...
        return _flatten(state_dict(), path, tensors, depth + 1)
    if isinstance(obj, int):  # an int subclass (IntEnum, ...) is saved as its value
        return _flatten(int(obj), path, tensors, depth)
    raise MemorySnapshotError(f"{path} is a {type(obj).__qualname__}: a snapshot holds tensors, "
                              "state_dict()-able objects and plain values (None, bool, int, float, str, bytes, "
                              "lists, tuples, dicts)")


def _rebuild(tree: Any, tensors: list[Any]) -> Any:
    if isinstance(tree, TensorRef):
        return tensors[tree.index]
    if isinstance(tree, dict):
        return {k: _rebuild(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_rebuild(v, tensors) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_rebuild(v, tensors) for v in tree)
    return tree


def _view(mm: mmap.mmap, offset: int, spec: TensorSpec) -> torch.Tensor:
    """A tensor over ``spec``'s bytes of the mapping (no copy)."""
    import torch

    dtype = getattr(torch, spec.dtype)
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype)
    flat = torch.frombuffer(mm, dtype=torch.uint8, count=spec.nbytes, offset=offset + spec.offset)
    return flat.view(dtype).view(spec.shape)


def _bytes_view(mm: mmap.mmap, start: int, end: int) -> torch.Tensor:
    import torch

    return torch.frombuffer(mm, dtype=torch.uint8, count=end - start, offset=start)


# -- agreement and peers ------------------------------------------------------------------------
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
        if missing:
            why = f"no monitor holds a snapshot of rank(s) {', '.join(map(str, missing[:8]))}"
        else:
            why = "no step is held for every rank: " + "; ".join(
                f"rank {q}: {sorted(o)}" for q, o in list(enumerate(options))[:8])
        return Agreement(None, {}, why)
    step = max(common)
    fetch = {q: where[q][step] for q in range(world) if where[q][step] != (q, 0) and where[q][step] != (q, 1)}
    return Agreement(step, fetch)


def _agree_alone(held: Holdings, rank: int) -> Agreement:
    """Without a process group: this rank's own newest complete snapshot."""
    steps = [h.step for h in held[:2] if h is not None and h.rank == rank]
    if not steps:
        return Agreement(None, {}, "no complete snapshot of this rank")
    return Agreement(max(steps))


def partners(rank: int, world: int, local_world: int) -> tuple[int, int] | None:
    """(the rank this one copies its snapshot to, the rank whose copy it keeps): the same local
    rank on the next node and on the previous one; None on a single node."""
    if local_world <= 0 or local_world >= world or world % local_world:
        return None
    return (rank + local_world) % world, (rank - local_world) % world


# -- the snapshotter -----------------------------------------------------------------------------
class Snapshotter:
    """Saves and restores one rank's snapshots through its monitor. Module functions `save`,
    `restore` and `wait` use one made from the environment (torchrun's and ft-launcher's)."""

    def __init__(self, *, socket_path: str | None = None, job: str | None = None, rank: int | None = None,
                 peer: bool | None = None, peer_every: int = 1, log_line: Callable[[str], None] | None = None) -> None:
        self.socket_path = socket_path if socket_path is not None else os.environ.get(env.RANK_MONITOR_SOCKET)
        self.job = job if job is not None else os.environ.get("TORCHELASTIC_RUN_ID", "")
        self._rank = rank
        self.peer_enabled = peer
        self.peer_every = max(1, peer_every)
        self._say = log_line or (lambda text: log.warning("%s", text))
        self._own: _Pair | None = None
        self._peer: _Pair | None = None
        self._pidfd: int | None = None
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._side: Any = None
        self._side_world: Any = None
        self._saves = 0
        self._staging: dict[int, Any] = {}
        self._verified: dict[int, Header] = {}
        self._peer_note_said = False
        self._refusal_said: str | None = None
        self.last_save_s = 0.0
        self.last_restore: dict[str, Any] = {}
        self.why_not: str | None = None
        """Why the last restore returned None (the one line it logged)."""

    # -- who am I ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        if self._rank is not None:
            return self._rank
        dist = _dist()
        if dist is not None:
            return int(dist.get_rank())
        return env.rank_from_env()

    def _world(self) -> int:
        dist = _dist()
        return int(dist.get_world_size()) if dist is not None else int(os.environ.get("WORLD_SIZE", "1"))

    # -- the monitor's memory -----------------------------------------------------------------
    def _monitor_gone(self) -> bool:
        if self._pidfd is None:
            return False
        readable, _, _ = select.select([self._pidfd], [], [], 0)
        return bool(readable)

    def _pair(self, kind: str, nbytes: int) -> _Pair | None:
        if self.socket_path is None:
            raise MemorySnapshotError(f"no monitor to keep snapshots: ${env.RANK_MONITOR_SOCKET} is not set "
                                      "(run under ft-launcher, or ft-monitor serve)")
        if self._monitor_gone():
            self._say("ft_client.snapshot: the monitor restarted: the snapshots it held are gone; new ones go to "
                      "the new monitor")
            self._drop()
        have = self._own if kind == OWN else self._peer
        if have is not None and have.capacity >= nbytes:
            return have
        ask = 0 if nbytes == 0 else min(fmt.aligned(int(nbytes * (1 + HEADROOM)), 4096), _MAX_INT)
        pair = open_pair(self.socket_path, kind, ask, self.rank)
        if have is not None:
            have.close()
        if kind == OWN:
            self._own = pair
        else:
            self._peer = pair
        if pair is not None and pair.monitor_pid is not None and self._pidfd is None:
            try:
                self._pidfd = os.pidfd_open(pair.monitor_pid)
            except OSError:
                self._pidfd = None
        return pair

    def _drop(self) -> None:
        for p in (self._own, self._peer):
            if p is not None:
                p.close()
        self._own = self._peer = None
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    # -- save ------------------------------------------------------------------------------------
    def save(self, step: int, state: Any) -> bool:
        """Snapshot ``state`` as of ``step``; True when it was handed over (the rest of the write
        finishes in the background; `wait` waits for it). False, after one line saying why, when
        the monitor refused the memory or cannot be reached. Every rank saves at the same steps."""
        t0 = time.perf_counter()
        if type(step) is not int or step < 0:
            raise MemorySnapshotError(f"step {step!r} is not a whole number >= 0")
        self.wait()
        tensors: list[torch.Tensor] = []
        tree = _flatten(state, "state", tensors)
        specs, data_len = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            specs.append(TensorSpec(str(t.dtype).removeprefix("torch."), tuple(t.shape), data_len, nbytes))
            data_len = fmt.aligned(data_len + nbytes)
        layout = fmt.encode_layout(tree, specs)
        data_offset = fmt.aligned(HEADER_SIZE + len(layout), 4096)
        end = data_offset + data_len
        try:
            pair = self._pair(OWN, end)
        except MemorySnapshotError as e:
            text = f"ft_client.snapshot: step {step} not saved: {e}"
            if text != self._refusal_said:
                self._say(text)
                self._refusal_said = text
            return False
        assert pair is not None
        i = pair.target(job=self.job)
        buf = pair.buffers[i]
        world = self._world()
        head = Header(state=fmt.WRITING, generation=pair.next_generation(), step=step, rank=self.rank, world=world,
                      layout_len=len(layout), data_offset=data_offset, data_len=data_len, saved_at=time.time(),
                      job=self.job, checksum=0)
        buf.write_header(head)
        pending = []
        for index, (t, spec) in enumerate(zip(tensors, specs)):
            if spec.nbytes == 0:
                continue
            dst = _view(buf.mm, data_offset, spec)
            if t.device.type == "cpu":
                dst.copy_(t)
            else:  # a device tensor: copied asynchronously into pinned memory, then here off this thread
                staged = self._staged(index, t)
                staged.copy_(t, non_blocking=True)
                pending.append((dst, staged))
            del dst
        event = _record_event(tensors) if pending else None
        side = self._side_group() if self._wants_peer(world) else None
        self._saves += 1
        send_peer = side is not None and self._saves % self.peer_every == 0
        self._thread_error = None
        self._thread = threading.Thread(target=self._finish, name="ft-snapshot-writer", daemon=True,
                                        args=(buf, head, layout, pending, event, side if send_peer else None))
        self._thread.start()
        self.last_save_s = time.perf_counter() - t0
        return True

    def _finish(self, buf: _Buffer, head: Header, layout: bytes, pending: list[tuple[Any, Any]], event: Any,
                side: Any) -> None:
        try:
            if event is not None:
                event.synchronize()
            for dst, staged in pending:
                dst.copy_(staged)
            pending.clear()
            buf.mm[HEADER_SIZE:HEADER_SIZE + len(layout)] = layout
            done = Header(**{**head.__dict__, "state": fmt.COMPLETE, "checksum": fmt.body_checksum(buf.mm, head)})
            buf.write_header(done)
            assert self._own is not None
            _forget_later_steps(self._own, buf, done)
            if side is not None:
                self._copy_to_partner(side, buf)
        except BaseException as e:  # reported by the next save or wait
            self._thread_error = e

    def _staged(self, index: int, t: torch.Tensor) -> torch.Tensor:
        """The pinned host tensor the ``index``-th device tensor of a state is copied into: one
        per position (a parameter and its optimizer moments have one shape, and each needs its
        own), made again when that position's shape or dtype changes."""
        import torch

        got = self._staging.get(index)
        if got is None or got.shape != t.shape or got.dtype != t.dtype:
            got = self._staging[index] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return got

    def wait(self) -> None:
        """Wait until the last save is complete in the monitor's memory (and at its partner's)."""
        t = self._thread
        if t is None:
            return
        t.join()
        self._thread = None
        e, self._thread_error = self._thread_error, None
        if e is not None:
            self._say(f"ft_client.snapshot: the last save did not complete: {type(e).__name__}: {e}")

    # -- peers -----------------------------------------------------------------------------------
    def _local_world(self, world: int) -> int:
        try:
            return int(os.environ.get("LOCAL_WORLD_SIZE", world))
        except ValueError:
            return world

    def _wants_peer(self, world: int) -> bool:
        if self.peer_enabled is False or _dist() is None or world <= 1:
            return False
        if partners(self.rank, world, self._local_world(world)) is None:
            if not self._peer_note_said:
                self._peer_note_said = True
                log.info("ft_client.snapshot: one node (LOCAL_WORLD_SIZE %s of %d ranks): no peer copy",
                         os.environ.get("LOCAL_WORLD_SIZE"), world)
            return False
        return True

    def _side_group(self) -> Any:
        """A gloo group over the whole world, for the agreement and the peer copies: made again when
        the job's default group is new (after an in-process restart); a collective."""
        dist = _dist()
        if dist is None:
            return None
        world = dist.group.WORLD
        if self._side is None or self._side_world is not world:
            self._side = dist.new_group(backend="gloo", timeout=PEER_TIMEOUT)
            self._side_world = world
        return self._side

    def _copy_to_partner(self, side: Any, buf: _Buffer) -> None:
        import torch

        dist = _dist()
        assert dist is not None
        world, rank = self._world(), self.rank
        to, frm = partners(rank, world, self._local_world(world)) or (rank, rank)
        mine = torch.frombuffer(bytearray(buf.mm[:fmt.HEAD_BYTES]), dtype=torch.uint8)
        theirs = torch.empty(fmt.HEAD_BYTES, dtype=torch.uint8)
        reqs = [dist.isend(mine, to, group=side), dist.irecv(theirs, frm, group=side)]
        for r in reqs:
            r.wait()
        head = fmt.parse_header(theirs.numpy().tobytes())
        if head.rank != frm or head.job != self.job or head.state != fmt.COMPLETE:
            raise MemorySnapshotError(f"rank {frm} sent a snapshot header of rank {head.rank}, job {head.job!r}")
        own = fmt.parse_header(buf.mm[:fmt.HEAD_BYTES])
        pair = self._pair(PEER, head.end)
        assert pair is not None
        j = pair.target(job=self.job)
        dst = pair.buffers[j]
        dst.write_header(Header(**{**head.__dict__, "state": fmt.WRITING}))
        out = _bytes_view(buf.mm, HEADER_SIZE, own.end)
        into = _bytes_view(dst.mm, HEADER_SIZE, head.end)
        reqs = [dist.isend(out, to, group=side), dist.irecv(into, frm, group=side)]
        for r in reqs:
            r.wait()
        del out, into
        dst.write_header(head)
        _forget_later_steps(pair, dst, head)

    # -- restore ---------------------------------------------------------------------------------
    def restore(self, map_location: Any = "cpu") -> tuple[int, Any] | None:
        """(step, state) of the newest snapshot every rank holds, or None after one line saying
        why (the caller loads its file checkpoint). A collective when torch.distributed is
        initialized with several ranks: every rank calls it."""
        t0 = time.perf_counter()
        self.wait()
        self.why_not = None
        notes: list[str] = []
        self._verified.clear()
        held = self._holdings(notes)
        dist = _dist()
        world = self._world()
        side = self._side_group() if dist is not None and world > 1 else None
        if side is None:
            agreement = _agree_alone(held, self.rank)
        else:
            agreement = self._agree(side, held, world)
        got: tuple[_Buffer, Header] | None = None
        layout: tuple[Any, list[TensorSpec]] = (None, [])
        failure = ""
        if agreement.step is not None:
            try:
                got = self._take(side, agreement)
                layout = _decode_layout(*got)  # a peer's copy too: refused in agreement with the other ranks
            except (MemorySnapshotError, OSError, RuntimeError, SnapshotFormatError) as e:
                failure = f"rank {self.rank} could not take step {agreement.step}'s snapshot: {e}"
            if side is not None:
                failure = self._confirm(side, failure)
        if agreement.step is None or failure:
            mine = any(h is not None and h.rank == self.rank for h in held[:2])
            why = failure or (agreement.why if mine else "; ".join(notes) or agreement.why) or "no snapshot"
            self.why_not = f"no snapshot to restore: {why}; falling back to the file checkpoint"
            self._say(f"ft_client.snapshot: {self.why_not}")
            return None
        for note in notes:
            self._say(f"ft_client.snapshot: {note}")
        assert got is not None
        buf, h = got
        state = self._load(buf, h, map_location, layout)
        self.last_restore = {"step": h.step, "seconds": time.perf_counter() - t0,
                             "from": agreement.fetch.get(self.rank, (self.rank, 0))[0], "bytes": h.end}
        return h.step, state

    def _holdings(self, notes: list[str]) -> Holdings:
        """What this rank's monitor holds. Its own snapshots are checked whole (checksum); copies
        of other ranks' only by their header here (their receiver checks them whole)."""
        out: list[Held | None] = [None] * SLOTS
        try:
            own = self._pair(OWN, 0)
        except MemorySnapshotError as e:
            notes.append(str(e))
            return tuple(out)
        if own is None:
            notes.append("the monitor holds no snapshot for this rank (a first start, or a monitor that restarted)")
        else:
            for i, b in enumerate(own.buffers):
                h = b.header()
                try:
                    if h is not None and h.rank != self.rank and h.state == fmt.COMPLETE and h.job == self.job:
                        out[i] = Held(h.rank, h.step)  # another rank's (ranks changed): checked by its taker
                        notes.append(f"buffer {i} holds rank {h.rank}'s snapshot, not rank {self.rank}'s "
                                     "(the ranks were numbered again: it is that rank's to take)")
                        continue
                    h = fmt.check(b.mm, job=self.job, rank=self.rank)
                    _decode_layout(b, h)  # a layout that does not decode is refused here: the other buffer serves
                    out[i] = Held(h.rank, h.step)
                    self._verified[i] = h
                except SnapshotFormatError as e:
                    if not str(e).startswith("empty"):
                        notes.append(f"buffer {i} refused: {e}")
        if _dist() is not None and self.peer_enabled is not False:
            try:
                peer = self._pair(PEER, 0)
            except MemorySnapshotError:
                peer = None
            for i, b in enumerate(peer.buffers if peer is not None else []):
                h = b.header()
                if h is not None and h.state == fmt.COMPLETE and h.job == self.job:
                    out[2 + i] = Held(h.rank, h.step)
        return tuple(out)

    def _agree(self, side: Any, held: Holdings, world: int) -> Agreement:
        import torch

        dist = _dist()
        assert dist is not None
        out = [torch.zeros(2 * SLOTS, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(out, torch.tensor(to_row(held), dtype=torch.int64), group=side)
        return agree([from_row([int(v) for v in row.tolist()]) for row in out])

    def _confirm(self, side: Any, failure: str) -> str:
        """Every rank took its snapshot, or none restores (a step is never mixed)."""
        import torch

        dist = _dist()
        assert dist is not None
        ok = torch.tensor([0 if failure else 1], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=side)
        if failure or int(ok.item()) == 1:
            return failure
        return "another rank could not take its snapshot of the agreed step"

    def _slot(self, slot: int) -> _Buffer:
        pair = self._own if slot < 2 else self._peer
        if pair is None:
            raise MemorySnapshotError(f"slot {slot} is gone")
        return pair.buffers[slot % 2]

    def _take(self, side: Any, agreement: Agreement) -> tuple[_Buffer, Header]:
        """This rank's snapshot of the agreed step, in its own pair: sends the copies it keeps
        for others, and takes its own from the monitor that keeps it (in rank order)."""
        import torch

        step = agreement.step
        sources = {slot for holder, slot in agreement.fetch.values() if holder == self.rank}
        for q, (holder, slot) in sorted(agreement.fetch.items()):
            if self.rank == holder and q != self.rank:
                dist = _dist()
                assert dist is not None
                src = self._slot(slot)
                head = fmt.parse_header(src.mm[:fmt.HEAD_BYTES])
                dist.send(torch.frombuffer(bytearray(src.mm[:fmt.HEAD_BYTES]), dtype=torch.uint8), q, group=side)
                body = _bytes_view(src.mm, HEADER_SIZE, head.end)
                dist.send(body, q, group=side)
                del body
            elif self.rank == q:
                self._receive(side, holder, slot, step, sources)
        assert self._own is not None
        for b in self._own.buffers:
            h = b.header()
            if h is not None and h.step == step and h.rank == self.rank and h.state == fmt.COMPLETE:
                i = self._own.buffers.index(b)
                if self._verified.get(i) == h:  # checked whole when its holdings were listed
                    return b, h
                return b, fmt.check(b.mm, job=self.job, rank=self.rank)
        raise MemorySnapshotError(f"step {step} is not in this rank's memory")

    def _receive(self, side: Any, holder: int, slot: int, step: int | None, sources: set[int]) -> None:
        import torch

        if holder == self.rank:  # a copy in this monitor's peer pair (this rank's number changed)
            src = self._slot(slot)
            head = fmt.parse_header(src.mm[:fmt.HEAD_BYTES])
            raw = bytes(src.mm[:head.end])
        else:
            dist = _dist()
            assert dist is not None
            got = torch.empty(fmt.HEAD_BYTES, dtype=torch.uint8)
            dist.recv(got, holder, group=side)
            head = fmt.parse_header(got.numpy().tobytes())
            raw = b""
        if head.rank != self.rank or head.step != step:
            raise MemorySnapshotError(f"rank {holder} sent rank {head.rank}'s step {head.step}")
        pair = self._pair(OWN, head.end)
        assert pair is not None
        free = [i for i in (pair.target(job=self.job), 1 - pair.target(job=self.job)) if i not in sources]
        if not free:
            raise MemorySnapshotError("both of this rank's buffers hold snapshots other ranks are taking")
        dst = pair.buffers[free[0]]
        dst.write_header(Header(**{**head.__dict__, "state": fmt.WRITING}))
        if raw:
            dst.mm[HEADER_SIZE:head.end] = raw[HEADER_SIZE:]
        else:
            dist = _dist()
            assert dist is not None
            into = _bytes_view(dst.mm, HEADER_SIZE, head.end)
            dist.recv(into, holder, group=side)
            del into
        dst.write_header(head)
        fmt.check(dst.mm, job=self.job, rank=self.rank)
        self._say(f"ft_client.snapshot: took step {step}'s snapshot ({head.end / 1e6:.1f} MB) from rank "
                  f"{holder}'s monitor, which kept a copy of this rank's")

    def _load(self, buf: _Buffer, h: Header, map_location: Any, layout: tuple[Any, list[TensorSpec]]) -> Any:
        """The state saved in ``buf``: its ``layout`` (`_decode_layout`'s) with its tensors copied out."""
        tree, specs = layout
        tensors = []
        for spec in specs:
            t = _view(buf.mm, h.data_offset, spec).clone()
            tensors.append(t.to(map_location) if map_location not in (None, "cpu") else t)
        return _rebuild(tree, tensors)

    def close(self) -> None:
        self.wait()
        self._drop()


def _decode_layout(buf: _Buffer, h: Header) -> tuple[Any, list[TensorSpec]]:
    """The buffer's layout (tree, tensor places), or SnapshotFormatError when it does not decode
    (an unknown extension type, a length past its bytes, tuples nested too deep): refused before
    the agreement, not raised at load."""
    raw = memoryview(buf.mm)
    try:
        return fmt.decode_layout(raw[HEADER_SIZE:HEADER_SIZE + h.layout_len], h.data_len)
    finally:
        raw.release()


def _dist() -> Any:
    """torch.distributed when it is imported and initialized, else None (nothing is imported here)."""
    import sys

    mod = sys.modules.get("torch.distributed")
    if mod is None or not mod.is_available() or not mod.is_initialized():
        return None
    return mod


def _forget_later_steps(pair: _Pair, written: _Buffer, head: Header) -> None:
    """After ``head`` is complete in ``written``: a snapshot of a later step (of the same rank)
    in the pair's other buffer is from before a rollback (the job went back to an earlier
    checkpoint); emptied, so that the newest save, not the highest step, is restored."""
    for b in pair.buffers:
        if b is written:
            continue
        h = b.header()
        if h is not None and h.rank == head.rank and h.step > head.step:
            b.write_header(Header(**{**h.__dict__, "state": fmt.EMPTY}))


def _record_event(tensors: list[torch.Tensor]) -> Any:
    import torch

    if any(t.is_cuda for t in tensors):
        e = torch.cuda.Event()  # type: ignore[no-untyped-call]
        e.record()
        return e
    return None


# -- the module's functions ----------------------------------------------------------------------
_default: Snapshotter | None = None
_default_lock = threading.Lock()


def default() -> Snapshotter:
    """The process's Snapshotter, made from the environment at first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Snapshotter()
        return _default


def save(step: int, state: Any) -> bool:
    """`Snapshotter.save` on the process's snapshotter."""
    return default().save(step, state)


def restore(map_location: Any = "cpu") -> tuple[int, dict[str, Any]] | None:
    """`Snapshotter.restore` on the process's snapshotter."""
    return default().restore(map_location)


def wait() -> None:
    """`Snapshotter.wait` on the process's snapshotter."""
    default().wait()


__all__ = ["Agreement", "Held", "Holdings", "MemorySnapshotError", "Snapshotter", "agree", "default", "open_pair",
           "partners", "restore", "save", "wait"]
