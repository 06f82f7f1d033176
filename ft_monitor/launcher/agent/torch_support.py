"""What ft-launcher needs from the installed torch, checked once at start.

The launcher is torchrun with one agent subclass swapped in (agent.py), so it relies on
torch.distributed.elastic internals that torch does not promise to keep. They were
checked on the torch versions in `TESTED` (the oldest and newest minor pyproject.toml admits,
and the default); on any torch, `problem` looks for each one *before* anything starts, and ft-launcher
refuses with one line naming what is missing (exit 2) instead of failing mid-run, after
workers were started. A torch outside `TESTED` whose internals are all there runs, with
one warning (`untested`).

It also reads torch's default process-group timeout (`default_pg_timeout`) for the
launch check of timeout_order.py. Nothing here starts anything.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

from ft_monitor.core.timeout_order import Limit

TESTED = ("2.6.0", "2.13.0", "2.14.1")
"""The torch releases CI runs the tests on: the whole suite on 2.13.0 (the CPU build), the
compatibility tier (scripts/test-compat) on 2.6.0 and 2.14.1, the oldest and newest of the range
pyproject.toml admits (``torch>=2.6.0a0,<2.15``). A build of one of their minors (a pre-release,
a local build such as ``2.13.0+cpu``) counts as tested; the minors between are supported by
feature test (ft_client/torch_features.py) and named in the one warning of `untested`."""


def _defines(cls: Any, *names: str) -> bool:
    """``cls`` itself (not only a base class) defines every one of ``names``."""
    return all(name in vars(cls) for name in names)


def _uses(fn: Any, *names: str) -> bool:
    """The code of ``fn`` reads or writes every one of ``names`` (as attribute or global names)."""
    code = getattr(fn, "__code__", None)
    return code is not None and all(name in code.co_names for name in names)


def _start_processes_takes_envs() -> bool:
    from torch.distributed.elastic.agent.server import local_elastic_agent as lea

    return "envs" in inspect.signature(getattr(lea, "start_processes")).parameters


def _agent() -> Any:
    from torch.distributed.elastic.agent.server import local_elastic_agent as lea

    return getattr(lea, "LocalElasticAgent")


def _simple_agent() -> Any:
    from torch.distributed.elastic.agent.server import api

    return getattr(api, "SimpleElasticAgent")


def _launch_agent_builds_local_elastic_agent() -> bool:
    from torch.distributed.launcher import api

    return hasattr(api, "LocalElasticAgent") and _uses(getattr(api, "launch_agent"), "LocalElasticAgent")


def _run_module() -> bool:
    from torch.distributed import run

    return all(callable(getattr(run, n, None)) for n in ("get_args_parser", "run", "determine_local_world_size"))


def _worker_group() -> bool:
    from torch.distributed.elastic.agent.server.api import RunResult, Worker, WorkerGroup, WorkerState

    return (_uses(WorkerGroup.__init__, "store", "group_rank", "group_world_size", "workers", "spec")
            and _uses(Worker.__init__, "global_rank", "local_rank", "id")
            and hasattr(WorkerState, "FAILED") and hasattr(WorkerState, "UNHEALTHY")
            and {"state", "failures"} <= set(inspect.signature(RunResult).parameters))


def _process_failure() -> bool:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return {"local_rank", "pid", "exitcode", "error_file"} <= set(inspect.signature(ProcessFailure).parameters)


def _pcontext() -> bool:
    from torch.distributed.elastic.multiprocessing.api import PContext

    return _uses(PContext.__init__, "error_files") and "timeout" in inspect.signature(PContext.close).parameters


def _errors() -> bool:
    from torch.distributed.elastic.multiprocessing import errors
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return all(hasattr(errors, n) for n in ("ChildFailedError", "get_error_handler")) and SignalException is not None


def _subprocess_handler() -> bool:
    import torch.distributed.elastic.multiprocessing.api as api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as sh

    return callable(getattr(api, "get_subprocess_handler", None)) and callable(
        getattr(getattr(sh, "SubprocessHandler", None), "_popen", None))


CHECKS: tuple[tuple[str, Callable[[], bool]], ...] = (
    ("torch.distributed.run's get_args_parser, run and determine_local_world_size", _run_module),
    ("LocalElasticAgent as the agent torch.distributed.launcher.api.launch_agent builds",
     _launch_agent_builds_local_elastic_agent),
    ("local_elastic_agent.start_processes(envs=...)", _start_processes_takes_envs),
    ("LocalElasticAgent's own _start_workers, _monitor_workers, _stop_workers and _shutdown",
     lambda: _defines(_agent(), "_start_workers", "_monitor_workers", "_stop_workers", "_shutdown")),
    ("LocalElasticAgent._pcontext", lambda: _uses(_agent().__init__, "_pcontext")),
    ("multiprocessing.api.get_subprocess_handler and SubprocessHandler._popen (--ft-warm-restart forks through them)",
     _subprocess_handler),
    ("SimpleElasticAgent's _rendezvous, _remaining_restarts and _worker_group",
     lambda: _defines(_simple_agent(), "_rendezvous")
     and _uses(_simple_agent()._invoke_run, "_remaining_restarts", "_worker_group")),
    ("WorkerGroup.store, group_rank, group_world_size, workers; Worker ids; RunResult; WorkerState",
     _worker_group),
    ("ProcessFailure(local_rank, pid, exitcode, error_file)", _process_failure),
    ("PContext.error_files and PContext.close(timeout=)", _pcontext),
    ("ChildFailedError, get_error_handler and SignalException", _errors),
)


def missing() -> list[str]:
    """The internals (as in `CHECKS`) this torch lacks; empty when it has them all."""
    out = []
    for what, check in CHECKS:
        try:
            ok = check()
        except Exception:  # noqa: BLE001 - an import or attribute that is not there
            ok = False
        if not ok:
            out.append(what)
    return out


def version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def problem() -> str | None:
    """Why ft-launcher cannot run on the installed torch, in one line; None when it can."""
    found = version()
    if found is None:
        return "torch is not installed (pip install 'torch>=2.6,<2.15')"
    lacking = missing()
    if not lacking:
        return None
    return (f"torch {found} is not supported: it lacks {'; '.join(lacking)}. ft-launcher relies on these "
            f"torch.distributed.elastic internals and is tested with torch {', '.join(TESTED)} "
            f"(pip install 'torch>=2.6,<2.15')")


def minor(release: str) -> str | None:
    """``2.9`` of ``2.9.0a0+abc.nv25.10``, ``2.13.0+cpu`` or ``2.14.1``; None for what is not a version."""
    found = re.match(r"(\d+)\.(\d+)(?:\D|$)", release)
    return f"{found.group(1)}.{found.group(2)}" if found else None


def tested_minors() -> list[str]:
    return sorted({m for m in map(minor, TESTED) if m is not None}, key=lambda m: tuple(map(int, m.split("."))))


def untested() -> str | None:
    """A warning for a torch whose minor CI did not run (`TESTED`) that passed the check; None on a
    tested one."""
    found = version()
    if found is None or minor(found) in tested_minors():
        return None
    return (f"torch {found} is not a version ft-launcher was tested with ({', '.join(TESTED)}); "
            "the internals it relies on are there, but it was not run on this version")


def process_group_default() -> Limit:
    """torch's default process-group timeout: NCCL's where this torch has NCCL (the smaller
    one), else the one for gloo and the other backends."""
    from torch.distributed import constants

    nccl = getattr(constants, "default_pg_nccl_timeout", None)
    if nccl is not None:
        seconds = nccl.total_seconds()
        return Limit(seconds, f"torch's default process-group timeout for NCCL, {seconds:g} s (no "
                              "process_group_timeout set; gloo's is longer)")
    seconds = constants.default_pg_timeout.total_seconds()
    return Limit(seconds, f"torch's default process-group timeout, {seconds:g} s (no process_group_timeout set; "
                          "this torch has no NCCL)")


def with_stopped_workers(failures: dict[int, Any], pcontext: Any, workers: list[Any]) -> dict[int, Any]:
    """``failures`` (global rank -> ProcessFailure) with the workers torch stopped after the first
    failure and that exited non-zero, as torch lists them itself from 2.10
    (`ft_client.torch_features.failures_list_stopped_workers`); before 2.10 they are read here
    from the exit codes of torch's (already reaped) processes, so a crash's victims are named."""
    from ft_client.torch_features import failures_list_stopped_workers

    handlers = getattr(pcontext, "subprocess_handlers", None)
    if failures_list_stopped_workers() or not failures or not isinstance(handlers, dict):
        return failures
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_files = getattr(pcontext, "error_files", None) or {}
    out = dict(failures)
    for worker in workers:
        proc: Any = getattr(handlers.get(worker.local_rank), "proc", None)
        code = getattr(proc, "returncode", None)
        if worker.global_rank in out or not isinstance(code, int) or code == 0:
            continue
        out[worker.global_rank] = ProcessFailure(local_rank=worker.local_rank, pid=proc.pid, exitcode=code,
                                                 error_file=error_files.get(worker.local_rank, ""))
    return out
