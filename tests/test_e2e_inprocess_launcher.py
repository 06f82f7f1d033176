"""End-to-end: in-process restart under real ft-launcher processes, examples/train_ddp.py
--inprocess (DDP on gloo, its training function under ft_client.inprocess.Wrapper) with
``--ft-on-hang inprocess``; the process restart is the fallback."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ft_monitor.launcher import exit_codes
from ft_monitor.launcher.telemetry.events import read_events
from tests.launchers import Launcher, two_nodes
from tests.procs import launcher_summary

pytestmark = pytest.mark.e2e

INPROCESS = ("--ft-on-hang", "inprocess", "--ft-inprocess-restart-timeout", "5")


def _final_losses(out: str) -> dict[int, str]:
    return {int(r): loss for r, loss in re.findall(r"\[rank (\d+)\] attempt \d+ iteration \d+: finished 30 steps, "
                                                    r"loss (\S+)", out)}


def _attempt_pids(summary: dict) -> list[dict[int, int]]:
    return [{int(r): p for r, p in a["pids"].items()} for a in summary["attempts"]]


@pytest.mark.compat
def test_a_hang_restarts_in_the_same_processes_and_training_goes_on_from_the_restored_state(workdir: Path) -> None:
    hung = Launcher(workdir, "--max-restarts", "2", *INPROCESS, "--ft-metrics-textfile", str(workdir / "ft.prom"),
                    name="hung",
                    train_args=("--inprocess", "--hang", "rank=1,step=12,attempt=0", "--ckpt-dir",
                                str(workdir / "ckpt-hung")))
    clean = Launcher(workdir, "--max-restarts", "0", name="clean",
                     train_args=("--inprocess", "--ckpt-dir", str(workdir / "ckpt-clean")))
    try:
        assert hung.wait() == exit_codes.SUCCESS, hung.output()
        assert clean.wait() == exit_codes.SUCCESS, clean.output()
    finally:
        hung.kill()
        clean.kill()
    # a clean run ends with its summary too, as every run does (issue 42: it printed none)
    assert ("exit code", "0") in launcher_summary(clean.output()), clean.output()
    out, summary = hung.output(), hung.summary()
    # the same processes: one attempt, no process restart used, no hang handled by killing
    (pids,) = _attempt_pids(summary)
    assert summary["restarts"] == [] and summary["hangs"] == [] and summary["exit_code"] == 0
    for rank, pid in pids.items():
        assert f"[rank {rank}] attempt 0 iteration 1: resumed at step 10 (pid {pid}, from memory)" in out
        assert f"[rank {rank}] attempt 0 iteration 1: finished 30 steps" in out
    (row,) = summary["inprocess_restarts"]
    assert (row["kind"], row["rank"], row["iteration"], row["reason"]) == ("inprocess", 1, 1, "section")
    assert row["pid"] == pids[1] and row["ranks_back"] == [0, 1]
    phases = row["phases"]
    assert phases["total"] is not None and set(phases) == {"notify", "abort", "interrupt", "finalize", "barrier",
                                                           "reinit", "first_step", "total"}
    assert phases["total"] == pytest.approx(sum(v for k, v in phases.items() if k != "total"), abs=1e-9)
    assert "all ranks back in their step loop" in out  # the launcher's line when it happened, and the summary's:
    assert any(k == "restart" and v.startswith("in-process restart 1 (same processes), all ranks back in their step "
                                                "loop ") for k, v in launcher_summary(out))
    # what the cluster's tools see: an in-process restart, with the same phases
    assert 'ft_restarts_total{kind="inprocess"} 1.0' in (workdir / "ft.prom").read_text()
    (event,) = [e for e in read_events(Path(summary["observability"]["events"])) if e["kind"] == "restart"]
    assert event["mode"] == "inprocess" and event["cause"] == "hang" and event["phases"] == phases
    # where it hung: the monitor dumped the stack before it pushed ABORT
    assert "write_metrics_to_stuck_filesystem" in Path(row["report"]).with_name(
        f"rank1-pid{pids[1]}-stack.txt").read_text()
    # loss continuity: steps 10 and 11 were redone from the state of step 10, so the run ends
    # exactly where the run without a fault does
    assert _final_losses(out) == _final_losses(clean.output()) and len(_final_losses(out)) == 2


def test_an_inprocess_hang_reported_first_by_a_waiting_rank_names_the_rank_outside_every_collective(
        workdir: Path) -> None:
    # rank 1 hangs between steps, outside every section; rank 0 waits for it in its next step's
    # all-reduce and its learned step timeout fires first. Before: the fault record, the row, the
    # launcher's line and the hang event named rank 0 (and one incident printed two "hung" lines)
    la = Launcher(workdir, "--max-restarts", "1", *INPROCESS,
                  train_args=("--inprocess", "--hang", "rank=1,step=12,attempt=0", "--hang-where", "between"))
    try:
        assert la.wait() == exit_codes.SUCCESS, la.output()
    finally:
        la.kill()
    out, summary = la.output(), la.summary()
    (pids,) = _attempt_pids(summary)
    (row,) = summary["inprocess_restarts"]
    assert row["rank"] == 1 and "rank 1 was outside every collective" in row["message"], row
    assert "rank 0" in row["message"]  # who reported first stays in the message
    hung_lines = [line for line in out.splitlines() if line.startswith("[ft-launcher]") and " hung: " in line]
    assert len(hung_lines) == 1 and "ft-launcher: rank 1 hung: rank 1 was outside" in hung_lines[0], hung_lines
    events = read_events(Path(summary["observability"]["events"]))
    assert [e["rank"] for e in events if e["kind"] == "hang"] == [1]
    assert [e["rank"] for e in events if e["kind"] == "restart"] == [1]
    assert [i["rank"] for i in summary["observability"]["incidents"]] == [1]
    for rank in (0, 1):
        assert f"[rank {rank}] attempt 0 iteration 1: finished 30 steps" in out
    # and every output as right as when the hung rank's own monitor fires first (issue 42): the summary showed
    # "pid None", the page "the job was not restarted" and "No stack was taken", the incident no recovery
    assert row["pid"] == pids[1] and row["reported_by"]["rank"] == 0, row
    rows = launcher_summary(out)
    assert ("fault", f"rank 1 (pid {pids[1]}) in attempt 0: {row['message']}") in rows, rows
    assert any(k == "reported by" and v.startswith("rank 0's monitor, whose rank waited for it") for k, v in rows)
    from ft_monitor.views.report_html import headline
    from ft_monitor.views.report_input import load
    from ft_monitor.views.report_model import build

    data = load([Path(summary["observability"]["events"]).parent])
    (incident,) = build(data.events, data.diagnoses, data.stacks).incidents
    assert incident.restart is not None and incident.restart.mode == "inprocess" and incident.lost_s, incident
    assert incident.waiting == (0,) and [t.rank for t in incident.waiting_stacks] == [0], incident
    assert "the ranks restarted the training function in their own processes" in headline(build(data.events))


@pytest.mark.parametrize("mode", ["gil", "swallow"])
def test_a_rank_that_cannot_be_interrupted_falls_back_to_the_process_restart(workdir: Path, mode: str) -> None:
    """Holding the GIL, the hung rank cannot take the ABORT; swallowing the interrupt, it
    never leaves its function. Either way its monitor stops it inprocess_restart_timeout
    after the verdict, and ft-launcher restarts the whole group in new processes."""
    la = Launcher(workdir, "--max-restarts", "2", *INPROCESS,
                  train_args=("--inprocess", "--hang", "rank=1,step=12,attempt=0", "--hang-mode", mode))
    try:
        assert la.wait() == exit_codes.SUCCESS, la.output()
    finally:
        la.kill()
    out, summary = la.output(), la.summary()
    first, second = _attempt_pids(summary)
    assert set(first.values()).isdisjoint(second.values())
    (hang,) = [h for h in summary["hangs"] if h["rank"] == 1]
    assert hang["reason"] == "inprocess_restart" and hang["timeout_s"] == 5.0
    assert "not back in the training function" in hang["message"]
    assert hang["stack_dump_captured"] and "write_metrics_to_stuck_filesystem" in Path(hang["stack_dump"]).read_text()
    assert len(summary["restarts"]) == 1
    assert "[rank 1] attempt 1 iteration 0: resumed at step 10" in out and "attempt 1 iteration 0: finished 30" in out


def test_a_rank_killed_mid_run_restarts_the_group(workdir: Path) -> None:
    la = Launcher(workdir, "--max-restarts", "2", *INPROCESS,
                  train_args=("--inprocess", "--die", "rank=1,step=7,attempt=0"))
    try:
        assert la.wait() == exit_codes.SUCCESS, la.output()
    finally:
        la.kill()
    out, summary = la.output(), la.summary()
    assert len(_attempt_pids(summary)) == 2  # a dead process: the process restart, not a barrier wait forever
    (restart,) = summary["restarts"]
    assert (restart["cause"], restart["rank"]) == ("failure", 1) and "killed by SIGKILL" in restart["message"]
    assert "[rank 1] attempt 1 iteration 0: resumed at step 5" in out
    assert "[rank 0] attempt 1 iteration 0: finished 30 steps" in out


def test_two_launchers_restart_in_process_together(workdir: Path) -> None:
    a, b = two_nodes(workdir, "ft-two-nodes-inprocess", "--max-restarts", "2", *INPROCESS,
                     train_args=("--inprocess", "--hang", "rank=3,step=12,attempt=0"))
    for la in (a, b):
        summary = la.summary()
        assert len(summary["attempts"]) == 1 and summary["restarts"] == [], la.output()
        (row,) = summary["inprocess_restarts"]
        assert row["iteration"] == 1 and row["rank"] == 3 and row["phases"]["total"] is not None
    both = a.output() + b.output()
    for rank in range(4):
        assert f"[rank {rank}] attempt 0 iteration 1: finished 30 steps" in both
