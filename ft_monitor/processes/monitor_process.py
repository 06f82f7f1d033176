"""A monitor daemon running as a child process: what `RankMonitorServer.run_in_subprocess` returns.

`MonitorProcess` has the members of ``multiprocessing.Process`` that callers of
nvidia-resiliency-ext's ``run_in_subprocess`` use on its result (``pid``, ``is_alive()``,
``terminate()``, ``kill()``, ``join(timeout)``, ``exitcode``), plus `stop()` (SIGTERM, a
bounded grace, SIGKILL) and use as a context manager. Like the reference's daemonic
process, a daemon still running when the interpreter exits is stopped then; with
``ServeSpec.parent_pid`` it also stops when its parent is killed outright.

Owns: starting the daemon process from a validated `settings.ServeSpec`, waiting until
its socket answers, and stopping and reaping it. Every wait is bounded. Must not import
torch or pydantic: the child is a fresh interpreter (``python -m ft_monitor.cli
--run-checked /dev/stdin``) that reads the spec as JSON on its stdin, so it loads neither,
whatever its parent has loaded.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from ft_client.errors import FtError
from ft_client.observer import ping
from ft_monitor.core.serve_argv import RUN_CHECKED
from ft_monitor.core.settings import ServeSpec

READY_POLL_INTERVAL = 0.01
STOP_GRACE = 5.0
"""Seconds `stop()` (and the stop at interpreter exit) waits after SIGTERM before SIGKILL."""


class MonitorStartError(FtError, RuntimeError):
    """The daemon process exited, or did not answer on its socket, before it was ready."""


class MonitorProcess:
    """A running monitor daemon, child of this process. Start it with `start`."""

    def __init__(self, proc: subprocess.Popen[bytes], socket_path: Path) -> None:
        self._proc = proc
        self.socket_path = socket_path
        """Where the daemon listens (absolute)."""

    @classmethod
    def start(cls, spec: ServeSpec, *, env: Mapping[str, str] | None = None, ready_timeout: float) -> MonitorProcess:
        """Start a daemon serving ``spec`` and return once its socket answers a PING.

        ``env`` is added to this process's environment for the child. The child shares
        this process's stdout, stderr and process group (a terminal's Ctrl-C stops it too).
        Raises MonitorStartError (after stopping the child) if it exits first or is not
        ready within ``ready_timeout`` seconds."""
        child_env = None if env is None else {**os.environ, **env}
        argv = [sys.executable, "-m", "ft_monitor.cli", RUN_CHECKED, "/dev/stdin"]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, env=child_env)
        handle = cls(proc, Path(spec.socket).absolute())
        _live.add(handle)
        try:
            assert proc.stdin is not None
            try:
                with proc.stdin:
                    proc.stdin.write(spec.to_json().encode())
            except BrokenPipeError:
                pass  # it exited already: _wait_ready says so
            handle._wait_ready(ready_timeout)
        except BaseException:
            handle.stop(grace=1.0)
            raise
        return handle

    def _wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                raise MonitorStartError(
                    f"the monitor for {self.socket_path} exited with status {code} before it was ready "
                    "(it said why on stderr)"
                )
            if ping(str(self.socket_path), 1.0):
                return
            if time.monotonic() >= end:
                raise MonitorStartError(
                    f"the monitor for {self.socket_path} (pid {self.pid}) did not answer within {timeout:g} s; "
                    "stopped it"
                )
            time.sleep(READY_POLL_INTERVAL)

    # -- multiprocessing.Process's members ------------------------------------------
    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def exitcode(self) -> int | None:
        """None while running; the exit status, or -N if signal N ended it."""
        return self._proc.poll()

    def is_alive(self) -> bool:
        return self._proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM: the daemon stops in order (closes its socket, removes the socket file)."""
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the daemon to exit, at most ``timeout`` seconds (None: no bound)."""
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return
        _live.discard(self)

    # -- ours ----------------------------------------------------------------------
    def stop(self, grace: float = STOP_GRACE) -> int:
        """SIGTERM, up to ``grace`` seconds to exit, then SIGKILL; returns the exit status."""
        if self.is_alive():
            self.terminate()
            self.join(grace)
            if self.is_alive():
                self.kill()
        self._proc.wait()
        _live.discard(self)
        return self._proc.returncode

    def __enter__(self) -> MonitorProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_alive() else f"exited {self.exitcode}"
        return f"<MonitorProcess pid={self.pid} socket={str(self.socket_path)!r} {state}>"

    def _signal(self, sig: int) -> None:
        if self._proc.poll() is None:  # reaped processes are never signalled: their pid may be reused
            self._proc.send_signal(sig)


_live: set[MonitorProcess] = set()
"""Daemons started here and not yet reaped: stopped at interpreter exit (and kept referenced,
so that a dropped handle does not leave an unreaped child)."""


@atexit.register
def _stop_all_at_exit() -> None:
    handles = list(_live)
    for handle in handles:
        handle.terminate()
    for handle in handles:
        handle.stop()
