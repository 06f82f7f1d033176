"""`ft-monitor report`'s page from events made by hand (issue 29): what it says, what it
draws, what it links, and how several run folders become one page. The same pages from
real runs, opened in Chromium: tests/test_report_browser.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft_monitor.core.settings import Settings
from ft_monitor.launcher.incident.restarts import RestartTiming
from ft_monitor.launcher.telemetry.events import RESTART_PHASES, EventLog, validate_event
from ft_monitor.launcher.telemetry.telemetry import Telemetry
from ft_monitor.views import human
from ft_monitor.views.report_html import ReportError, headline, render, write_report
from ft_monitor.views.report_input import ReportInput, load, parse_diagnosis
from ft_monitor.views.report_model import build
from tests.test_observability import FakeMonitors, _stepped

T = 1_795_000_000.0
STACK_1 = """Current thread 0x0001 (most recent call first):
  File "/x/train.py", line 64 in write_metrics
  File "/x/train.py", line 97 in <module>
"""
STACK_0 = """Current thread 0x0002 (most recent call first):
  File "/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2 in all_reduce
  File "/x/train.py", line 50 in train
  File "/x/train.py", line 97 in <module>
"""
VERDICT = "rank 1 never entered all_reduce #23 on the default group (train.py:64 in write_metrics); rank 0 waits"


def ev(kind: str, seq: int, t: float, host: str = "h", lpid: int = 7, /, **fields: Any) -> dict[str, Any]:
    return validate_event({"v": 1, "seq": seq, "time": T + t, "kind": kind, "host": host, "launcher_pid": lpid,
                           **fields})


def start(seq: int, t: float, attempt: int, ranks: dict[int, int], host: str = "h", pid: int = 7,
          node: int = 0, log_dir: str | None = None) -> dict[str, Any]:
    return ev("attempt_start", seq, t, host, pid, attempt=attempt, run_id="job", node_rank=node, log_dir=log_dir,
              ranks={str(r): {"local_rank": lr, "pid": 100 + r} for r, lr in ranks.items()})


def progress(seq: int, t: float, attempt: int, its: dict[int, tuple[int, float]], host: str = "h",
             pid: int = 7) -> dict[str, Any]:
    return ev("progress", seq, t, host, pid, attempt=attempt,
              ranks={str(r): {"local_rank": r % 2, "iteration": it, "last_progress": T + lp}
                     for r, (it, lp) in its.items()})


def hang(seq: int, t: float, rank: int, host: str = "h", pid: int = 7, action: str = "kill",
         victim_of: int | None = None, files: dict[str, str | None] | None = None) -> dict[str, Any]:
    return ev("hang", seq, t, host, pid, attempt=0, rank=rank, local_rank=rank % 2, pid=100 + rank, reason="section",
              section="step", message="section 'step' open for 2.0 s, timeout 2.0 s", elapsed_s=2.0, timeout_s=2.0,
              onset_time=T + t - 2.2, detected_time=T + t - 0.2, iteration=12, action=action,
              report=(files or {}).get("report"), stack_dump=(files or {}).get("stack_dump"),
              error_file=(files or {}).get("error_file"), victim_of=victim_of)


def job_end(seq: int, t: float, restarts: dict[str, int], host: str = "h", pid: int = 7) -> dict[str, Any]:
    return ev("job_end", seq, t, host, pid, exit_code=0, outcome="", hangs=1, restarts=restarts, goodput=0.0423,
              productive_s=1.8, wall_s=43.2, lost_s=9.7)


PROCESS_PHASES = {"notify": 0.138, "to_stop": 0.094, "stop": 0.145, "rendezvous": 0.4, "worker_start": 6.383,
                  "first_step": 0.395, "total": 7.555}
INPROCESS_PHASES = {"notify": 0.056, "abort": 0.007, "interrupt": 0.0, "finalize": 0.27, "barrier": 0.037,
                    "reinit": 0.019, "first_step": 0.035, "total": 0.424}


def process_run(diagnosis_path: str = "/logs/run/attempt_0/diagnosis.json") -> list[dict[str, Any]]:
    return [
        ev("launcher_start", 0, 0.0, nproc_per_node=2, max_restarts=2, metrics_url=None, metrics_textfile=None),
        start(1, 2.0, 0, {0: 0, 1: 1}),
        progress(2, 20.0, 0, {0: (11, 19.9), 1: (12, 19.95)}),
        ev("diagnosis", 3, 22.2, attempt=0, rank=1, action="kill", path=diagnosis_path, verdict=VERDICT,
           basis="flight_recorder", behind=[1], roll_call_s=0.05),
        hang(4, 22.3, 1),
        progress(5, 22.3, 0, {0: (13, 20.0), 1: (12, 19.95)}),
        ev("attempt_end", 6, 22.4, attempt=0, state="FAILED", iteration=13,
           failures=[{"rank": 1, "exitcode": -15, "message": "RankHang"}]),
        ev("kill", 7, 22.5, attempt=0, cause="hang", signal="SIGTERM", grace_s=3.0, began=T + 22.4, ended=T + 22.5,
           duration_s=0.1),
        start(8, 28.0, 1, {0: 0, 1: 1}),
        ev("restart", 9, 29.7, mode="process", cause="hang", attempt=1, rank=1, phases=PROCESS_PHASES, lost_s=9.73,
           redone_iterations=3),
        progress(10, 31.0, 1, {0: (30, 30.9), 1: (30, 30.9)}),
        ev("attempt_end", 11, 32.0, attempt=1, state="SUCCEEDED", iteration=30, failures=[]),
        job_end(12, 33.0, {"process": 1, "inprocess": 0}),
    ]


def diagnosis_doc() -> dict[str, Any]:
    return {"schema": "ft-monitor/diagnosis", "version": 1, "attempt": 0,
            "verdict": {"line": VERDICT, "basis": "flight_recorder", "behind": [1], "waiting": [0]},
            "ranks": [{"rank": 0, "host": "h", "pid": 100, "stack": STACK_0},
                      {"rank": 1, "host": "h", "pid": 101, "stack": STACK_1}]}


def _input(events: list[dict[str, Any]], diagnoses: dict[str, Any] | None = None) -> ReportInput:
    return ReportInput(runs=[], events=events, diagnoses={p: parse_diagnosis(d, p) for p, d in
                                                          (diagnoses or {}).items()})


def _texts(page: str) -> str:
    return re.sub(r"<[^>]+>", " ", page)


def test_numbers_are_written_for_people() -> None:
    assert [human.seconds(v) for v in (0.0000421, 0.00421, 0.0421, 0.4, 7.5, 42.04, 125, 7384, 200000, None)] == \
        ["42 µs", "4.21 ms", "42 ms", "400 ms", "7.50 s", "42.0 s", "2 min 5 s", "2 h 3 min", "2 d 8 h", "–"]
    assert (human.percent(0.0423), human.percent(0.5), human.count(12345)) == ("4.2 %", "50 %", "12,345")
    assert human.ranks([3]) == "rank 3" and human.ranks([0, 2]) == "ranks 0 and 2"
    assert human.ranks([0, 1, 2, 5]) == "ranks 0–2 and 5" and human.ranks([0, 1]) == "ranks 0 and 1"


def test_the_process_restart_page_says_what_happened_from_the_launchers_decision() -> None:
    events = process_run()
    m = build(events, {p: parse_diagnosis(d, p) for p, d in {"/logs/run/attempt_0/diagnosis.json":
                                                             diagnosis_doc()}.items()})
    assert headline(m) == (
        "Rank 1 hung at iteration 12 in attempt 0, in train.py:64 in write_metrics (section 'step' open for 2.0 s, "
        "timeout 2.0 s); it cost 9.73 s, and the job restarted its processes (process restart: 7.55 s from "
        "detection to every rank stepping again, 3 iterations done again). The job finished (exit code 0).")
    page = render(events, data=_input(events, {"/logs/run/attempt_0/diagnosis.json": diagnosis_doc()}))
    text = _texts(page)
    assert f'<p class="verdict top">verdict: {VERDICT}</p>' in page
    assert "{'" not in text and "': " not in text  # no Python reprs
    assert "1 process restart, 0 in-process restarts" in text and "4.2 %" in text
    assert not re.search(r"<li>\s*</li>", page)
    # one lane per rank: its progress, the hang (rank 1), the wait (rank 0), the stop, the exit
    assert re.findall(r'<g class="lane rank" data-rank="(\d+)"', page) == ["0", "1"]
    lanes = dict(re.findall(r'data-rank="(\d)"(.*?)</g>', page, re.S))
    assert lanes["1"].count('class="hang"') == 1 and lanes["0"].count('class="wait"') == 1
    assert lanes["0"].count('class="stop"') == lanes["1"].count('class="stop"') == 1
    assert lanes["1"].count('class="exit"') == 1 and lanes["0"].count('class="tick"') == 3
    # the restart: its lane and its legend, process phases only, in order
    assert re.findall(r'<g class="lane restarts (\w+)"', page) == ["process"]
    assert re.findall(r'<div class="legend" data-mode="(\w+)"', page) == ["process"]
    lane = page[page.index('<g class="lane restarts process"'):]
    assert re.findall(r'data-phase="(\w+)"', lane[:lane.index("</g>")]) == list(RESTART_PHASES["process"])
    # where the culprit and the waiting rank were, from diagnosis.json
    assert '<pre class="stack culprit" data-ranks="1">train.py:64 in write_metrics\ntrain.py:97 in &lt;module&gt;' \
        in page
    assert '<pre class="stack waiting" data-ranks="0">distributed_c10d.py:2 in all_reduce' in page


def test_the_inprocess_page_draws_its_own_phases_with_its_own_legend() -> None:
    events = [
        start(0, 0.0, 0, {0: 0, 1: 1}),
        progress(1, 20.0, 0, {0: (12, 19.9), 1: (12, 19.8)}),
        hang(2, 22.3, 1, action="inprocess"),
        ev("restart", 3, 22.3, mode="inprocess", cause="hang", attempt=0, rank=1, phases=INPROCESS_PHASES,
           lost_s=2.43, redone_iterations=None),
        ev("attempt_end", 4, 30.0, attempt=0, state="SUCCEEDED", iteration=30, failures=[]),
        job_end(5, 31.0, {"process": 0, "inprocess": 1}),
    ]
    page = render(events)
    assert re.findall(r'<g class="lane restarts (\w+)"', page) == ["inprocess"]
    assert re.findall(r'<div class="legend" data-mode="(\w+)"', page) == ["inprocess"]
    legend = page[page.index('<div class="legend" data-mode="inprocess"'):]
    assert re.findall(r"<b>(\w+)</b>", legend[:legend.index("</div>")]) == list(RESTART_PHASES["inprocess"])
    lane = page[page.index('<g class="lane restarts inprocess"'):]
    assert re.findall(r'data-phase="(\w+)"', lane[:lane.index("</g>")]) == list(RESTART_PHASES["inprocess"])
    assert "the ranks restarted the training function in their own processes (424 ms from detection" in page
    assert "0 process restarts, 1 in-process restart" in _texts(page)


def test_a_waiting_ranks_hang_on_another_node_is_part_of_the_culprits_incident() -> None:
    a, b = ("node-a", 7), ("node-b", 8)
    events = [
        start(0, 0.0, 0, {0: 0, 1: 1}, *a, node=0), start(0, 0.1, 0, {2: 0, 3: 1}, *b, node=1),
        hang(1, 22.3, 3, *b),
        hang(1, 22.4, 1, *a, victim_of=3),
        ev("restart", 2, 30.0, *a, mode="process", cause="hang", attempt=1, rank=1, phases=PROCESS_PHASES,
           lost_s=9.0, redone_iterations=3),
        ev("restart", 2, 30.1, *b, mode="process", cause="hang", attempt=1, rank=3, phases=PROCESS_PHASES,
           lost_s=9.1, redone_iterations=3),
        job_end(3, 31.0, {"process": 1, "inprocess": 0}, *a), job_end(3, 31.0, {"process": 1, "inprocess": 0}, *b),
    ]
    m = build(events)
    (incident,) = m.incidents
    assert (incident.rank, incident.node, incident.waited_on_other_nodes) == (3, 1, (1,))
    assert incident.restart is not None and incident.restart.host == "node-b"  # its own node's timing
    assert len(m.restarts) == 1 and [ln.rank for ln in m.lanes] == [0, 1, 2, 3]
    assert headline(m).startswith("Rank 3 (node 1) hung at iteration 12 in attempt 0 (section 'step'")


def _crashed(**attempt_end: Any) -> list[dict[str, Any]]:
    """Attempt 0 failed (its attempt_end's fields), rank 1's restart, the job's end."""
    return [
        start(0, 0.0, 0, {0: 0, 1: 1}),
        ev("attempt_end", 1, 5.0, attempt=0, state="FAILED", iteration=7, **attempt_end),
        start(2, 7.0, 1, {0: 0, 1: 1}),
        ev("restart", 3, 9.0, mode="process", cause="failure", attempt=1, rank=1,
           phases={**PROCESS_PHASES, "notify": None}, lost_s=None, redone_iterations=None),
        job_end(4, 12.0, {"process": 1, "inprocess": 0}),
    ]


def test_a_worker_that_crashed_is_an_incident_with_its_restart() -> None:
    m = build(_crashed(failures=[{"rank": 1, "exitcode": 1, "message": "ValueError: bad batch\nmore"}]))
    (incident,) = m.incidents
    assert (incident.kind, incident.rank, incident.what) == ("failure", 1, "exited with code 1: ValueError: bad batch")
    assert headline(m).startswith("Rank 1 exited with code 1: ValueError: bad batch in attempt 0; the job restarted "
                                  "its processes")
    assert incident.restart is not None and [n for n, _ in incident.restart.phases][0] == "to_stop"


def test_a_crash_is_told_by_the_launchers_verdict_not_by_torchs_boilerplate() -> None:
    # issue 42: the page named the survivor ("Rank 0 was killed by SIGTERM") and showed torch's "To enable
    # traceback see ..." instead of the exception
    boiler = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    m = build(_crashed(failures=[{"rank": 0, "exitcode": -15, "message": boiler},
                                 {"rank": 1, "exitcode": 1, "message": boiler}],
                       root=1, how="rank 1 (pid 101) raised ValueError: bad batch and exited with code 1",
                       root_seen=True, victims=[0], others=[], others_how="", root_host=None,
                       victims_how="rank 0 (pid 100) raised RuntimeError: Connection reset by peer and was killed "
                                   "by SIGTERM"))
    (incident,) = m.incidents
    assert (incident.kind, incident.rank, incident.pid) == ("failure", 1, 101)
    assert incident.what == ("raised ValueError: bad batch and exited with code 1; failed because of it: rank 0 "
                             "(pid 100) raised RuntimeError: Connection reset by peer and was killed by SIGTERM")
    assert headline(m).startswith("Rank 1 raised ValueError: bad batch") and "To enable" not in headline(m)


def test_evidence_is_linked_relative_to_the_page_even_after_the_folder_moved(tmp_path: Path) -> None:
    """The events name the files where the launcher wrote them (/old/...); the run folder was
    copied since. The page links the copies, relatively; a file no longer there is said so."""
    old = "/old/logs/job_x"
    run = tmp_path / "copied" / "job_x"
    (run / "attempt_0" / "1").mkdir(parents=True)
    (run / "attempt_0" / "0").mkdir(parents=True)
    (run / "attempt_0" / "1" / "rank1-pid101-stack.txt").write_text(STACK_1)
    (run / "attempt_0" / "1" / "rank1-pid101-hang.json").write_text("{}")
    (run / "attempt_0" / "1" / "error.json").write_text("{}")
    (run / "attempt_0" / "0" / "monitor.log").write_text("")
    (run / "attempt_0" / "diagnosis.json").write_text(json.dumps(diagnosis_doc()))
    (run / "attempt_0" / "0" / "rank0-pid100-stack.txt").symlink_to("/etc/passwd")  # never followed or linked
    events = process_run(f"{old}/attempt_0/diagnosis.json")
    events[1]["log_dir"] = old
    events[4].update(stack_dump=f"{old}/attempt_0/1/rank1-pid101-stack.txt",
                     report=f"{old}/attempt_0/1/rank1-pid101-hang.json", error_file=f"{old}/attempt_0/1/gone.json")
    log = EventLog("h", pid=7)
    log.attach(run)
    for e in events:
        log.emit(e["kind"], e["time"], **{k: v for k, v in e.items() if k not in ("v", "seq", "time", "kind", "host",
                                                                                  "launcher_pid")})
    log.close()
    page_file = write_report(run)
    assert page_file == run / "report.html"
    page = page_file.read_text()
    hrefs = re.findall(r'href="([^"]+)"', page)
    assert all(not h.startswith(("/", "file:", "http")) and (run / h).is_file() for h in hrefs), hrefs
    assert {"attempt_0/diagnosis.json", "attempt_0/1/rank1-pid101-stack.txt", "attempt_0/1/rank1-pid101-hang.json",
            "attempt_0/1/error.json", "attempt_0/0/monitor.log", "events.jsonl"} <= set(hrefs)
    assert "rank0-pid100-stack.txt" not in page
    assert f'<span class="missing">{old}/attempt_0/1/gone.json (not found)</span>' in page
    assert f'verdict: {VERDICT}' in page and 'data-ranks="0"' in page  # diagnosis.json read from the copy
    assert "run folder <code>job_x</code>" in page


def test_several_folders_of_one_job_are_one_page_beside_them(tmp_path: Path) -> None:
    for n, host in enumerate(("node-a", "node-b")):
        run = tmp_path / f"node{n}-logs" / f"job_{n}"
        run.mkdir(parents=True)
        log = EventLog(host, pid=7 + n)
        log.attach(run)
        log.emit("attempt_start", T + n, attempt=0, run_id="job", node_rank=n, log_dir=str(run),
                 ranks={str(2 * n + i): {"local_rank": i, "pid": 100 + i} for i in range(2)})
        log.close()
    page_file = write_report([tmp_path / "node0-logs", tmp_path / "node1-logs" / "job_1" / "events.jsonl"])
    assert page_file == tmp_path / "report.html"
    page = page_file.read_text()
    assert re.findall(r'<g class="lane rank" data-rank="(\d+)"', page) == ["0", "1", "2", "3"]
    assert "rank 2 · node 1" in page and "node0-logs/job_0/events.jsonl" in page
    with pytest.raises(ReportError, match="holds no events.jsonl"):
        load([tmp_path])  # the folder above the log dirs: no run folder one level down


def test_the_restart_phase_names_are_the_launchers() -> None:
    assert tuple(RestartTiming(1, 0.0, 0.1).breakdown())[:-1] == RESTART_PHASES["process"]


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5) | st.floats(),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                        st.sampled_from(["schema", "verdict", "line", "ranks", "rank", "stack", "waiting", "x"]),
                        inner, max_size=4), max_leaves=15))
def test_any_diagnosis_document_is_read_or_refused_in_one_error(doc: Any) -> None:
    if isinstance(doc, dict) and isinstance(doc.get("verdict"), dict):
        doc["schema"] = "ft-monitor/diagnosis"
    try:
        parsed = parse_diagnosis(doc, "d.json")
    except ReportError:
        return
    assert isinstance(parsed.verdict, str)


def test_progress_is_sampled_more_sparsely_as_the_run_ages(tmp_path: Path) -> None:
    clock = {"t": 1000.0}
    mon = FakeMonitors()
    tel = Telemetry(config=Settings(), monitors=mon, host="h", nproc=2, max_restarts=1, clock=lambda: clock["t"],
                    monotonic=lambda: clock["t"])
    tel.attempt_started(0, "run", 0, {0: 0, 1: 1}, {0: 100, 1: 101}, str(tmp_path))
    for i in range(60):  # 60 polls a second apart, the iteration moving at each
        clock["t"] += 1.0
        mon.now = clock["t"] - 1000.0
        _stepped(mon, i, 1)
        tel.tick()
    clock["t"] = 2000.0  # 1000 s old: one sample per 10 s at most
    for i in range(30):
        clock["t"] += 1.0
        mon.now = clock["t"] - 1000.0
        _stepped(mon, 100 + i, 1)
        tel.tick()
    tel.close(None)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    times = [e["time"] for e in events if e["kind"] == "progress"]
    early = [t for t in times if t < 2000.0]
    late = [t for t in times if t > 2000.0]
    assert len(early) == 60 and 3 <= len(late) <= 4, (len(early), len(late))


def test_an_inprocess_hang_that_fell_back_to_a_process_restart_says_so() -> None:
    events = [
        start(0, 0.0, 0, {0: 0, 1: 1}),
        ev("attempt_end", 1, 30.0, attempt=0, state="FAILED", iteration=12,
           failures=[{"rank": 1, "exitcode": -15, "message": ""}]),
        hang(1, 30.0, 1, action="inprocess"),  # emitted at the attempt's end: the ranks never came back
        start(2, 32.0, 1, {0: 0, 1: 1}),
        ev("restart", 3, 35.0, mode="process", cause="failure", attempt=1, rank=1, phases=PROCESS_PHASES,
           lost_s=None, redone_iterations=None),
        job_end(4, 40.0, {"process": 1, "inprocess": 0}),
    ]
    m = build(events)
    (incident,) = m.incidents  # one incident: the hang, recovered by the fallback (not also a "failure")
    assert incident.kind == "hang" and incident.restart is not None and incident.restart.mode == "process"
    assert "the job restarted its processes (fallback process restart: 7.55 s" in headline(m)
    page = render(events)
    assert re.findall(r'<g class="lane restarts (\w+)"', page) == ["process"]


def test_a_dump_only_roll_call_is_an_incident_the_job_ran_through() -> None:
    events = [
        start(0, 0.0, 0, {0: 0, 1: 1}),
        ev("diagnosis", 1, 10.0, attempt=0, rank=1, action="dump", path="/d.json", verdict=VERDICT,
           basis="flight_recorder", behind=[1], roll_call_s=0.05),
        ev("attempt_end", 2, 30.0, attempt=0, state="SUCCEEDED", iteration=30, failures=[]),
        job_end(3, 31.0, {"process": 0, "inprocess": 0}),
    ]
    m = build(events)
    (incident,) = m.incidents
    assert (incident.rank, incident.action, incident.verdict) == (1, "dump", VERDICT)
    assert "the job kept running (on_hang: dump)" in headline(m)
    assert '<g class="lane restarts' not in render(events) and '<div class="legend" data-mode=' not in render(events)


def test_a_hang_whose_restart_failed_before_it_was_measured_is_followed_by_the_failure() -> None:
    """Seen on a loaded machine: attempt 1, restarted after the hang, failed (a worker could not
    bind its store's port) before every rank stepped; attempt 2 ran. Two incidents, and the
    hang's restart is said to be unmeasured, not absent; no cost is made up for it."""
    events = [
        start(0, 0.0, 0, {0: 0, 1: 1}),
        hang(1, 22.3, 1),
        ev("attempt_end", 2, 22.4, attempt=0, state="FAILED", iteration=13,
           failures=[{"rank": 1, "exitcode": -15, "message": ""}]),
        start(3, 70.0, 1, {0: 0, 1: 1}),
        ev("attempt_end", 4, 84.0, attempt=1, state="FAILED", iteration=13,
           failures=[{"rank": 0, "exitcode": 1, "message": "To enable traceback see: ..."}]),
        start(5, 89.0, 2, {0: 0, 1: 1}),
        ev("restart", 6, 90.0, mode="process", cause="failure", attempt=2, rank=0, phases=PROCESS_PHASES,
           lost_s=None, redone_iterations=None),
        job_end(7, 110.0, {"process": 2, "inprocess": 0}),
    ]
    m = build(events)
    first, second = m.incidents
    assert (first.kind, first.rank, first.restart, first.restarted_into, first.lost_s) == ("hang", 1, None, 1, None)
    assert (second.kind, second.attempt, second.rank) == ("failure", 1, 0) and second.restart is not None
    assert headline(m).startswith("2 incidents (1 hang, 1 failure); the first: rank 1 hung at iteration 12 in "
                                  "attempt 0 (section 'step' open for 2.0 s, timeout 2.0 s), and the job restarted "
                                  "its processes into attempt 1, but that restart was not measured")
