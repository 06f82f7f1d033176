"""One real torch.distributed TCPStore in a process of its own, and clients that count what
they ask of it: the plumbing of the store simulations of issue 28 (bench/sim_inprocess.py,
tests/test_sim_inprocess.py). Nothing here models the store: every operation goes to the
real server over its own TCP connection.

* `StoreServer`: ``python -m bench.simstore --serve`` hosts the TCPStore (torch's default
  backend, libuv) and prints its port; its CPU time, wire bytes (``/proc/PID/io``: rchar,
  wchar count the socket reads and writes) and RSS are read from /proc while it serves.
* `CountingStore`: a torch.distributed Store (so that a PrefixStore can sit on it, as
  `CallWrapper.store` does) that forwards every call to a client of that server and counts
  it in a `Tally`: calls per operation, and payload bytes (keys and values) each way.
  A clone counts into the same tally: one tally per simulated rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"


# -- the server ------------------------------------------------------------------
def serve() -> None:
    """Host a TCPStore until stdin closes (the harness's end, or its death)."""
    from torch._C._distributed_c10d import TCPStore

    store = TCPStore(HOST, 0, 1, True, timeout=timedelta(seconds=600), wait_for_workers=False)
    print(f"port {store.port}", flush=True)
    sys.stdin.read()


@dataclass(frozen=True)
class ServerReading:
    cpu_s: float
    """CPU time of the server process (every thread's /proc schedstat)."""
    rchar: int
    wchar: int
    """Bytes the server read and wrote (its sockets: it touches no file while serving)."""
    syscr: int
    syscw: int
    rss_kb: int

    def __sub__(self, other: ServerReading) -> ServerReading:
        return ServerReading(self.cpu_s - other.cpu_s, self.rchar - other.rchar, self.wchar - other.wchar,
                             self.syscr - other.syscr, self.syscw - other.syscw, self.rss_kb - other.rss_kb)


class StoreServer:
    """The TCPStore host as a child process; `reading()` reads its /proc entries."""

    def __init__(self, start_timeout: float = 300.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_", "TORCHELASTIC_"))}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.simstore", "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        line = _readline(self.proc, start_timeout)
        if not line.startswith("port "):
            self.stop()
            raise RuntimeError(f"the store server did not start: {line!r}")
        self.port = int(line.split()[1])
        self.pid = self.proc.pid

    def client(self, timeout: float = 300.0) -> Any:
        from torch._C._distributed_c10d import TCPStore

        return TCPStore(HOST, self.port, 1, False, timeout=timedelta(seconds=timeout), wait_for_workers=False)

    def reading(self) -> ServerReading:
        cpu = 0.0
        for task in os.listdir(f"/proc/{self.pid}/task"):  # every thread (the libuv loop has its own), in ns
            try:
                with open(f"/proc/{self.pid}/task/{task}/schedstat") as f:
                    cpu += int(f.read().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                continue
        io: dict[str, int] = {}
        with open(f"/proc/{self.pid}/io") as f:
            for line in f:
                k, _, v = line.partition(":")
                io[k] = int(v)
        rss = 0
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
        return ServerReading(cpu, io["rchar"], io["wchar"], io["syscr"], io["syscw"], rss)

    def stop(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    """The child's first line, or '' after ``timeout`` seconds (or at its exit)."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
    reader.start()
    reader.join(timeout)
    return got[0].strip() if got else ""


# -- counting clients ------------------------------------------------------------
@dataclass
class Tally:
    """What one simulated rank asked of the store (its connections together)."""

    calls: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    """Payload bytes sent: keys and values."""
    received: int = 0
    """Payload bytes received: values."""
    waiting: int = 0
    """Calls that may block (wait, get) in progress now."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, op: str, sent: int, received: int = 0) -> None:
        with self.lock:
            self.calls[op] += 1
            self.sent += sent
            self.received += received

    def snapshot(self) -> tuple[Counter[str], int, int]:
        with self.lock:
            return Counter(self.calls), self.sent, self.received


def _n(keys: list[str]) -> int:
    return sum(len(k) for k in keys)


class CountingStore(dist.Store):
    """A store that forwards to ``inner`` (a TCPStore client) and counts into ``tally``."""

    def __init__(self, inner: Any, tally: Tally, spare: Any = None) -> None:
        super().__init__()
        self.inner = inner
        self.tally = tally
        self.spare = spare
        """A second client, connected beforehand, that `clone` hands out (None: it connects one)."""
        self.port = getattr(inner, "port", None)

    def _blocking(self, op: str, fn: Any, *args: Any) -> Any:
        with self.tally.lock:
            self.tally.waiting += 1
        try:
            return fn(*args)
        finally:
            with self.tally.lock:
                self.tally.waiting -= 1

    def set(self, key: str, value: Any) -> None:
        v = value.encode() if isinstance(value, str) else bytes(value)
        self.tally.count("set", len(key) + len(v))
        self.inner.set(key, v)

    def get(self, key: str) -> bytes:
        got = self._blocking("get", self.inner.get, key)
        self.tally.count("get", len(key), len(got))
        return got  # type: ignore[no-any-return]

    def add(self, key: str, amount: int) -> int:
        self.tally.count("add", len(key) + 8, 8)
        return self.inner.add(key, amount)  # type: ignore[no-any-return]

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        got = bytes(self.inner.compare_set(key, expected, desired))
        self.tally.count("compare_set", len(key) + len(expected) + len(desired), len(got))
        return got

    def check(self, keys: list[str]) -> bool:
        self.tally.count("check", _n(keys), 8)
        return self.inner.check(keys)  # type: ignore[no-any-return]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.tally.count("wait", _n(keys))
        if timeout is None:
            self._blocking("wait", self.inner.wait, keys)
        else:
            self._blocking("wait", self.inner.wait, keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        got = self._blocking("multi_get", self.inner.multi_get, keys)
        self.tally.count("multi_get", _n(keys), sum(len(v) for v in got))
        return got  # type: ignore[no-any-return]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.tally.count("multi_set", _n(keys) + sum(len(v) for v in values))
        self.inner.multi_set(keys, values)

    def delete_key(self, key: str) -> bool:
        self.tally.count("delete_key", len(key), 1)
        return self.inner.delete_key(key)  # type: ignore[no-any-return]

    def num_keys(self) -> int:
        self.tally.count("num_keys", 0, 8)
        return self.inner.num_keys()  # type: ignore[no-any-return]

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self.inner.timeout  # type: ignore[no-any-return]

    def clone(self) -> CountingStore:
        spare, self.spare = self.spare, None
        return CountingStore(self.inner.clone() if spare is None else spare, self.tally)


def connect(server: StoreServer, count: int) -> list[Any]:
    """``count`` clients of ``server``. Connected ahead of a simulation and reused by every
    N: here (gVisor) about one TCPStore client in 30 takes 5 s to connect, so 2,048 of them
    take minutes, in threads or not."""
    return [server.client() for _ in range(count)]


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.002) -> None:
    """Poll ``predicate`` (the harness's own readiness checks, not the protocol's) until true."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    serve()
