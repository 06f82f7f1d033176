"""The daemon's seams: what each of its parts needs from it, one narrow interface each.

The progress record's watch (`record_watch`), the message handlers (`handlers`), the
start-up watch (`startup_watch`) and the roll call's dump (`rank_snapshot`) take a host
typed by one of these protocols, never `monitor.MonitorDaemon`. Each protocol names
exactly the attributes its module touches, the config values it reads included (the
daemon's `Settings` satisfies every ``*Settings`` protocol here). Only `monitor` knows
all the parts: `MonitorDaemon` passes itself in, so the parts import this module and the
daemon imports the parts, one way. (`connection.ConnectionHost` is the same for a
connection, kept beside it.)

Imports nothing of the daemon above the modules whose types cross the seams.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ft_monitor.core.section_stats import SectionStats
from ft_monitor.core.settings import Settings
from ft_monitor.core.status import HangSummary
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
