"""The daemon's seams: what each of its parts needs from it, one narrow interface each.

The progress record's watch (`record_watch`: `RecordHost`), the message handlers
(`handlers`: `HandlerHost`), the start-up watch (`startup_watch`: `StartupHost`) and the
roll call's dump (`rank_snapshot`: `SnapshotHost`) take a host typed by one of these
protocols, never `monitor.MonitorDaemon`. Each protocol names exactly what its module
touches, the config values it reads included (the daemon's `Settings` satisfies every
``*Settings`` protocol; the start-up watch takes the settings whole, as
`startup.dump_spec` does). Where a part uses another part, it sees a narrow view of it
too (`StartupGate`, `RollCall`, `SnapshotKeeper`, `StartingWorkers`, the executor's `DumpTools`). Only
`monitor` knows all the parts: `MonitorDaemon` passes itself in, so the parts import this
module and the daemon imports the parts, one way; mypy checks at those calls that it
fits. (`connection.ConnectionHost` is the same for a connection, kept beside it.)

This module imports, of the daemon, only what crosses the seams (clock, connection,
executor, rank), never a part or the daemon.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ft_client import wire
from ft_client.timeouts import Timeouts
from ft_monitor.core.section_stats import SectionStats
from ft_monitor.core.settings import Settings
from ft_monitor.core.state import Session
from ft_monitor.core.status import ExitSummary, HangSummary, InprocessRestart, MonitorStatus
from ft_monitor.daemon.clock import Clock
from ft_monitor.daemon.connection import Connection
from ft_monitor.daemon.executor import HangCase, ProcessOps
from ft_monitor.daemon.rank import Hold, RankResources
from ft_monitor.processes.exits import ExitWatch
from ft_monitor.processes.procinfo import ProcessHandle


class RecordSettings(Protocol):
    """The config values `record_watch` reads."""

    @property
    def progress_record(self) -> bool:
        """Whether a rank that asks for a progress record may have one."""


class RecordHost(Protocol):
    """What `record_watch` needs from the daemon: its clock, and where progress is tallied."""

    @property
    def clock(self) -> Clock:
        """Stamps a record's creation and each read of it."""

    @property
    def config(self) -> RecordSettings:
        """Whether records are offered at all."""

    @property
    def section_stats(self) -> SectionStats:
        """Where the sections a record closed are counted, over all sessions (STATUS)."""

    iteration_high: int | None
    """The highest iteration any session reported; an iteration read from a record raises it."""


class HandlerSettings(RecordSettings, Protocol):
    """The config values `handlers` reads (the handshake offers a record, so those too)."""

    @property
    def report_dir(self) -> str | None:
        """None: a rank's reports go to its torchelastic attempt directory, when it has one."""

    @property
    def num_warmup_iterations(self) -> int:
        """Warm-up length for a rank whose HELLO does not say its own."""

    @property
    def stack_dump_signal(self) -> signal.Signals:
        """Told to the rank at the handshake (its faulthandler listens on it)."""

    @property
    def skip_section_response(self) -> bool:
        """Told to the rank at the handshake."""

    @property
    def on_monitor_lost(self) -> str:
        """Told to the rank at the handshake."""

    @property
    def on_hang(self) -> str:
        """Told to the rank at the handshake."""

    @property
    def client_request_timeout(self) -> float:
        """Told to the rank at the handshake."""

    @property
    def safety_factor(self) -> float:
        """Told to the rank at the handshake (it learns timeouts with it)."""

    @property
    def min_learned_timeout(self) -> float:
        """Told to the rank at the handshake."""

    @property
    def flight_recorder_entries(self) -> int:
        """Whether the rank keeps a Flight Recorder (told at the handshake)."""

    @property
    def inprocess_restart_timeout(self) -> float:
        """How long a rank restarting in-process has to come back."""

    def timeouts(self) -> Timeouts:
        """The configured timeouts, none learned (to tell which a learned update switches on)."""


class StartupGate(Protocol):
    """What the handlers ask the start-up watch."""

    def refusal(self, pid: int) -> str | None:
        """Why ``pid`` may not connect as the rank now, or None."""

    def connected(self, session: Session) -> None:
        """A rank's session began (its worker's start-up may be over)."""

    def worker_started(self, pid: int, rank: int, error_file: str | None = None) -> str:
        """Time a worker the launcher announced; what was done, for its ACK."""


class RollCall(Protocol):
    """What the handlers ask of the roll call (rank_snapshot)."""

    def answer(self, conn: Connection, req: wire.DumpRequest) -> None:
        """Snapshot the rank in a task and reply on ``conn``."""


class SnapshotKeeper(Protocol):
    """What the handlers ask of the snapshot memory (snapshot_memory)."""

    def hello(self, conn: Connection, msg: wire.Hello) -> None:
        """Answer a `snapshot` HELLO on ``conn`` (the descriptors, or why not) and close it."""


class HandlerHost(RecordHost, Protocol):
    """What `handlers` needs from the daemon to act on a message (the record's host too)."""

    @property
    def config(self) -> HandlerSettings:
        """What the handshake tells the rank, and the defaults a rank may override."""

    @property
    def rank(self) -> RankResources | None:
        """The connected rank, if any: its messages go to its session."""

    timeouts: Timeouts
    """In force for the connected rank and later sessions; UPDATE_CONFIG replaces it."""

    @property
    def report_dir(self) -> Path:
        """Where a new rank's reports go (unless its attempt directory is used)."""

    @property
    def exits(self) -> ExitWatch:
        """Handed to a new rank's resources, which watch its process's exit."""

    @property
    def sessions_started(self) -> int:
        """The session number a new rank and its control connection are told."""

    @property
    def launcher_pid(self) -> int | None:
        """The launcher that started this daemon: the only pid whose launcher HELLO is accepted."""

    @property
    def others(self) -> dict[Connection, None]:
        """Connections that are not the rank's; a control connection leaves them."""

    last_exit: ExitSummary | None
    """The latest session's EXITING (STATUS)."""

    last_restart: InprocessRestart | None
    """The rank's latest in-process restart, as its REENTERED said (STATUS)."""

    @property
    def startup_watch(self) -> StartupGate:
        """The watch on a worker that has not connected yet."""

    @property
    def snapshots(self) -> RollCall:
        """Answers the launcher's DUMP_REQUEST."""

    @property
    def snapshot_memory(self) -> SnapshotKeeper:
        """Holds the rank's snapshot memory and hands it to `snapshot` connections."""

    def observer_active(self, conn: Connection) -> None:
        """An observer sent something: it is the most recently active (the cap evicts others first)."""

    def status(self) -> MonitorStatus:
        """The answer to STATUS."""

    def rank_connected(self, rank: RankResources) -> None:
        """A rank's HELLO was accepted: it is the connected rank now."""

    def disconnected(self, conn: Connection) -> None:
        """The session on ``conn`` ended (GOODBYE, EXITING): not timed any more."""


class StartupHost(Protocol):
    """What `startup_watch` needs from the daemon: to time a worker, see the rank, act on a hang."""

    @property
    def clock(self) -> Clock:
        """Times the start-up deadline."""

    @property
    def config(self) -> Settings:
        """startup_timeout, startup_until and stack_dump_signal; whole, since `startup.dump_spec`
        (where the start-up hook's stack dump goes) takes the settings."""

    @property
    def report_dir(self) -> Path:
        """The daemon's report directory: where a start-up hang's report and dump go."""

    @property
    def exits(self) -> ExitWatch:
        """Tells when a watched worker exits; forgets its process once it is let go."""

    @property
    def rank(self) -> RankResources | None:
        """The connected rank: a worker announced after it connected is timed in its session."""

    @property
    def hangs(self) -> list[HangSummary]:
        """The daemon's hangs (STATUS); a start-up hang is added to them."""

    def after_batch(self, conn: Connection) -> None:
        """Arm the deadline timer again on the session of the rank on ``conn``."""

    def spawn(self, coro: Coroutine[Any, Any, Any], hold: Hold | None = None) -> None:
        """Run a task the daemon waits for at shutdown."""

    async def handle_hang(self, case: HangCase) -> None:
        """Act on a hang as on any other (report, dump, hand-off, termination)."""


@dataclass(frozen=True)
class Starting:
    """A worker that has not connected as the rank: watched, or its start-up hang being handled."""

    rank: int
    pid: int
    process: ProcessHandle
    dump_path: Path | None
    """Where the start-up hook's faulthandler writes its stacks (None: it has no handler)."""


class StartingWorkers(Protocol):
    """What the roll call asks the start-up watch."""

    def starting(self) -> Starting | None:
        """The worker this monitor's rank is still starting as, if any."""


class DumpTools(Protocol):
    """What the roll call uses of the executor."""

    @property
    def ops(self) -> ProcessOps:
        """Signal the rank, see whether it lives, size its dump file, sleep."""

    @property
    def dump_lock(self) -> asyncio.Lock:
        """Held while a stack dump is taken, so nothing else reaches the rank meanwhile."""

    @property
    def stack_dump_signal(self) -> int:
        """The signal that makes the rank's faulthandler dump its stacks."""

    @property
    def stack_dump_timeout(self) -> float:
        """How long a stack dump may take."""


class SnapshotSettings(Protocol):
    """The config values `rank_snapshot` reads."""

    @property
    def native_stacks(self) -> bool:
        """Whether a roll call also takes py-spy's native stacks."""


class SnapshotHost(Protocol):
    """What `rank_snapshot` (the roll call's dump) needs from the daemon."""

    @property
    def clock(self) -> Clock:
        """Times the request's deadline and the wait for the dump."""

    @property
    def config(self) -> SnapshotSettings:
        """Whether native stacks are taken."""

    @property
    def rank(self) -> RankResources | None:
        """The connected rank, whose process is dumped and whose control connection gets FR_DUMP."""

    @property
    def startup_watch(self) -> StartingWorkers:
        """The worker still starting, dumped when no rank is connected."""

    @property
    def executor(self) -> DumpTools:
        """The process operations and the dump lock, shared with the hang path."""

    def spawn(self, coro: Coroutine[Any, Any, Any], hold: Hold | None = None) -> None:
        """Run a task (holding the rank's resources) that the daemon waits for at shutdown."""
