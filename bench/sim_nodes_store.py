"""The store of bench/sim_nodes.py's simulated launchers: ONE real torch.distributed TCPStore
in its own process (nobody's node; its CPU from /proc/PID/stat), and the counting face each
node's store client wears (operations and bytes, keys and values both ways)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import Counter as Tally
from datetime import timedelta
from pathlib import Path
from typing import Any

# -- the store host ----------------------------------------------------------------
SERVER = """
import sys, datetime
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=120))
print(s.port, flush=True)
sys.stdin.read()
"""


class StoreHost:
    """A TCPStore server in its own process (nobody's node), and its CPU from /proc."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # bounded: the server prints its port or dies (EOF)
        if not line.strip().isdigit():
            raise RuntimeError(f"the store host did not start: {line!r}")
        self.port = int(line)
        from torch.distributed import TCPStore

        self.client = TCPStore("127.0.0.1", self.port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=60))

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def num_keys(self) -> int:
        return int(self.client.num_keys())

    def close(self) -> None:
        from bench.harness import end_by_stdin  # not at the top: `bench/sim_nodes.py --help` needs no ft_client

        end_by_stdin(self.proc, 10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


# -- counting ---------------------------------------------------------------------
def _len(v: Any) -> int:
    return len(v) if isinstance(v, (bytes, bytearray, str)) else 8


class Counter:
    """Store operations and bytes (keys and values, both ways) of one node."""

    def __init__(self) -> None:
        self.ops: Tally[str] = Tally()
        self.bytes = 0
        self.lock = threading.Lock()

    def count(self, op: str, nbytes: int) -> None:
        with self.lock:
            self.ops[op] += 1
            self.bytes += nbytes

    def total(self) -> tuple[int, int]:
        with self.lock:
            return sum(self.ops.values()), self.bytes

    def by_op(self) -> dict[str, int]:
        with self.lock:
            return dict(self.ops)


class CountingStore:
    """A store client's Python face, counted: what the protocols call on ``wg.store``."""

    def __init__(self, inner: Any, counter: Counter, written: set[str] | None = None) -> None:
        self.inner = inner
        self.counter = counter
        self.written = written if written is not None else set()

    def set(self, key: str, value: Any) -> None:
        self.written.add(key)
        self.counter.count("set", _len(key) + _len(value))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        out: bytes = self.inner.get(key)
        self.counter.count("get", _len(key) + len(out))
        return out

    def add(self, key: str, n: int) -> int:
        self.written.add(key)
        self.counter.count("add", _len(key) + 16)
        return int(self.inner.add(key, n))

    def append(self, key: str, value: Any) -> None:
        self.written.add(key)
        self.counter.count("append", _len(key) + _len(value))
        self.inner.append(key, value)

    def check(self, keys: list[str]) -> bool:
        self.counter.count("check", sum(map(_len, keys)))
        return bool(self.inner.check(keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        out: list[bytes] = self.inner.multi_get(keys)
        self.counter.count("multi_get", sum(map(_len, keys)) + sum(map(len, out)))
        return out

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.written.update(keys)
        self.counter.count("multi_set", sum(map(_len, keys)) + sum(map(_len, values)))
        self.inner.multi_set(keys, values)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self.written.add(key)
        out: bytes = self.inner.compare_set(key, expected, desired)
        self.counter.count("compare_set", _len(key) + _len(expected) + _len(desired) + len(out))
        return out

    def delete_key(self, key: str) -> bool:
        self.counter.count("delete_key", _len(key))
        return bool(self.inner.delete_key(key))

    def wait(self, keys: list[str], *args: Any) -> None:
        self.counter.count("wait", sum(map(_len, keys)))
        self.inner.wait(keys, *args)

    def num_keys(self) -> int:
        self.counter.count("num_keys", 0)
        return int(self.inner.num_keys())

    def __getattr__(self, name: str) -> Any:  # timeout, set_timeout, ...: not store operations
        return getattr(self.inner, name)
