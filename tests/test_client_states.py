"""The client's connection states against a daemon running in this process.

The daemon runs on an event loop in a thread of the test process (the "rank" is
the test process itself), with a recording fake for its process operations, so
nothing is ever signalled. No subprocess, no torch; each test takes well under a
second except where the client's own reconnect interval is waited for.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ft_client.client.link as client_link  # the reconnection (its interval) lives there
from ft_client import RankMonitorClient, RankMonitorClientError
from ft_client.client import ConnState
from ft_monitor.config import FaultToleranceConfig
from ft_monitor.core.settings import Settings
from ft_monitor.daemon.monitor import MonitorDaemon
from tests.procs import wait_until

pytestmark = pytest.mark.compat  # also run on the oldest and newest torch (scripts/test-compat)


class NoSignals:
    """ProcessOps that never touch a process (the rank here is the test itself)."""

    sent: list[int]

    def __init__(self) -> None:
        self.sent = []

    def send(self, proc: Any, sig: int) -> bool:
        self.sent.append(sig)
        return True

    def alive(self, proc: Any) -> bool:
        return True

    def stop_target(self, proc: Any) -> None:
        return None

    async def wait_exit(self, proc: Any, timeout: float) -> bool:
        return False

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def file_size(self, path: Path) -> int:
        return 0


class ThreadDaemon:
    """A MonitorDaemon serving on its own loop in a thread of this process."""

    def __init__(self, socket_path: Path, **config: Any) -> None:
        config.setdefault("report_dir", str(socket_path.parent / "reports"))
        self.settings = Settings.from_config(FaultToleranceConfig(**config))
        self.socket_path = socket_path
        self.loop = asyncio.new_event_loop()
        self.daemon: MonitorDaemon | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("in-process daemon did not start within 10 s")
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            self.daemon = MonitorDaemon(self.settings, self.socket_path, ops=NoSignals())
            await self.daemon.startup()

        try:
            self.loop.run_until_complete(start())
        except BaseException as e:  # reported to the test thread
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    def call(self, fn: Any) -> Any:
        """Run ``fn()`` on the daemon's loop and return its result."""
        fut: Any = asyncio.run_coroutine_threadsafe(self._call(fn), self.loop)
        return fut.result(10)

    @staticmethod
    async def _call(fn: Any) -> Any:
        return fn()

    def status(self) -> dict[str, Any]:
        assert self.daemon is not None
        d = self.daemon
        return self.call(lambda: d.status().to_wire())  # type: ignore[no-any-return]

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        assert self.daemon is not None
        asyncio.run_coroutine_threadsafe(self.daemon.shutdown("test"), self.loop).result(15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture
def sock(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cs")
    d.chmod(0o700)
    return d / "m.sock"


@pytest.fixture
def daemons(sock: Path) -> Iterator[list[ThreadDaemon]]:
    started: list[ThreadDaemon] = []
    yield started
    for d in started:
        d.stop()


QUIET = {"rank_heartbeat_timeout": None, "initial_rank_heartbeat_timeout": None,
         "rank_section_timeouts": {"step": 600.0}, "rank_out_of_section_timeout": None}


def test_states_from_init_to_shutdown_and_again(sock: Path, daemons: list[ThreadDaemon]) -> None:
    daemons.append(d := ThreadDaemon(sock, **QUIET))
    c = RankMonitorClient(str(sock))
    assert c.connection_state is ConnState.NOT_INITIALIZED and not c.is_initialized
    with pytest.raises(RankMonitorClientError):
        c.set_timeouts(c.timeouts)
    c.init_workload_monitoring()
    assert c.connection_state is ConnState.CONNECTED and c.is_initialized
    with pytest.raises(RankMonitorClientError, match="already initialized"):
        c.init_workload_monitoring()
    c.start_section("step")
    wait_until(lambda: d.status().get("open_sections"), 5, "the daemon to see the section")
    c.end_section("step")
    c.shutdown_workload_monitoring()
    assert c.connection_state is ConnState.SHUT_DOWN and not c.is_initialized
    wait_until(lambda: not d.status()["connected"], 5, "the session to end")
    c.init_workload_monitoring()  # a shut-down client may start again
    assert c.connection_state is ConnState.CONNECTED
    wait_until(lambda: d.status()["sessions"] == 2, 5, "the second session")
    c.shutdown_workload_monitoring()


def test_a_lost_monitor_makes_the_client_lost_and_it_reconnects_off_the_training_thread(
        sock: Path, daemons: list[ThreadDaemon], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_link, "RECONNECT_INTERVAL", 0.05)
    first = ThreadDaemon(sock, **QUIET)
    c = RankMonitorClient(str(sock))
    c.init_workload_monitoring()
    c.start_section("step")
    first.stop()
    wait_until(lambda: (c.send_heartbeat(), c.connection_state)[1] is ConnState.LOST, 5, "the client to notice")
    assert c.lost_reason and c.is_initialized
    c.send_heartbeat()  # progress calls keep working while lost
    daemons.append(second := ThreadDaemon(sock, **QUIET))
    wait_until(lambda: c.connection_state is ConnState.CONNECTED, 10, "the client to reconnect")
    with c._lock:  # the reconnection says CONNECTED first, then clears the reason, under this lock
        assert c.lost_reason is None
    wait_until(lambda: [s["name"] for s in second.status().get("open_sections", [])] == ["step"], 5,
               "the new daemon to learn of the open section")
    c.end_section("step")
    c.shutdown_workload_monitoring()


def test_on_monitor_lost_raise_raises_on_the_next_call(sock: Path, daemons: list[ThreadDaemon]) -> None:
    d = ThreadDaemon(sock, on_monitor_lost="raise", **QUIET)
    c = RankMonitorClient(str(sock))
    c.init_workload_monitoring()
    d.stop()

    def raised() -> bool:
        try:
            c.send_heartbeat()
        except RankMonitorClientError:
            return True
        return False

    wait_until(raised, 5, "the client to raise")
    c.shutdown_workload_monitoring()


def test_a_forked_child_client_is_detached_and_sends_nothing(sock: Path, daemons: list[ThreadDaemon]) -> None:
    daemons.append(d := ThreadDaemon(sock, **QUIET))
    c = RankMonitorClient(str(sock))
    c.init_workload_monitoring()
    c.send_heartbeat()
    wait_until(lambda: d.status().get("heartbeats") == 1, 5, "the first heartbeat")
    assert c._transport is not None
    parents_copy = os.dup(c._transport._sock.fileno())  # in a real fork the parent keeps its copy open
    c._detach_in_child()  # what os.register_at_fork runs in a child process
    assert c.connection_state is ConnState.FORKED_CHILD and not c.is_initialized
    for _ in range(5):
        c.send_heartbeat()
        c.start_section("step")
        c.end_section("step")
    with pytest.raises(RankMonitorClientError, match="fork"):
        c.init_workload_monitoring()
    c.shutdown_workload_monitoring()  # does nothing in a child
    st = d.status()
    assert st["connected"] and st["heartbeats"] == 1 and st["steps_started"] == 0, st
    os.close(parents_copy)


def test_the_reference_clients_arguments_warmup_and_loaded_timeouts(sock: Path, daemons: list[ThreadDaemon]) -> None:
    daemons.append(d := ThreadDaemon(sock, **QUIET))
    c = RankMonitorClient(str(sock))
    with pytest.raises(RankMonitorClientError, match="num_warmup_iters = '/run/ft.sock'"):
        c.init_workload_monitoring("/run/ft.sock")  # type: ignore[arg-type]  # a path is no warm-up length
    assert c.loaded_hb_timeouts is None and c.loaded_section_timeouts is None
    c.load_state_dict(state={"current_timeouts": {"heartbeat": {"initial": 300.0, "subsequent": 60.0,
                                                                "were_calculated": True}}})
    assert c.loaded_hb_timeouts is not None and c.loaded_hb_timeouts.subsequent == 60.0
    c.init_workload_monitoring(num_warmup_iters=3)
    assert d.call(lambda: d.daemon.rank.session.num_warmup_iterations) == 3  # type: ignore[union-attr]
    assert c.hb_timeouts.subsequent == 60.0
    c.start_section(section="step")
    c.end_section(section="step")
    c.shutdown_workload_monitoring()
