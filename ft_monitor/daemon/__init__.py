"""The monitor daemon, `ft-monitor serve`: one per rank, asyncio on a Unix socket.

`monitor.MonitorDaemon` owns the listener (`listener`), the connections (`connection`,
whose messages `handlers` acts on), the rank (`rank`: its progress record,
`rank_record`, `record_map` and `record_watch`; its start-up watch, `startup_watch`), the
session's deadline timer (`deadline`, on the one `clock`) and what a hang sets off
(`executor`, which reports,
dumps, hands off to the launcher through `launcher_link`, or stops the rank; the roll
call's dump, `rank_snapshot`). `server` runs it as a process and `child` is the command it
may start (``serve -- CMD``). `fdlimits` keeps it from running short of descriptors. Every
module here runs inside the daemon's process; what starts a daemon from another process is
`ft_monitor.processes.monitor_process`.

May import: the core, forensics and processes rooms, and ft_client. Never the launcher or
the views. The handlers and watchers get the narrow interfaces they use, not the daemon:
each takes a host protocol from `ports` (`HandlerHost`, `RecordHost`, `StartupHost`,
`SnapshotHost`; a connection its `connection.ConnectionHost`) that names exactly what it
touches, and only `monitor` imports them all and passes itself in, so no module of the
daemon imports itself back through others.
"""
from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    """``ft_monitor.daemon.MonitorDaemon``, where it was before the daemon's modules had a room."""
    if name == "MonitorDaemon":
        from ft_monitor.daemon.monitor import MonitorDaemon

        return MonitorDaemon
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
