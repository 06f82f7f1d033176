"""Events, metrics, goodput, slow ranks and the telemetry that drives them, in-process (no launcher run)."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ft_client.timeouts import Timeouts
from ft_monitor.core.policy import iteration_now
from ft_monitor.core.section_stats import SectionHistogram, SectionStats
from ft_monitor.core.settings import Settings
from ft_monitor.core.state import Session
from ft_monitor.core.status import ExitSummary, MonitorStatus, SnapshotPair, SnapshotsStatus, build_status
from ft_monitor.launcher.agent.agent import RestartTiming
from ft_monitor.launcher.incident.restarts import all_stepping
from ft_monitor.launcher.telemetry.events import SCHEMA, EventLog, EventSchemaError, read_events, validate_event
from ft_monitor.launcher.telemetry.goodput import Incident, goodput
from ft_monitor.launcher.telemetry.metrics import RankView, Snapshot, registry
from ft_monitor.launcher.telemetry.slow_ranks import judge
from ft_monitor.launcher.telemetry.telemetry import Telemetry
from ft_monitor.launcher.telemetry.torch_events import TorchMetrics, routed
from ft_monitor.views.live_view import Row, format_table, to_json
from ft_monitor.views.report_html import render

ROOT = Path(__file__).resolve().parent.parent


# -- events ---------------------------------------------------------------------------------------
def test_events_are_kept_until_the_directory_is_known_then_written_in_order(tmp_path: Path) -> None:
    log = EventLog("h", pid=7)
    log.emit("launcher_start", 1.0, nproc_per_node=2, max_restarts=1, metrics_url=None, metrics_textfile=None)
    assert log.attach(tmp_path) == tmp_path / "events.jsonl"
    log.emit("workload_request", 2.0, rank=0, action="Continue", reason="x")
    log.emit("stats", 3.0, ranks={}, goodput=float("nan"), productive_s=None, wall_s=2.0, lost_s=0.0)
    log.close()
    events = read_events(tmp_path / "events.jsonl")
    assert [(e["seq"], e["kind"]) for e in events] == [(0, "launcher_start"), (1, "workload_request"), (2, "stats")]
    assert events[2]["goodput"] is None  # JSON has no NaN
    assert events[0]["host"] == "h" and events[0]["launcher_pid"] == 7


def test_an_event_field_cannot_overwrite_the_envelope_and_kinds_are_known() -> None:
    log = EventLog("h")
    with pytest.raises(EventSchemaError, match="overwrite the envelope"):
        log.emit("exclusion", 1.0, rank=0, reason="r", seq=5)
    with pytest.raises(EventSchemaError, match="unknown event kind"):
        log.emit("party", 1.0)


@pytest.mark.parametrize(("event", "problem"), [
    ({"kind": "hang"}, r"hang event of version None"),
    ({"v": 1, "kind": "nope"}, r"unknown event kind 'nope'"),
    ({"v": 1, "seq": 0, "time": 1.0, "kind": "exclusion", "host": "h", "launcher_pid": 1, "rank": 0},
     r"exclusion event without its field 'reason'"),
    ({"v": 1, "seq": 0, "time": 1.0, "kind": "exclusion", "host": "h", "launcher_pid": 1, "rank": True,
      "reason": ""}, r"field 'rank' = True is a boolean"),
    ({"v": 1, "seq": 0, "time": "now", "kind": "exclusion", "host": "h", "launcher_pid": 1, "rank": 0,
      "reason": ""}, r"field 'time' = 'now': must be int or float"),
])
def test_validation_names_what_is_wrong(event: dict[str, Any], problem: str) -> None:
    with pytest.raises(EventSchemaError, match=problem):
        validate_event(event)


def test_the_docs_list_every_event_kind_and_field() -> None:
    doc = (ROOT / "docs" / "observability.md").read_text()
    for kind, fields in SCHEMA.items():
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{kind}` |")), None)
        assert row is not None, kind
        for name in fields:
            assert f"`{name}`" in row, (kind, name)


# -- goodput, slow ranks ----------------------------------------------------------------------------
def test_goodput_subtracts_redone_work_and_lost_time_counts_onset_to_running_again() -> None:
    inc = Incident(rank=1, onset=100.0, iteration_before=13, step_median_s=0.5, running_again=110.0,
                   resumed_from=10)
    assert inc.redone_iterations == 3 and inc.lost_s == pytest.approx(11.5)
    gp = goodput({0: 30.0, 1: 28.0}, [inc], start=0.0, now=100.0)
    assert gp.productive_s == pytest.approx(29.0 - 1.5) and gp.ratio == pytest.approx(0.275)
    assert gp.lost_s == pytest.approx(11.5)
    assert goodput({}, [], start=0.0, now=1.0).ratio is None
    pending = Incident(rank=1, onset=100.0, iteration_before=None, step_median_s=None)
    assert pending.lost_s is None and pending.redone_s == 0.0


def test_slow_rank_verdicts_use_the_ratio_a_floor_and_hysteresis() -> None:
    v = judge({0: 0.010, 1: 0.060, 2: 0.011}, 1.5)
    assert [r for r, x in v.items() if x.slow] == [1]
    assert v[1].others_median_s == pytest.approx(0.0105)
    # 2x, but only 1 ms more: timer noise, not a slow rank
    assert not any(x.slow for x in judge({0: 0.001, 1: 0.002}, 1.5).values())
    # a flagged rank stays flagged until it falls below the midpoint (1.25 here)
    assert judge({0: 0.10, 1: 0.13}, 1.5, frozenset({1}))[1].slow
    assert not judge({0: 0.10, 1: 0.12}, 1.5, frozenset({1}))[1].slow
    assert judge({0: 0.1}, 1.5) == {}


# -- metrics ---------------------------------------------------------------------------------------
def _hist(*durations: float) -> SectionHistogram:
    h = SectionHistogram()
    for d in durations:
        h.record(d)
    return h


def test_metrics_are_the_snapshot_in_prometheus_names_and_units() -> None:
    t = Timeouts.from_config(Settings(rank_heartbeat_timeout=30, rank_section_timeouts={"step": 60, "ckpt": None}))
    snap = Snapshot(
        start=1000.0,
        ranks=(RankView(rank=4, local_rank=0, last_progress=1005.0, iteration=12,
                        sections={"step": _hist(0.05, 0.2)}, timeouts=t.to_wire(), slow=True, slow_ratio=2.5,
                        snapshot_held=3 << 20, snapshot_limit=16 << 30),
               RankView(rank=5, local_rank=1, last_progress=None, iteration=None, sections={}, timeouts={}),),
        hangs={("4", "section", "step"): 1}, restarts={"process": 1},
        restart_phases={("process", "total"): (3.0,), ("process", "stop"): (0.05,)}, incident_lost=(7.5,),
        goodput=goodput({4: 5.0}, [], start=1000.0, now=1010.0))
    text = generate_latest(registry(lambda: snap)).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}

    def v(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert v("ft_hangs_total", rank="4", reason="section", section="step") == 1  # which rank hung
    assert v("ft_restarts_total", kind="process") == 1 and v("ft_restarts_total", kind="inprocess") == 0
    assert v("ft_restart_phase_seconds_bucket", kind="process", phase="total", le="2.5") == 0
    assert v("ft_restart_phase_seconds_bucket", kind="process", phase="total", le="5.0") == 1
    assert v("ft_incident_lost_seconds_sum") == 7.5 and v("ft_incident_lost_seconds_count") == 1
    ids = {"rank": "4", "local_rank": "0"}
    assert v("ft_section_duration_seconds_bucket", section="step", le="0.05", **ids) == 1
    assert v("ft_section_duration_seconds_count", section="step", **ids) == 2
    assert v("ft_rank_last_progress_timestamp_seconds", **ids) == 1005.0
    assert v("ft_rank_slow", **ids) == 1 and v("ft_rank_slow_ratio", **ids) == 2.5
    assert v("ft_snapshot_bytes_held", **ids) == 3 << 20 and v("ft_snapshot_bytes_limit", **ids) == 16 << 30
    assert ("ft_snapshot_bytes_held", (("local_rank", "1"), ("rank", "5"))) not in samples  # an older monitor
    assert v("ft_timeout_seconds", rank="4", kind="section", section="step", source="configured") == 60
    assert v("ft_timeout_seconds", rank="4", kind="heartbeat", section="", source="configured") == 30
    assert ("ft_timeout_seconds", (("kind", "section"), ("rank", "4"), ("section", "ckpt"),
                                   ("source", "configured"))) not in samples  # off: not a number
    assert v("ft_goodput_ratio") == pytest.approx(0.5) and v("ft_wall_seconds") == 10.0


# -- torchelastic's events and metrics -------------------------------------------------------------
def test_torchelastic_events_and_metrics_are_routed_while_the_run_lasts() -> None:
    from torch.distributed.elastic import events as te_events
    from torch.distributed.elastic import metrics as te_metrics

    got: list[tuple[Any, ...]] = []
    metrics = TorchMetrics()
    args = SimpleNamespace(event_log_handler="null")
    with routed(lambda *a: got.append(a), metrics, args):
        assert args.event_log_handler == "ft-monitor"
        te_events.record(te_events.Event("agent.thing", te_events.EventSource.AGENT, metadata={"k": 1}),
                         args.event_log_handler)
        te_events.construct_and_record_rdzv_event(run_id="r", message="joined", node_state=te_events.NodeState.INIT)
        te_events.construct_and_record_rdzv_event(run_id="r", message="alive", node_state=te_events.NodeState.RUNNING,
                                                  name="X._keep_alive")
        te_events.construct_and_record_rdzv_event(  # each keep-alive's sync: counted, not a line
            run_id="r", message="The node 'n' has successfully synced its local changes with other nodes in the "
                                "rendezvous 'r'.", node_state=te_events.NodeState.RUNNING, name="X.run")
        for ms in (5, 7):
            te_metrics.put_metric("tick.duration.ms", ms, "torchelastic")
    te_metrics.put_metric("after", 1, "torchelastic")  # no longer ours
    assert args.event_log_handler == "null"
    assert got[0] == ("agent.thing", "AGENT", None, {"k": 1})
    assert got[1][1] == "RENDEZVOUS" and got[1][3]["message"] == "joined" and len(got) == 2
    drained = metrics.drain()
    assert drained["torchelastic.tick.duration.ms"] == {"count": 2, "sum": 12.0, "min": 5.0, "max": 7.0,
                                                        "last": 7.0}
    assert drained["rendezvous.keep_alive"]["count"] == 1 and drained["rendezvous.sync"]["count"] == 1
    assert metrics.drain() == {}


# -- the telemetry, with fake monitors and clocks ------------------------------------------------
class FakeMonitors:
    def __init__(self) -> None:
        self.sessions: dict[int, Session | None] = {0: None, 1: None}
        self.stats = {0: SectionStats(), 1: SectionStats()}
        self.timeouts = Timeouts.from_config(Settings(rank_section_timeouts={"step": 60, "data": 60}))
        self.now = 0.0
        self.last_iteration: dict[int, int | None] = {0: None, 1: None}
        self.snapshots: dict[int, SnapshotsStatus | None] = {0: None, 1: None}

    def statuses(self) -> dict[int, Any]:
        return {lr: build_status(now=self.now, monitor_pid=1, socket=f"/m{lr}", started_at=0.0, sessions=1,
                                 timeouts=self.timeouts, iteration_high=None, session=s, hangs=[],
                                 section_stats=self.stats[lr], last_iteration=self.last_iteration[lr],
                                 snapshots=self.snapshots[lr])
                for lr, s in self.sessions.items()}

    def end_sessions(self) -> None:
        """The ranks are gone: their monitors say where each session ended."""
        for lr, s in self.sessions.items():
            if s is not None:
                self.last_iteration[lr] = iteration_now(s)
        self.sessions = dict.fromkeys(self.sessions)


def _stepped(mon: FakeMonitors, start_iteration: int, steps: int, slow_data: float = 0.0) -> None:
    for lr in (0, 1):
        s = mon.sessions[lr] = Session(rank=lr, pid=100 + lr, started_at=mon.now, timeouts=mon.timeouts)
        for _ in range(steps):
            s.open_section("data", mon.now)
            s.close_section("data", mon.now + 0.001 + (slow_data if lr == 1 else 0.0))
            mon.stats[lr].record("data", 0.001 + (slow_data if lr == 1 else 0.0))
            s.open_section("step", mon.now)
            s.close_section("step", mon.now + 0.1)
            mon.stats[lr].record("step", 0.1)
        s.set_iteration(start_iteration + steps)


def test_telemetry_turns_a_hang_and_its_restart_into_events_metrics_and_goodput(tmp_path: Path,
                                                                                caplog: pytest.LogCaptureFixture) -> None:
    clock = {"t": 1000.0}
    mon = FakeMonitors()
    tel = Telemetry(config=Settings(slow_rank_section="data"), monitors=mon, host="h", nproc=2, max_restarts=1,
                    clock=lambda: clock["t"], monotonic=lambda: clock["t"])
    tel.launcher_started("http://127.0.0.1:1/metrics", None)
    tel.attempt_started(0, "run", 0, {0: 0, 1: 1}, {0: 100, 1: 101}, str(tmp_path))
    _stepped(mon, 0, 12, slow_data=0.05)
    clock["t"] += 2.0
    with caplog.at_level(logging.WARNING, "ft_monitor.launcher"):
        tel.tick()
    assert tel.flagged == {1} and "rank 1 (local rank 1) is slow" in caplog.text
    summary = {"rank": 1, "local_rank": 1, "pid": 101, "reason": "section", "section": "step", "message": "m",
               "elapsed_s": 2.0, "timeout_s": 2.0, "onset_time": 1000.5, "detected_time": 1002.5, "iteration": 12,
               "attempt": 0}
    tel.hang(summary)
    timing = RestartTiming(1, 1002.5, 1002.6)
    tel.hang_timing(timing)
    tel.attempt_ended("FAILED", {1: SimpleNamespace(exitcode=-15, message="hang")}, 1)
    timing.stop_began, timing.stopped = 1002.6, 1002.7
    tel.workers_stopped(1002.6, "hang", "SIGTERM", 3.0)
    timing.rendezvous_done, timing.workers_started = 1002.9, 1003.0
    tel.attempt_started(1, "run", 0, {0: 0, 1: 1}, {0: 200, 1: 201}, str(tmp_path))
    clock["t"] = 1006.0
    timing.first_step = 1005.0
    _stepped(mon, 10, 3)
    tel.tick()
    tel.finish(0, "")
    tel.close(None)
    events = read_events(tmp_path / "events.jsonl")
    kinds = [e["kind"] for e in events]
    assert [k for k in kinds if k != "progress"] == ["launcher_start", "attempt_start", "slow_rank", "hang",
                                                     "attempt_end", "stats", "kill", "attempt_start", "restart",
                                                     "stats", "job_end"]
    # each rank's progress, sampled for the report's lanes: at the first poll, and once it moved again
    progress = [(e["attempt"], {r: v["iteration"] for r, v in e["ranks"].items()}) for e in events
                if e["kind"] == "progress"]
    assert progress[0] == (0, {"0": 12, "1": 12}) and progress[-1] == (1, {"0": 13, "1": 13}), progress
    restart = events[kinds.index("restart")]
    assert restart["phases"] == timing.breakdown() and restart["redone_iterations"] == 2
    assert restart["lost_s"] == pytest.approx(1005.0 - 1000.5 + 2 * 0.1)
    snap = tel.snapshot
    assert snap.hangs == {("1", "section", "step"): 1} and snap.restarts == {"process": 1, "inprocess": 0}
    assert snap.restart_phases["process", "total"] == (timing.breakdown()["total"],)
    assert snap.goodput is not None and snap.goodput.productive_s == pytest.approx(15 * 0.1 - 0.2)
    assert tel.summary()["slow_ranks"] == [1]


def test_the_iteration_reported_at_the_end_is_where_each_rank_ended_not_the_last_poll(tmp_path: Path) -> None:
    """Polls are a second apart; ranks that finish between two polls are reported (events,
    metrics, the textfile) at the iteration their sessions ended at."""
    clock = {"t": 0.0}
    mon = FakeMonitors()
    tel = Telemetry(config=Settings(), monitors=mon, host="h", nproc=2, max_restarts=0,
                    clock=lambda: clock["t"], monotonic=lambda: clock["t"])
    tel.attempt_started(0, "run", 0, {0: 0, 1: 1}, {}, str(tmp_path))
    _stepped(mon, 0, 12)
    clock["t"] = 2.0
    tel.tick()
    assert [v.iteration for v in tel.snapshot.ranks] == [12, 12]
    for lr in (0, 1):  # 18 more steps before the next poll, then the ranks exit
        s = mon.sessions[lr]
        assert s is not None
        for _ in range(18):
            s.open_section("step", clock["t"])
            s.close_section("step", clock["t"] + 0.01)
    mon.end_sessions()
    clock["t"] = 2.5
    tel.attempt_ended("SUCCEEDED", {}, 0)
    tel.finish(0, "")
    tel.close(None)
    assert [v.iteration for v in tel.snapshot.ranks] == [30, 30]
    (end,) = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "attempt_end"]
    assert end["iteration"] == 30
    snap = tel.snapshot
    assert 'ft_rank_iteration{local_rank="0",rank="0"} 30.0' in generate_latest(registry(lambda: snap)).decode()


def test_each_ranks_snapshot_memory_reaches_the_metrics_and_stays_while_it_restarts(tmp_path: Path) -> None:
    clock = {"t": 0.0}
    mon = FakeMonitors()
    tel = Telemetry(config=Settings(), monitors=mon, host="h", nproc=2, max_restarts=0,
                    clock=lambda: clock["t"], monotonic=lambda: clock["t"])
    tel.attempt_started(0, "run", 0, {0: 0, 1: 1}, {}, str(tmp_path))
    _stepped(mon, 0, 3)
    mon.snapshots[0] = SnapshotsStatus(4 << 20, 1 << 30, own=SnapshotPair(2 << 20, 2, 3))
    clock["t"] = 2.0
    tel.tick()
    mon.end_sessions()  # the rank's process is gone; its monitor still holds the memory
    clock["t"] = 4.0
    tel.tick()
    tel.finish(0, "")
    tel.close(None)
    text = generate_latest(registry(lambda: tel.snapshot)).decode()
    assert 'ft_snapshot_bytes_held{local_rank="0",rank="0"} 4.194304e+06' in text
    assert 'ft_snapshot_bytes_limit{local_rank="0",rank="0"} 1.073741824e+09' in text
    assert 'ft_snapshot_bytes_held{local_rank="1"' not in text  # its monitor said nothing of snapshots


def test_a_crash_restart_is_timed_by_the_telemetry_itself(tmp_path: Path) -> None:
    clock = {"t": 0.0}
    mon = FakeMonitors()
    tel = Telemetry(config=Settings(), monitors=mon, host="h", nproc=2, max_restarts=1,
                    clock=lambda: clock["t"], monotonic=lambda: clock["t"])
    tel.attempt_started(0, "run", 0, {0: 0, 1: 1}, {}, str(tmp_path))
    clock["t"] = 5.0
    tel.attempt_ended("FAILED", {0: SimpleNamespace(exitcode=1)}, 1)
    tel.workers_stopping()
    clock["t"] = 5.5
    tel.workers_stopped(5.0, "failure", "SIGTERM", 3.0)
    clock["t"] = 6.0
    tel.rendezvous_done()
    tel.attempt_started(1, "run", 0, {0: 0, 1: 1}, {0: 100, 1: 101}, str(tmp_path))
    clock["t"] = mon.now = 8.0  # the monitors' monotonic clock is the launcher's
    _stepped(mon, 5, 1)  # the workers of attempt 1 (pids 100 and 101) step at 8.0
    tel.tick()
    tel.close(None)
    (restart,) = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "restart"]
    assert restart["cause"] == "failure" and restart["rank"] == 0
    assert restart["phases"]["stop"] == 0.5 and restart["phases"]["total"] == 3.0
    assert restart["lost_s"] is None


def test_a_crash_is_an_incident_whose_redone_work_from_the_file_checkpoint_is_counted(tmp_path: Path) -> None:
    """A new user's crash resumed from a file checkpoint showed no lost work (``resumed_from`` and
    ``redone_iterations`` null) and was missing from ``observability.incidents``."""
    from ft_monitor.launcher.incident.crash import FailedRank, decide_crash

    clock = {"t": 0.0}
    mon = FakeMonitors()
    tel = Telemetry(config=Settings(), monitors=mon, host="h", nproc=2, max_restarts=1,
                    clock=lambda: clock["t"], monotonic=lambda: clock["t"])
    tel.attempt_started(0, "run", 0, {0: 0, 1: 1}, {}, str(tmp_path))
    _stepped(mon, 0, 8)  # 8 steps done; the last checkpoint was at step 5
    clock["t"] = 4.0
    tel.tick()
    clock["t"] = 5.0
    crash = decide_crash([FailedRank(1, 101, 1, "ValueError: bad batch", raised_at=4.9),
                          FailedRank(0, 100, -15, "RuntimeError: Connection closed by peer")])
    tel.attempt_ended("FAILED", {1: SimpleNamespace(exitcode=1), 0: SimpleNamespace(exitcode=-15)}, 1, crash=crash)
    tel.workers_stopping()
    tel.workers_stopped(5.0, "failure", "SIGTERM", 3.0)
    clock["t"] = 6.0
    tel.rendezvous_done()
    tel.attempt_started(1, "run", 0, {0: 0, 1: 1}, {0: 100, 1: 101}, str(tmp_path))
    clock["t"] = mon.now = 8.0  # the monitors' monotonic clock is the launcher's
    _stepped(mon, 5, 1)  # resumed from the file checkpoint's step 5 (the new workers: pids 100 and 101)
    tel.tick()
    tel.close(None)
    (restart,) = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "restart"]
    assert restart["cause"] == "failure" and restart["rank"] == 1
    (incident,) = tel.summary()["incidents"]
    assert incident["rank"] == 1 and incident["resumed_from"] == 5 and incident["redone_iterations"] == 3, incident
    assert restart["redone_iterations"] == 3 and restart["lost_s"] == pytest.approx(incident["lost_s"])
    assert restart["lost_s"] > 3.0  # detection to stepping again, and the redone steps


def test_a_restart_whose_ranks_stepped_and_ended_between_two_slow_ticks_keeps_its_first_step(tmp_path: Path) -> None:
    """Issue 49's flood: a tick waits for torch's look at a slow store (seconds), and the restarted
    ranks started, stepped and finished between two ticks. Before, the first step was stamped only
    when a tick saw every rank stepping: the row lost its first step and total, and the incident
    counted 0.0 s lost to hangs. Now it is each monitor's record of its worker's first progress
    (kept after the worker ended, sent over the socket), the latest of the restart's workers."""
    clock = {"t": 1000.0}
    mon = FakeMonitors()
    tel = Telemetry(config=Settings(), monitors=mon, host="h", nproc=2, max_restarts=1,
                    clock=lambda: clock["t"], monotonic=lambda: clock["t"] - 900.0)  # two clocks, one offset
    tel.attempt_started(0, "run", 0, {0: 0, 1: 1}, {0: 100, 1: 101}, str(tmp_path))
    _stepped(mon, 0, 3)  # attempt 0's workers made progress at monotonic 0
    clock["t"] = 1010.0
    tel.attempt_ended("FAILED", {0: SimpleNamespace(exitcode=1)}, 1)  # a failure: the telemetry times it
    clock["t"] = 1010.5
    tel.workers_stopped(1010.0, "failure", "SIGTERM", 3.0)
    clock["t"] = 1019.5  # a slow rendezvous
    tel.rendezvous_done()
    clock["t"] = 1019.6
    tel.attempt_started(1, "run", 0, {0: 0, 1: 1}, {0: 200, 1: 201}, str(tmp_path))
    for lr, started in ((0, 121.0), (1, 122.5)):  # monotonic: wall 1021.0 and 1022.5
        mon.now = started
        mon.sessions[lr] = Session(rank=lr, pid=200 + lr, started_at=started - 1.0, timeouts=mon.timeouts)
        mon.sessions[lr].open_section("step", started)  # type: ignore[union-attr]
    mon.now = 130.0
    statuses = {lr: MonitorStatus.from_wire(st.to_wire()) for lr, st in mon.statuses().items()}  # over the socket
    ended = {lr: replace(st, rank=None) for lr, st in statuses.items()}  # the ranks finished before the next tick
    mon.statuses = lambda: ended  # type: ignore[method-assign]
    clock["t"] = 1030.0
    tel.tick()
    tel.close(None)
    restarts = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "restart"]
    assert [(r["phases"]["first_step"], r["phases"]["total"]) for r in restarts] == [(2.9, 12.5)], restarts
    # a hang's restart, timed by the agent at its tick (restarts.all_stepping), after the ranks ended
    from ft_monitor.launcher.incident.restarts import running_again_at

    timing = RestartTiming(1, 1008.0, 1008.1, stop_began=1010.0, stopped=1010.5, rendezvous_done=1019.5,
                           workers_started=1019.6, pids=frozenset({200, 201}))
    assert all_stepping(timing, ended, clocks=(1030.0, 130.0))
    assert timing.first_step == pytest.approx(1022.5) and timing.breakdown()["total"] == pytest.approx(14.5)
    stale = {lr: replace(st, first_progress=ExitSummary(100 + lr, "first progress", 0.0)) for lr, st in ended.items()}
    assert running_again_at(stale, timing.pids, wall=1030.0, mono=130.0) is None  # an older attempt's workers


# -- live view, report ----------------------------------------------------------------------------
def test_the_live_view_table_and_json_from_statuses() -> None:
    mon = FakeMonitors()
    _stepped(mon, 40, 2)
    mon.sessions[1].open_section("step", 0.0)  # type: ignore[union-attr]
    mon.now = 1.5
    rows = [Row(f"/run/monitor{lr}.sock", st) for lr, st in mon.statuses().items()]
    rows.append(Row("/run/monitor2.sock", None, "no answer: refused"))
    table = format_table(rows).splitlines()
    assert table[0].split()[:3] == ["rank", "pid", "state"]
    assert table[2].startswith("1 ") and "step (1.5s/60.0s)" in table[2] and "0.100s" in table[2]
    assert table[3].split()[2:] == ["down", "-", "-", "-", "-", "-", "no", "answer:", "refused"]
    data = to_json(rows)
    assert data[0]["iteration"] == 42 and data[1]["section"] == "step" and data[2]["error"] == "no answer: refused"
    json.dumps(data)


def test_the_live_view_escapes_section_names_as_the_other_views_do() -> None:
    """`status --all` printed a rank's section name as it came: an escape sequence in it
    reached the operator's terminal (cleared it, retitled it). `--socket` and `--json` escape."""
    mon = FakeMonitors()
    _stepped(mon, 0, 1)
    evil = "\x1b[2J\x1b]0;owned\x07step"
    mon.sessions[0].open_section(evil, 0.0)  # type: ignore[union-attr]
    mon.timeouts = Timeouts.from_config(Settings(rank_section_timeouts={evil: 60}))
    rows = [Row(f"/run/monitor{lr}.sock", st) for lr, st in mon.statuses().items()]
    table = format_table(rows)
    assert "\x1b" not in table and "\x07" not in table, table
    assert repr(evil) in table.splitlines()[1], table  # the section column, and the timeouts column
    assert f"{repr(evil)}=60" in table


def _ev(kind: str, seq: int, time: float, **fields: Any) -> dict[str, Any]:
    """One schema-valid event (the report renders validated events only)."""
    return validate_event({"v": 1, "seq": seq, "time": time, "kind": kind, "host": fields.pop("host", "h"),
                           "launcher_pid": 1, **fields})


def _hang(seq: int, time: float, **fields: Any) -> dict[str, Any]:
    base = {"attempt": 0, "rank": 1, "local_rank": 1, "pid": 101, "reason": "section", "section": "step",
            "message": "m", "elapsed_s": 1.0, "timeout_s": 1.0, "onset_time": 0.5, "detected_time": 1.5,
            "iteration": 12, "action": "kill", "report": None, "stack_dump": None, "error_file": None,
            "victim_of": None}
    return _ev("hang", seq, time, **{**base, **fields})


def _start(seq: int, time: float, attempt: int = 0, host: str = "h") -> dict[str, Any]:
    return _ev("attempt_start", seq, time, host=host, attempt=attempt, run_id="run", node_rank=0, log_dir=None,
               ranks={"0": {"local_rank": 0, "pid": 100}, "1": {"local_rank": 1, "pid": 101}})


def test_the_report_escapes_what_ranks_wrote() -> None:
    log_events = [_start(0, 0.0, host="<h>"), _hang(1, 2.0, host="<h>", message="<script>alert(1)</script>")]
    page = render(log_events, title="<t>")
    assert "<script>" not in page and "&lt;script&gt;" in page and "&lt;t&gt;" in page and "&lt;h&gt;" in page


def test_the_report_shows_the_verdict_of_the_incident() -> None:
    verdict = "rank 1 is not in a collective (train.py:64 in write_metrics); rank 0 waits in <backward>"
    log_events = [
        _start(0, 0.0),
        _ev("diagnosis", 1, 1.9, attempt=0, rank=1, verdict=verdict, basis="stacks", behind=[1], path="/d.json",
            action="kill", roll_call_s=0.05),
        _hang(2, 2.0),
    ]
    page = render(log_events)
    assert '<p class="verdict top">verdict: rank 1 is not in a collective' in page and "&lt;backward&gt;" in page
    assert '<span class="missing">/d.json (not found)</span>' in page  # named, but not there: no link to nothing


def _run_folder(log_dir: Path, name: str, run_id: str | None = None, host: str = "h", node_rank: int = 0) -> Path:
    run = log_dir / name
    run.mkdir(parents=True)
    log = EventLog(host, pid=7)
    log.attach(run)
    log.emit("attempt_start", 1.0, attempt=0, run_id=run_id or name, node_rank=node_rank,
             ranks={str(2 * node_rank + i): {"local_rank": i, "pid": 10 + i} for i in range(2)}, log_dir=str(run))
    log.close()
    return run


def test_report_given_the_log_dir_finds_its_one_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ft_monitor.cli import main

    run = _run_folder(tmp_path, "job_abc123")
    assert main(["report", str(tmp_path)]) == 0  # before: "<log dir>/events.jsonl does not exist"
    assert capsys.readouterr().out.strip() == str(run / "report.html")
    assert (run / "report.html").exists()


def test_report_given_a_log_dir_shared_by_two_launchers_makes_one_page(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Two launchers of one job with the same --log-dir: one run folder each, one page for both
    (before: refused, "give one of them")."""
    from ft_monitor.cli import main

    _run_folder(tmp_path, "job_x1", run_id="job", host="node-a", node_rank=0)
    _run_folder(tmp_path, "job_x2", run_id="job", host="node-b", node_rank=1)
    assert main(["report", str(tmp_path)]) == 0
    page = Path(capsys.readouterr().out.strip())
    assert page == tmp_path / "report.html"
    text = page.read_text()
    assert [f'data-rank="{r}"' in text for r in range(4)] == [True] * 4
    assert "node-a, node-b" in text and '<a class="evidence-link" href="job_x1/events.jsonl">' in text


def test_report_of_run_folders_of_different_jobs_lists_them(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from ft_monitor.cli import main

    runs = [_run_folder(tmp_path, name) for name in ("job_a", "job_b")]
    assert main(["report", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ft-monitor report: the run folders are of 2 different jobs (run id job_a: {runs[0]}; "
                          f"run id job_b: {runs[1]}); give the folders of one job"), err
    assert not (tmp_path / "report.html").exists()


def test_an_inprocess_restart_is_counted_with_its_own_phases(tmp_path: Path) -> None:
    clock = {"t": 50.0}
    tel = Telemetry(config=Settings(), monitors=FakeMonitors(), host="h", nproc=2, max_restarts=1,
                    clock=lambda: clock["t"], monotonic=lambda: clock["t"])
    tel.attempt_started(0, "run", 0, {0: 0, 1: 1}, {0: 100, 1: 101}, str(tmp_path))
    notice = {"rank": 1, "pid": 101, "reason": "section", "section": "step", "message": "m", "elapsed_s": 2.0,
              "timeout_s": 2.0, "onset_time": 48.0, "detected_time": 50.0, "iteration": 12, "attempt": 0,
              "report": "/r.json", "restart_iteration": 1}
    tel.inprocess_hang(notice)
    phases = {"notify": 0.01, "abort": 0.02, "interrupt": 0.0, "finalize": 0.15, "barrier": 0.01, "reinit": 0.01,
              "first_step": 0.02, "total": 0.22}
    clock["t"] = 50.5
    tel.inprocess_restart({"kind": "inprocess", "attempt": 0, "iteration": 1, "rank": 1, "reason": "section",
                           "message": "m", "report": "/r.json", "detected_time": 50.0, "phases": phases})
    tel.finish(0, "")
    tel.close(None)
    events = read_events(tmp_path / "events.jsonl")
    hang, restart = (e for e in events if e["kind"] in ("hang", "restart"))
    assert hang["action"] == "inprocess" and hang["rank"] == 1
    assert restart["mode"] == "inprocess" and restart["cause"] == "hang" and restart["phases"] == phases
    assert restart["lost_s"] == pytest.approx(50.0 + 0.22 - 48.0)  # onset -> every rank stepping again
    snap = tel.snapshot
    assert snap.restarts == {"process": 0, "inprocess": 1} and snap.hangs == {("1", "section", "step"): 1}
    assert snap.restart_phases["inprocess", "total"] == (0.22,) and ("process", "total") not in snap.restart_phases


def test_notices_of_ranks_that_waited_for_the_hung_one_are_one_inprocess_hang(tmp_path: Path) -> None:
    clock = {"t": 50.0}
    tel = Telemetry(config=Settings(), monitors=FakeMonitors(), host="h", nproc=2, max_restarts=1,
                    clock=lambda: clock["t"], monotonic=lambda: clock["t"])
    tel.attempt_started(0, "run", 0, {0: 0, 1: 1}, {0: 100, 1: 101}, str(tmp_path))
    base = {"reason": "section", "section": "step", "message": "m", "elapsed_s": 2.0, "timeout_s": 2.0,
            "detected_time": 50.0, "iteration": 12, "attempt": 0, "report": "/r.json", "restart_iteration": 1}
    tel.inprocess_hang({**base, "rank": 0, "pid": 100, "onset_time": 48.3})  # waited in the all-reduce: first here
    tel.inprocess_hang({**base, "rank": 1, "pid": 101, "onset_time": 48.0})  # the hung rank
    clock["t"] = 50.5
    tel.inprocess_restart({"kind": "inprocess", "attempt": 0, "iteration": 1, "rank": 1, "reason": "section",
                           "message": "m", "report": "/r.json", "detected_time": 50.0, "phases": {"total": 0.22}})
    tel.finish(0, "")
    tel.close(None)
    events = read_events(tmp_path / "events.jsonl")
    assert [e["kind"] for e in events].count("hang") == 1 and tel.snapshot.hangs == {("1", "section", "step"): 1}
    (restart,) = (e for e in events if e["kind"] == "restart")
    assert restart["lost_s"] == pytest.approx(50.0 + 0.22 - 48.0)  # from the hung rank's onset
    assert len(tel.incidents) == 1 and tel.incidents[0].rank == 1


def test_an_inprocess_hang_notice_that_comes_after_its_restart_row_is_named_after_the_culprit(
        tmp_path: Path) -> None:
    """Under load the ledger's row (read from the monitors' status) can close the restart before the
    launcher has handled the hang notice of the waiting rank that reported first: the hang event
    named that waiting rank (rank 0), once, when the attempt ended (seen in one full-suite run)."""
    clock = {"t": 50.0}
    tel = Telemetry(config=Settings(), monitors=FakeMonitors(), host="h", nproc=2, max_restarts=1,
                    clock=lambda: clock["t"], monotonic=lambda: clock["t"])
    tel.attempt_started(0, "run", 0, {0: 0, 1: 1}, {0: 100, 1: 101}, str(tmp_path))
    tel.inprocess_restart({"kind": "inprocess", "attempt": 0, "iteration": 1, "rank": 1, "reason": "section",
                           "message": "m", "report": "/r.json", "detected_time": 50.0, "phases": {"total": 0.22}})
    base = {"reason": "section", "section": "step", "message": "m", "elapsed_s": 2.0, "timeout_s": 2.0,
            "detected_time": 50.0, "iteration": 12, "attempt": 0, "report": "/r.json", "restart_iteration": 1}
    clock["t"] = 51.0
    tel.inprocess_hang({**base, "rank": 0, "pid": 100, "onset_time": 48.3})  # the waiting rank, reported first
    tel.inprocess_hang({**base, "rank": 1, "pid": 101, "onset_time": 48.0})  # part of the same restart
    tel.attempt_ended("SUCCEEDED", {}, 1)
    tel.close(None)
    hangs = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "hang"]
    assert [(h["rank"], h.get("reported_by", {}).get("rank")) for h in hangs] == [(1, 0)], hangs
    assert len(tel.incidents) == 1 and tel.incidents[0].rank == 1 and tel.snapshot.hangs == {("1", "section", "step"): 1}


def test_an_inprocess_hang_whose_ranks_never_come_back_is_still_an_event(tmp_path: Path) -> None:
    # the fallback to the process restart: the row never completes, so the hang event (which waits
    # for the ranks' word on the culprit) is emitted when the attempt ends
    tel = Telemetry(config=Settings(), monitors=FakeMonitors(), host="h", nproc=2, max_restarts=1,
                    clock=lambda: 50.0, monotonic=lambda: 50.0)
    tel.attempt_started(0, "run", 0, {0: 0, 1: 1}, {0: 100, 1: 101}, str(tmp_path))
    tel.inprocess_hang({"rank": 1, "pid": 101, "reason": "section", "section": "step", "message": "m",
                        "elapsed_s": 2.0, "timeout_s": 2.0, "onset_time": 48.0, "detected_time": 50.0,
                        "iteration": 12, "attempt": 0, "report": "/r.json", "restart_iteration": 1})
    tel.attempt_ended("FAILED", {1: SimpleNamespace(exitcode=-15, message="")}, 1)
    tel.close(None)
    kinds = [(e["kind"], e.get("rank")) for e in read_events(tmp_path / "events.jsonl")]
    assert ("hang", 1) in kinds and kinds.index(("hang", 1)) < kinds.index(("attempt_end", None))


def test_a_waiting_nodes_hang_event_names_the_culprit_and_its_own_rank_only_as_waiting() -> None:
    """On the node whose rank waited for another node's hung rank, the ``hang`` event said
    ``rank: 0`` (its own rank): it names the culprit now, its waiting rank under ``waiting``."""
    from ft_monitor.launcher.telemetry.telemetry_fields import hang_fields

    row = {"attempt": 0, "rank": 3, "local_rank": None, "pid": None, "victim_of": 3, "reason": "section",
           "section": "step", "message": "section 'step' open for 2.1 s", "elapsed_s": 2.1, "timeout_s": 2.0,
           "onset_time": 10.0, "detected_time": 12.1, "iteration": 7, "report": "/r0.json",
           "stack_dump": "/s0.txt", "error_file": "/e0.json", "waiting": {"rank": 0, "local_rank": 0, "pid": 4080}}
    fields = hang_fields(row, "kill")
    assert (fields["rank"], fields["victim_of"], fields["local_rank"], fields["pid"]) == (3, 3, None, None)
    assert fields["waiting"] == {"rank": 0, "local_rank": 0, "pid": 4080}
    assert fields["stack_dump"] == "/s0.txt" and fields["message"] == "section 'step' open for 2.1 s"
    event = _ev("hang", 1, 12.2, **fields)  # schema-valid
    from ft_monitor.views.report_model import build

    (inc,) = build([_start(0, 0.0), event]).incidents  # only the waiting node's folder
    assert inc.rank == 3 and inc.waited_on_other_nodes == (0,) and "rank 0 on h waited for it" in inc.what
