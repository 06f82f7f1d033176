"""End-to-end: a real `ft-monitor serve` daemon, real rank processes, real signals."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from ft_client import RankMonitorClient, RankMonitorClientError, wire
from tests import other_user
from tests.procs import ROOT, Daemon, Rank, pid_alive, raw_client, slack, status, wait_until

pytestmark = pytest.mark.e2e

FAST = ("--ft-stack-dump-timeout", "3", "--ft-termination-grace-time", "2")
STEP_TIMEOUT = 1.0
MARGIN = 2.0  # generous: CI machines are shared; bench/ measures the real delay


@pytest.fixture
def daemon(workdir: Path) -> Iterator[Daemon]:
    d = Daemon(workdir, "--ft-rank-section-timeouts", f"step:{STEP_TIMEOUT}", *FAST).wait_ready()
    yield d
    d.stop()


@pytest.fixture
def detecting(workdir: Path, progress: tuple[str, ...]) -> Iterator[Daemon]:
    """The `daemon` above, in each progress mode (the detection tests run in both)."""
    d = Daemon(workdir, "--ft-rank-section-timeouts", f"step:{STEP_TIMEOUT}", *FAST, *progress).wait_ready()
    yield d
    d.stop()


def _hang_case(daemon: Daemon, scenario: str, function: str, expected_rc: int) -> dict:
    rank = Rank(scenario, daemon.socket)
    try:
        rank.wait_line("steps done")
        rc = rank.wait(30)
    finally:
        rank.kill()
    assert rc == expected_rc, daemon.log()
    report = daemon.report()
    assert report["reason"] == "section" and report["section"] == "step"
    assert STEP_TIMEOUT <= report["elapsed_s"] < STEP_TIMEOUT + MARGIN
    assert report["stack_dump_captured"], report
    dump = Path(report["stack_dump"]).read_text()
    assert f"in {function}" in dump, dump
    assert report["pid"] == rank.proc.pid
    log = daemon.log()
    assert "ERROR hang detected: rank=0 pid=%d reason=section section=step" % rank.proc.pid in log
    return report


def test_rank_hung_in_sleep_is_dumped_and_terminated(detecting: Daemon) -> None:
    report = _hang_case(detecting, "sleep", "hang_in_sleep", -signal.SIGTERM)
    assert report["terminated_by"] == "SIGTERM"


def test_rank_hung_in_c_call_holding_the_gil_still_dumps(detecting: Daemon) -> None:
    _hang_case(detecting, "gil", "hang_in_c_call_holding_gil", -signal.SIGTERM)


def test_stopped_rank_is_continued_dumped_and_terminated(detecting: Daemon) -> None:
    _hang_case(detecting, "stop", "stop_myself", -signal.SIGTERM)


def test_rank_ignoring_sigterm_is_killed_after_grace(workdir: Path, progress: tuple[str, ...]) -> None:
    d = Daemon(workdir, "--ft-rank-section-timeouts", "step:1", "--ft-termination-grace-time", "0.5",
               "--ft-stack-dump-timeout", "0", *progress).wait_ready()
    try:
        rank = Rank("ignore-term", d.socket)
        try:
            rc = rank.wait(30)
        finally:
            rank.kill()
        report = d.report()
        assert rc == -signal.SIGKILL
        assert report["terminated_by"] == "SIGKILL"
        assert report["actions"][-1].startswith("sent SIGKILL")
        assert "still running after 0.5s; sent SIGKILL" in d.log()
    finally:
        d.stop()


def test_data_loader_children_die_with_the_rank(detecting: Daemon) -> None:
    rank = Rank("children", detecting.socket)
    try:
        child = int(rank.wait_line("child pid=").split("=")[1])
        rank.wait(30)
        wait_until(lambda: not pid_alive(child), 10, "the data-loader child to die")
    finally:
        rank.kill()
        if pid_alive(child):
            os.kill(child, signal.SIGKILL)


def test_after_a_hang_the_next_connection_is_a_fresh_session(detecting: Daemon) -> None:
    first = Rank("sleep", detecting.socket)
    try:
        first.wait(30)
    finally:
        first.kill()
    detecting.report()
    second = Rank("clean", detecting.socket)
    try:
        second.wait_line("shutdown")
        assert second.wait(30) == 0
    finally:
        second.kill()
    log = detecting.wait_log("shut down monitoring cleanly")
    assert "(session 2)" in log
    assert status(detecting.socket)["sessions"] == 2


def test_second_rank_connection_is_refused_naming_the_live_pid(daemon: Daemon) -> None:
    first = Rank("wait-stdin", daemon.socket, stdin=True)
    try:
        first.wait_line("steps done")
        client = RankMonitorClient(str(daemon.socket))
        with pytest.raises(RankMonitorClientError, match=rf"busy\): a rank is already connected to this monitor: "
                                                         rf"pid {first.proc.pid}$"):
            client.init_workload_monitoring()
        assert first.proc.stdin is not None
        first.proc.stdin.write("\n")
        first.proc.stdin.flush()
        assert first.wait(30) == 0
    finally:
        first.kill()


def test_timeouts_pushed_by_a_rank_survive_its_restart(daemon: Daemon) -> None:
    c = RankMonitorClient(str(daemon.socket))
    c.init_workload_monitoring()
    t = c.timeouts.with_updates(rank_heartbeat_timeout=99.0)
    assert c.set_timeouts(t).rank_heartbeat_timeout == 99.0
    c.shutdown_workload_monitoring()
    daemon.wait_log("shut down monitoring cleanly")
    c2 = RankMonitorClient(str(daemon.socket))
    c2.init_workload_monitoring()
    assert c2.hb_timeouts.subsequent == 99.0
    c2.shutdown_workload_monitoring()


@pytest.mark.parametrize(
    "payload, reason",
    [
        (struct.pack(">I", wire.MAX_FRAME + 1), "frame length 65537 outside"),
        (struct.pack(">I", 0), "frame length 0 outside"),
        (struct.pack(">I", 3) + b"\xc1\xc1\xc1", "not valid msgpack"),
        (struct.pack(">I", 2) + msgpack.packb([99]), "unknown message type 99"),
        (wire.encode(wire.HEARTBEAT), "expected HELLO first"),
    ],
)
def test_bad_frames_close_that_connection_and_the_daemon_keeps_serving(daemon: Daemon, payload: bytes,
                                                                       reason: str) -> None:
    s = raw_client(daemon.socket)
    try:
        s.sendall(payload)
        data = b""
        while True:  # the daemon answers with ERROR, then closes
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    finally:
        s.close()
    msgs = list(wire.FrameDecoder().feed(data))
    assert msgs and isinstance(msgs[0], wire.Error) and msgs[0].code == wire.ErrorCode.PROTOCOL
    assert reason in msgs[0].message
    daemon.wait_log(reason)
    rank = Rank("clean", daemon.socket)
    try:
        assert rank.wait(30) == 0
    finally:
        rank.kill()


def test_wrong_protocol_version_is_refused(daemon: Daemon) -> None:
    s = raw_client(daemon.socket)
    try:
        s.sendall(wire.encode(wire.Hello(wire.PROTOCOL_VERSION + 1, wire.Role.RANK, 0, {})))
        msgs = list(wire.FrameDecoder().feed(s.recv(4096)))
    finally:
        s.close()
    assert isinstance(msgs[0], wire.Error) and msgs[0].code == wire.ErrorCode.VERSION


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer as another uid")
def test_peer_with_another_uid_is_refused(daemon: Daemon) -> None:
    # The private directory already keeps other users out; open it up to test the
    # second line of defence, the SO_PEERCRED uid check.
    os.chmod(daemon.dir, 0o711)
    os.chmod(daemon.socket, 0o666)
    code = (
        "import socket,sys;s=socket.socket(socket.AF_UNIX);s.connect(sys.argv[1]);"
        "print(s.recv(4096).hex())"
    )
    out = subprocess.run(other_user.command([sys.executable, "-c", code, str(daemon.socket)]), capture_output=True,
                         text=True, timeout=30, cwd="/")
    assert out.returncode == 0, out.stderr
    msgs = list(wire.FrameDecoder().feed(bytes.fromhex(out.stdout.strip())))
    assert isinstance(msgs[0], wire.Error) and msgs[0].code == wire.ErrorCode.FORBIDDEN
    daemon.wait_log("uid 65534 is not the monitor's uid")
    os.chmod(daemon.dir, 0o700)
    rank = Rank("clean", daemon.socket)
    try:
        assert rank.wait(30) == 0
    finally:
        rank.kill()


def test_exit_without_shutdown_is_logged_as_exit_not_hang(workdir: Path) -> None:
    # the client was a local of the script's main: freed, its socket closed, before atexit
    d = Daemon(workdir, "--ft-rank-section-timeouts", "step:5", *FAST,
               cmd=[sys.executable, str(ROOT / "tests/workers/rank.py"), "exit3"])
    try:
        assert d.proc.wait(60) == 3
        log = d.log()
        assert "disconnected without shutdown_workload_monitoring(); the process exited (exit code 3)" in log
        assert "hang detected" not in log
    finally:
        d.stop()


def test_a_rank_slow_to_exit_after_its_main_returned_is_not_judged(workdir: Path) -> None:
    """Issue 39 item 7: a rank that returned right after init_workload_monitoring() took 2.8-3.1 s
    to exit under load and was stopped for "no first heartbeat" (3 s). Its exit here takes 3 s
    against a 1 s initial heartbeat timeout, its client (a global) alive until the end: the
    client shuts down at atexit, as the script could have."""
    d = Daemon(workdir, "--ft-initial-rank-heartbeat-timeout", "1", "--ft-rank-section-timeouts", "", *FAST,
               cmd=[sys.executable, str(ROOT / "tests/workers/rank.py"), "return-slow-exit"])
    try:
        assert d.proc.wait(60 * slack()) == 0
        log = d.log()
        assert "shut down monitoring; no longer timed" in log and "hang detected" not in log, log
        assert not list(d.report_dir.glob("*-hang.json"))
    finally:
        d.stop()


def test_a_rank_that_raised_and_is_slow_to_exit_is_a_crash_not_a_hang(workdir: Path, progress: tuple[str, ...]) -> None:
    # before: the rank stayed an active session while its interpreter ran a 3 s teardown, its 1 s
    # heartbeat timeout passed, and it was reported and stopped as a hang (a restart spent on a hang)
    d = Daemon(workdir, "--ft-rank-heartbeat-timeout", "1", "--ft-initial-rank-heartbeat-timeout", "1",
               "--ft-rank-section-timeouts", "", *FAST, *progress,
               cmd=[sys.executable, str(ROOT / "tests/workers/rank.py"), "raise-slow-exit"])
    try:
        assert d.proc.wait(60 * slack()) == 1  # the rank's own exit code, not SIGTERM's
        log = d.log()
        assert "is exiting: RuntimeError: bad batch (test); no longer timed (a crash, not a hang)" in log, log
        assert "hang detected" not in log and not list(d.report_dir.glob("*-hang.json"))
    finally:
        d.stop()


def test_clean_shutdown_with_open_section_warns(daemon: Daemon) -> None:
    rank = Rank("clean-open-section", daemon.socket)
    try:
        assert rank.wait(30) == 0
    finally:
        rank.kill()
    daemon.wait_log("shut down with section(s) still open: step")


def test_sigterm_stops_the_daemon_and_removes_the_socket(workdir: Path) -> None:
    d = Daemon(workdir).wait_ready()
    assert d.socket.exists()
    assert d.stop() == 0
    assert not d.socket.exists()
    assert "monitor shutting down: received SIGTERM" in d.log()


def test_status_shows_open_sections_and_timeouts(workdir: Path) -> None:
    # this test's own process is the rank: a timeout it could miss under load would end it
    daemon = Daemon(workdir, "--ft-rank-section-timeouts", "step:600").wait_ready()
    c = RankMonitorClient(str(daemon.socket))
    c.init_workload_monitoring()
    try:
        c.send_heartbeat()
        c.start_section("step")
        st = wait_until(lambda: (lambda s: s if s.get("open_sections") else None)(status(daemon.socket)),
                        10, "the open section in status")
        assert st["rank"] == 0 and st["pid"] == os.getpid()
        assert [s["name"] for s in st["open_sections"]] == ["step"]
        out = subprocess.run([sys.executable, "-m", "ft_monitor.cli", "status", "--socket", str(daemon.socket)],
                             capture_output=True, text=True, timeout=30, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        assert "section 'step' open" in out.stdout and f"pid {os.getpid()}" in out.stdout
        js = subprocess.run([sys.executable, "-m", "ft_monitor.cli", "status", "--socket", str(daemon.socket),
                             "--json"], capture_output=True, text=True, timeout=30, cwd=ROOT)
        assert json.loads(js.stdout)["timeouts"]["rank_section_timeouts"] == {"step": 600}
        c.end_section("step")
    finally:
        c.shutdown_workload_monitoring()
        daemon.stop()


# -- start-up errors -----------------------------------------------------------------------------


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ft_monitor.cli", "serve", *args], capture_output=True, text=True,
                          timeout=30, cwd=ROOT)


def test_socket_path_too_long_is_a_clear_error(workdir: Path) -> None:
    out = _serve("--socket", str(workdir / ("x" * 120)))
    assert out.returncode == 1
    assert "Unix sockets allow at most 107" in out.stderr


def test_second_daemon_on_a_live_socket_is_refused(daemon: Daemon) -> None:
    out = _serve("--socket", str(daemon.socket))
    assert out.returncode == 1
    assert f"another daemon is already serving {daemon.socket}" in out.stderr
    assert status(daemon.socket)["connected"] is False  # the first one is untouched


def test_stale_socket_file_is_replaced(workdir: Path) -> None:
    path = workdir / "rank0.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # bound, never listened, closed: a stale file
    d = Daemon(workdir).wait_ready()
    d.stop()


def test_symlink_at_socket_path_is_not_followed(workdir: Path) -> None:
    target = workdir / "elsewhere"
    (workdir / "rank0.sock").symlink_to(target)
    out = _serve("--socket", str(workdir / "rank0.sock"))
    assert out.returncode == 1 and "is a symbolic link; refusing to follow it" in out.stderr
    assert not target.exists()


def test_shared_directory_is_refused(workdir: Path) -> None:
    shared = workdir / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    out = _serve("--socket", str(shared / "r.sock"))
    assert out.returncode == 1 and "has mode 0777; it must be 0700" in out.stderr


def test_missing_directory_is_created_private(workdir: Path) -> None:
    sub = workdir / "sub"
    p = subprocess.Popen([sys.executable, "-m", "ft_monitor.cli", "serve", "--socket", str(sub / "r.sock")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, start_new_session=True)
    try:
        wait_until(lambda: (sub / "r.sock").exists(), 20, "the socket")
        assert (os.stat(sub).st_mode & 0o777) == 0o700
        assert (os.stat(sub / "r.sock").st_mode & 0o777) == 0o600
    finally:
        p.terminate()
        p.wait(10)


def test_client_without_socket_variable_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FT_RANK_MONITOR_IPC_SOCKET", raising=False)
    with pytest.raises(RankMonitorClientError, match=r"^no monitor socket: set FT_RANK_MONITOR_IPC_SOCKET"):
        RankMonitorClient().init_workload_monitoring()


def test_client_with_nothing_listening_names_the_path(workdir: Path) -> None:
    with pytest.raises(RankMonitorClientError, match=rf"^no monitor listens at {workdir}/nope.sock"):
        RankMonitorClient(str(workdir / "nope.sock")).init_workload_monitoring()


def test_reinit_right_after_shutdown_is_not_refused(daemon: Daemon) -> None:
    c = RankMonitorClient(str(daemon.socket))
    for _ in range(3):
        c.init_workload_monitoring()
        c.send_heartbeat()
        c.shutdown_workload_monitoring()


def test_training_goes_on_when_the_monitor_dies(workdir: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = Daemon(workdir, "--ft-rank-section-timeouts", "step:30").wait_ready()
    c = RankMonitorClient(str(d.socket))
    c.init_workload_monitoring()
    try:
        c.start_section("step")
        c.end_section("step")
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
        def lost() -> list[logging.LogRecord]:
            return [r for r in caplog.records if "training continues without hang detection" in r.getMessage()]

        # train on (no call raises) until the client has noticed the death: with a progress record the
        # steps never touch the socket and its watcher thread sees the hang-up when it is scheduled (a
        # fixed 200 steps could all run before that on a busy machine: seen once by the flake hunter)
        steps, end = 0, time.monotonic() + 20 * slack()
        with caplog.at_level("WARNING", logger="ft_client"):
            while (steps < 200 or not lost()) and time.monotonic() < end:
                with c.section("step"):
                    pass
                c.send_heartbeat()
                steps += 1
        assert len(lost()) == 1
        assert c.iteration == steps + 1  # steps are still counted (they go into the checkpoint)
    finally:
        c.shutdown_workload_monitoring()
        d.stop()


def test_rank_reconnects_on_its_own_to_a_restarted_monitor(workdir: Path) -> None:
    first = Daemon(workdir, "--ft-rank-section-timeouts", "step:30").wait_ready()
    c = RankMonitorClient(str(first.socket))
    c.init_workload_monitoring()
    try:
        learned = c.timeouts.with_updates(rank_section_timeouts={"step": 7.5}, learned=frozenset({"section:step"}))
        c.set_timeouts(learned)
        c.start_section("step")
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        c.send_heartbeat()  # notices the loss (warning), keeps going
        second = Daemon(workdir, "--ft-rank-section-timeouts", "step:30").wait_ready()
        try:
            def restored() -> dict | None:
                c.send_heartbeat()  # reconnection is tried from the client's own calls, at most once a second
                st = status(second.socket)
                # connected at the HELLO; the learned timeout and the open section follow just after it
                # (a status taken in between showed the configured 30 s: seen once under load)
                return st if st["connected"] and st["timeouts"]["rank_section_timeouts"] == {"step": 7.5} \
                    and [s["name"] for s in st["open_sections"]] == ["step"] else None

            # the restarted monitor gets the learned timeout and the open section back
            st = wait_until(restored, 20, "the client to reconnect and restore its timeouts and sections",
                            interval=0.1)
            assert st["pid"] == os.getpid()
            c.end_section("step")
        finally:
            c.shutdown_workload_monitoring()
            second.stop()
    finally:
        first.stop()


def test_socket_file_removed_under_the_daemon_is_recreated(daemon: Daemon) -> None:
    c = RankMonitorClient(str(daemon.socket))
    c.init_workload_monitoring()
    try:
        os.unlink(daemon.socket)
        daemon.wait_log("was removed; listening on it again")
        wait_until(lambda: daemon.socket.exists(), 10, "the socket file to come back")
        assert status(daemon.socket)["pid"] == os.getpid()  # the connected rank was not affected
        c.send_heartbeat()
    finally:
        c.shutdown_workload_monitoring()


def test_import_ft_client_stays_light() -> None:
    code = ("import sys; import ft_client; from ft_client import RankMonitorClient; "
            "heavy = [m for m in ('torch', 'asyncio', 'uvloop', 'pydantic', 'yaml') if m in sys.modules]; "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_unreachable_launcher_means_the_daemon_kills_the_rank_itself(workdir: Path, progress: tuple[str, ...]) -> None:
    d = Daemon(workdir, "--ft-rank-section-timeouts", "step:0.5", "--ft-stack-dump-timeout", "0",
               "--launcher-socket", str(workdir / "no-launcher.sock"), *progress).wait_ready()
    rank = Rank("sleep", d.socket)
    try:
        assert rank.wait(30) == -signal.SIGTERM
    finally:
        rank.kill()
        d.stop()
    assert d.report()["terminated_by"] == "SIGTERM"
    assert "cannot reach the launcher" in d.log()


def test_launcher_that_acknowledges_but_never_acts_is_overridden(workdir: Path) -> None:
    from ft_monitor.launcher.agent.control import EventKind, LauncherServer

    server = LauncherServer(str(workdir / "launcher.sock"))  # acknowledges, queues, never stops anything
    monitors: set[int] = set()
    server.authorize(monitor=monitors.__contains__, worker=lambda pid: False)
    server.start()
    d = Daemon(workdir, "--ft-rank-section-timeouts", "step:0.5", "--ft-stack-dump-timeout", "0",
               "--ft-launcher-response-timeout", "0.5", "--ft-termination-grace-time", "0.5",
               "--launcher-socket", server.path).wait_ready()
    monitors.add(d.proc.pid)
    rank = Rank("sleep", d.socket)
    try:
        assert rank.wait(30) == -signal.SIGTERM
        (event,) = server.drain()
        assert event.kind is EventKind.HANG and event.notice is not None and event.notice.pid == rank.proc.pid
        assert event.notice.message.startswith("section 'step' open for")
    finally:
        rank.kill()
        d.stop()
        server.stop()
    log = d.log()
    assert "launcher acknowledged the hang" in log
    assert "still running 1.0s after the launcher was told; terminating it here" in log


@pytest.mark.parametrize(("scenario", "confirmed"), [("corrupt-record", False), ("corrupt-iteration", False),
                                                     ("corrupt-iteration", True)])
def test_a_rank_whose_record_is_refused_is_told_and_keeps_running_on_the_socket(workdir: Path, scenario: str,
                                                                                confirmed: bool) -> None:
    """Issue 24 item 6: a healthy rank heartbeating every 50 ms whose record is corrupted once
    (garbage, or one word: ITERATION = -7), for 4 s after. On main the rank was never told:
    its heartbeats went on into the refused record and it was SIGTERMed 1 s later ("no
    heartbeat"). ``confirmed``: each progress call is confirmed with a PING, so the refusal
    meets the rank's request before the PONG (the transport takes it aside)."""
    flags = ("--ft-skip-section-response", "false") if confirmed else ()
    d = Daemon(workdir, "--ft-rank-section-timeouts", "step:1", "--ft-rank-heartbeat-timeout", "1",
               "--ft-stack-dump-timeout", "0", "--ft-termination-grace-time", "2", *flags).wait_ready()
    rank = Rank(scenario, d.socket)
    try:
        rank.wait_line("record corrupted")
        rank.wait_line("reporting through the socket after", timeout=10)
        rank.wait_line("finished, told: True", timeout=30)
        assert rank.wait(30) == 0, d.log()
        (line,) = [x for x in d.log().splitlines() if "progress record is corrupt" in x]
        why = "magic word is" if scenario == "corrupt-record" else "iteration -7 is below -1"
        assert f"ERROR rank 0 pid {rank.proc.pid}: its progress record is corrupt ({why}" in line
        assert "the rank is told and reports through the socket" in line
        assert d.proc.poll() is None, "the monitor must outlive the record"
        assert status(d.socket)["hangs_detected"] == 0
        assert not list(d.report_dir.glob("*.json")), d.log()
    finally:
        rank.kill()
        d.stop()
