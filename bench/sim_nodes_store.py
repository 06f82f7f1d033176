"""The store of bench/sim_nodes.py's simulated launchers: ONE real torch.distributed TCPStore
in its own process (nobody's node; its CPU from /proc/PID/stat), or ONE real etcd (issue 43:
tests/etcd.py's server, v2 API, in a temporary folder), and the counting face each node's
store client wears (operations and bytes, keys and values both ways; on etcd also the HTTP
requests python-etcd makes for them, and the bytes of their answers)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
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
        return cpu_s(self.proc.pid)

    def num_keys(self) -> int:
        return int(self.client.num_keys())

    def close(self) -> None:
        from bench.harness import end_by_stdin  # not at the top: `bench/sim_nodes.py --help` needs no ft_client

        end_by_stdin(self.proc, 10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


ETCD_STORE_FOLDER = "/torch/elastic/store"
"""Where torch's etcd-v2 backend keeps its EtcdStore (etcd_rendezvous_backend.create_backend)."""


class EtcdHost:
    """A real etcd in its own process and a temporary folder (nobody's node), as the job's
    rendezvous store: its CPU from /proc, its keys over the v2 HTTP API."""

    def __init__(self) -> None:
        from tests.etcd import Etcd  # the tests' server: one way to start etcd in the project

        if shutil.which("etcd") is None:
            raise RuntimeError("no etcd here (scripts/setup-env installs Debian's etcd-server)")
        self.dir = Path(tempfile.mkdtemp(prefix="ftb-etcd-"))
        self.server = Etcd(self.dir)
        self.endpoint = self.server.endpoint

    def cpu_s(self) -> float:
        return cpu_s(self.server.proc.pid)

    def num_keys(self) -> int:
        """The keys of torch's EtcdStore (every run's and round's: one folder)."""
        return len(self.server.keys(ETCD_STORE_FOLDER))

    def close(self) -> None:
        self.server.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def count_requests(client: Any, counter: Counter) -> None:
    """Count every HTTP request python-etcd's ``client`` makes (by method), with the bytes of
    each answer: what one EtcdStore or rendezvous operation costs etcd."""
    def counting(send: Any) -> Any:
        def counted(method: str, *args: Any, **kwargs: Any) -> Any:
            answer = send(method, *args, **kwargs)
            counter.count(method, len(answer.data))  # python-etcd reads it at once too (a watch: when it fires)
            return answer

        return counted

    http = client.http
    for name in ("request", "request_encode_body"):  # GET and DELETE; PUT and POST (python-etcd's api_execute)
        setattr(http, name, counting(getattr(http, name)))


class CountingBackend:
    """torch's rendezvous backend (etcd-v2's), its ``get_state`` and ``set_state`` counted as the
    rendezvous's store operations (with the bytes of the state)."""

    def __init__(self, inner: Any, counter: Counter) -> None:
        self.inner = inner
        self.counter = counter

    @property
    def name(self) -> str:
        return str(self.inner.name)

    def get_state(self) -> Any:
        out = self.inner.get_state()
        self.counter.count("get_state", len(out[0]) if out else 0)
        return out

    def set_state(self, state: bytes, token: Any = None) -> Any:
        out = self.inner.set_state(state, token)
        self.counter.count("set_state", len(state) + (len(out[0]) if out else 0))
        return out


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

    def clone(self) -> CountingStore:
        """A new connection, counted as this one (ft_client.store.counter adds on a clone: issue 38)."""
        return CountingStore(self.inner.clone(), self.counter, self.written)

    def __getattr__(self, name: str) -> Any:  # timeout, set_timeout, ...: not store operations
        return getattr(self.inner, name)
