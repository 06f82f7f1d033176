"""Real-process helpers for end-to-end tests: start a daemon, start ranks, wait on
what they print or write. Every wait is bounded and polls for an event (a socket
that answers, a line, a file), never a bare sleep.

Starting, waiting for and stopping an `ft-monitor serve` daemon is shared with
bench/harness.py: see ft_monitor/testing.py."""

from __future__ import annotations

import itertools
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ft_client import observer
from ft_monitor import testing
from ft_monitor.testing import ping as ping  # re-exported: callers import it from here

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"
T = TypeVar("T")


MAX_SLACK = 5.0
_next_port = itertools.count()


def free_port(span: int = 1) -> int:
    """A port that is free now, with its ``span - 1`` successors (the in-process Wrapper's
    store is at MASTER_PORT + 1), for a server a test's child binds later. Below the kernel's
    ephemeral range (32768 on): a port from ``bind(0)`` is one that outgoing connections and
    torch's own listeners draw from too, and one was taken before a child bound it. Each xdist
    worker and process parity has a block of its own: a store's listener allows address
    reuse, so two jobs that picked the same port would quietly share one store."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    base = 21000 + 400 * worker + 200 * (os.getpid() % 2)
    for _ in range(100):
        port = base + (2 * next(_next_port)) % 200
        try:
            socks = [socket.socket() for _ in range(span)]
            try:
                for i, sk in enumerate(socks):
                    sk.bind(("127.0.0.1", port + i))
            finally:
                for sk in socks:
                    sk.close()
            return port
        except OSError:
            continue
    raise AssertionError(f"no {span} free consecutive ports in {base}..{base + 199}")


def slack() -> float:
    """How many times longer than on a quiet machine work takes now: ``FT_TEST_TIME_SCALE``
    when set, else the 1-minute load average per core, between 1 and MAX_SLACK. Bounds on
    waits are multiplied by it, so that a test's time limit holds on a busy machine (a
    fixed 110 s limit failed beside other work on 2 cores) and still ends a hang."""
    fixed = os.environ.get("FT_TEST_TIME_SCALE")
    if fixed:
        return max(1.0, float(fixed))
    return min(MAX_SLACK, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.01) -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds
    (scaled by `slack`)."""
    return testing.wait_until(predicate, timeout * slack(), what, interval, error=AssertionError)


def short_tmpdir() -> Path:
    """A private (0700) directory with a short path: AF_UNIX paths are limited to 107 bytes."""
    return testing.short_dir("ft-")


def status(sock_path: Path) -> dict[str, Any]:
    return observer.status(str(sock_path))


class Daemon(testing.ServeProcess):
    """`ft-monitor serve` on ``directory/name``, its log beside it, reports in ``directory/reports``."""

    ready_timeout = 20.0
    poll_interval = 0.01
    failure = AssertionError

    def __init__(self, directory: Path, *flags: str, cmd: list[str] | None = None,
                 env: dict[str, str] | None = None, name: str = "rank0.sock",
                 preexec: Callable[[], None] | None = None) -> None:
        self.dir = directory
        self.report_dir = directory / "reports"
        super().__init__(directory / name, *flags, log_path=directory / f"{Path(name).stem}.log", cmd=cmd,
                         env={**os.environ, **(env or {})}, cwd=ROOT, preexec=preexec)

    def wait_log(self, text: str, timeout: float = 20.0) -> str:
        wait_until(lambda: text in self.log(), timeout, f"{text!r} in the monitor log")
        return self.log()

    def report(self, timeout: float = 20.0, rank: int | None = None) -> dict[str, Any]:
        """The hang report (of ``rank``, if given), once the daemon has finished acting."""
        def done() -> dict[str, Any] | None:
            for p in self.report_dir.glob(f"rank{'' if rank is None else rank}*-hang.json"):
                data = json.loads(p.read_text())
                if data.get("terminated_by"):
                    return data
            return None

        return wait_until(done, timeout, "a finished hang report")


class Rank:
    """A tests/workers/rank.py process (or another ``worker`` there) in its own session
    (as launchers start ranks)."""

    def __init__(self, scenario: str, sock: Path, *args: str, stdin: bool = False, worker: str = "rank.py") -> None:
        env = {**os.environ, "FT_RANK_MONITOR_IPC_SOCKET": str(sock), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKERS / worker), scenario, *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.PIPE if stdin else None,
            env=env, cwd=ROOT, start_new_session=True, text=True,
        )
        self.lines: list[str] = []
        self._partial = b""

    def wait_line(self, prefix: str, timeout: float = 20.0) -> str:
        """The first stdout line starting with ``prefix``, waiting up to ``timeout``.
        Reads the pipe's descriptor directly: lines that arrive together must not sit
        in a file object's buffer where select() cannot see them."""
        end = time.monotonic() + timeout * slack()
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            for line in self.lines:
                if line.startswith(prefix):
                    return line
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {prefix!r}; got {self.lines}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise AssertionError(f"rank exited ({self.proc.wait()}) before {prefix!r}; "
                                         f"stderr: {self.proc.stderr.read() if self.proc.stderr else ''}")
                self._partial += chunk
                *complete, self._partial = self._partial.split(b"\n")
                self.lines.extend(line.decode(errors="replace").strip() for line in complete)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout * slack())

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)
        for f in (self.proc.stdout, self.proc.stderr, self.proc.stdin):
            if f is not None:
                f.close()


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except FileNotFoundError:
        return False


def raw_client(sock_path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5.0)
    s.connect(str(sock_path))
    return s


def cleanup_dir(d: Path) -> None:
    shutil.rmtree(d, ignore_errors=True)


def launcher_summary(output: str) -> list[tuple[str, str]]:
    """The ``key : value`` lines of ft-launcher's closing summary in ``output`` (which must
    hold exactly one), keys stripped of their alignment; every line of it has its colon
    in the same column."""
    assert output.count("ft-launcher summary:") == 1, output
    text = output.split("ft-launcher summary:", 1)[1]
    lines: list[str] = []
    for line in text.splitlines()[1:]:
        if " : " not in line and line.strip():
            break  # the summary ended (a later line of the output)
        lines.append(line)
    body = [line for line in lines if line.strip()]
    assert len({line.index(" : ") for line in body}) == 1, text
    return [(k.strip(), v) for k, v in (line.split(" : ", 1) for line in body)]
