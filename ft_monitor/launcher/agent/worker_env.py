"""What each worker's environment gains as torch starts it: its daemon's and the
launcher's sockets, the rendezvous store's address for the in-process Wrapper
(`store_address`), the start-up hook, the process-group timeout, the Flight Recorder's
size and where its dumps go, and the in-process key derived from the job secret (never
the secret itself). `started_with_ft_env` wraps torch's ``start_processes`` to add them.

Flight Recorder dumps (issue 38): torch's NCCL watchdog writes a rank's trace, a pickle, to
``$TORCH_FR_DUMP_TEMP_FILE<rank>`` (before torch 2.8: ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``), by
default ``/tmp/nccl_trace_rank_<rank>``: a predictable name in a directory every user can
write, where another user can plant a file or a link first. Unless the user's environment
names a place, each worker's dumps go to ``report_dir`` when it is set, else into the worker's
own torchelastic attempt directory beside its error.json (which torch makes inside a
private ``mkdtemp``; the monitor's reports go there too), checked private
(`private_dir_problem`) before it is used; where neither is private, torch's default stays
and the launcher says so once."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any, Protocol

from torch.distributed.elastic.agent.server import local_elastic_agent as _lea

from ft_client import env as ft_env
from ft_client.errors import FtError
from ft_client.process_group import PROCESS_GROUP_TIMEOUT_ENV
from ft_client.safefiles import private_dir_problem
from ft_client.startup import worker_env as startup_env
from ft_client.store.jobkey import INPROCESS_KEY_ENV
from ft_client.torch_features import FR_DUMP_ENVS, flight_recorder
from ft_monitor.core.settings import Settings
from ft_monitor.core.startup import dump_spec
from ft_monitor.launcher.store.store_auth import SECRET_ENV, SECRET_FILE_ENV

FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
"""torch's Flight Recorder from 2.8: entries each process keeps (0 or unset: off); before 2.8 NCCL's
``TORCH_NCCL_TRACE_BUFFER_SIZE`` (`torch_features.flight_recorder`, the one the installed torch reads)."""
FR_DUMP_NAME = "flight_recorder_rank_"

log = logging.getLogger("ft_monitor.launcher")


def fr_dump_prefix(error_file: str | None, report_dir: str | None) -> str | None:
    """Where a worker's Flight Recorder dumps go (the prefix torch appends the rank to):
    ``report_dir``, else the directory of its ``error_file`` (its attempt directory), the
    first of them that is private to this user; None when neither is."""
    places = [report_dir] if report_dir else []
    if error_file and error_file != os.devnull:
        places.append(os.path.dirname(error_file))
    for place in places:
        if private_dir_problem(place) is None:
            return os.path.join(place, FR_DUMP_NAME)
    return None


class _FrDumpsPlaced:
    """torch's LogsSpecs, whose `reify` also puts each worker's Flight Recorder dumps beside its
    error file (torch's PContext reifies the same ``envs`` it then starts the workers with)."""

    def __init__(self, inner: Any, report_dir: str | None) -> None:
        self._inner = inner
        self._report_dir = report_dir
        self.unplaced = False

    def reify(self, envs: dict[int, dict[str, str]]) -> Any:
        dest = self._inner.reify(envs)
        error_files = getattr(dest, "error_files", None) or {}
        for local_rank, worker_env in envs.items():
            prefix = fr_dump_prefix(error_files.get(local_rank), self._report_dir)
            if prefix is None:
                self.unplaced = True
                continue
            worker_env.update(dict.fromkeys(FR_DUMP_ENVS, prefix))
        return dest

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class TorchVersionError(FtError, RuntimeError):
    """torch's elastic internals are not what this launcher was built against."""


class WorkerEnvSource(Protocol):
    """What `started_with_ft_env` asks for each worker (`runtime.FtRuntime` is one)."""

    def worker_env(self, local_rank: int) -> dict[str, str]: ...

    def inprocess_key(self, run_id: str) -> str | None: ...

    @property
    def report_dir(self) -> str | None: ...


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
    fr = flight_recorder()  # the name the installed torch reads (torch_features.py)
    if config.flight_recorder_entries > 0 and not any(name in os.environ for name in fr.buffer_envs):
        out[fr.buffer_env] = str(config.flight_recorder_entries)  # torch's Flight Recorder, read at init
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
    warned: list[bool] = []

    def start_processes(*args: Any, **kwargs: Any) -> Any:
        envs = kwargs.get("envs")
        if envs is None:
            raise TorchVersionError("ft-launcher: torch's start_processes was called without envs=; "
                                    "this torch version is not supported")
        placed: _FrDumpsPlaced | None = None
        if kwargs.get("logs_specs") is not None and not any(k in os.environ for k in FR_DUMP_ENVS):
            placed = kwargs["logs_specs"] = _FrDumpsPlaced(kwargs["logs_specs"], ft.report_dir)
        for local_rank, worker_env in envs.items():
            worker_env.update(ft.worker_env(local_rank))
            worker_env.pop(SECRET_ENV, None)  # the job secret is the launchers', not the training code's
            worker_env.pop(SECRET_FILE_ENV, None)
            key = ft.inprocess_key(worker_env.get("TORCHELASTIC_RUN_ID") or "local")
            if key is not None:  # a key derived for the in-process Wrapper's records, not the secret
                worker_env[INPROCESS_KEY_ENV] = key
        try:
            return original(*args, **kwargs)
        finally:
            if placed is not None and placed.unplaced and not warned:
                warned.append(True)
                log.warning("ft-launcher: no private directory for the workers' Flight Recorder dumps (neither "
                            "report_dir nor the attempt directory is): torch's default %s stays; set "
                            "TORCH_FR_DUMP_TEMP_FILE to a private place", "/tmp/nccl_trace_rank_<rank>")

    setattr(_lea, "start_processes", start_processes)
    try:
        yield
    finally:
        setattr(_lea, "start_processes", original)
