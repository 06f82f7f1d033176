"""Run a real `ft-monitor serve` daemon from another program: for tests and benchmarks.

Shared by the project's end-to-end tests (tests/procs.py) and its benchmarks
(bench/harness.py), and usable by anyone who wants a real daemon in their own
integration tests. It lives in the package so that both can import it however
they are started (`pytest` from the repository root, `python bench/run.py`,
`python -m bench.run`, a benchmark's worker process) without one of them
importing the other's private modules.

Nothing here is used by the daemon, the launcher or the client, and nothing here
imports pytest, torch or any test-only dependency: only the standard library and
`ft_client.observer` (to PING the daemon's socket).

- `ServeProcess`: a `python -m ft_monitor.cli serve --socket PATH ...` process in its
  own session, its stdout and stderr in a log file. `wait_ready()` returns once the
  socket answers a PING (and fails at once if the process exits first); `stop()`
  sends SIGCONT (in case it was stopped) then SIGTERM, and SIGKILL if it has not
  exited in time. Every wait is bounded by a timeout.
- `wait_until`: poll a predicate until it returns something truthy, with a timeout.
- `short_dir`: a private (0700) directory with a short path under /tmp, for sockets
  (AF_UNIX paths are limited to 107 bytes).
- `ping`: whether a daemon answers on a socket.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Self, TypeVar

# imported here, not on first use: bench/startup.py times spawn -> first PING answered
from ft_client import observer

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.01,
               error: type[Exception] = RuntimeError) -> T:
    """Poll ``predicate`` every ``interval`` seconds until it returns something truthy
    and return that; raise ``error`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise error(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def short_dir(prefix: str = "ft-") -> Path:
    """A new private (0700) directory with a short path under /tmp: AF_UNIX paths are
    limited to 107 bytes, and a pytest or system temp dir can be longer than that allows.
    The caller removes it."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(d, 0o700)
    return d


def ping(sock_path: str | os.PathLike[str], timeout: float = 1.0) -> bool:
    """Whether a daemon answers a PING on ``sock_path`` within ``timeout`` seconds."""
    return observer.ping(os.fspath(sock_path), timeout)


class ServeProcess:
    """A real `python -m ft_monitor.cli serve --socket SOCKET *FLAGS [-- CMD...]` process.

    Started in its own session with stdout and stderr written to ``log_path``. The class
    attributes are the defaults of `wait_ready` and the exception its waits raise;
    subclasses set their own.
    """

    ready_timeout: float = 30.0
    poll_interval: float = 0.01
    failure: type[Exception] = RuntimeError

    def __init__(self, socket: Path, *flags: str, log_path: Path, cmd: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
                 preexec: Callable[[], None] | None = None, python: str = sys.executable) -> None:
        self.socket = Path(socket)
        self.log_path = Path(log_path)
        argv = [python, "-m", "ft_monitor.cli", "serve", "--socket", str(self.socket), *flags]
        if cmd:
            argv += ["--", *cmd]
        self._log = open(self.log_path, "w")
        self.spawned_at = time.perf_counter()
        try:
            self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd,
                                         env=None if env is None else dict(env), start_new_session=True,
                                         preexec_fn=preexec)
        except BaseException:
            self._log.close()
            raise
        self.ready_after: float | None = None  # seconds from spawn to the first PING answered

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        """Everything the daemon has written so far."""
        return self.log_path.read_text()

    def wait_ready(self, timeout: float | None = None, interval: float | None = None) -> Self:
        """Poll until the socket answers a PING (raise if the process exits first, or after
        ``timeout`` seconds); records `ready_after`. Returns self."""
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise self.failure(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            return ping(self.socket)

        wait_until(ready, self.ready_timeout if timeout is None else timeout, f"daemon at {self.socket}",
                   self.poll_interval if interval is None else interval, error=self.failure)
        self.ready_after = time.perf_counter() - self.spawned_at
        return self

    def stop(self, timeout: float = 10.0) -> int:
        """SIGCONT (a stopped daemon cannot act on SIGTERM) and SIGTERM; SIGKILL if it has not
        exited within ``timeout`` seconds. Returns the exit status; closes the log file."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode
