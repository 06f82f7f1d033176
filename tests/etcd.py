"""A real etcd for the tests of torch's etcd rendezvous backends (issue 43): Debian's
etcd-server (3.4, installed by scripts/setup-env), its v2 API on (the API torch's ``etcd`` and
``etcd-v2`` backends speak through python-etcd), on loopback ports, its data and log in the
test's private folder; started and stopped by the test, its log kept with a failing test's
folder. bench/sim_nodes_store.py starts the same server for the store benchmark.

Besides starting it: its keys as they are now (the v2 API's recursive listing, read over
HTTP as an operator would, not through the client under test), a write of a test's own, and
a stop mid-job (`kill`) for the tests of what a launcher does when its store goes away."""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.procs import free_port, wait_until


class Etcd:
    """One etcd member answering on ``127.0.0.1:port`` (`endpoint`)."""

    def __init__(self, workdir: Path, name: str = "etcd") -> None:
        self.port, peer = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            ["etcd", "--data-dir", str(workdir / f"{name}-data"), "--name", "ft-test",
             "--listen-client-urls", f"http://{self.endpoint}", "--advertise-client-urls", f"http://{self.endpoint}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
             f"http://127.0.0.1:{peer}", "--initial-cluster", f"ft-test=http://127.0.0.1:{peer}",
             "--enable-v2=true"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until(self._answers, 60, "etcd answering on its client port")
        except BaseException:
            self.stop()
            raise

    def _answers(self) -> bool:
        assert self.proc.poll() is None, self.log_path.read_text()
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/v2/keys", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def keys(self, prefix: str = "/") -> dict[str, str]:
        """Every key under ``prefix`` (recursively) and its value, as etcd holds them now."""
        url = f"http://{self.endpoint}/v2/keys{urllib.parse.quote(prefix)}?recursive=true"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                tree = json.load(r)["node"]
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return {}
            raise
        out: dict[str, str] = {}
        todo = [tree]
        while todo:
            node = todo.pop()
            if node.get("dir"):
                todo.extend(node.get("nodes", []))
            else:
                out[node["key"]] = node["value"]
        return out

    def put(self, key: str, value: str) -> None:
        """Write ``value`` at ``key``, as anyone who reaches etcd's client port can."""
        data = urllib.parse.urlencode({"value": value}).encode()
        req = urllib.request.Request(f"http://{self.endpoint}/v2/keys{urllib.parse.quote(key)}", data=data,
                                     method="PUT")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status in (200, 201), r.status

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Stop etcd now (mid-job): its clients find nothing on its port from then on."""
        self.proc.send_signal(sig)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def etcd_server(workdir: Path) -> Iterator[Etcd]:
    """The body of a test module's ``etcd`` fixture: a server for the test, skipped with the
    reason where etcd or torch's client for it is not installed."""
    import pytest  # here: bench/sim_nodes_store.py starts an `Etcd` without pytest

    if shutil.which("etcd") is None:
        pytest.skip("no etcd here (scripts/setup-env installs Debian's etcd-server where it runs as root with apt)")
    if importlib.util.find_spec("etcd") is None:
        pytest.skip("no python-etcd (torch's client for the etcd rendezvous; the test extra installs it)")
    server = Etcd(workdir)
    try:
        yield server
    finally:
        server.stop()
