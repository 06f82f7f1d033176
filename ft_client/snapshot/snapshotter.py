"""`Snapshotter`: one rank's saves and restores through its monitor (docs/snapshots.md).

`save` flattens the state (`tree`), copies its tensors into the buffer of the monitor's
memory (`memory`) not holding the newest snapshot, and finishes on a background thread:
the layout, the checksum, the header that makes it complete (`format`), then the partner
copy (`peer`). `restore` checks what this rank's monitor holds, agrees with every other
rank on the step (`agreement`), takes what this rank lacks from the monitor that kept it
(`peer`), and copies the state out. torch is imported only when they run.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ft_client import env, logs
from ft_client.errors import MemorySnapshotError
from ft_client.snapshot import agreement, peer
from ft_client.snapshot import format as fmt
from ft_client.snapshot.agreement import SLOTS, Held, Holdings
from ft_client.snapshot.format import HEADER_SIZE, Header, SnapshotFormatError, TensorSpec
from ft_client.snapshot.memory import OWN, PEER, Buffer, MonitorMemory
from ft_client.snapshot.tree import DTensors, check_like, check_shards, flatten, lay_out, rebuild, view

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ft_client.snapshot")  # its handler is installed by the first Snapshotter (logs.install)


class Snapshotter:
    """Saves and restores one rank's snapshots through its monitor. Module functions `save`,
    `restore` and `wait` use one made from the environment (torchrun's and ft-launcher's)."""

    def __init__(self, *, socket_path: str | None = None, job: str | None = None, rank: int | None = None,
                 peer: bool | None = None, peer_every: int = 1, log_line: Callable[[str], None] | None = None) -> None:
        logs.install()
        self.job = job if job is not None else os.environ.get("TORCHELASTIC_RUN_ID", "")
        self._rank = rank
        self.peer_enabled = peer
        self.peer_every = max(1, peer_every)
        self._say = log_line or (lambda text: log.warning("%s", text))
        self.memory = MonitorMemory(socket_path if socket_path is not None else os.environ.get(env.RANK_MONITOR_SOCKET),
                                    rank=lambda: self.rank, say=self._say)
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

    @property
    def socket_path(self) -> str | None:
        """The monitor's socket (``$FT_RANK_MONITOR_IPC_SOCKET`` unless given); None: no monitor."""
        return self.memory.socket_path

    @socket_path.setter
    def socket_path(self, path: str | None) -> None:
        self.memory.socket_path = path

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
        tree = flatten(state, "state", tensors)
        specs, data_len = lay_out(tensors)
        layout = fmt.encode_layout(tree, specs)
        data_offset = fmt.aligned(HEADER_SIZE + len(layout), 4096)
        end = data_offset + data_len
        try:
            pair = self.memory.pair(OWN, end)
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
            dst = view(buf.mm, data_offset, spec)
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

    def _finish(self, buf: Buffer, head: Header, layout: bytes, pending: list[tuple[Any, Any]], event: Any,
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
            assert self.memory.own is not None
            self.memory.own.forget_later_steps(buf, done)
            if side is not None:
                peer.copy_to_partner(side, buf, self.memory, rank=self.rank, world=self._world(), job=self.job)
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
    def _wants_peer(self, world: int) -> bool:
        if self.peer_enabled is False or _dist() is None or world <= 1:
            return False
        if peer.partners(self.rank, world, peer.local_world(world)) is None:
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
            self._side = dist.new_group(backend="gloo", timeout=peer.PEER_TIMEOUT)
            self._side_world = world
        return self._side

    # -- restore ---------------------------------------------------------------------------------
    def restore(self, map_location: Any = "cpu", *, like: Any = None) -> tuple[int, Any] | None:
        """(step, state) of the newest snapshot every rank holds, or None after one line saying
        why (the caller loads its file checkpoint). A collective when torch.distributed is
        initialized with several ranks: every rank calls it. ``like``: a state shaped as the one
        saved (the model and optimizer to load into, FSDP2's included), whose DTensors give the
        restored DTensors their device meshes (`tree.DTensors`): without it, or where it has none,
        they are made on meshes made as recorded."""
        t0 = time.perf_counter()
        found: dict[str, Any] = {}
        if like is not None:  # refused by path here, before any collective, as save would refuse it
            flatten(like, "state", [], found=found)
        self.wait()
        self.why_not = None
        notes: list[str] = []
        self._verified.clear()
        held = self._holdings(notes, found)
        dist = _dist()
        world = self._world()
        side = self._side_group() if dist is not None and world > 1 else None
        if side is None:
            agreed = agreement.agree_alone(held, self.rank)
        else:
            agreed = agreement.gather(side, held, world)
        got: tuple[Buffer, Header] | None = None
        layout: tuple[Any, list[TensorSpec]] = (None, [])
        dtensors: DTensors | None = None
        failure = ""
        if agreed.step is not None:
            try:
                got = self._take(side, agreed)
                layout = _decode_layout(*got, found)  # a peer's copy too: refused in agreement with the other ranks
                dtensors = DTensors(*layout, found, world=world, map_location=map_location)
            except (MemorySnapshotError, OSError, RuntimeError, SnapshotFormatError, TypeError, ValueError) as e:
                failure = f"rank {self.rank} could not take step {agreed.step}'s snapshot: {e}"
            if side is not None:
                failure = agreement.confirm(side, failure, dtensors.token if dtensors is not None else 0)
        if agreed.step is None or failure:
            mine = any(h is not None and h.rank == self.rank for h in held[:2])
            why = failure or (agreed.why if mine else "; ".join(notes) or agreed.why) or "no snapshot"
            self.why_not = f"no snapshot to restore: {why}; falling back to the file checkpoint"
            if agreed.nothing and not failure and os.environ.get(env.RESTART_COUNT) == "0":
                if self.rank == 0:  # a job's first start: said once, quietly, not a warning per rank
                    log.info("ft_client.snapshot: %s", self.why_not)
            else:
                self._say(f"ft_client.snapshot: {self.why_not}")
            return None
        for note in notes:
            self._say(f"ft_client.snapshot: {note}")
        assert got is not None
        buf, h = got
        assert dtensors is not None
        dtensors.build()  # every rank (a collective when torch makes process groups for a mesh)
        state = self._load(buf, h, map_location, layout, dtensors)
        self.last_restore = {"step": h.step, "seconds": time.perf_counter() - t0,
                             "from": agreed.fetch.get(self.rank, (self.rank, 0))[0], "bytes": h.end}
        return h.step, state

    def _holdings(self, notes: list[str], like: dict[str, Any]) -> Holdings:
        """What this rank's monitor holds. Its own snapshots are checked whole (checksum, layout, and
        its DTensors against those of ``like``, the state to restore into); copies of other ranks'
        only by their header here (their receiver checks them whole)."""
        out: list[Held | None] = [None] * SLOTS
        try:
            own = self.memory.pair(OWN, 0)
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
                    _decode_layout(b, h, like)  # a layout that does not decode or fit like: the other serves
                    out[i] = Held(h.rank, h.step)
                    self._verified[i] = h
                except SnapshotFormatError as e:
                    if not str(e).startswith("empty"):
                        notes.append(f"buffer {i} refused: {e}")
        if _dist() is not None and self.peer_enabled is not False:
            try:
                kept = self.memory.pair(PEER, 0)
            except MemorySnapshotError:
                kept = None
            for i, b in enumerate(kept.buffers if kept is not None else []):
                h = b.header()
                if h is not None and h.state == fmt.COMPLETE and h.job == self.job:
                    out[2 + i] = Held(h.rank, h.step)
        return tuple(out)

    def _take(self, side: Any, agreed: agreement.Agreement) -> tuple[Buffer, Header]:
        """This rank's snapshot of the agreed step, in its own pair: the ranks first move what
        some of them lack from the monitors that keep it (`peer.exchange`)."""
        peer.exchange(side, agreed, self.memory, rank=self.rank, job=self.job, say=self._say)
        own = self.memory.own
        assert own is not None
        for i, b in enumerate(own.buffers):
            h = b.header()
            if h is not None and h.step == agreed.step and h.rank == self.rank and h.state == fmt.COMPLETE:
                if self._verified.get(i) == h:  # checked whole when its holdings were listed
                    return b, h
                return b, fmt.check(b.mm, job=self.job, rank=self.rank)
        raise MemorySnapshotError(f"step {agreed.step} is not in this rank's memory")

    def _load(self, buf: Buffer, h: Header, map_location: Any, layout: tuple[Any, list[TensorSpec]],
              dtensors: DTensors) -> Any:
        """The state saved in ``buf``: its ``layout`` (`_decode_layout`'s) with its tensors copied out
        (a DTensor's shard to the device ``dtensors`` says)."""
        tree, specs = layout
        tensors = []
        for i, spec in enumerate(specs):
            t = view(buf.mm, h.data_offset, spec).clone()
            moved = map_location not in (None, "cpu") and i not in dtensors.locals
            tensors.append(t.to(map_location) if moved else t)
        return rebuild(tree, tensors, dtensors)

    def close(self) -> None:
        self.wait()
        self.memory.drop()


def _decode_layout(buf: Buffer, h: Header, like: dict[str, Any]) -> tuple[Any, list[TensorSpec]]:
    """The buffer's layout (tree, tensor places), or SnapshotFormatError when it does not decode
    (an unknown extension type, a length past its bytes, tuples nested too deep, a DTensor's shard
    that is not the one the header's rank holds, a DTensor saved otherwise than ``like``'s at its
    path: `tree.check_like`): refused before the agreement, not raised at load."""
    raw = memoryview(buf.mm)
    try:
        tree, specs = fmt.decode_layout(raw[HEADER_SIZE:HEADER_SIZE + h.layout_len], h.data_len)
    finally:
        raw.release()
    check_shards(tree, specs, h.rank)
    check_like(tree, specs, like)
    return tree, specs


def _dist() -> Any:
    """torch.distributed when it is imported and initialized, else None (nothing is imported here)."""
    mod = sys.modules.get("torch.distributed")
    if mod is None or not mod.is_available() or not mod.is_initialized():
        return None
    return mod


def _record_event(tensors: list[torch.Tensor]) -> Any:
    import torch

    if any(t.is_cuda for t in tensors):
        e = torch.cuda.Event()  # type: ignore[no-untyped-call]
        e.record()
        return e
    return None
