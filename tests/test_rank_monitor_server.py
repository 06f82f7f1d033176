"""ft_monitor.RankMonitorServer, the programmatic entry point: run_in_subprocess (ready on
return, stopped and reaped through its handle, gone with its parent), the foreground run,
and the errors it raises before and while starting. Real processes and sockets."""

from __future__ import annotations

import json
import os
import select
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import ft_monitor
from ft_client import FtError, RankMonitorClient
from ft_monitor.core.settings import Settings, SettingsError
from ft_monitor.daemon.listener import ListenerError
from ft_monitor.processes.monitor_process import MonitorStartError
from tests.procs import ROOT, pid_alive, ping, status, wait_until

pytestmark = pytest.mark.e2e

CFG = ft_monitor.FaultToleranceConfig.from_kwargs(rank_heartbeat_timeout=30.0, rank_section_timeouts={"step": 30.0})


def test_run_in_subprocess_is_ready_on_return_and_stops_through_its_handle(workdir: Path) -> None:
    sock = workdir / "rank0.sock"
    proc = ft_monitor.RankMonitorServer.run_in_subprocess(cfg=CFG, ipc_socket_path=str(sock), is_restarter_logger=False,
                                                          mp_ctx=None, env={"FT_TEST_MARK": "monitor-env"})
    try:
        assert ping(sock) and proc.is_alive() and proc.exitcode is None
        assert proc.socket_path == sock
        with open(f"/proc/{proc.pid}/maps") as f:
            maps = f.read()
        assert "libtorch" not in maps and "pydantic_core" not in maps  # a fresh interpreter, not a fork
        with open(f"/proc/{proc.pid}/environ", "rb") as f:
            assert b"FT_TEST_MARK=monitor-env" in f.read().split(b"\0")
        assert status(sock)["timeouts"]["rank_section_timeouts"] == {"step": 30.0}
        client = RankMonitorClient(str(sock))
        client.init_workload_monitoring()
        client.send_heartbeat()
        wait_until(lambda: status(sock)["connected"], 10, "the rank to show as connected")
        client.shutdown_workload_monitoring()
    finally:
        proc.terminate()
        proc.join(timeout=10)
    assert (proc.is_alive(), proc.exitcode) == (False, 0)
    assert not sock.exists()  # removed by the daemon on its way out


def test_kill_and_stop_and_the_context_manager(workdir: Path) -> None:
    proc = ft_monitor.RankMonitorServer.run_in_subprocess(CFG, workdir / "a.sock")
    proc.kill()
    proc.join(timeout=10)
    assert proc.exitcode == -signal.SIGKILL
    with ft_monitor.RankMonitorServer(Settings(), workdir / "b.sock").start_process() as other:
        assert ping(workdir / "b.sock")
    assert other.exitcode == 0 and other.stop() == 0  # stop() on an exited daemon: its status again


def test_a_bad_socket_path_is_refused_before_a_process_starts(workdir: Path) -> None:
    shared = workdir / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ListenerError, match=r"socket directory .*/shared has mode 0777; it must be 0700"):
        ft_monitor.RankMonitorServer.run_in_subprocess(CFG, shared / "r.sock")
    with pytest.raises(SettingsError, match=r"^cfg = dict: must be an ft_monitor FaultToleranceConfig"):
        ft_monitor.RankMonitorServer.run_in_subprocess({"rank_heartbeat_timeout": 3}, workdir / "r.sock")


def test_a_daemon_that_fails_at_start_is_reported(workdir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    reports = workdir / "reports-open"
    reports.mkdir()
    reports.chmod(0o777)
    cfg = ft_monitor.FaultToleranceConfig.from_kwargs(report_dir=str(reports))
    with pytest.raises(MonitorStartError, match=r"^the monitor for .*/r.sock exited with status 1 before it was ready"):
        ft_monitor.RankMonitorServer.run_in_subprocess(cfg, workdir / "r.sock")
    assert "report directory" in capfd.readouterr().err  # the daemon's own reason, on the shared stderr
    assert stat.S_IMODE(os.stat(reports).st_mode) == 0o777


def test_daemons_stop_when_the_program_that_started_them_exits(workdir: Path) -> None:
    code = textwrap.dedent(f"""
        import ft_monitor
        cfg = ft_monitor.FaultToleranceConfig.from_kwargs()
        p = ft_monitor.RankMonitorServer.run_in_subprocess(cfg, {str(workdir / 'r.sock')!r})
        print(p.pid, flush=True)
    """)  # exits without stopping it, as a script using the reference's daemonic process may
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[0])
    assert not pid_alive(pid)  # stopped and reaped before the interpreter exited
    assert not (workdir / "r.sock").exists()


def test_run_in_the_foreground_sets_the_ready_event_and_stops_on_sigterm(workdir: Path) -> None:
    sock = workdir / "fg.sock"
    code = textwrap.dedent(f"""
        import sys
        import ft_monitor

        class Ready:
            def set(self):
                print("READY", flush=True)

        cfg = ft_monitor.FaultToleranceConfig.from_kwargs(rank_heartbeat_timeout=30)
        sys.exit(ft_monitor.RankMonitorServer.run(cfg, {str(sock)!r}, Ready(), False, env={{"FT_TEST_MARK": "fg"}}))
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, start_new_session=True)
    try:
        assert proc.stdout is not None
        readable, _, _ = select.select([proc.stdout], [], [], 20)
        assert readable, "no READY line within 20 s"
        assert proc.stdout.readline().strip() == "READY"  # printed once the socket accepts
        assert ping(sock)
        assert status(sock)["monitor_pid"] == proc.pid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        out, err = proc.communicate()
    assert "monitor shutting down: received SIGTERM" in err


def test_a_rank_that_starts_its_own_monitor_is_stopped_on_a_hang_and_its_monitor_goes_too(workdir: Path) -> None:
    code = textwrap.dedent(f"""
        import time
        import ft_monitor
        from ft_client import RankMonitorClient

        cfg = ft_monitor.FaultToleranceConfig.from_kwargs(rank_section_timeouts={{"s": 0.5}}, stack_dump_timeout=0)
        monitor = ft_monitor.RankMonitorServer.run_in_subprocess(cfg, {str(workdir / 'r.sock')!r})
        print(monitor.pid, flush=True)
        client = RankMonitorClient({str(workdir / 'r.sock')!r})
        client.init_workload_monitoring()
        client.start_section("s")
        time.sleep(60)  # hung: the monitor, a child of this process, must stop it
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    monitor_pid = int(proc.stdout.split()[0])
    assert "and its descendants" not in proc.stderr  # the monitor did not signal itself
    wait_until(lambda: not pid_alive(monitor_pid), 20, "the monitor to exit with its parent")
    (report,) = (workdir / "reports").glob("rank0-*-hang.json")
    assert json.loads(report.read_text())["terminated_by"] == "SIGTERM"  # finished before it exited


def test_serve_outside_the_main_thread_is_refused(workdir: Path) -> None:
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            ft_monitor.RankMonitorServer(Settings(), workdir / "t.sock").serve()
        except BaseException as e:  # handed to the test thread
            errors.append(e)

    t = threading.Thread(target=serve)
    t.start()
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], FtError), errors
    assert str(errors[0]).startswith("RankMonitorServer.serve() must run in the main thread")
    assert not (workdir / "t.sock").exists()
