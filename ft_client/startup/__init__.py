"""The start-up stack dump: armed in a worker before any of its own code runs.

A worker that hangs before ``init_workload_monitoring()`` (in ``import``, in
``init_process_group``, loading a checkpoint) has no client yet, so nothing has
registered faulthandler for the monitor's dump signal. When ``startup_timeout`` is
set, ft-launcher and ``ft-monitor serve -- CMD`` start every worker with

* ``PYTHONPATH`` led by `HOOK_DIR` (``ft_client/startup/hook``, whose only module is a
  ``sitecustomize``, which Python imports at start-up, before the script), and
* `STARTUP_DUMP_ENV` (``FT_STARTUP_DUMP``): this `StartupDump` spec as JSON.

The hook calls `arm()`: it registers faulthandler on the dump signal, writing to
`StartupDump.dump_path`, then removes both variables from its environment so that
the worker's own children (data-loader workers, subprocesses) do not arm too. The
daemon computes the same path from the same spec (one rule, here), sends the signal
when the start-up deadline passes and waits for the dump as it does for a connected
rank. When the worker later connects, the client registers its own dump (the same
file when the directories agree); nothing else changes for the script.

Stdlib only: this runs in every worker before its script, so it must be cheap and
must never stop the worker from starting (the hook catches everything).

The room ``ft_client/startup/`` holds what runs in a worker around its script, apart from
the client: this contract (the package itself, which the daemon and the launcher import
for the spec and the file names), ``hook/`` (the ``sitecustomize``), `loaded_modules` (the
modules report for warm restarts), `parent_death` (dying with the launcher) and
`exit_teardown` (a bounded torch.distributed teardown at exit). It imports only the hall
(``ft_client.env``, ``errors``, ``safefiles``, ``logs``): nothing of the client, the wire or
torch, so a worker that never connects pays for none of them.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import IO

from ft_client import env
from ft_client.errors import FtError
from ft_client.safefiles import open_append, private_dir_problem

STARTUP_DUMP_ENV = "FT_STARTUP_DUMP"
"""JSON `StartupDump`: set by the launcher (or `serve -- CMD`) for each worker, removed by the hook."""
HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hook")
"""The directory put first on the worker's PYTHONPATH: its ``sitecustomize`` arms the dump."""


class StartupDumpError(FtError, ValueError):
    """A `STARTUP_DUMP_ENV` value that does not follow the rules."""


def stack_dump_name(rank: int, pid: int) -> str:
    """The file name of a rank's stack dumps (the daemon's and the start-up hook's)."""
    return f"rank{rank}-pid{pid}-stack.txt"


def attempt_dir(error_file: str | None) -> str | None:
    """The rank's torchelastic attempt directory (that of its error file), when it is
    private to this user; else None."""
    if not error_file:
        return None
    directory = os.path.dirname(error_file)
    if not directory or private_dir_problem(directory) is not None:
        return None
    return directory


@dataclass(frozen=True, slots=True)
class StartupDump:
    """Where a worker's start-up stack dump goes, and on which signal."""

    signal: int
    report_dir: str
    """The monitor's report directory."""
    attempt_dir_first: bool
    """True when report_dir is not configured: under torchelastic the dump goes to the
    rank's attempt directory (beside its error.json) when that one is private, as the
    monitor's reports do."""

    def dump_dir(self, error_file: str | None) -> str:
        if self.attempt_dir_first:
            found = attempt_dir(error_file)
            if found is not None:
                return found
        return self.report_dir

    def dump_path(self, rank: int, pid: int, error_file: str | None) -> str:
        return os.path.join(self.dump_dir(error_file), stack_dump_name(rank, pid))

    def to_env(self) -> str:
        return json.dumps({"signal": self.signal, "report_dir": self.report_dir,
                           "attempt_dir_first": self.attempt_dir_first})

    @classmethod
    def from_env(cls, text: str) -> StartupDump:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise StartupDumpError(f"{STARTUP_DUMP_ENV} is not JSON: {e}") from e
        if not isinstance(data, dict):
            raise StartupDumpError(f"{STARTUP_DUMP_ENV} must be a JSON object")
        sig, directory, first = data.get("signal"), data.get("report_dir"), data.get("attempt_dir_first")
        if isinstance(sig, bool) or not isinstance(sig, int) or not 0 < sig < signal.NSIG:
            raise StartupDumpError(f"{STARTUP_DUMP_ENV} signal = {sig!r:.40}: must be a signal number")
        if not isinstance(directory, str) or not directory.startswith("/"):
            raise StartupDumpError(f"{STARTUP_DUMP_ENV} report_dir = {directory!r:.80}: must be an absolute path")
        if not isinstance(first, bool):
            raise StartupDumpError(f"{STARTUP_DUMP_ENV} attempt_dir_first = {first!r:.40}: must be true or false")
        return cls(sig, directory, first)


def worker_env(spec: StartupDump, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that make a worker arm its start-up dump: the spec, and PYTHONPATH
    led by HOOK_DIR (the rest of ``environ``'s PYTHONPATH kept after it)."""
    rest = environ.get("PYTHONPATH", "")
    return {STARTUP_DUMP_ENV: spec.to_env(),
            "PYTHONPATH": HOOK_DIR + (os.pathsep + rest if rest else "")}


def _forget(environ: MutableMapping[str, str]) -> None:
    """Leave the environment as the worker's launcher had it before we added to it."""
    environ.pop(STARTUP_DUMP_ENV, None)
    parts = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != HOOK_DIR]
    if parts:
        environ["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        environ.pop("PYTHONPATH", None)


def arm(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Register faulthandler on the spec's signal, writing to the dump path; return the
    path (None when no spec is set). Called by the start-up hook; raises OSError or
    StartupDumpError on a bad spec or an unsafe file (the hook reports it and goes on)."""
    environ = os.environ if environ is None else environ
    text = environ.get(STARTUP_DUMP_ENV)
    _forget(environ)
    if text is None:
        return None
    spec = StartupDump.from_env(text)
    pid = os.getpid()
    try:
        rank = env.rank_from_env()
    except ValueError:
        rank = 0
    path = spec.dump_path(rank, pid, environ.get(env.ERROR_FILE))
    # faulthandler keeps it (and a reference). No header: the monitor writes one before a dump it asks for.
    stream: IO[str] = os.fdopen(open_append(path), "a", buffering=1)
    faulthandler.register(spec.signal, file=stream, all_threads=True, chain=False)
    return path
