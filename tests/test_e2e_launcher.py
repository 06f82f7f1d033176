"""End-to-end: real ft-launcher processes running examples/train_ddp.py (DDP on gloo)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ft_monitor.launcher import exit_codes
from tests import other_user, zygote
from tests.launchers import JOB_SECRET, Launcher, launcher_argv, listening, two_nodes
from tests.procs import ROOT, free_port, launcher_summary, slack, wait_until

pytestmark = pytest.mark.e2e

@pytest.mark.compat
def test_hung_rank_is_caught_dumped_and_the_job_resumes_from_its_checkpoint(workdir: Path,
                                                                           progress: tuple[str, ...]) -> None:
    # the shared-memory record's run as a user runs it by default (every worker a new interpreter);
    # the socket's with --ft-warm-start (every attempt's workers forked from the template), started in
    # workdir with a relative --log-dir and --ft-summary-json (`_check_a_relative_log_dir_kept_the_evidence`)
    warm = bool(progress)
    la = Launcher(workdir, "--max-restarts", "2", *progress, train_args=("--hang", "rank=1,step=12,attempt=0"),
                  warm=warm, relative=warm)
    try:
        assert la.wait() == exit_codes.SUCCESS, la.output()
    finally:
        la.kill()
    out = la.output()
    assert "[rank 1] attempt 1: resumed at step 10" in out
    assert "[rank 0] attempt 1: finished 30 steps" in out
    summary = la.summary()
    (hang,) = summary["hangs"]
    assert hang["rank"] == 1 and hang["attempt"] == 0 and hang["section"] == "step"
    assert hang["stack_dump_captured"]
    # the learned step timeout (from the checkpoints) is what caught it, not the 60 s in ft.yaml
    assert hang["timeout_s"] < 60
    assert "write_metrics_to_stuck_filesystem" in Path(hang["stack_dump"]).read_text()
    # torchrun's attempt layout, with the hang report, the dump and the monitor's log beside error.json
    attempt_dir = Path(hang["error_file"]).parent
    assert attempt_dir.name == "1" and attempt_dir.parent.name == "attempt_0"
    names = {p.name for p in attempt_dir.iterdir()}
    assert {"error.json", "monitor.log", Path(hang["stack_dump"]).name, Path(hang["report"]).name} <= names
    error = json.loads(Path(hang["error_file"]).read_text())
    assert int(error["message"]["extraInfo"]["timestamp"]) == int(hang["onset_time"])
    assert "RankHang: section 'step' open for" in error["message"]["message"]
    (restart,) = summary["restarts"]
    assert restart["total"] is not None
    assert restart["message"] and restart["message"] == (hang.get("verdict") or hang["message"])  # it was ""
    assert [a["started"] for a in summary["attempts"]] == (["forked", "forked"] if warm else ["exec", "exec"])
    if warm:  # attempt 0 too (--ft-warm-start), each from the launcher's one template
        assert "attempt 0: 2 worker(s) forked from the worker template" in out, out
        assert sorted(summary["warm_restarts"]["forked"]) == ["0", "1"] and not summary["warm_restarts"]["fallbacks"]
    lines = launcher_summary(out)  # printed once, aligned
    assert ("error file", hang["error_file"]) in lines and ("exit code", "0") in lines
    assert any(k == "restart" and v.startswith("all ranks running again ") for k, v in lines), lines
    if warm:
        _check_a_relative_log_dir_kept_the_evidence(la, workdir)


def _paths(value: object) -> list[str]:
    """Every absolute path among the strings of a JSON value."""
    if isinstance(value, dict):
        return [p for v in value.values() for p in _paths(v)]
    if isinstance(value, list):
        return [p for v in value for p in _paths(v)]
    return [value] if isinstance(value, str) and value.startswith("/") and "\n" not in value else []


def _check_a_relative_log_dir_kept_the_evidence(la: Launcher, workdir: Path) -> None:
    """A launcher started in ``workdir`` with a relative --log-dir, whose hang was restarted
    (test_hung_rank_is_caught...[socket]'s run): every piece of evidence is where the outputs say."""
    # before: the monitors resolved the relative --log-dir elsewhere and sent the stack dumps and
    # hang reports to the launcher's private folder, deleted at exit; the summary pointed there
    summary = la.summary()
    (hang,) = summary["hangs"]
    error = json.loads(Path(hang["error_file"]).read_text())
    events = [json.loads(line) for line in Path(summary["observability"]["events"]).read_text().splitlines()]
    paths = _paths(summary) + _paths(error) + _paths(events)
    evidence = [hang["stack_dump"], hang["report"], hang["error_file"], hang["diagnosis"]]
    assert all(p in paths for p in evidence), (evidence, paths)
    for p in paths:
        if p.startswith(str(workdir)) or "/ft-launcher-" in p:
            assert Path(p).exists(), f"{p} is named in an output but does not exist after the launcher exited"
    for p in evidence:
        assert Path(p).is_relative_to(la.log_dir), p


def test_the_rank_behind_is_named_everywhere_when_a_waiting_ranks_monitor_fires_first(workdir: Path) -> None:
    # rank 1 hangs between steps, outside every section; rank 0 waits for it in its next step's
    # all-reduce, so rank 0's learned step timeout always fires first. Before: the launcher's
    # "hung" line, error.json, the summary, the events and the metrics named rank 0, while
    # the verdict line said rank 1
    la = Launcher(workdir, "--max-restarts", "1",
                  train_args=("--hang", "rank=1,step=12,attempt=0", "--hang-where", "between"))
    try:
        assert la.wait() == exit_codes.SUCCESS, la.output()
    finally:
        la.kill()
    out, summary = la.output(), la.summary()
    hung_lines = [line for line in out.splitlines() if ") hung: " in line and "ft-launcher: rank" in line]
    assert len(hung_lines) == 1 and "ft-launcher: rank 1 (local rank 1, pid" in hung_lines[0], hung_lines
    assert "rank 0's monitor reported first" in hung_lines[0]
    (hang,) = summary["hangs"]
    assert hang["rank"] == 1 and hang["local_rank"] == 1 and hang["victim_of"] is None
    assert hang["reported_by"]["rank"] == 0 and hang["pid"] == summary["attempts"][0]["pids"]["1"]
    assert "write_metrics_to_stuck_filesystem" in Path(hang["stack_dump"]).read_text()
    assert Path(hang["error_file"]).parent.name == "1"
    error = json.loads(Path(hang["error_file"]).read_text())["message"]
    assert error["message"].startswith("RankHang: rank 1 is not in a collective") and "(rank 1, pid" in error["message"]
    assert "write_metrics_to_stuck_filesystem" in error["extraInfo"]["py_callstack"]
    assert [d["rank"] for d in summary["diagnoses"]] == [1]
    assert [i["rank"] for i in summary["observability"]["incidents"]] == [1]
    events = [json.loads(line) for line in Path(summary["observability"]["events"]).read_text().splitlines()]
    named = {e["kind"]: e.get("rank") for e in events if e["kind"] in ("hang", "diagnosis", "restart")}
    assert named == {"hang": 1, "diagnosis": 1, "restart": 1}, named
    lines = launcher_summary(out)
    assert ("hung rank", f"rank 1 (local rank 1, pid {hang['pid']}) in attempt 0") in lines
    assert any(k == "reported by" and v.startswith("rank 0's monitor, whose rank waited for it: ") for k, v in lines)


def test_restart_budget_exhausted_reports_the_hung_rank_as_root_cause(workdir: Path) -> None:
    # without --ft-summary-json, as a new user runs it: the summary is written all the same, beside
    # the run's events.jsonl, and its path is printed
    la = Launcher(workdir, "--max-restarts", "0", train_args=("--hang", "rank=1,step=12,attempt=0"),
                  summary_flag=False)
    try:
        assert la.wait() == exit_codes.WORKERS_FAILED, la.output()
    finally:
        la.kill()
    out = la.output()
    root = out.split("Root Cause (first observed failure):", 1)[1]
    assert "rank      : 1" in root.split("\n\n")[0] or "rank      : 1 " in root
    assert "RankHang: section 'step' open for" in root
    assert "write_metrics_to_stuck_filesystem" in root
    summary = la.summary()
    assert la.summary_path.name == "summary.json" and la.log_dir in la.summary_path.parents
    assert la.summary_path.parent == Path(summary["observability"]["events"]).parent
    assert summary["exit_code"] == exit_codes.WORKERS_FAILED and summary["hangs"][0]["rank"] == 1


@pytest.mark.compat
def test_crashed_rank_restarts_the_job(workdir: Path) -> None:
    # a crash is torch's usual path: the attempt fails, the group restarts from the checkpoint;
    # every worker a new interpreter, as by default. The entry point is a module (`-m`) under
    # --ft-warm-restart, which the worker template cannot run: the restart starts the workers as
    # usual (new interpreters), with one line saying why (the same run checks both; it was also
    # test_warm_restart_e2e.py's own cold run)
    la = Launcher(workdir, "--max-restarts", "1", "--ft-warm-restart", "-m", entry=("examples.train_ddp",),
                  train_args=("--crash", "rank=0,step=7,attempt=0"), warm=False)
    try:
        assert la.wait() == exit_codes.SUCCESS, la.output()
    finally:
        la.kill()
    out = la.output()
    assert "[rank 0] attempt 1: resumed at step 5" in out
    assert "[rank 1] attempt 1: finished 30 steps" in out
    # the template cannot run `-m module`: both attempts new interpreters, and one line says why
    assert [a["started"] for a in la.summary()["attempts"]] == ["exec", "exec"], out
    warm_lines = [line for line in out.splitlines() if "warm restart:" in line]
    assert len(warm_lines) == 1 and "-m" in warm_lines[0] and "starting the workers as usual" in warm_lines[0], \
        warm_lines
    # before: the restart was in events.jsonl only, not in the summary or summary.json
    (restart,) = la.summary()["restarts"]
    assert (restart["cause"], restart["rank"], restart["attempt"]) == ("failure", 0, 0), restart
    # rank 0 raised its own error first; rank 1, whose all-reduce then failed, is its victim (it raised a gloo
    # error, or was stopped by torch) or, where it died of its own teardown (SIGABRT) after rank 0 raised,
    # listed after it
    assert restart["how"].startswith("rank 0 (pid") and restart["total"] is not None, restart
    assert "raised RuntimeError: rank 0 crashed at step 7 (on purpose)" in restart["how"], restart
    assert restart["victims"] + restart["others"] == [1], restart
    assert ("failed", f"{restart['how']} in attempt 0, the root of the failure; the worker group restarted") \
        in launcher_summary(out)
    # the exception's story, in a plain script without @record: its own error.json, named by the summary
    error = json.loads(Path(restart["error_file"]).read_text())["message"]
    assert error["message"] == "RuntimeError: rank 0 crashed at step 7 (on purpose)", error
    assert error["extraInfo"]["py_callstack"].startswith("Traceback (most recent call last):")
    assert 'raise RuntimeError(f"rank {rank} crashed at step {step} (on purpose)")' in error["extraInfo"]["py_callstack"]
    assert ("error file", restart["error_file"]) in launcher_summary(out)


@pytest.mark.compat
def test_a_rank_killed_with_sigkill_is_named_in_every_output_and_its_peer_as_its_victim(workdir: Path) -> None:
    # the review's case: rank 1 SIGKILLs itself (as the OOM killer would); rank 0's all-reduce fails, it raises
    # first and its monitor hears it; every output named rank 0. Now: rank 1, decided once (crash.py)
    from ft_monitor.views.report_html import headline
    from ft_monitor.views.report_input import load
    from ft_monitor.views.report_model import build

    prom = workdir / "ft.prom"
    la = Launcher(workdir, "--max-restarts", "1", "--ft-metrics-textfile", str(prom),
                  train_args=("--die", "rank=1,step=7,attempt=0"))
    summary = la.succeed()
    out = la.output()
    pid = summary["attempts"][0]["pids"]["1"]
    killed = f"rank 1 (pid {pid}) was killed by SIGKILL"
    (restart,) = summary["restarts"]
    assert (restart["cause"], restart["rank"], restart["attempt"], restart["how"], restart["victims"],
            restart["root_seen"]) == ("failure", 1, 0, killed, [0], True), restart
    assert f"ft-launcher: attempt 0 failed: {killed}; failed because of it: rank 0 (pid" in out
    assert "all ranks running again" in out and "after rank 1's failure was detected" in out
    rows = launcher_summary(out)
    assert ("failed", f"{killed} in attempt 0, the root of the failure; the worker group restarted") in rows
    assert any(k == "because of it" and v.startswith("rank 0 (pid") for k, v in rows), rows
    (run,) = la.log_dir.iterdir()
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    (end,) = [e for e in events if e["kind"] == "attempt_end" and e["attempt"] == 0]
    assert (end["root"], end["victims"], end["how"]) == (1, [0], killed), end
    assert [e["rank"] for e in events if e["kind"] == "restart"] == [1]
    # torch's failure table and a parent launcher's error.json take the root's error file, which it never wrote
    error = json.loads((run / "attempt_0" / "1" / "error.json").read_text())["message"]["message"]
    assert error == f"RankCrash: {killed}; rank(s) 0 failed because of it", error
    assert 'ft_failed_ranks_total{rank="1",role="root"} 1.0' in prom.read_text()
    assert 'ft_failed_ranks_total{rank="0",role="victim"} 1.0' in prom.read_text()
    data = load([run])
    (incident,) = build(data.events).incidents
    assert (incident.kind, incident.rank, incident.pid) == ("failure", 1, pid), incident
    assert incident.what.startswith("was killed by SIGKILL; failed because of it: rank 0 (pid"), incident.what
    assert headline(build(data.events)).startswith("Rank 1 was killed by SIGKILL"), headline(build(data.events))


def _root_on_both_nodes(workdir: Path, rdzv_id: str, fault: str, rank: int,
                        how: str) -> tuple[Launcher, Launcher, dict[str, Any], dict[str, Any], str]:
    """Two launchers, ``fault`` (a train_ddp.py flag) at ``rank``: both name it as the root in their
    restart rows and events, its own node (the first returned) with ``how`` (``{pid}`` filled in)."""
    a, b = two_nodes(workdir, rdzv_id, "--max-restarts", "1", train_args=(fault, f"rank={rank},step=7,attempt=0"))
    if str(rank) not in a.summary()["attempts"][0]["pids"]:  # the rendezvous gave the rank to the other launcher
        a, b = b, a
    root = how.format(pid=a.summary()["attempts"][0]["pids"][str(rank)])
    (mine,) = a.summary()["restarts"]
    assert (mine["cause"], mine["rank"], mine["attempt"], mine["root_host"]) == ("failure", rank, 0, None), mine
    assert mine["how"].startswith(root), mine
    (theirs,) = b.summary()["restarts"]
    assert (theirs["cause"], theirs["rank"], theirs["attempt"]) == ("failure", rank, 0), theirs
    assert theirs["how"].startswith(f"{root}") and theirs["how"].endswith(" (another node)"), theirs
    for node in (a, b):  # the events (and the page made from them) too, whichever way torch restarted it
        events = [json.loads(line) for line in Path(node.summary()["observability"]["events"]).read_text().splitlines()]
        assert [e.get("root") for e in events if e["kind"] == "attempt_end" and e["state"] != "SUCCEEDED"] == [rank]
        assert [e["rank"] for e in events if e["kind"] == "restart"] == [rank]
    return a, b, mine, theirs, root


@pytest.mark.compat
def test_two_launchers_a_rank_killed_with_sigkill_is_named_on_both_nodes(workdir: Path) -> None:
    # the review's case: the killed rank's own node named it, the other node's summary had no restart row
    # at all, though its ranks were restarted too (by torch's membership change, or after their own
    # collectives failed). Now the other node takes the root from the killed rank's node's crash record
    a, b, mine, theirs, killed = _root_on_both_nodes(workdir, "crash-two", "--die", 1,
                                                     "rank 1 (pid {pid}) was killed by SIGKILL")
    assert mine["how"] == killed and theirs["how"].startswith(f"{killed} on "), (mine, theirs)
    assert set(theirs["victims"]) <= {2, 3}, theirs
    assert f"{killed} on " in b.output() and "rank 0 (pid" not in theirs["how"]
    assert any(k == "failed" and v.startswith(f"{killed} on ") for k, v in launcher_summary(b.output()))


@pytest.mark.compat
def test_two_launchers_a_rank_that_raised_is_named_on_both_nodes(workdir: Path) -> None:
    # the commonest real failure with two launchers: rank 2 raises; its peers' gloo errors come within
    # milliseconds, on both nodes. Every node names rank 2 (its own node from its error file, the other
    # from its crash record), the restart resumes from the checkpoint
    a, b, _, _, raised = _root_on_both_nodes(workdir, "raise-two", "--crash", 2, "rank 2 (pid {pid}) raised "
                                             "RuntimeError: rank 2 crashed at step 7 (on purpose)")
    both = a.output() + b.output()
    assert "resumed at step 5" in both and "finished 30 steps" in both
    for node in (a, b):
        assert any(k == "failed" and v.startswith(raised) for k, v in launcher_summary(node.output())), node.output()


@pytest.mark.parametrize("warm", [False, True], ids=["new interpreters", "forked"])
def test_the_job_secret_reaches_no_worker_and_fr_dumps_stay_private(workdir: Path, warm: bool) -> None:
    # issue 38: with FT_JOB_SECRET in the launcher's environment, every cold worker had it in os.environ and
    # /proc/self/environ (torch builds a worker's environment from a copy of the launcher's), and every
    # warm-forked one from the template's environment; the test checked torch's per-worker dict, not a worker
    secret = JOB_SECRET["FT_JOB_SECRET"]
    la = Launcher(workdir, "--max-restarts", "0", env=JOB_SECRET, warm=warm, cold_launcher=True,  # as a user
                  entry=(str(ROOT / "tests" / "workers" / "env_probe.py"),), train_args=(secret,))  # starts it
    la.succeed()
    # two workers print at once: their lines can run together
    probes = sorted(re.findall(r"probe rank (\d): environ=(\w+) file_env=(\w+) block=(\w+) key=(\w+)", la.output()))
    assert probes == [(r, "False", "False", "False", "True") for r in ("0", "1")], la.output()
    # and torch's Flight Recorder dumps go to the worker's private attempt directory, not to /tmp/nccl_trace_rank_N
    places = sorted(re.findall(r"probe rank (\d): fr_beside_error_file=(\w+) fr_old_name=(\w+)", la.output()))
    assert places == [(r, "True", "True") for r in ("0", "1")], la.output()


def test_no_progress_stops_restarting_early(workdir: Path) -> None:
    la = Launcher(workdir, "--max-restarts", "6", "--ft-max-no-progress-cycles", "2",
                  train_args=("--hang", "rank=1,step=12,attempt=-1"))
    try:
        assert la.wait() == exit_codes.NO_PROGRESS, la.output()
    finally:
        la.kill()
    summary = la.summary()
    assert len(summary["hangs"]) == 3  # attempt 0 progressed to 12; attempts 1 and 2 did not
    assert "did not advance past" in summary["outcome"]


def test_workload_shutdown_request_stops_without_restart(workdir: Path) -> None:
    la = Launcher(workdir, "--max-restarts", "3", train_args=("--control", "3:ShutdownWorkload"))
    try:
        assert la.wait() == exit_codes.SHUTDOWN_REQUESTED, la.output()
    finally:
        la.kill()
    out = la.output()
    assert "requests ShutdownWorkload" in out
    assert "attempt 1" not in out


def test_exclude_this_node_stops_this_node_with_its_own_exit_code(workdir: Path) -> None:
    la = Launcher(workdir, "--max-restarts", "3", train_args=("--control", "3:ExcludeThisNode"))
    try:
        assert la.wait() == exit_codes.NODE_EXCLUDED, la.output()
    finally:
        la.kill()
    out = la.output()
    assert "requests ExcludeThisNode" in out and "attempt 1" not in out
    assert "asked to exclude this node" in la.summary()["outcome"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_launcher_sigterm_or_sigint_leaves_no_process_of_the_job(workdir: Path, sig: signal.Signals) -> None:
    la = Launcher(workdir, "--max-restarts", "3", train_args=("--steps", "100000"))
    try:
        wait_until(lambda: "timeouts in force" in la.output(), 120, "workers to start")
        assert len(la.processes()) >= 5  # launcher, 2 monitors, 2 workers
        la.proc.send_signal(sig)
        rc = la.wait(120)
        assert rc == 128 + sig, la.output()
        left = la.processes()
        assert left == [], f"processes of the job still alive: {left}"
    finally:
        la.kill()


def test_a_monitor_killed_mid_run_is_restarted(workdir: Path) -> None:
    la = Launcher(workdir, "--max-restarts", "1", train_args=("--steps", "80"))
    try:
        wait_until(lambda: "timeouts in force" in la.output(), 120, "workers to start")
        monitors = [p for p in la.processes()
                    if b"monitor0.json" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(monitors) == 1
        os.kill(monitors[0], signal.SIGKILL)
        assert la.wait() == exit_codes.SUCCESS, la.output()
    finally:
        la.kill()
    out = la.output()
    assert "monitor for local rank 0" in out and "restarting it" in out
    assert la.summary()["monitor_restarts"] == 1


@pytest.mark.compat
def test_two_nodes_hang_on_one_restarts_both_and_completes(workdir: Path) -> None:
    # node 1's workers new interpreters (as by default), node 0's forked from its template; with the
    # Flight Recorder on, the same run is also the two-launcher roll call's (one diagnosis holds every rank's
    # stack, taken by the hung rank's node, the other node answering through the store: it was
    # test_e2e_diagnosis.py's test_two_launchers_one_diagnosis_holds_every_ranks_stack, the same scenario)
    a, b = two_nodes(workdir, "ft-two-nodes", "--max-restarts", "2", "--ft-flight-recorder-entries", "2000",
                     train_args=("--hang", "rank=3,step=12,attempt=0"), warm=(True, False))
    hangs = a.summary()["hangs"] + b.summary()["hangs"]
    # rank 3 hung; a rank on the other node waiting for it in the step's collective may
    # time out too, and is then reported as its victim, not as a second hang
    assert [h["rank"] for h in hangs if h["victim_of"] is None] == [3]
    assert {h["rank"] for h in hangs} == {3}  # a victim's row names the culprit too, its waiting rank beside it
    assert all(h["victim_of"] == 3 and h["waiting"]["rank"] != 3 for h in hangs if h["victim_of"] is not None)
    both = a.output() + b.output()
    assert "finished 30 steps" in both and "resumed at step 10" in both
    rows = a.summary()["diagnoses"] + b.summary()["diagnoses"]
    (row,) = rows  # one roll call, by the node of the rank that hung first
    doc = json.loads(Path(row["diagnosis"]).read_text())
    assert doc["schema"] == "ft-monitor/diagnosis" and doc["version"] == 1
    assert [r["rank"] for r in doc["ranks"]] == list(range(4)) and doc["missing_ranks"] == []
    assert all(r["status"] == "answered" and "most recent call first" in r["stack"] for r in doc["ranks"])
    from ft_client import torch_features  # before torch 2.8 gloo's collectives are not recorded

    basis = "flight_recorder" if torch_features.flight_recorder().records_gloo else "stacks"
    assert doc["verdict"]["behind"] == [3] and doc["verdict"]["basis"] == basis, doc["verdict"]
    assert len(doc["roll_call"]["nodes_answered"]) == 2
    assert "roll call 1 from" in both  # the other node answered through the store


def test_forged_store_messages_are_ignored_and_the_job_completes(workdir: Path) -> None:
    # before: any process reaching the rendezvous port ended the job (exit 4, "do not
    # requeue") with a plain shutdown value, and a malformed hang record made both
    # launchers exit 2 at the next real hang (also, with a job secret, a non-ASCII mac or
    # 16 KiB of '[' at round 0's hang keys: TypeError / RecursionError out of decode)
    # The ranks train only once everything is forged (--wait-for), so every read of the store
    # comes after the forger's writes. Node 0's ranks, which wait in the all-reduce for rank 3,
    # get a 30 s floor on their learned timeouts: they never report a hang of their own, so the
    # forged record at node 0's hang key is still there when node 1 reads it (with the same
    # timeouts they could publish first and overwrite it, ~50 ms after rank 3's detection).
    port = free_port()
    common = ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", "ft-forged")
    train = ("--hang", "rank=3,step=12,attempt=0", "--wait-for", str(workdir / "forged"))
    a = Launcher(workdir, "--max-restarts", "2", "--ft-min-learned-timeout", "30", train_args=train, name="node0",
                 launcher_flags=common, env=JOB_SECRET)
    b = Launcher(workdir, "--max-restarts", "2", train_args=train, name="node1", launcher_flags=common, env=JOB_SECRET)
    try:
        wait_until(lambda: listening(port), 60, "the rendezvous store")
        cmd = [sys.executable, str(ROOT / "tests/workers/store_forger.py"), str(port), "ft-forged", "4"]
        if os.geteuid() == 0:  # another local user, as in the review
            cmd = other_user.command(cmd)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FT_JOB_SECRET")}
        forger = subprocess.run(cmd, cwd="/", env=env, capture_output=True, text=True, timeout=60 * slack())
        assert forger.returncode == 0 and forger.stdout.endswith("done\n"), forger.stderr
        (workdir / "forged").touch()  # the ranks wait for it
        assert a.wait() == exit_codes.SUCCESS, a.output()
        assert b.wait() == exit_codes.SUCCESS, b.output()
    finally:
        a.kill()
        b.kill()
    both = a.output() + b.output()
    assert "ignored a shutdown message in the rendezvous store" in both
    assert "ignored a hang message in the rendezvous store" in both
    assert "finished 30 steps" in both and "workload shutdown requested" not in both
    assert [h["rank"] for h in a.summary()["hangs"] + b.summary()["hangs"] if h["victim_of"] is None] == [3]


def test_launcher_sigkill_takes_monitors_and_workers_down(workdir: Path) -> None:
    la = Launcher(workdir, "--max-restarts", "3", train_args=("--steps", "100000"))
    try:
        wait_until(lambda: "timeouts in force" in la.output(), 120, "workers to start")
        assert len(la.processes()) >= 5
        os.kill(la.proc.pid, signal.SIGKILL)  # the launcher alone: no chance to clean up
        la.wait(30)
        wait_until(lambda: la.processes() == [], 30, "monitors and workers to exit")
    finally:
        la.kill()
        for pid in la.processes():
            os.kill(pid, signal.SIGKILL)


def test_excluded_node_leaves_and_the_other_continues(workdir: Path) -> None:
    port = free_port()
    # After B leaves, A's next round waits until torch deems B gone (no keep-alive for
    # keep_alive_interval x keep_alive_max_attempt: 15 s by default), then, with its 1 node (the
    # minimum), for torch's last call (30 s); B joins round 0 within the same window: it starts at once.
    wait = max(5, round(5 * slack()))
    common = ("--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", "ft-exclude", "--rdzv-conf",
              f"last_call_timeout={wait},keep_alive_interval=1,keep_alive_max_attempt={wait}")
    # node A starts first and hosts the rendezvous store (a node hosting it cannot leave)
    a = Launcher(workdir, "--max-restarts", "2", train_args=("--steps", "20"), name="nodeA", launcher_flags=common)
    b = None
    try:
        wait_until(lambda: listening(port), 60, "node A's rendezvous store")
        b = Launcher(workdir, "--max-restarts", "2", train_args=("--steps", "20"), name="nodeB",
                     launcher_flags=common, env={"FT_DEMO_CONTROL": "3:ExcludeThisNode"})
        assert b.wait() == exit_codes.NODE_EXCLUDED, b.output()
        assert a.wait() == exit_codes.SUCCESS, a.output()
    finally:
        a.kill()
        if b is not None:
            b.kill()
    assert "requests ExcludeThisNode" in b.output()
    assert "attempt 1: finished 20 steps" in a.output()


def _proc_counts(pid: int) -> tuple[int, int, int, int]:
    """(open fds, threads, live children, RSS kB) of a process."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(status.split("Threads:")[1].split()[0])
    rss = int(status.split("VmRSS:")[1].split()[0])
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return fds, threads, len(children), rss


def test_twenty_hang_restarts_leak_nothing_in_the_launcher(workdir: Path) -> None:
    # a torch-free rank that hangs in every attempt: 20 fast hang -> restart cycles
    argv = launcher_argv("--standalone", "--nproc-per-node", "2", "--max-restarts", "20", "--monitor-interval", "0.05",
                         "--ft-rank-section-timeouts", "step:0.3", "--ft-max-no-progress-cycles", "0",
                         "--ft-termination-grace-time", "1", "--ft-summary-json", str(workdir / "summary.json"),
                         str(ROOT / "tests/workers/rank.py"), "sleep")
    out = open(workdir / "out", "w")
    proc = zygote.popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    samples: dict[frozenset[int], tuple[int, int, int, int]] = {}
    try:
        while proc.poll() is None:  # sample once per attempt, once its workers are running
            try:
                children = frozenset(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split())
                if len(children) >= 4 and children not in samples:  # 2 monitors + 2 workers
                    samples[children] = _proc_counts(proc.pid)
            except FileNotFoundError:
                break
            try:
                proc.wait(0.05)
            except subprocess.TimeoutExpired:
                pass
        proc.wait(60)
        assert proc.returncode == exit_codes.WORKERS_FAILED
    finally:
        out.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert len(json.loads((workdir / "summary.json").read_text())["hangs"]) == 21
    values = list(samples.values())
    assert len(values) >= 15, values  # most attempts sampled
    (fds0, threads0, kids0, rss0), (fds1, threads1, kids1, rss1) = values[1], values[-1]
    assert fds1 <= fds0 + 2 and threads1 <= threads0 + 1 and kids1 == kids0, values
    assert rss1 - rss0 < 5 * 1024, values  # kB
