"""RankMonitorServer: the monitor daemon started from Python, under nvidia-resiliency-ext's name.

`ft-monitor serve` is the daemon as a command; this is the same daemon for programs that
start it themselves, with the reference's entry points::

    cfg = FaultToleranceConfig.from_yaml_file("ft.yaml")
    proc = RankMonitorServer.run_in_subprocess(cfg, "/run/user/1000/ft/rank0.sock")  # ready on return
    ...                                     # ranks connect with FT_RANK_MONITOR_IPC_SOCKET set
    proc.terminate(); proc.join(timeout=10)  # or proc.stop(): SIGTERM, grace, SIGKILL

    RankMonitorServer(cfg, path).serve()     # this process becomes the daemon until SIGTERM/SIGINT

``cfg`` is a `ft_monitor.config.FaultToleranceConfig` (validated when it was built) or the
daemon's own `settings.Settings`. `run_in_subprocess` starts a fresh interpreter that gets
the settings as JSON (`monitor_process`): the daemon never imports torch and never loads
pydantic or yaml, whatever the caller has loaded.

Owns: turning a config and a socket path into a running daemon, in this process or in a
child. Must not import torch or pydantic, read argv, or exit the process (errors are raised:
`ListenerError` for a socket path the daemon cannot use, `MonitorStartError` for a child
that does not come up, `SettingsError` for a config of the wrong type, `UsageError` for
`serve()` outside the main thread).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ft_monitor.core.server_log import LOG_FORMAT
from ft_monitor.core.settings import ServeSpec, Settings, SettingsError
from ft_monitor.daemon.listener import check_socket_path
from ft_monitor.processes.monitor_process import MonitorProcess

if TYPE_CHECKING:
    from ft_monitor.config import FaultToleranceConfig

log = logging.getLogger("ft_monitor.server")


class ReadyEvent(Protocol):
    """Anything with ``set()``: a threading.Event, a multiprocessing Event, ..."""

    def set(self) -> None: ...


class RankMonitorServer:
    """The monitor daemon of one rank, listening on ``ipc_socket_path``.

    ``rank_monitor_ready_event`` (optional) is set once the socket accepts connections.
    ``logger`` and ``is_restarter_logger`` are accepted for nvidia-resiliency-ext's
    signature: the daemon logs through the ``ft_monitor`` loggers, and has no restarter
    log. ``launcher_socket``: where to report hangs (ft-launcher's socket), if any.
    """

    RANK_MONITOR_INIT_TIMEOUT = 180.0
    """Seconds `run_in_subprocess` waits at most for the daemon to answer (it takes ~0.2 s)."""

    def __init__(
        self,
        cfg: FaultToleranceConfig | Settings,
        ipc_socket_path: str | os.PathLike[str],
        rank_monitor_ready_event: ReadyEvent | None = None,
        logger: logging.Logger | None = None,
        is_restarter_logger: bool = False,
        *,
        launcher_socket: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.settings = _settings(cfg)
        self.ipc_socket_path = os.fspath(ipc_socket_path)
        self.rank_monitor_ready_event = rank_monitor_ready_event
        self.logger = logger or log
        self.is_restarter_logger = is_restarter_logger
        self.launcher_socket = launcher_socket

    # -- in this process ------------------------------------------------------------
    def serve(self) -> int:
        """Run the daemon in this process until SIGTERM, SIGINT, SIGHUP or SIGQUIT; returns
        the exit code (0). Call it from the main thread (it handles those signals). Raises
        ListenerError if the socket path cannot be used."""
        from ft_monitor.cli import UsageError, _new_loop_factory
        from ft_monitor.daemon import server

        if threading.current_thread() is not threading.main_thread():
            raise UsageError("RankMonitorServer.serve() must run in the main thread (it handles SIGTERM, SIGINT, "
                             "SIGHUP and SIGQUIT); from another thread use start_process()")
        with asyncio.Runner(loop_factory=_new_loop_factory("auto")) as runner:
            return runner.run(server.run_daemon(self.settings, self.ipc_socket_path,
                                                launcher_socket=self.launcher_socket, on_ready=self._ready))

    def _ready(self) -> None:
        if self.rank_monitor_ready_event is not None:
            self.rank_monitor_ready_event.set()

    @staticmethod
    def run(
        cfg: FaultToleranceConfig | Settings,
        ipc_socket_path: str | os.PathLike[str],
        rank_monitor_ready_event: ReadyEvent | None = None,
        is_restarter_logger: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> int:
        """The daemon as this process's job (nvidia-resiliency-ext's process entry point):
        put ``env`` in the environment, log to stderr at the config's level (unless logging is
        already configured), serve until a stop signal, return the exit code."""
        if env is not None:
            os.environ.update(env)
        inst = RankMonitorServer(cfg, ipc_socket_path, rank_monitor_ready_event, None, is_restarter_logger)
        logging.basicConfig(level=inst.settings.log_level, format=LOG_FORMAT)
        return inst.serve()

    # -- in a child process -----------------------------------------------------------
    def start_process(self, env: Mapping[str, str] | None = None, *,
                      ready_timeout: float | None = None, log_file: str | None = None) -> MonitorProcess:
        """Start the daemon in a new process; return once its socket answers.

        The daemon stops (SIGTERM) when this process exits, even when it is killed outright
        (started from another thread than the main one: at interpreter exit only).
        ``env`` is added to the child's environment. Its log goes to this process's
        stderr, and to ``log_file`` as well if given. Raises ListenerError (before starting
        anything) for a socket path the daemon would refuse, MonitorStartError if the child
        exits or does not answer within ``ready_timeout`` (default RANK_MONITOR_INIT_TIMEOUT)."""
        path = check_socket_path(self.ipc_socket_path)
        # prctl's parent-death signal follows the thread that started the child: ask for it
        # only from the main thread, whose end is this process's
        parent = os.getpid() if threading.current_thread() is threading.main_thread() else None
        spec = ServeSpec(self.settings, str(path), log_file=log_file, launcher_socket=self.launcher_socket,
                         parent_pid=parent)
        timeout = self.RANK_MONITOR_INIT_TIMEOUT if ready_timeout is None else ready_timeout
        proc = MonitorProcess.start(spec, env=env, ready_timeout=timeout)
        self._ready()
        return proc

    @staticmethod
    def run_in_subprocess(
        cfg: FaultToleranceConfig | Settings,
        ipc_socket_path: str | os.PathLike[str],
        is_restarter_logger: bool = False,
        mp_ctx: Any = None,
        env: Mapping[str, str] | None = None,
        *,
        ready_timeout: float | None = None,
        log_file: str | None = None,
        launcher_socket: str | None = None,
    ) -> MonitorProcess:
        """nvidia-resiliency-ext's way to start a monitor: a daemon process, ready on return.

        ``mp_ctx`` is accepted and not used: the daemon is always a fresh interpreter, not a
        fork or multiprocessing child of this (torch-laden) process. The rest is
        `start_process`."""
        server = RankMonitorServer(cfg, ipc_socket_path, None, None, is_restarter_logger,
                                   launcher_socket=launcher_socket)
        return server.start_process(env, ready_timeout=ready_timeout, log_file=log_file)

    def __repr__(self) -> str:
        return f"<RankMonitorServer socket={self.ipc_socket_path!r}>"


def _settings(cfg: Any) -> Settings:
    if isinstance(cfg, Settings):
        return cfg
    if callable(getattr(cfg, "model_dump", None)):  # ft_monitor.config.FaultToleranceConfig
        return Settings.from_config(cfg)
    raise SettingsError(
        f"cfg = {type(cfg).__name__}: must be an ft_monitor FaultToleranceConfig (FaultToleranceConfig.from_kwargs, "
        ".from_yaml_file, .from_args) or Settings"
    )


__all__ = ["RankMonitorServer", "ReadyEvent", "MonitorProcess"]
