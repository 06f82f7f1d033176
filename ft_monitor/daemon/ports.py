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

from typing import Protocol

from ft_monitor.core.section_stats import SectionStats
from ft_monitor.daemon.clock import Clock


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
