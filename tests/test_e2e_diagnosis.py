"""End-to-end: a hang's roll call and diagnosis under real ft-launcher processes (gloo, CPU).

Every rank's stack, the Flight Recorder comparison, the verdict line, diagnosis.json
beside the attempt, error.json pointing at it; a rank holding the GIL; two launchers;
ranks that died or never answer (the roll call's bound); the dump-only mode."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ft_monitor.launcher import exit_codes
from ft_monitor.launcher.incident.crossnode import HANG_COUNT_KEY, HANG_INDEX_KEY
from ft_monitor.launcher.incident.rollcall_wire import ASKERS_KEY, BELL_KEY
from tests import zygote
from tests.launchers import JOB_SECRET, Launcher, job_processes, launcher_argv, listening, two_nodes
from tests.procs import ROOT, free_port, launcher_summary, wait_until
from tests.test_rollcall_attacks import forge

pytestmark = pytest.mark.e2e

FR = ("--ft-flight-recorder-entries", "2000")


def _diagnosis(summary: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    (row,) = summary["diagnoses"]
    return row, json.loads(Path(row["diagnosis"]).read_text())


def _check_document(doc: dict[str, Any], ranks: int) -> None:
    assert doc["schema"] == "ft-monitor/diagnosis" and doc["version"] == 1
    assert [r["rank"] for r in doc["ranks"]] == list(range(ranks)) and doc["missing_ranks"] == []
    assert all(r["status"] == "answered" and "most recent call first" in r["stack"] for r in doc["ranks"])


def test_two_ranks_the_verdict_names_the_rank_that_never_entered_the_all_reduce(workdir: Path) -> None:
    la = Launcher(workdir, "--max-restarts", "1", *FR, train_args=("--hang", "rank=1,step=12,attempt=0"))
    try:
        assert la.wait() == exit_codes.SUCCESS, la.output()
    finally:
        la.kill()
    summary = la.summary()
    row, doc = _diagnosis(summary)
    _check_document(doc, 2)
    v = doc["verdict"]
    assert v["basis"] == "flight_recorder" and v["behind"] == [1] and v["waiting"] == [0] and v["op"] == "all_reduce"
    assert v["line"].startswith(f"rank 1 never entered all_reduce #{v['seq']} on the default group (train_ddp.py:")
    assert v["line"].endswith(f"in write_metrics_to_stuck_filesystem); rank 0 waits in all_reduce #{v['seq']}")
    assert doc["hung"]["iteration"] == 12  # the step it hung in, not the last throttled report
    (hang,) = summary["hangs"]
    assert hang["verdict"] == v["line"] and hang["diagnosis"] == row["diagnosis"]
    assert Path(row["diagnosis"]).parent == Path(hang["error_file"]).parent.parent  # attempt_0/diagnosis.json
    error = json.loads(Path(hang["error_file"]).read_text())["message"]
    assert f"diagnosis: {row['diagnosis']}" in error["message"] and error["extraInfo"]["ft_diagnosis"]
    out = la.output()
    assert f"ERROR ft-launcher: verdict: {v['line']}" in out
    lines = launcher_summary(out)
    assert ("verdict", v["line"]) in lines and ("diagnosis", row["diagnosis"]) in lines


def test_four_ranks_one_holding_the_gil_is_still_named(workdir: Path) -> None:
    la = Launcher(workdir, "--nproc-per-node", "4", "--max-restarts", "0", *FR, "--ft-roll-call-timeout", "3",
                  train_args=("--hang", "rank=1,step=12,attempt=0", "--hang-mode", "gil"))
    try:
        assert la.wait() == exit_codes.WORKERS_FAILED, la.output()
    finally:
        la.kill()
    _, doc = _diagnosis(la.summary())
    _check_document(doc, 4)  # faulthandler dumps a rank that holds the GIL
    hung = doc["ranks"][1]
    assert hung["flight_recorder"] is None and "not written in time" in hung["flight_recorder_note"]
    assert all(r["flight_recorder"]["recording"] for r in doc["ranks"] if r["rank"] != 1)
    v = doc["verdict"]
    assert v["basis"] == "flight_recorder+stacks" and v["behind"] == [1] and v["waiting"] == [0, 2, 3]
    assert v["line"].startswith(f"rank 1 did not reach all_reduce #{v['seq']} on the default group")
    assert doc["roll_call"]["duration_s"] < 3.0 + 2.0  # the rank that never writes its trace is waited for no longer


# Two launchers, one diagnosis holding every rank's stack (the hung rank's node takes the roll call,
# the other answers through the store): tests/test_e2e_launcher.py's
# test_two_nodes_hang_on_one_restarts_both_and_completes checks it on its run, the same scenario.


def test_two_launchers_a_heartbeat_hang_has_one_culprit_on_every_node(workdir: Path) -> None:
    """Issue 42 item 3: with a heartbeat timeout every rank misses its deadline, and a rank
    waiting in a collective may have stopped first: the stuck rank's own node printed "rank 1 on
    vm hung first; rank 0 here was waiting for it" (the first-hang exchange), while the node that
    took the roll call printed the right verdict; each node's rows named its own rank. Now the
    nodes that answered take the roll call's verdict as theirs."""
    a, b = two_nodes(workdir, "ft-heartbeat", "--max-restarts", "1", *FR, "--ft-rank-heartbeat-timeout", "3",
                     train_args=("--hang", "rank=0,step=12,attempt=0", "--hang-where", "between"))
    if "0" not in a.summary()["attempts"][0]["pids"]:
        a, b = b, a  # a: the stuck rank's node
    (diagnosis,) = a.summary()["diagnoses"] + b.summary()["diagnoses"]  # one roll call
    assert diagnosis["rank"] == 0, diagnosis
    for node in (a, b):
        summary = node.summary()
        assert {h["rank"] for h in summary["hangs"]} == {0}, summary["hangs"]  # one culprit, on every node
        assert [r["rank"] for r in summary["restarts"]] == [0], summary["restarts"]
        assert "after rank 0's hang was detected" in node.output()
    pid = a.summary()["attempts"][0]["pids"]["0"]
    assert f"ft-launcher: rank 0 (local rank 0, pid {pid}) hung:" in a.output()
    assert "hung first" not in "\n".join(line for line in a.output().splitlines() if line.startswith("[ft-launcher]"))


def test_two_launchers_a_counter_added_to_by_another_user_misses_no_node(workdir: Path) -> None:
    """Issue 24 item 4: another user's `add` of 100 to ft_launcher/roll_call_count (the counter
    the incident came from) made the other node poll the wrong incident: its ranks were missing
    from diagnosis.json. Issue 38: the bell and the hang board's counter `set` to "x" made torch's
    store server close each launcher's only rendezvous connection at its next poll (both exited 2
    within 1.5 s, the hang was never handled), and indexes grown to megabytes were read and split
    whole every second. The ranks train only once the forger is done (--wait-for)."""
    port = free_port()
    common = ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", "ft-roll-call-forged")
    train = ("--hang", "rank=3,step=12,attempt=0", "--wait-for", str(workdir / "forged"))
    a, b = (Launcher(workdir, "--max-restarts", "1", *FR, train_args=train, name=name, launcher_flags=common,
                     env=JOB_SECRET) for name in ("node0", "node1"))
    try:
        wait_until(lambda: listening(port), 60, "the rendezvous store")
        forged = "torch.rendezvous.ft-roll-call-forged.{}/{}"
        forge(port, [op for r in range(2) for op in (
            ["add", forged.format(r, "ft_launcher/roll_call_count"), 100],
            *(["set", forged.format(r, key), "x"] for key in (BELL_KEY, HANG_COUNT_KEY)),
            *(["fill", forged.format(r, key), 4 << 20] for key in (ASKERS_KEY, HANG_INDEX_KEY)))])
        (workdir / "forged").touch()
        assert a.wait() == exit_codes.SUCCESS, a.output()
        assert b.wait() == exit_codes.SUCCESS, b.output()
    finally:
        a.kill()
        b.kill()
    (row,) = a.summary()["diagnoses"] + b.summary()["diagnoses"]
    doc = json.loads(Path(row["diagnosis"]).read_text())
    _check_document(doc, 4)  # every rank of both nodes answered, none missing
    assert len(doc["roll_call"]["nodes_answered"]) == 2 and doc["verdict"]["behind"] == [3]
    both = a.output() + b.output()
    assert "roll call 1 from" in both
    assert "could have written" in both and "does not hold a number" in both  # the grown index and the spoiled bell


def _launcher(workdir: Path, *args: str, scenario: str) -> tuple[Any, Path, Path]:
    out = workdir / "out"
    summary = workdir / "summary.json"
    argv = launcher_argv("--standalone", "--monitor-interval", "0.05",
                         "--log-dir", str(workdir / "logs"), "--ft-summary-json", str(summary),
                         "--ft-termination-grace-time", "1", *args, str(ROOT / "tests/workers/rank.py"), scenario,
                         "--steps", "2", "--until-file", str(workdir / "go"))
    with open(out, "w") as f:
        proc = zygote.popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                            env={**os.environ, "FT_TEST_MARKER": workdir.name})
    return proc, out, summary


def test_a_rank_that_died_and_a_monitor_that_never_answers_do_not_delay_the_kill(workdir: Path) -> None:
    proc, out, summary = _launcher(workdir, "--nproc-per-node", "3", "--max-restarts", "0",
                                   "--ft-rank-section-timeouts", "step:0.5", "--ft-roll-call-timeout", "1.5",
                                   "--ft-stack-dump-timeout", "1", scenario="roll-call")
    stopped: list[int] = []
    try:
        wait_until(lambda: "rank 1 leaves" in out.read_text() and "rank 2 idles" in out.read_text(), 120,
                   "the workers")
        monitor2 = [p for p in job_processes(workdir.name) if b"monitor2.json" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(monitor2) == 1
        os.kill(monitor2[0], signal.SIGSTOP)  # rank 2's monitor will not answer
        stopped = monitor2
        (workdir / "go").touch()  # rank 0 hangs now
        wait_until(lambda: "verdict:" in out.read_text(), 60, "the verdict")
        os.kill(monitor2[0], signal.SIGCONT)
        stopped = []
        assert proc.wait(120) == exit_codes.WORKERS_FAILED, out.read_text()
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    _, doc = _diagnosis(json.loads(summary.read_text()))
    by_rank = {r["rank"]: r for r in doc["ranks"]}
    assert by_rank[0]["status"] == "answered" and "hang_in_sleep" in by_rank[0]["stack"]
    assert by_rank[1]["status"] == "not running"  # it had left before the roll call
    assert by_rank[2]["status"] == "no answer" and "did not answer" in by_rank[2]["notes"][0]
    assert not doc["roll_call"]["flight_recorder"] and "Flight Recorder off" in by_rank[0]["flight_recorder_note"]
    assert doc["verdict"]["behind"] == [0] and doc["verdict"]["line"].startswith("rank 0 hung: section 'step'")
    assert doc["roll_call"]["duration_s"] < 1.5 + 2.0  # the bound, not the silent monitor, decides


def test_dump_only_mode_diagnoses_and_the_job_runs_on(workdir: Path) -> None:
    proc, out, summary = _launcher(workdir, "--nproc-per-node", "2", "--max-restarts", "2", "--ft-on-hang", "dump",
                                   "--ft-rank-section-timeouts", "step:0.5", scenario="stall")
    try:
        assert proc.wait(120) == exit_codes.SUCCESS, out.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    data = json.loads(summary.read_text())
    row, doc = _diagnosis(data)
    assert row["action"] == "dump" and row["rank"] == 0 and doc["verdict"]["behind"] == [0]
    assert data["hangs"] == [] and len(data["attempts"]) == 1  # nothing stopped, nothing restarted
    text = out.read_text()
    assert text.count("finished") == 2
    lines = launcher_summary(text)
    assert ("diagnosed", "rank 0 in attempt 0, left running (on_hang: dump)") in lines
    assert ("verdict", doc["verdict"]["line"]) in lines and ("diagnosis", row["diagnosis"]) in lines
