"""End-to-end: the start-up deadline (startup_timeout) with real processes.

A worker that hangs before it connects to its monitor is dumped through the start-up
hook (the stack names the place) and stopped; under ft-launcher the job restarts.
A worker that connects in time is never touched.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ft_monitor.launcher import exit_codes
from tests import zygote
from tests.launchers import launcher_argv
from tests.procs import ROOT, WORKERS, Daemon, slack

pytestmark = pytest.mark.e2e

WORKER = str(WORKERS / "startup.py")


def test_serve_cmd_worker_asleep_before_init_is_dumped_and_stopped(workdir: Path) -> None:
    d = Daemon(workdir, "--ft-startup-timeout", "1.5", "--ft-termination-grace-time", "2",
               cmd=[sys.executable, WORKER, "sleep"])
    assert d.proc.wait(60) == 128 + signal.SIGTERM, d.log()
    d.stop()
    report = d.report()
    assert report["reason"] == "startup" and report["stack_dump_captured"], report
    assert report["message"] == "not connected to its monitor 1.5 s after it started, startup timeout 1.5 s"
    assert "in sleep_before_init" in Path(report["stack_dump"]).read_text()
    assert "reason=startup" in d.log()


def test_serve_cmd_worker_that_connects_in_time_is_not_touched(workdir: Path) -> None:
    d = Daemon(workdir, "--ft-startup-timeout", "30", "--ft-startup-until", "first_step",
               cmd=[sys.executable, WORKER, "fast"])
    assert d.proc.wait(60) == 0, d.log()
    d.stop()
    assert "connected" in d.log() and "hang detected" not in d.log()
    assert not list(d.report_dir.glob("*-hang.json"))
    assert not list(d.report_dir.glob("*-stack.txt"))  # before: a file with only the start-up hook's header


def test_a_dump_file_holds_one_header_and_the_dump_after_it(workdir: Path) -> None:
    """The start-up hook and then the client open the same file; before, each wrote a header
    there at once: an empty "start-up stack dumps" header, then a second one, then the dump."""
    d = Daemon(workdir, "--ft-startup-timeout", "30", "--ft-rank-section-timeouts", "step:1",
               "--ft-termination-grace-time", "2", cmd=[sys.executable, WORKER, "step"])
    assert d.proc.wait(60) == 128 + signal.SIGTERM, d.log()
    d.stop()
    report = d.report()
    assert report["reason"] == "section" and report["stack_dump_captured"], report
    lines = Path(report["stack_dump"]).read_text().splitlines()
    headers = [line for line in lines if line.startswith("#")]
    assert headers == [f"# ft-monitor stack dump of pid {report['pid']} (signal SIGUSR2): section"], lines
    assert lines[0] == headers[0] and "(most recent call first)" in lines[1], lines
    assert "in wait_to_be_stopped" in "\n".join(lines)


@pytest.mark.parametrize("warm", [False, True], ids=["exec", "forked"])
def test_launcher_restarts_workers_hung_before_init_each_dumped_where_it_hung(workdir: Path, warm: bool) -> None:
    """Attempt 0: rank 1 asleep before anything; 1: rank 0 in init_process_group waiting
    for rank 1, connected but never joining; 2: rank 0 stuck importing a module; 3: all finish.
    In attempt 1 rank 0's start-up deadline fires, but the roll call dumps it (not connected:
    through the start-up hook) waiting in init_process_group, and names rank 1 (before: rank 0).
    ``forked``: with --ft-warm-restart, attempts 1 to 3 are forked from the worker template
    (the start-up hook armed in the fork, the deadline timed from the fork)."""
    summary_path = workdir / "summary.json"
    # In attempts 1 and 2 rank 0 must reach init_process_group before its deadline. Started cold it
    # imports torch first: that took more than 8 s at a load of 12 on 2 cores (1.1 s on a quiet
    # machine), and the deadline then rightly named rank 0. Forked, it has torch already. Every
    # hang here waits out this deadline: the shortest that is safe, scaled by the load.
    startup = round((2.5 if warm else 5.0) * slack(), 1)
    argv = launcher_argv("--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "--log-dir",
                         str(workdir / "logs"), "--ft-summary-json", str(summary_path), "--ft-startup-timeout",
                         str(startup), "--ft-termination-grace-time", "1", *(["--ft-warm-restart"] if warm else []),
                         WORKER)
    log = workdir / "launcher.out"
    with open(log, "w") as f:
        proc = zygote.popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        rc = proc.wait(100 * slack())
    finally:
        if proc.poll() is None:  # SIGTERM stops its workers too (they run in sessions of their own)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    output = log.read_text()
    assert rc == exit_codes.SUCCESS, output
    summary = json.loads(summary_path.read_text())
    started = [a["started"] for a in summary["attempts"]]
    assert started == (["exec", "forked", "forked", "forked"] if warm else ["exec"] * 4), (started, output)
    hangs = summary["hangs"]
    assert [(h["attempt"], h["rank"], h["reason"]) for h in hangs] == [(0, 1, "startup"), (1, 1, "startup"),
                                                                      (2, 0, "startup")], hangs
    where = ["in sleep_before_init", "in wait_to_be_stopped", "stuck_at_import.py"]
    for hang, place in zip(hangs, where):
        assert hang["stack_dump_captured"] and hang["timeout_s"] == startup <= hang["elapsed_s"], hang
        assert place in Path(hang["stack_dump"]).read_text(), (place, Path(hang["stack_dump"]).read_text())
        error = json.loads(Path(hang["error_file"]).read_text())
        message = error["message"]["message"]
        assert "not connected to its monitor" in message and f"startup timeout {startup:.1f} s" in message, message
    assert hangs[1]["reported_by"]["rank"] == 0 and "rank 0 waits in init_process_group" in hangs[1]["message"]
    assert "reported_by" not in hangs[0] and "reported_by" not in hangs[2]
    hung_lines = [line for line in output.splitlines() if ") hung: " in line and "ft-launcher: rank" in line]
    assert [line.split("ft-launcher: ")[1].split(" (")[0] for line in hung_lines] == ["rank 1", "rank 1", "rank 0"]
    assert output.count("] finished") == 2
