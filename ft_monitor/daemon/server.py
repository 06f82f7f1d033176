"""`ft-monitor serve` as a process: start the daemon, serve until told to stop, stop cleanly.

The daemon itself (listener, connections, rank, hangs) is daemon.py; this
module owns what belongs to the process: its scheduling class, its signals
(SIGTERM, SIGINT, SIGHUP and SIGQUIT stop it; SIGUSR1/SIGUSR2 are ignored
rather than fatal) and, with ``command``, the child it supervises (child.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable

from ft_monitor.core.settings import Settings
from ft_monitor.daemon.child import run_command
from ft_monitor.daemon.monitor import MonitorDaemon

log = logging.getLogger("ft_monitor.server")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
"""Each stops the daemon in order: with `serve -- CMD`, CMD is terminated first, never
left running unmonitored (SIGHUP arrives when a terminal closes)."""
IGNORED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
"""Their default action would kill the daemon and orphan `serve -- CMD`'s command."""


async def run_daemon(
    config: Settings,
    socket_path: str | os.PathLike[str],
    *,
    command: list[str] | None = None,
    launcher_socket: str | None = None,
    on_ready: Callable[[], None] | None = None,
) -> int:
    """Serve until a stop signal (or until ``command``, if given, exits). Returns the exit code.
    ``on_ready`` is called once the socket accepts connections and the stop signals are handled."""
    _yield_to_training()
    daemon = MonitorDaemon(config, socket_path, launcher_socket=launcher_socket)
    await daemon.startup()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    stop_reason: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        stop_reason.append(f"received {sig.name}")
        stop.set()

    def on_ignored(sig: signal.Signals) -> None:
        log.warning("received %s; ignored (stop the monitor with SIGTERM, SIGINT, SIGHUP or SIGQUIT)", sig.name)

    installed = []
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
        installed.append(sig)
    for sig in IGNORED_SIGNALS:
        loop.add_signal_handler(sig, on_ignored, sig)
        installed.append(sig)
    code = 0
    try:
        if on_ready is not None:
            on_ready()
        if command:
            code, why = await run_command(daemon, command, stop)
            if why is not None:
                stop_reason.append(why)
        else:
            await stop.wait()
    finally:
        await daemon.shutdown(stop_reason[0] if stop_reason else "stopped")
        for sig in installed:
            loop.remove_signal_handler(sig)
    return code


def _yield_to_training() -> None:
    """SCHED_BATCH: woken by a rank's event, the daemon does not preempt the rank (the
    scheduler lets it wait for its turn). Its timers still fire within a scheduler tick
    of milliseconds, well inside the 50 ms detection target."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError) as e:
        log.debug("SCHED_BATCH not available: %s", e)
