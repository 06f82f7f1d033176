"""What each worker's environment gains as torch starts it: its daemon's and the
launcher's sockets, the rendezvous store's address for the in-process Wrapper
(`store_address`), the start-up hook, the process-group timeout, the Flight Recorder's
size, and the in-process key derived from the job secret (never the secret itself).
`started_with_ft_env` wraps torch's ``start_processes`` to add them."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Protocol

from torch.distributed.elastic.agent.server import local_elastic_agent as _lea

from ft_client import env as ft_env
from ft_client.errors import FtError
from ft_client.jobkey import INPROCESS_KEY_ENV
from ft_client.process_group import PROCESS_GROUP_TIMEOUT_ENV
from ft_client.startup import worker_env as startup_env
from ft_monitor.core.settings import Settings
from ft_monitor.core.startup import dump_spec
from ft_monitor.launcher.store_auth import SECRET_ENV, SECRET_FILE_ENV

FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
"""torch's Flight Recorder: entries each process keeps (0 or unset: off)."""


class TorchVersionError(FtError, RuntimeError):
    """torch's elastic internals are not what this launcher was built against."""


class WorkerEnvSource(Protocol):
    """What `started_with_ft_env` asks for each worker (`runtime.FtRuntime` is one)."""

    def worker_env(self, local_rank: int) -> dict[str, str]: ...

    def inprocess_key(self, run_id: str) -> str | None: ...


def worker_variables(config: Settings, monitor_socket: os.PathLike[str] | str, launcher_socket: str,
                     inprocess_store: str | None) -> dict[str, str]:
    """The FT_* (and torch) variables of the worker whose daemon listens at ``monitor_socket``."""
    out = {
        ft_env.RANK_MONITOR_SOCKET: str(monitor_socket),
        ft_env.LAUNCHER_SOCKET: launcher_socket,
        ft_env.LAUNCHER_PID: str(os.getpid()),
    }
    if inprocess_store is not None:
        out[ft_env.INPROCESS_STORE] = inprocess_store
    if config.startup_timeout is not None:  # the start-up hook: a stack dump before init
        report_dir = config.report_dir_for(monitor_socket)
        out.update(startup_env(dump_spec(config, report_dir), os.environ))
    if config.process_group_timeout is not None:  # for ft_client.process_group_timeout()
        out[PROCESS_GROUP_TIMEOUT_ENV] = repr(config.process_group_timeout)
    if config.flight_recorder_entries > 0 and FR_BUFFER_ENV not in os.environ:
        out[FR_BUFFER_ENV] = str(config.flight_recorder_entries)  # torch's Flight Recorder, read at init
    return out


def store_address(store: object) -> str | None:
    """``host:port`` of the TCPStore under torch's PrefixStore wrappers, or None (another kind)."""
    for _ in range(8):
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if not isinstance(host, str) or not host or not isinstance(port, int) or not 0 < port < 65536:
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@contextlib.contextmanager
def started_with_ft_env(ft: WorkerEnvSource) -> Iterator[None]:
    """Add the FT_* variables to each worker's environment as torch starts them."""
    original = getattr(_lea, "start_processes")  # torch internals: checked to exist at start

    def start_processes(*args: Any, **kwargs: Any) -> Any:
        envs = kwargs.get("envs")
        if envs is None:
            raise TorchVersionError("ft-launcher: torch's start_processes was called without envs=; "
                                    "this torch version is not supported")
        for local_rank, worker_env in envs.items():
            worker_env.update(ft.worker_env(local_rank))
            worker_env.pop(SECRET_ENV, None)  # the job secret is the launchers', not the training code's
            worker_env.pop(SECRET_FILE_ENV, None)
            key = ft.inprocess_key(worker_env.get("TORCHELASTIC_RUN_ID") or "local")
            if key is not None:  # a key derived for the in-process Wrapper's records, not the secret
                worker_env[INPROCESS_KEY_ENV] = key
        return original(*args, **kwargs)

    setattr(_lea, "start_processes", start_processes)
    try:
        yield
    finally:
        setattr(_lea, "start_processes", original)
