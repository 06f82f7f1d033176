"""The root of a crash, decided once (ft_monitor/launcher/incident/crash.py), and what the launcher's
outputs take from it: pure, with plain values (the real kill -9 runs are in test_e2e_launcher.py)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ft_monitor.core.status import ExitSummary, MonitorStatus, build_status
from ft_monitor.launcher.incident.crash import (
    FailedRank,
    decide_crash,
    on_another_node,
    peer_failure,
)
from ft_monitor.launcher.incident.restarts import failed_ranks, failure_restart
from ft_monitor.launcher.incident.rootcause import crash_error_data, remote_crash_error_data
from ft_monitor.launcher.store.store_auth import CrashRecord, StoreChannel, StoreMessageError
from ft_monitor.launcher.telemetry import summary_text
from ft_monitor.launcher.telemetry.metrics import Snapshot, collect

GLOO_RESET = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4242: "
              "Connection reset by peer")
GLOO_CLOSED = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4243"
NCCL_REMOTE = ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process "
               "exited or there was a network error, NCCL version 2.21.5")
NCCL_WATCHDOG = "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=23, OpType=ALLREDUCE) ran for 600000 ms"
STORE_GONE = "torch.distributed.DistNetworkError: failed to recv, got 0 bytes"
KILL, TERM, ABRT, SEGV = (-int(s) for s in (signal.SIGKILL, signal.SIGTERM, signal.SIGABRT, signal.SIGSEGV))


@pytest.mark.parametrize("error", [GLOO_RESET, GLOO_CLOSED, NCCL_REMOTE, NCCL_WATCHDOG, STORE_GONE,
                                   "Gloo connectFullMesh failed with Connection refused"])
def test_a_peers_death_is_recognised_in_the_errors_gloo_nccl_and_the_store_raise(error: str) -> None:
    assert peer_failure(error)


@pytest.mark.parametrize("error", ["RuntimeError: rank 0 crashed at step 7 (on purpose)", "ValueError: bad batch",
                                   "torch.OutOfMemoryError: CUDA out of memory"])
def test_an_error_of_the_rank_itself_is_not_a_peers(error: str) -> None:
    assert not peer_failure(error)


def test_a_killed_rank_is_the_root_though_its_peer_raised_first() -> None:
    # the review's case: rank 1 SIGKILLed; rank 0's all-reduce fails and it raises (its monitor heard it
    # first), then torch stops it; the first rank that raised is the victim
    v = decide_crash([FailedRank(0, 100, TERM, GLOO_RESET, raised_at=5.0, timestamp=10),
                      FailedRank(1, 101, KILL, None, gone_at=5.2, timestamp=11)])
    assert (v.root, v.root_seen, v.victims, v.others) == (1, True, (0,), ())
    assert v.how == "rank 1 (pid 101) was killed by SIGKILL"
    assert v.message == (f"rank 1 (pid 101) was killed by SIGKILL; failed because of it: rank 0 (pid 100) raised "
                         f"{GLOO_RESET} and was killed by SIGTERM")


def test_a_killed_rank_is_the_root_when_no_monitor_saw_anything() -> None:
    v = decide_crash([FailedRank(0, 100, 1, GLOO_CLOSED, timestamp=10), FailedRank(1, 101, KILL, timestamp=12)])
    assert (v.root, v.victims) == (1, (0,))


def test_a_rank_that_raised_its_own_error_first_is_the_root_and_its_peers_abort_is_not() -> None:
    # rank 0 raised; rank 1, whose all-reduce then failed, died of SIGABRT in its teardown (gone before rank 0's
    # process, but after rank 0 raised)
    v = decide_crash([FailedRank(0, 100, 1, "RuntimeError: bad batch", raised_at=5.0, gone_at=5.5),
                      FailedRank(1, 101, ABRT, None, gone_at=5.3)])
    assert (v.root, v.others, v.victims) == (0, (1,), ())
    # with no times at all, an exception still comes before a SIGABRT
    v = decide_crash([FailedRank(1, 101, ABRT), FailedRank(0, 100, 1, "RuntimeError: bad batch")])
    assert v.root == 0


def test_of_two_faults_of_their_own_the_earlier_is_the_root() -> None:
    v = decide_crash([FailedRank(0, 100, 1, "ValueError: bad batch", raised_at=7.0),
                      FailedRank(1, 101, SEGV, None, gone_at=6.0)])
    assert (v.root, v.others) == (1, (0,))
    assert v.message.startswith("rank 1 (pid 101) was killed by SIGSEGV; then rank 0 (pid 100) raised ValueError")
    # a time known beats a time unknown; without times: a signal, an exit, an exception
    assert decide_crash([FailedRank(0, 100, 3), FailedRank(1, 101, SEGV, None, gone_at=1.0)]).root == 1
    assert decide_crash([FailedRank(0, 100, 3), FailedRank(1, 101, SEGV)]).root == 1
    assert decide_crash([FailedRank(0, 100, 1, "ValueError: x"), FailedRank(1, 101, 3)]).how == \
        "rank 1 (pid 101) exited with code 3"


def test_when_every_rank_here_lost_a_peer_no_rank_here_is_named_the_root() -> None:
    # issue 56: a node without the other node's record printed "attempt 0 failed: rank 2 (pid 200) raised
    # RuntimeError: ... Connection reset by peer (every failed rank here lost a peer; ...)", its own victim as
    # the root, and summary.json, the events and the restart line named rank 2. Now: on another node, or unknown
    v = decide_crash([FailedRank(2, 200, 1, GLOO_RESET, raised_at=5.1), FailedRank(3, 201, TERM)])
    assert (v.root_seen, v.named, v.victims) == (False, None, (3,))
    assert v.message.startswith("the root of the failure is on another node or unknown; every rank that failed "
                                "here lost a peer: rank 2 (pid 200) raised RuntimeError"), v.message
    assert v.message.endswith("rank 3 (pid 201) was killed by SIGTERM")
    row = failure_restart(v, 0).row()
    assert (row["rank"], row["root_seen"]) == (None, False), row
    rows = summary_text.rows({"restarts": [row], "exit_code": 0})
    assert ("failed", "in attempt 0, the root of the failure is on another node or unknown (every rank that failed "
                      "here lost a peer); the worker group restarted") in rows, rows
    assert not any(row_ is not None and row_[0] == "failed" and "rank 2" in row_[1] for row_ in rows), rows
    # the report page: no rank named for the incident, the ranks here listed as what they are
    from ft_monitor.views.report_model import _crash_verdict
    event = {"root": None, **v.row()}
    assert _crash_verdict(event) == (None, None, "the root is on another node or unknown; every rank that failed "
                                                 f"here lost a peer: {v.how}")
    # once the other node's record arrives, it names the root, and the ranks here are its victims
    there = on_another_node(7, "rank 7 (pid 700) was killed by SIGKILL", "node-b", v)
    assert (there.named, there.victims) == (7, (2, 3)) and there.message.startswith("rank 7 (pid 700) was killed")


def test_a_victim_here_of_a_root_on_another_node_gets_an_error_file_naming_it() -> None:
    # issue 56: the node whose ranks only lost a peer had no error.json naming the root (its ranks wrote
    # none, or their own "Connection closed by peer"): torch's failure table there named its own rank
    here = decide_crash([FailedRank(2, 200, 1, GLOO_CLOSED, raised_at=5.1), FailedRank(3, 201, TERM)])
    v = on_another_node(1, "rank 1 (pid 101) was killed by SIGKILL", "node-a", here)
    own = {"message": {"message": GLOO_CLOSED, "extraInfo": {"py_callstack": "Traceback: in all_reduce",
                                                              "timestamp": "1700000009"}}}
    data = remote_crash_error_data(v, 2, own, 1700000005)["message"]
    assert data["message"] == ("RankCrash: rank 1 (pid 101) was killed by SIGKILL on node-a (another node), the "
                               "root of the failure; rank 2 here failed because of it"), data
    assert data["extraInfo"]["timestamp"] == "1700000005"
    assert f"rank 2's own error: {GLOO_CLOSED}\nTraceback: in all_reduce" in data["extraInfo"]["py_callstack"]
    bare = remote_crash_error_data(v, 2, None, 1700000005)["message"]["extraInfo"]["py_callstack"]
    assert "(rank 2 wrote no error file of its own)" in bare


def test_the_root_on_another_node_makes_every_rank_here_a_victim() -> None:
    here = decide_crash([FailedRank(2, 200, 1, GLOO_RESET, raised_at=5.1), FailedRank(3, 201, TERM)])
    v = on_another_node(1, "rank 1 (pid 101) was killed by SIGKILL", "node-a", here)
    assert (v.root, v.root_seen, v.victims, v.host) == (1, True, (2, 3), "node-a")
    assert v.message.startswith("rank 1 (pid 101) was killed by SIGKILL on node-a (another node); failed because "
                                "of it: rank 2 (pid 200) raised")
    alone = on_another_node(1, "rank 1 (pid 101) was killed by SIGKILL", "node-a", None)
    assert (alone.victims, alone.message) == ((), "rank 1 (pid 101) was killed by SIGKILL on node-a (another node)")


def test_the_monitors_word_is_matched_to_the_failed_process_by_pid(tmp_path: Path) -> None:
    written = tmp_path / "error.json"
    written.write_text(json.dumps({"message": {"message": "ValueError: bad batch",
                                               "extraInfo": {"py_callstack": "...", "timestamp": "1700000000"}}}))
    failures = {0: ProcessFailure(0, 100, 1, str(written)), 1: ProcessFailure(1, 101, KILL, "<N/A>")}

    def status(exit_: ExitSummary | None, gone: ExitSummary | None) -> MonitorStatus:
        from ft_client.timeouts import Timeouts
        return build_status(now=9.0, monitor_pid=1, socket="/s", started_at=0.0, sessions=1, timeouts=Timeouts(),
                            iteration_high=None, session=None, hangs=[], last_exit=exit_, last_gone=gone)

    statuses = {0: status(ExitSummary(100, GLOO_RESET, 5.0), None),
                1: status(None, ExitSummary(101, "connection closed in phase active", 4.9))}
    by_rank = {f.rank: f for f in failed_ranks(failures, statuses)}
    assert (by_rank[0].error, by_rank[0].raised_at, by_rank[1].error, by_rank[1].gone_at) == \
        (GLOO_RESET, 5.0, None, 4.9)
    # an earlier process of the same local rank (another pid) says nothing of this one; the error file speaks
    stale = {0: status(ExitSummary(99, "old", 1.0), None), 1: None}
    by_rank = {f.rank: f for f in failed_ranks(failures, stale)}
    assert (by_rank[0].error, by_rank[0].raised_at, by_rank[1].error) == ("ValueError: bad batch", None, None)


def test_the_summary_names_the_root_first_then_the_ranks_that_failed_because_of_it() -> None:
    v = decide_crash([FailedRank(0, 100, TERM, GLOO_RESET, raised_at=5.0), FailedRank(1, 101, KILL, gone_at=5.2)])
    row = failure_restart(v, 0).row()
    assert (row["cause"], row["rank"], row["victims"], row["root_seen"]) == ("failure", 1, [0], True)
    rows = summary_text.rows({"restarts": [row], "exit_code": 0})
    assert ("failed", "rank 1 (pid 101) was killed by SIGKILL in attempt 0, the root of the failure; the worker "
                      "group restarted") in rows
    assert ("because of it", f"rank 0 (pid 100) raised {GLOO_RESET} and was killed by SIGTERM") in rows
    elsewhere = failure_restart(on_another_node(1, v.how, "node-a", None), 0).row()
    assert ("failed", "rank 1 (pid 101) was killed by SIGKILL on node-a (another node) in attempt 0, the root of "
                      "the failure; the worker group here restarted with it") in summary_text.rows({"restarts": [elsewhere]})
    older = {"cause": "failure", "rank": 0, "attempt": 0, "message": "rank 0 (pid 1) exited with code 1"}
    assert ("failed", "rank 0 (pid 1) exited with code 1 in attempt 0; the worker group restarted") in \
        summary_text.rows({"restarts": [older]})


def test_the_error_file_of_a_root_that_wrote_none_names_it_for_torch_and_a_parent() -> None:
    v = decide_crash([FailedRank(0, 100, TERM, GLOO_RESET, raised_at=5.0), FailedRank(1, 101, KILL, gone_at=5.2)])
    data = crash_error_data(v, 1700000000)
    msg = data["message"]
    assert isinstance(msg, dict)
    assert msg["message"] == "RankCrash: rank 1 (pid 101) was killed by SIGKILL; rank(s) 0 failed because of it"
    assert msg["extraInfo"]["timestamp"] == "1700000000"


def test_failed_ranks_are_counted_by_role_in_the_metrics() -> None:
    (family,) = [m for m in collect(Snapshot(start=0.0, failures={("1", "root"): 2, ("0", "victim"): 2}))
                 if m.name == "ft_failed_ranks"]
    assert {(s.name, s.labels["rank"], s.labels["role"], s.value) for s in family.samples} == {
        ("ft_failed_ranks_total", "0", "victim", 2), ("ft_failed_ranks_total", "1", "root", 2)}


def test_a_crash_record_is_refused_in_another_round() -> None:
    ch = StoreChannel(b"s" * 32, "job-1")
    raw = ch.encode("ft_launcher/crash/0", CrashRecord(1, "rank 1 (pid 9) was killed by SIGKILL", "a"), {"round": 3})
    assert ch.decode("ft_launcher/crash/0", raw, CrashRecord, {"round": 3}).rank == 1
    with pytest.raises(StoreMessageError):
        ch.decode("ft_launcher/crash/0", raw, CrashRecord, {"round": 4})  # replayed into a later round
    with pytest.raises(StoreMessageError):
        ch.decode("ft_launcher/crash/1", raw, CrashRecord, {"round": 3})  # copied to another node's key
