"""`ft-monitor serve -- CMD`: the command the daemon starts, watches and stops.

CMD runs in its own session with the daemon's socket in its environment (and, with
``startup_timeout``, the start-up hook: ft_client/startup/__init__.py); the daemon times its
start-up from here (startup_watch.py). Its
exit status is published to the daemon (`MonitorDaemon.children`) so the rank's
disconnect is logged with it; stopping it is the one TERM -> grace -> KILL
sequence (escalation.py) applied to its process group.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from ft_client.env import RANK_MONITOR_SOCKET, rank_from_env
from ft_client.process_group import PROCESS_GROUP_TIMEOUT_ENV
from ft_client.startup import worker_env as startup_env
from ft_monitor.core.startup import dump_spec
from ft_monitor.daemon.monitor import MonitorDaemon
from ft_monitor.processes.escalation import terminate_then_kill
from ft_monitor.processes.procinfo import ProcessHandle, describe_wait_status, signal_group

log = logging.getLogger("ft_monitor.server")


class _Group:
    def __init__(self, pgid: int) -> None:
        self.pgid = pgid

    def send(self, sig: int) -> bool:
        return signal_group(self.pgid, sig)


async def run_command(daemon: MonitorDaemon, command: list[str], stop: asyncio.Event) -> tuple[int, str | None]:
    """Run ``command`` until it exits or ``stop`` is set. Returns (exit code for the
    daemon, why it stopped or None when ``stop`` came first); the command is stopped
    before this returns, whatever happens."""
    env = dict(os.environ)
    env[RANK_MONITOR_SOCKET] = str(daemon.socket_path)
    if daemon.config.startup_timeout is not None:  # arm its start-up stack dump before its own code runs
        env.update(startup_env(dump_spec(daemon.config, daemon.report_dir), env))
    if daemon.config.process_group_timeout is not None:  # for ft_client.process_group_timeout()
        env[PROCESS_GROUP_TIMEOUT_ENV] = repr(daemon.config.process_group_timeout)
    child = await asyncio.create_subprocess_exec(*command, env=env, start_new_session=True)
    log.info("started %s as pid %d", command[0], child.pid)
    if daemon.config.startup_timeout is not None:
        try:
            rank = rank_from_env()
        except ValueError:
            rank = 0
        daemon.startup_watch.worker_started(child.pid, rank, process=ProcessHandle.open(child.pid))
    loop = asyncio.get_running_loop()
    exit_status: asyncio.Future[int] = loop.create_future()
    daemon.children[child.pid] = exit_status
    try:
        waiter = loop.create_task(child.wait())
        stopper = loop.create_task(stop.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not waiter.done():
            waiter.cancel()
            return 0, None
        rc = waiter.result()
        exit_status.set_result(returncode_to_status(rc))
        why = f"command exited ({describe_wait_status(exit_status.result())})"
        try:  # let the rank's disconnect be logged with its exit status
            await asyncio.wait_for(daemon.no_rank.wait(), 2.0)
        except TimeoutError:
            pass
        return (rc if rc >= 0 else 128 - rc), why
    finally:
        if child.returncode is None:
            async def gone(timeout: float) -> bool:
                try:
                    await asyncio.wait_for(child.wait(), timeout)
                except TimeoutError:
                    return False
                return True

            await terminate_then_kill(_Group(child.pid), signal.SIGTERM, daemon.config.termination_grace_time,
                                      gone, cont=False)


def returncode_to_status(rc: int) -> int:
    """asyncio returncode -> a waitpid-style status."""
    return (-rc) & 0x7F if rc < 0 else (rc & 0xFF) << 8
