"""The launcher's hang verdict (ft_monitor.launcher.incident.decide), on plain values.

No processes, no torch store, no real clock: ``now`` is a fixed number, other
nodes' store values are bytes signed (or not) with a test secret.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any

import pytest

from ft_monitor.core.notices import HangNotice
from ft_monitor.core.status import MonitorStatus
from ft_monitor.launcher import exit_codes
from ft_monitor.launcher.incident.decide import (
    HANG_EXIT_CODE,
    AttemptVerdict,
    HangDecision,
    LogLine,
    RollCallFindings,
    WorkerRef,
    decide_attempt_end,
    decide_hang,
    first_hang,
    iteration_high,
    read_hang_record,
    triage_hang,
    with_diagnosis,
)
from ft_monitor.launcher.incident.progress import Progress, ProgressPolicy, ProgressTracker
from ft_monitor.launcher.store.store_auth import HangRecord, StoreChannel, StoreMessageError

SECRET = b"s" * 32
RUN = "run-1"
HOST = "node0"
NOW = 1_000_000.0
"""The fake clock: wall-clock seconds when the launcher takes the notice up."""
KEY = "ft_launcher/hang/{}"
WORKERS = (WorkerRef(global_rank=0, local_rank=0, pid=100), WorkerRef(global_rank=1, local_rank=1, pid=101))
POLICY = ProgressPolicy(max_no_progress_cycles=3, min_progress_iterations=1)
FRESH = Progress()


def notice(pid: int = 101, rank: int = 1, onset: float = NOW - 2.0, detected: float = NOW - 0.05,
           **kw: Any) -> HangNotice:
    fields: dict[str, Any] = dict(
        rank=rank, pid=pid, reason="section", section="step", message="section 'step' open for 2.0 s, timeout 2.0 s",
        elapsed_s=2.0, timeout_s=2.0, onset_time=onset, detected_time=detected, iteration=12,
        report="/r/hang.json", stack_dump="/r/stack.txt", stack_dump_captured=True, error_file=None)
    fields.update(kw)
    return HangNotice(**fields)


def channel(secret: bytes = SECRET, run: str = RUN) -> StoreChannel:
    return StoreChannel(secret, run)


def signed(node: int, record: HangRecord, ch: StoreChannel | None = None) -> tuple[str, bytes]:
    key = KEY.format(node)
    return key, (ch or channel()).encode(key, record)


def decide(n: HangNotice | None = None, *, peers: dict[str, bytes] | None = None, ch: StoreChannel | None = None,
           stack: str | None = "Thread 1:\n  File x.py, line 3\n", high: int | None = 12,
           progress: Progress = FRESH, remaining: int = 2, now: float = NOW) -> HangDecision:
    n = n or notice()
    t = triage_hang(n, WORKERS, HOST)
    assert t.worker is not None and t.record is not None
    return decide_hang(n, t.worker, t.record, now=now, peer_values=peers or {}, channel=ch or channel(),
                       stack=stack, error_file="/logs/attempt_0/1/error.json", attempt=0, high=high,
                       progress=progress, policy=POLICY, remaining_restarts=remaining)


HUNG_LINE = ("ft-launcher: rank 1 (local rank 1, pid 101) hung: section 'step' open for 2.0 s, timeout 2.0 s; "
             "stopping the worker group")
"""The one "hung" line of a hang of rank 1 that its own monitor reported."""

# -- triage ---------------------------------------------------------------------------------


def test_notice_for_a_current_worker_is_acted_on() -> None:
    t = triage_hang(notice(), WORKERS, HOST)
    assert t.act and t.worker == WORKERS[1]
    assert t.record == HangRecord(1, NOW - 2.0, notice().message, HOST)
    assert [(line.level, line.text()) for line in t.logs] == [
        (logging.ERROR, "ft-launcher: rank 1 (local rank 1, pid 101) hung: section 'step' open for 2.0 s, "
                        "timeout 2.0 s; stopping the worker group")]


def test_notice_for_a_worker_of_a_stopped_attempt_is_ignored() -> None:
    t = triage_hang(notice(pid=99), WORKERS, HOST)
    assert not t.act and t.worker is None and t.record is None
    assert [(line.level, line.text()) for line in t.logs] == [
        (logging.INFO, "ft-launcher: ignoring a hang notice for pid 99, not a current worker")]


def test_the_rank_is_the_workers_not_the_notices() -> None:
    # the launcher's own worker table decides which rank failed, whatever rank the notice names
    t = triage_hang(notice(pid=100, rank=7), WORKERS, HOST)
    assert t.worker == WORKERS[0] and t.record is not None and t.record.rank == 0


def test_log_text_is_made_printable() -> None:
    t = triage_hang(notice(message="bad\x1b[2Jtext"), WORKERS, HOST)
    assert "\x1b" not in t.logs[0].text()


# -- first hang ------------------------------------------------------------------------------


def test_first_hang_on_one_node() -> None:
    d = decide()
    assert d.root_cause.rank == 1 and d.victim_of is None
    assert [line.text() for line in d.logs] == [HUNG_LINE] and d.ignored_records == ()
    assert d.worker == WORKERS[1] and d.exitcode == HANG_EXIT_CODE == -15
    assert d.error_file == "/logs/attempt_0/1/error.json"
    headline = d.error_data["message"]["message"]
    assert headline.startswith("RankHang: section 'step' open for 2.0 s") and "(rank 1, pid 101)" in headline
    assert d.error_data["message"]["extraInfo"]["timestamp"] == str(int(NOW - 2.0))  # the onset: torch's root cause
    assert d.error_data["message"]["extraInfo"]["py_callstack"].endswith("Thread 1:\n  File x.py, line 3\n")
    assert d.summary == {**notice().to_wire(), "error_file": d.error_file, "local_rank": 1, "attempt": 0,
                         "victim_of": None}


def test_detection_time_comes_from_the_daemon_else_the_clock() -> None:
    d = decide(now=NOW)
    assert (d.detected, d.received) == (NOW - 0.05, NOW)
    d = decide(notice(detected=0.0), now=NOW + 7)
    assert (d.detected, d.received) == (NOW + 7, NOW + 7)


def test_no_stack_dump_captured() -> None:
    d = decide(notice(stack_dump=None, stack_dump_captured=False), stack=None)
    assert d.error_data["message"]["extraInfo"]["py_callstack"].endswith("(no stack dump was captured)")


def test_earliest_onset_across_nodes_wins_and_this_rank_is_its_victim() -> None:
    peers = dict([signed(1, HangRecord(5, NOW - 3.0, "section 'step' open", "node1")),
                  signed(2, HangRecord(9, NOW - 4.0, "heartbeat missed", "node2")),
                  signed(3, HangRecord(12, NOW - 1.0, "late victim", "node3"))])
    d = decide(peers=peers)
    assert d.root_cause == HangRecord(9, NOW - 4.0, "heartbeat missed", "node2")
    assert d.victim_of == d.root_cause and d.summary["victim_of"] == 9
    assert [line.text() for line in d.logs] == [
        "ft-launcher: rank 9 on node2 hung first (heartbeat missed); rank 1 here (local rank 1, pid 101) was waiting "
        "for it; stopping the worker group"]
    assert d.error_data["message"]["message"].startswith("RankHang: rank 9 on node2 hung first (heartbeat missed); "
                                                          "this rank was waiting for it: ")
    # the timestamp stays this rank's own onset: torch picks the earliest error file of *this* node
    assert d.error_data["message"]["extraInfo"]["timestamp"] == str(int(NOW - 2.0))


def test_this_node_hung_first() -> None:
    peers = dict([signed(1, HangRecord(5, NOW - 1.0, "victim", "node1"))])
    d = decide(peers=peers)
    assert d.root_cause.rank == 1 and d.root_cause.host == HOST and d.victim_of is None
    assert [line.text() for line in d.logs] == [HUNG_LINE]


def test_a_tie_goes_to_this_node() -> None:
    peers = dict([signed(1, HangRecord(5, NOW - 2.0, "same onset", "node1"))])
    assert decide(peers=peers).victim_of is None


def test_same_rank_reported_elsewhere_is_not_a_victim() -> None:
    peers = dict([signed(1, HangRecord(1, NOW - 9.0, "same rank, older record", "node1"))])
    d = decide(peers=peers)
    assert d.root_cause.onset_time == NOW - 9.0 and d.victim_of is None


def test_unsigned_forged_replayed_and_malformed_records_are_ignored() -> None:
    early = HangRecord(5, NOW - 100.0, "forged: would blame rank 5", "evil")
    body = {"rank": 5, "onset_time": NOW - 100.0, "message": "x", "host": "evil"}
    other_job = channel(secret=b"o" * 32)
    replayed_key, replayed = signed(4, early)  # authentic, but written for another key
    peers = {
        KEY.format(1): json.dumps({"v": 1, "kind": "hang", "key": KEY.format(1), "run": RUN, "body": body}).encode(),
        KEY.format(2): signed(2, early, other_job)[1],
        KEY.format(3): replayed,
        KEY.format(4): b"\xff not json",
        KEY.format(5): signed(5, early, channel(run="run-0"))[1],  # an earlier rendezvous round
        KEY.format(6): channel().encode(KEY.format(6), replace(early, host="x" * 5000)),  # text too long
    }
    d = decide(peers=peers)
    assert d.root_cause.rank == 1 and d.victim_of is None and [line.text() for line in d.logs] == [HUNG_LINE]
    why = dict(d.ignored_records)
    assert sorted(why) == sorted(peers)
    assert why[KEY.format(1)] == "not signed"
    assert why[KEY.format(2)].startswith("bad signature")
    assert "another key" in why[KEY.format(3)] and "another key" in why[KEY.format(5)]
    assert why[KEY.format(4)] == "not JSON"
    assert why[KEY.format(6)].startswith("field host must be text")
    assert replayed_key == KEY.format(4)


def test_an_authentic_record_beside_bad_ones_still_counts() -> None:
    peers = {KEY.format(1): b"garbage", **dict([signed(2, HangRecord(3, NOW - 5.0, "first", "node2"))])}
    d = decide(peers=peers)
    assert d.victim_of is not None and d.victim_of.rank == 3
    assert [k for k, _ in d.ignored_records] == [KEY.format(1)]


def test_without_a_secret_no_peer_record_is_believed() -> None:
    mine = HangRecord(1, NOW - 2.0, "m", HOST)
    first, ignored = first_hang(mine, None, dict([signed(1, HangRecord(5, NOW - 9.0, "e", "n1"))]))
    assert first == mine and ignored == ((KEY.format(1), "no job secret to check it with"),)


def test_on_hang_dump_a_peer_record_of_an_earlier_incident_is_not_the_first_hang() -> None:
    """The round goes on after a diagnosed hang: node 1's record of the first incident stays
    in the store, and must not claim the second (the roll call would then be nobody's)."""
    mine = HangRecord(1, NOW - 2.0, "second incident", HOST)
    peers = dict([signed(1, HangRecord(5, NOW - 60.0, "first incident", "n1")),
                  signed(2, HangRecord(6, NOW - 3.0, "second incident, earlier", "n2"))])
    first, ignored = first_hang(mine, channel(), peers, after=NOW - 30.0)
    assert first.rank == 6 and ignored == ((KEY.format(1), "a hang of an earlier incident"),)
    assert first_hang(mine, channel(), peers)[0].rank == 5  # without the bound: the stale record wins


def test_read_hang_record() -> None:
    rec = HangRecord(2, 5.0, "m", "h")
    key, raw = signed(0, rec)
    assert read_hang_record(channel(), key, raw) == rec
    assert isinstance(read_hang_record(channel(), KEY.format(1), raw), StoreMessageError)


# -- progress: restart or stop --------------------------------------------------------------


def test_progress_made_keeps_restarting() -> None:
    d = decide(high=20, progress=Progress(best=10, no_progress=2))
    assert d.attempt == AttemptVerdict(Progress(20, 0), 2, None, "", ()) and d.attempt.restart


def test_no_progress_for_max_cycles_stops_restarting() -> None:
    d = decide(high=10, progress=Progress(best=10, no_progress=2), remaining=2)
    v = d.attempt
    assert not v.restart and v.restarts_left == 0 and v.outcome == exit_codes.NO_PROGRESS
    assert v.progress == Progress(10, 3)
    assert v.outcome_message == ("the training iteration did not advance past 10 in 3 consecutive attempt(s) "
                                 "(max_no_progress_cycles=3)")
    assert v.logs == (LogLine(logging.ERROR, "ft-launcher: %s; not restarting again", (v.outcome_message,)),)


def test_no_progress_yet_below_the_limit() -> None:
    v = decide(high=10, progress=Progress(best=10, no_progress=0)).attempt
    assert v == AttemptVerdict(Progress(10, 1), 2, None, "", ())


def test_no_progress_with_no_restarts_left_is_not_an_outcome() -> None:
    # the budget is spent anyway: torch's own failure (exit 1) stands, the record still advances
    v = decide(high=10, progress=Progress(best=10, no_progress=2), remaining=0).attempt
    assert v == AttemptVerdict(Progress(10, 3), 0, None, "", ())


def test_nothing_judged_until_an_iteration_is_reported() -> None:
    v = decide(high=None, progress=Progress(), remaining=5).attempt
    for _ in range(10):
        v = decide_attempt_end(None, v.progress, POLICY, v.restarts_left)
    assert v.outcome is None and v.restarts_left == 5 and v.progress == Progress(None, 11)


def test_min_progress_iterations() -> None:
    policy = ProgressPolicy(max_no_progress_cycles=1, min_progress_iterations=5)
    assert decide_attempt_end(14, Progress(best=10), policy, 3).outcome == exit_codes.NO_PROGRESS
    assert decide_attempt_end(15, Progress(best=10), policy, 3) == AttemptVerdict(Progress(15), 3, None, "", ())
    assert ProgressPolicy(3, 0).min_progress_iterations == 1


def test_max_no_progress_cycles_zero_never_stops() -> None:
    policy = ProgressPolicy(max_no_progress_cycles=0)
    v = decide_attempt_end(1, Progress(best=1, no_progress=1000), policy, 3)
    assert v.outcome is None and v.restarts_left == 3


def test_tracker_matches_the_pure_record() -> None:
    tracker = ProgressTracker(2, 1)
    state = Progress()
    for it in [None, 3, 3, 4, 4, 4]:
        state, stop = state.after_attempt(it, ProgressPolicy(2, 1))
        assert tracker.attempt_ended(it) == stop
        assert (tracker.best, tracker.no_progress) == (state.best, state.no_progress)
    assert tracker.describe() == state.describe(ProgressPolicy(2, 1))


def _status(high: int | None) -> MonitorStatus:
    return MonitorStatus(monitor_pid=1, socket="s", uptime_s=1.0, sessions=1, hangs_detected=0,
                         iteration_high=high, timeouts={}, rank=None, last_hang=None)


def test_iteration_high_from_daemon_statuses() -> None:
    assert iteration_high({}) is None
    assert iteration_high({0: None, 1: _status(None)}) is None
    assert iteration_high({0: _status(7), 1: None, 2: _status(12), 3: _status(None)}) == 12


def test_decision_is_a_frozen_value() -> None:
    d = decide()
    with pytest.raises(AttributeError):
        d.exitcode = 0  # type: ignore[misc]
    assert decide() == d  # same inputs, same verdict


# -- the culprit, once the roll call's evidence is in ----------------------------------------

ERROR_FILES = {0: "/logs/attempt_0/0/error.json", 1: "/logs/attempt_0/1/error.json"}
VERDICT = ("rank 1 is not in a collective (train.py:64 in write_metrics); rank 0 waits in backward "
           "(train.py:168 in train)")


def findings(culprit: int | None, **kw: Any) -> RollCallFindings:
    fields: dict[str, Any] = dict(path="/logs/attempt_0/diagnosis.json", verdict=VERDICT, culprit=culprit,
                                  host=HOST, pid=101, stack="Thread 1:\n  File train.py, line 64\n",
                                  stack_dump="/logs/attempt_0/1/rank1-pid101-stack.txt")
    fields.update(kw)
    return RollCallFindings(**fields)


def heartbeat_notice_of_rank0() -> HangNotice:
    """Rank 0 waits in backward for rank 1; with a heartbeat timeout its monitor fired first."""
    return notice(pid=100, rank=0, reason="heartbeat", section=None, onset=NOW - 3.0,
                  message="no heartbeat for 3.0 s, heartbeat timeout 3.0 s", report="/r/rank0-hang.json",
                  stack_dump="/r/rank0-stack.txt")


def test_the_waiting_rank_whose_monitor_fired_first_is_not_the_culprit() -> None:
    n = heartbeat_notice_of_rank0()
    d = with_diagnosis(decide(n), n, "rank 0's stack", findings(1), WORKERS, ERROR_FILES)
    assert d.worker == WORKERS[1] and d.root_cause.rank == 1 and d.victim_of is None
    assert d.error_file == ERROR_FILES[1]
    assert (d.summary["rank"], d.summary["local_rank"], d.summary["pid"]) == (1, 1, 101)
    assert d.summary["victim_of"] is None and d.summary["reported_by"]["rank"] == 0
    assert d.summary["stack_dump"] == "/logs/attempt_0/1/rank1-pid101-stack.txt" and d.summary["error_file"] == \
        ERROR_FILES[1]
    assert d.summary["message"].startswith(VERDICT) and "rank 0's monitor reported first" in d.summary["message"]
    (line,) = d.logs
    assert line.text().startswith("ft-launcher: rank 1 (local rank 1, pid 101) hung: " + VERDICT)
    headline = d.error_data["message"]["message"]
    assert headline.startswith("RankHang: " + VERDICT) and "(rank 1, pid 101)" in headline
    assert "rank1-pid101-stack.txt" in headline and "rank0" not in headline.split("reported first")[0]
    assert d.error_data["message"]["extraInfo"]["py_callstack"].endswith("File train.py, line 64\n")


def test_the_culprit_stays_when_the_evidence_agrees_or_is_only_the_monitors() -> None:
    for culprit in (1, None):
        n = notice()
        d = with_diagnosis(decide(n), n, "stack", findings(culprit), WORKERS, ERROR_FILES)
        assert d.worker == WORKERS[1] and d.summary["rank"] == 1 and "reported_by" not in d.summary
        assert d.summary["verdict"] == VERDICT and d.summary["diagnosis"].endswith("diagnosis.json")
        assert [line.text() for line in d.logs] == [HUNG_LINE]


def test_a_culprit_on_another_node_makes_this_rank_its_victim() -> None:
    n = heartbeat_notice_of_rank0()
    d = with_diagnosis(decide(n), n, "stack", findings(3, host="node1"), WORKERS, ERROR_FILES)
    assert d.worker == WORKERS[0] and d.victim_of is not None and d.victim_of.rank == 3
    # the row names the culprit, as every node's row of the incident does; this rank waited for it
    assert d.summary["victim_of"] == 3 and d.summary["rank"] == 3 and d.summary["waiting"]["rank"] == 0
    (line,) = d.logs
    assert line.text().startswith("ft-launcher: rank 3 on node1 hung first") and "rank 0 here" in line.text()
    assert d.error_data["message"]["message"].startswith("RankHang: rank 3 on node1 hung first")
