"""The monitor's part of a roll call: dump its rank and answer the launcher (DUMP_REQUEST).

When a hang is detected anywhere in the job, the launcher that owns the verdict asks
every monitor (its own, and through the other nodes' launchers theirs) for a snapshot
of its rank (docs/hang-handling.md, "The roll call"). For one request, in this order,
all within the request's ``timeout``:

1. the stack dump: the dump signal, and the wait until the dump file grew and stopped
   growing (at most ``stack_dump_timeout``), under the executor's ``dump_lock``, so no
   other dump or push reaches the rank meanwhile. A rank without a handler for the
   signal (it would die of it) is not signalled; a rank restarting in-process (its
   threads are running Python) is not dumped at all;
2. with ``native_stacks``, py-spy's native stacks (native_stacks.py);
3. with the Flight Recorder asked for, FR_DUMP pushed on the rank's control connection,
   only once the stack dump is complete: faulthandler reads every thread's frames
   without the GIL, and the control thread running Python while it does could crash
   the rank; then the wait for the trace file (the rank writes it through a rename).

The answer (`snapshot.MonitorSnapshot`) names the files and the bytes of this dump; the
launcher reads them. Every process operation goes through the executor's `ProcessOps`
and every wait through the daemon's clock, so tests run this in-process with fakes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ft_client import wire
from ft_client.safefiles import write_bytes_atomic
from ft_monitor.core.policy import iteration_now
from ft_monitor.core.snapshot import FR_NOTE, STARTING, MonitorSnapshot
from ft_monitor.core.state import Phase
from ft_monitor.daemon.executor import _POLL, wait_for_dump
from ft_monitor.forensics import dump_file
from ft_monitor.forensics.native_stacks import NativeStacks, PySpy
from ft_monitor.processes.procinfo import ProcessHandle, catches_signal

if TYPE_CHECKING:
    from ft_monitor.daemon.connection import Connection
    from ft_monitor.daemon.ports import SnapshotHost, Starting
    from ft_monitor.daemon.rank import RankResources

log = logging.getLogger("ft_monitor.server")

MAX_TIMEOUT = 600.0


class RankSnapshots:
    def __init__(self, daemon: SnapshotHost, native: NativeStacks | None = None,
                 catches: Callable[[int, int], bool | None] = catches_signal) -> None:
        self.d = daemon
        self.native: NativeStacks = native or PySpy()
        self.catches = catches
        self.taken = 0

    def answer(self, conn: Connection, req: wire.DumpRequest) -> None:
        """Take the snapshot in a task; reply on ``conn`` when done."""
        rank = self.d.rank
        self.d.spawn(self._answer(conn, req), rank.hold() if rank is not None else None)

    async def _answer(self, conn: Connection, req: wire.DumpRequest) -> None:
        ex = self.d.executor
        start = self.d.clock.now()
        deadline = start + min(req.timeout, MAX_TIMEOUT)
        async with ex.dump_lock:
            snap = await self.take(req, deadline)
        took = self.d.clock.now() - start
        snap = MonitorSnapshot(**{**snap.to_wire(), "took_s": round(took, 6)})
        log.info("roll call %d: rank %s answered in %.3fs (stack %s, Flight Recorder %s)%s", req.incident,
                 snap.rank, took, "captured" if snap.stack_captured else "missing",
                 "written" if snap.flight_recorder else "missing",
                 f": {'; '.join(snap.notes)}" if snap.notes else "")
        conn.send(wire.DumpReply(snap.to_wire()))

    async def take(self, req: wire.DumpRequest, deadline: float) -> MonitorSnapshot:
        d, ex = self.d, self.d.executor
        rank = d.rank
        if rank is None:
            starting = d.startup_watch.starting()
            if starting is None:
                return MonitorSnapshot(connected=False, notes=["no rank is connected to this monitor"])
            return await self._starting(starting, req, deadline)
        s = rank.session
        self.taken += 1
        notes: list[str] = []
        base = dict(connected=True, rank=s.rank, pid=s.pid, phase=s.phase.value, iteration=iteration_now(s))
        if not ex.ops.alive(rank.process):
            return MonitorSnapshot(**base, alive=False, notes=["the rank's process has exited"])  # type: ignore[arg-type]
        if s.phase is Phase.RESTARTING:
            return MonitorSnapshot(**base, alive=True, notes=[  # type: ignore[arg-type]
                "restarting in-process: not dumped (its threads run Python while it unwinds)"])
        path = rank.dump_path()
        captured, start_at = await self._stack(s.pid, rank.process, path, req.incident, deadline, notes)
        end_at = ex.ops.file_size(path)
        native = await self._native(rank, req, deadline, notes) if d.config.native_stacks else None
        fr = await self._flight_recorder(rank, req, deadline, notes) if req.flight_recorder else None
        return MonitorSnapshot(**base, alive=True, stack_dump=str(path), stack_from=start_at,  # type: ignore[arg-type]
                               stack_to=end_at if captured else start_at, stack_captured=captured,
                               native_stack=native, flight_recorder=fr, notes=notes)

    def _left(self, deadline: float) -> float:
        return max(0.0, deadline - self.d.clock.now())

    async def _starting(self, w: Starting, req: wire.DumpRequest, deadline: float) -> MonitorSnapshot:
        """The worker has not connected yet (it may wait in ``init_process_group`` for a peer, or be
        the peer that never got there): its stack through the start-up hook's faulthandler, in the
        file its start-up deadline would use, so the verdict can tell the waiting from the stuck."""
        self.taken += 1
        notes: list[str] = ["not connected yet: dumped through the start-up hook"]
        base = dict(connected=False, rank=w.rank, pid=w.pid, phase=STARTING)
        if not self.d.executor.ops.alive(w.process):
            return MonitorSnapshot(**base, alive=False, notes=[*notes, "its process has exited"])  # type: ignore[arg-type]
        if w.dump_path is None:
            return MonitorSnapshot(**base, alive=True, notes=[  # type: ignore[arg-type]
                *notes, "no stack dump: it has no handler for the dump signal (not started through the hook)"])
        captured, start_at = await self._stack(w.pid, w.process, w.dump_path, req.incident, deadline, notes)
        end_at = self.d.executor.ops.file_size(w.dump_path)
        return MonitorSnapshot(**base, alive=True, stack_dump=str(w.dump_path), stack_from=start_at,  # type: ignore[arg-type]
                               stack_to=end_at if captured else start_at, stack_captured=captured, notes=notes)

    async def _stack(self, pid: int, process: ProcessHandle, path: Path, incident: int, deadline: float,
                     notes: list[str]) -> tuple[bool, int]:
        """Whether the dump came, and where in ``path`` it starts (after its header)."""
        ex = self.d.executor
        sig = ex.stack_dump_signal
        timeout = min(ex.stack_dump_timeout, self._left(deadline))
        if timeout <= 0:
            notes.append("stack dump skipped (stack_dump_timeout is 0, or no time left)")
            return False, ex.ops.file_size(path)
        if self.catches(pid, sig) is False:
            notes.append(f"stack dump skipped: the rank has no handler for signal {sig} (it would die of it)")
            return False, ex.ops.file_size(path)
        header = dump_file.announce(path, dump_file.header(pid, sig, f"roll call {incident}"))
        before = ex.ops.file_size(path)
        if ex.ops.send(process, sig):
            if await wait_for_dump(ex.ops, self.d.clock, path, before, timeout, process):
                return True, before
            notes.append(f"no stack dump within {timeout:.1f}s")
        else:
            notes.append("stack dump skipped: the process is gone")
        if header is not None:
            dump_file.take_back(path, header)
        return False, ex.ops.file_size(path)

    async def _native(self, rank: RankResources, req: wire.DumpRequest, deadline: float,
                      notes: list[str]) -> str | None:
        s = rank.session
        text, why = await self.native.dump(s.pid, self._left(deadline))
        if text is None:
            notes.append(f"no native stacks: {why}")
            return None
        out = rank.session_dir / f"rank{s.rank}-pid{s.pid}-native{req.incident}.txt"
        try:
            write_bytes_atomic(out, text.encode())
        except OSError as e:
            notes.append(f"cannot write the native stacks to {out}: {e.strerror or e}")
            return None
        return str(out)

    async def _flight_recorder(self, rank: RankResources, req: wire.DumpRequest, deadline: float,
                               notes: list[str]) -> str | None:
        """Push FR_DUMP (after the stack dump: see the module docstring) and wait for the file."""
        s = rank.session
        if rank.control is None:
            notes.append(f"{FR_NOTE} the rank has no control connection (a client older than "
                         "flight_recorder_entries, or it could not open one)")
            return None
        out = rank.session_dir / f"rank{s.rank}-pid{s.pid}-fr{req.incident}.json"
        try:
            out.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            notes.append(f"{FR_NOTE} cannot clear {out}: {e.strerror or e}")
            return None
        rank.control.send(wire.FrDump(str(out)))
        ops = self.d.executor.ops
        while self._left(deadline) > 0:
            if ops.file_size(out) > 0:
                return str(out)
            if not ops.alive(rank.process):
                break
            await ops.sleep(_POLL)
        if ops.file_size(out) > 0:
            return str(out)
        notes.append(f"{FR_NOTE} not written in time (the rank's control thread did not run: does its main "
                     "thread hold the GIL?)")
        return None
