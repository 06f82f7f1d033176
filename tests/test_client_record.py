"""The client with a progress record, against a daemon on a loop in this process
(`ThreadDaemon` of test_client_states.py): what is stored, what still goes through the
socket, the restart gate, the fallbacks. No subprocess; the "rank" is this process."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from ft_client import RankMonitorClient, wire
from ft_client.client import ConnState
from ft_client.inprocess import events
from ft_client.record import words_for
from ft_client.record.read import RecordView, decode
from ft_client.wire.transport import Transport
from ft_monitor.daemon import record_watch
from tests.procs import wait_until
from tests.test_client_states import QUIET, ThreadDaemon

pytestmark = pytest.mark.compat  # also run on the oldest and newest torch (scripts/test-compat)


def stored(c: RankMonitorClient, slots: int = 2) -> RecordView:
    assert c._record is not None
    b = bytes(c._record.words[: words_for(slots)].cast("B"))
    return decode(b, b, b, slots)


@pytest.fixture
def sock(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cr")
    d.chmod(0o700)
    return d / "m.sock"


@pytest.fixture
def daemons() -> Any:
    started: list[ThreadDaemon] = []
    yield started
    for d in started:
        d.stop()


def test_progress_is_stored_and_the_daemon_sees_it(sock: Path, daemons: list[ThreadDaemon],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    daemons.append(d := ThreadDaemon(sock, **{**QUIET, "rank_section_timeouts": {"step": 600.0, "data": None}}))
    c = RankMonitorClient(str(sock))
    c.init_workload_monitoring()
    assert c._record is not None
    sent: list[bytes] = []
    real = Transport.send_event
    monkeypatch.setattr(Transport, "send_event", lambda t, frame: (sent.append(frame), real(t, frame))[1])
    c.start_section("step")  # registered once: SECTION_SLOT over the socket, then stored
    c.end_section("step")
    sent_after_first = len(sent)
    for _ in range(10):
        c.start_section("step")
        c.end_section("step")
        c.send_heartbeat()
        c.start_section("data")  # not monitored: not even stored
        c.end_section("data")
    assert sent_after_first == 1 and len(sent) == 1, "progress went through the socket"
    assert wire.decode_body(sent[0][4:]) == wire.SectionSlot("step", 0)
    v = stored(c)
    assert v.slots[0] is not None and v.slots[0].writes == 22 and v.iteration == 11
    assert v.heartbeats is not None and v.heartbeats.count == 10
    st = wait_until(lambda: (lambda s: s if s.get("steps_closed") == 11 else None)(d.status()), 5, "the steps")
    assert st["heartbeats"] == 10 and st["iteration"] == 11 and st["iteration_high"] == 11
    c.shutdown_workload_monitoring()


def test_with_progress_record_off_everything_goes_through_the_socket(sock: Path,
                                                                    daemons: list[ThreadDaemon]) -> None:
    daemons.append(d := ThreadDaemon(sock, progress_record=False, **QUIET))
    c = RankMonitorClient(str(sock))
    c.init_workload_monitoring()
    assert c._record is None
    c.start_section("step")
    c.send_heartbeat()
    wait_until(lambda: d.status().get("heartbeats") == 1 and d.status().get("open_sections"), 5, "the events")
    c.end_section("step")
    c.shutdown_workload_monitoring()


def test_a_record_on_another_clock_is_declined_and_progress_goes_through_the_socket(
        sock: Path, daemons: list[ThreadDaemon], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    real = record_watch.create_record
    monkeypatch.setattr(record_watch, "create_record", lambda created: real(created - 10**10))  # 10 s off
    daemons.append(d := ThreadDaemon(sock, **QUIET))
    c = RankMonitorClient(str(sock))
    with caplog.at_level(logging.WARNING):
        c.init_workload_monitoring()
    assert c._record is None and "cannot use the monitor's progress record (the monitor's clock differs" in caplog.text
    wait_until(lambda: d.daemon is not None and d.daemon.rank is not None and d.daemon.rank.record is None, 5,
               "the daemon to drop the record")
    c.start_section("step")
    wait_until(lambda: d.status().get("open_sections"), 5, "the open over the socket")
    c.end_section("step")
    c.shutdown_workload_monitoring()


def test_nothing_is_stored_while_unwinding_and_reentry_sends_reentered_before_storing(
        sock: Path, daemons: list[ThreadDaemon]) -> None:
    daemons.append(d := ThreadDaemon(sock, **QUIET))
    c = RankMonitorClient(str(sock))
    c.init_workload_monitoring()
    c.start_section("step")
    wait_until(lambda: d.status().get("open_sections"), 5, "the step")
    c._aborting(1)  # what the Wrapper's abort does (through events.RestartListener)
    wait_until(lambda: d.status().get("phase") == "restarting", 5, "RESTARTING")
    before = stored(c)
    c.end_section("step")  # unwinding: nothing is reported, nothing stored
    c.send_heartbeat()
    assert stored(c) == before
    restart = events.Restart(1, events.Fault("test", 0, 0, "exception"))
    c._entering(restart)  # the Wrapper calls the function again: a new epoch
    v = stored(c)
    assert v.epoch_ns > 0 and v.slots[0] is not None and not v.slots[0].is_open  # what was left open is closed
    c.start_section("step")  # the first progress: REENTERED, then stored
    st = wait_until(lambda: (lambda s: s if s.get("phase") == "active" and s.get("open_sections") else None)(
        d.status()), 5, "back, with the new step open")
    assert [s["name"] for s in st["open_sections"]] == ["step"] and st["open_sections"][0]["elapsed_s"] < 5
    assert d.status()["last_restart"]["iteration"] == 1
    c.end_section("step")
    c.shutdown_workload_monitoring()


def test_a_monitor_that_dies_is_noticed_without_any_send(sock: Path, daemons: list[ThreadDaemon],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import ft_client.client.link as client_link

    monkeypatch.setattr(client_link, "RECONNECT_INTERVAL", 0.05)
    first = ThreadDaemon(sock, **QUIET)
    c = RankMonitorClient(str(sock))
    c.init_workload_monitoring()
    assert c._record is not None
    first.stop()
    wait_until(lambda: c.connection_state is ConnState.LOST, 5, "the watcher to notice")  # no progress call made
    daemons.append(second := ThreadDaemon(sock, **QUIET))
    wait_until(lambda: c.connection_state is ConnState.CONNECTED, 10, "the client to reconnect")
    with c._lock:  # the reconnection says CONNECTED, then maps the new record, all under this lock
        assert c._record is not None  # a new record from the new monitor
    c.send_heartbeat()
    wait_until(lambda: second.status().get("heartbeats") == 1, 5, "the new monitor to read it")
    c.shutdown_workload_monitoring()


def test_a_forked_child_does_not_inherit_the_mapping(sock: Path, daemons: list[ThreadDaemon]) -> None:
    daemons.append(ThreadDaemon(sock, **QUIET))
    c = RankMonitorClient(str(sock))
    c.init_workload_monitoring()
    assert c._record is not None

    def mapped() -> bool:
        with open("/proc/self/maps") as f:
            return "ft-progress-record" in f.read()

    assert mapped()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a data-loader worker: the client is detached and the page is not mapped here
        ok = c._record is None and c.connection_state is ConnState.FORKED_CHILD and not mapped()
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.close(r)
    os.waitpid(pid, 0)
    c.shutdown_workload_monitoring()


@pytest.mark.parametrize("record", [True, False], ids=["record", "socket"])
def test_a_step_left_by_an_exception_is_closed_but_not_counted(sock: Path, daemons: list[ThreadDaemon],
                                                               record: bool) -> None:
    # the review's case: a step that ended in an exception was counted as completed (the summary's and the
    # launcher's iteration one too high, a resumed run's progress judged on a step that never finished)
    daemons.append(d := ThreadDaemon(sock, progress_record=record, **{**QUIET, "rank_section_timeouts": {"step": 600.0}}))
    c = RankMonitorClient(str(sock))
    c.init_workload_monitoring()
    try:
        with c.section("step"):
            pass
        with pytest.raises(ValueError), c.section("step"):
            raise ValueError("bad batch")
        assert c.iteration == 1 and (not record or stored(c).iteration == 1)
        assert "step" not in c._open  # closed: no longer timed
        with c.section("step"):
            pass
        assert c.iteration == 2 and (not record or stored(c).iteration == 2)
        wait_until(lambda: d.status()["iteration_base"] + d.status()["steps_closed"] == 2, 10,
                   "the monitor's count (policy.iteration_now): two completed steps")
    finally:
        c.shutdown_workload_monitoring()
