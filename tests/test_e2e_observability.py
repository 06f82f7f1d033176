"""End-to-end: what ft-launcher tells the people who run the cluster, from real runs of the demo.

One run with a hang (rank 1, step 12, attempt 0) is checked fact by fact (one function
each, all called by one test): /metrics is scraped while it runs, the live view is taken
while it runs, then the summary JSON, events.jsonl, the textfile and the HTML report are
checked after it. One more pair of runs (a slow rank, an even one) checks slow-rank flagging.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ft_monitor.launcher import exit_codes
from ft_monitor.launcher.telemetry.events import read_events
from tests.launchers import Launcher
from tests.procs import ROOT, cleanup_dir, free_port, short_tmpdir, wait_until

pytestmark = pytest.mark.e2e

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples | None:
    """Every sample at ``url`` as {(name, sorted labels): value}, or None if nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    return parse(text)


def parse(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def sum_where(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


@dataclass
class HangRun:
    launcher: Launcher
    url: str
    textfile: Path
    before: Samples
    during: Samples
    run_dir: str
    status_json: dict[str, Any]
    launcher_status: str
    exit_code: int


def _run_dir(output: str) -> str | None:
    m = re.search(r"monitor\(s\) ready in (\S+)", output)
    return m.group(1) if m else None


@pytest.fixture(scope="module")
def hang_run() -> Iterator[HangRun]:
    workdir = short_tmpdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    textfile = workdir / "ft.prom"
    # The ranks linger (heartbeating) after their last step until the live views below were
    # read: on a busy machine attempt 1 once finished before `status` had started.
    seen = workdir / "views-read"
    la = Launcher(workdir, "--max-restarts", "2", "--ft-metrics-port", str(port), "--ft-metrics-textfile",
                  str(textfile), train_args=("--hang", "rank=1,step=12,attempt=0", "--steps", "80",
                                             "--linger-until", str(seen)))
    try:
        # before the hang: the ranks are stepping and the metrics say so
        before = wait_until(lambda: (s := scrape(url)) and value(s, "ft_rank_iteration", rank="0", local_rank="0")
                            and s, 120, "/metrics with rank 0's iteration")
        # after the restart, while attempt 1 runs
        during = wait_until(lambda: (s := scrape(url)) and value(s, "ft_restart_phase_seconds_count", kind="process", phase="total")
                            and s, 120, "/metrics with the restart's phases")
        run_dir = _run_dir(la.output())
        assert run_dir is not None, la.output()
        st = subprocess.run([sys.executable, "-m", "ft_monitor.cli", "status", "--all", run_dir, "--json"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert st.returncode == 0, st.stderr
        ls = subprocess.run([sys.executable, "-m", "ft_monitor.launcher.main", "status", run_dir, "--watch", "0.1",
                             "--count", "2"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert ls.returncode == 0, ls.stderr
        seen.touch()
        code = la.wait()
        yield HangRun(la, url, textfile, before, during, run_dir, json.loads(st.stdout), ls.stdout, code)
    finally:
        la.kill()
        cleanup_dir(workdir)


def the_run_recovers(hang_run: HangRun) -> None:
    assert hang_run.exit_code == exit_codes.SUCCESS, hang_run.launcher.output()
    assert scrape(hang_run.url) is None  # /metrics goes with the launcher


def metrics_while_running_count_the_hang_and_the_restart_phases_of_the_summary(hang_run: HangRun) -> None:
    before, during = hang_run.before, hang_run.during
    assert sum_where(before, "ft_hangs_total") == 0
    assert value(during, "ft_hangs_total", rank="1", reason="section", section="step") == 1  # the rank that hung
    assert sum_where(during, "ft_hangs_total") == 1
    assert value(during, "ft_restarts_total", kind="process") == 1
    assert value(during, "ft_restarts_total", kind="inprocess") == 0
    (restart,) = hang_run.launcher.summary()["restarts"]
    assert restart["cause"] == "hang" and restart["rank"] == 1
    for phase, seconds in restart.items():
        if phase in ("cause", "rank", "attempt", "message"):
            continue
        assert value(during, "ft_restart_phase_seconds_count", kind="process", phase=phase) == 1, phase
        assert value(during, "ft_restart_phase_seconds_sum", kind="process", phase=phase) == pytest.approx(seconds, abs=1e-9), phase
    # per rank: progress, step-time histograms from the monitors, the timeouts in force
    for rank in ("0", "1"):
        ids = {"rank": rank, "local_rank": rank}
        assert value(during, "ft_rank_last_progress_timestamp_seconds", **ids) > value(
            during, "ft_launcher_start_time_seconds")
        assert value(during, "ft_section_duration_seconds_count", section="step", **ids) >= 12
        assert value(during, "ft_section_duration_seconds_bucket", section="step", le="+Inf", **ids) == value(
            during, "ft_section_duration_seconds_count", section="step", **ids)
        # learned from the checkpoints (the config file says 60 s)
        assert value(during, "ft_timeout_seconds", rank=rank, kind="section", section="step", source="learned") < 60
        assert value(during, "ft_rank_slow", **ids) == 0
    lost = value(during, "ft_incident_lost_seconds_sum")
    assert lost is not None and lost >= restart["total"]
    assert 0 < value(during, "ft_goodput_ratio") < 1


def goodput_and_lost_work_are_consistent_with_the_step_times(hang_run: HangRun) -> None:
    obs = hang_run.launcher.summary()["observability"]
    (restart,) = hang_run.launcher.summary()["restarts"]
    (incident,) = obs["incidents"]
    assert 0 < obs["goodput"] < 1
    assert obs["goodput"] == pytest.approx(obs["productive_s"] / obs["wall_s"])
    # the checkpoint before the hang is at step 10; the ranks had reached 12 or 13 (rank 0 finishes step 12
    # before it waits for rank 1 in step 13)
    assert incident["resumed_from"] == 10 and incident["iteration_before"] in (12, 13)
    redone_s = incident["redone_iterations"] * incident["step_median_s"]
    assert incident["lost_s"] == pytest.approx(incident["running_again"] - incident["onset"] + redone_s)
    assert incident["lost_s"] >= restart["total"]
    final = parse(hang_run.textfile.read_text())  # written at the end
    steps = [value(final, "ft_section_duration_seconds_sum", rank=r, local_rank=r, section="step") for r in "01"]
    assert obs["productive_s"] == pytest.approx(statistics.mean(steps) - redone_s, rel=1e-6)
    assert obs["productive_s"] < obs["wall_s"] - obs["lost_s"] + redone_s
    assert value(final, "ft_lost_seconds_total") == pytest.approx(obs["lost_s"])


def events_follow_the_schema_and_hold_the_incident_in_order(hang_run: HangRun) -> None:
    events_path = Path(hang_run.launcher.summary()["observability"]["events"])
    assert events_path.parent.parent == hang_run.launcher.log_dir  # <log dir>/<run id>_<random>/events.jsonl
    events = read_events(events_path)  # each line validated against the schema
    assert [e["seq"] for e in events] == list(range(len(events)))
    mine = [(e["kind"], e.get("attempt")) for e in events if e["kind"] in
            ("launcher_start", "attempt_start", "hang", "attempt_end", "kill", "restart", "job_end")]
    assert mine == [("launcher_start", None), ("attempt_start", 0), ("hang", 0), ("attempt_end", 0), ("kill", 0),
                    ("attempt_start", 1), ("restart", 1), ("attempt_end", 1), ("job_end", None)]
    by_kind = {e["kind"]: e for e in events}
    hang, restart, end = by_kind["hang"], by_kind["restart"], by_kind["job_end"]
    assert hang["rank"] == 1 and hang["section"] == "step" and hang["action"] == "kill"
    assert restart["mode"] == "process" and restart["cause"] == "hang" and restart["rank"] == 1
    (row,) = hang_run.launcher.summary()["restarts"]
    assert {k: row[k] for k in restart["phases"]} == restart["phases"] and row["cause"] == "hang" and row["rank"] == 1
    assert end["exit_code"] == 0 and end["hangs"] == 1 and end["restarts"] == {"process": 1, "inprocess": 0}
    assert [e["state"] for e in events if e["kind"] == "attempt_end"] == ["FAILED", "SUCCEEDED"]
    # learned timeouts, torchelastic's own events and metrics, step times
    assert any(e["kind"] == "timeouts" and "section:step" in e["changed"] for e in events)
    names = {e["name"] for e in events if e["kind"] == "torchelastic_event"}
    assert "torchelastic.worker.status.START" in names and "torchelastic.worker.status.SUCCEEDED" in names
    metrics = {k for e in events if e["kind"] == "torchelastic_metrics" for k in e["metrics"]}
    assert "torchelastic.workers.default.remaining_restarts" in metrics
    stats = [e for e in events if e["kind"] == "stats"][-1]
    assert stats["ranks"]["0"]["sections"]["step"]["count"] >= 80


def the_live_view_shows_every_rank(hang_run: HangRun) -> None:
    (rows,) = hang_run.status_json.values()
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert r["state"] == "active" and r["step_median_s"] > 0 and r["iteration"] >= 10
        assert r["timeouts"]["rank_section_timeouts"]["step"] < 60
    views = hang_run.launcher_status.split("ft-launcher status: every 0.1s, ")  # --watch's heading
    assert len(views) == 3 and views[0] == ""  # --count 2
    for view in views[1:]:
        when, directory, header, *lines = [line for line in view.strip().splitlines() if line]
        assert re.fullmatch(r"\d\d:\d\d:\d\d \(Ctrl-C stops\)", when) and directory == hang_run.run_dir + ":"
        assert header.split()[:3] == ["rank", "pid", "state"]
        assert [line.split()[0] for line in lines] == ["0", "1"]
        assert all(" active " in line and "step=" in line for line in lines)


class _Shapes(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.classes: dict[str, int] = {}
        self.text: list[str] = []
        self.goodput: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        cls = dict(attrs).get("class")
        if cls == "goodput":
            self.goodput = dict(attrs).get("data-ratio")
        if cls:
            key = f"{tag}.{cls}"
            self.classes[key] = self.classes.get(key, 0) + 1
        assert tag not in ("script", "link", "iframe", "img"), tag  # self-contained, nothing fetched

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def the_html_report_renders_the_run(hang_run: HangRun) -> None:
    events_path = Path(hang_run.launcher.summary()["observability"]["events"])
    out = subprocess.run([sys.executable, "-m", "ft_monitor.cli", "report", str(events_path.parent)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    page = Path(out.stdout.strip())
    assert page == events_path.parent / "report.html"
    shapes = _Shapes()
    shapes.feed(page.read_text())
    shapes.close()
    c = shapes.classes
    assert c["rect.attempt"] == 2 and c["rect.hang"] == 1
    assert c["rect.stop"] == 2  # the group stop, on each rank's lane
    # notify, to_stop, stop, rendezvous, worker_start, first_step: on the timeline and in the restart's own bar
    assert c["rect.phase"] == 2 * 6 and c["svg.phase-bar"] == 1
    assert c["g.lane rank"] == 2 and c["tr.rank"] == 2 and c["tr.incident"] == 1 and c["svg.timeline"] == 1
    text = " ".join(shapes.text)
    goodput = hang_run.launcher.summary()["observability"]["goodput"]
    assert "section 'step' open for" in text
    assert re.search(r"goodput\s+\d+(\.\d)? %", text)
    assert abs(float(shapes.goodput) - goodput) < 1e-9  # the launcher's number, shown as a percentage


def test_a_run_that_hangs_and_recovers(hang_run: HangRun) -> None:
    """Every fact of the shared run, one check each, all checked (the failures listed together).
    One test, not one per check: pytest-xdist's worksteal handed this module's tests to several
    workers, and each worker (and each return to the module after another one's tests) ran the
    module fixture again: four runs of the same scenario in one whole run."""
    failed = []
    for check in (the_run_recovers, metrics_while_running_count_the_hang_and_the_restart_phases_of_the_summary,
                  goodput_and_lost_work_are_consistent_with_the_step_times,
                  events_follow_the_schema_and_hold_the_incident_in_order, the_live_view_shows_every_rank,
                  the_html_report_renders_the_run):
        try:
            check(hang_run)
        except AssertionError as e:
            failed.append(f"{check.__name__}: {e}")
    assert not failed, "\n\n".join(failed)


def test_a_slow_rank_is_flagged_and_an_even_run_is_not(workdir: Path) -> None:
    # two jobs side by side, each in its own folder (before: one checkpoint folder for both, and one
    # job's rename found the other's ckpt.tmp gone)
    (workdir / "slow").mkdir()
    (workdir / "even").mkdir()
    slow = Launcher(workdir / "slow", "--max-restarts", "0", name="slow",
                    train_args=("--slow", "rank=1,ms=50", "--steps", "40"))
    even = Launcher(workdir / "even", "--max-restarts", "0", name="even", train_args=("--steps", "40"))
    try:
        assert slow.wait() == exit_codes.SUCCESS, slow.output()
        assert even.wait() == exit_codes.SUCCESS, even.output()
    finally:
        slow.kill()
        even.kill()
    assert slow.summary()["observability"]["slow_ranks"] == [1]
    flagged = [e for e in read_events(slow.summary()["observability"]["events"]) if e["kind"] == "slow_rank"]
    assert [(e["rank"], e["section"]) for e in flagged] == [(1, "data")]
    assert flagged[0]["median_s"] - flagged[0]["others_median_s"] >= 0.04 and flagged[0]["ratio"] > 1.5
    assert "rank 1 (local rank 1) is slow" in slow.output()
    assert even.summary()["observability"]["slow_ranks"] == []
    assert not [e for e in read_events(even.summary()["observability"]["events"]) if e["kind"] == "slow_rank"]
