"""The hang diagnosis, pure: Flight Recorder traces (torch 2.13's JSON, as gloo writes it),
faulthandler dumps, and the verdict that names who is behind. No process, no clock."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ft_monitor.core.snapshot import MonitorSnapshot, SnapshotError
from ft_monitor.forensics import stacks
from ft_monitor.forensics.fr_digest import FrDigest, digest, op_name
from ft_monitor.launcher.incident.decide import same_incident
from ft_monitor.launcher.incident.diagnosis import (
    ANSWERED,
    NO_ANSWER,
    SCHEMA,
    EvidenceError,
    HungRank,
    RankEvidence,
    RollCallFacts,
    diagnose,
)
from ft_monitor.launcher.store.store_auth import RollCallAnswer, RollCallRequest, StoreChannel, StoreMessageError


def entry(seq: int, pg: int = 0, op: str = "gloo:all_reduce", retired: bool = True, created: int = 0) -> dict[str, Any]:
    """One entry as torch 2.13 writes it on gloo (the keys _dump_fr_trace_json gives)."""
    return {"collective_seq_id": seq, "input_dtypes": ["Float"], "input_sizes": [[4]], "is_p2p": False,
            "op_id": seq, "output_dtypes": ["Float"], "output_sizes": [[4]], "p2p_seq_id": 0, "pg_id": pg,
            "process_group": [str(pg), "default_pg" if pg == 0 else "undefined"], "profiling_name": op,
            "record_id": seq - 1, "retired": retired, "state": "scheduled", "thread_id": "1",
            "thread_name": "python", "time_created_ns": created or 1_000 + seq, "time_discovered_completed_ns": 0,
            "time_discovered_started_ns": 0, "timeout_ms": 1800000}


def trace(enqueued: int, completed: int, *, pg: int = 0, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A rank's whole trace: ``enqueued`` collectives on group ``pg``, the last not completed if completed < enqueued."""
    entries = [entry(i, pg, "gloo:barrier" if i == 4 else "gloo:all_reduce", retired=i <= completed)
               for i in range(1, enqueued + 1)]
    status = {str(pg): {"last_completed_collective": str(completed), "last_enqueued_collective": str(enqueued),
                        "last_started_collective": "-1"}}
    out = {"comm_lib_version": "", "entries": entries, "nccl_comm_state": {},
           "pg_config": {"": {"desc": "", "name": "", "ranks": "[]"}},  # what gloo writes: the bundled analyzer's KeyError
           "pg_status": status, "version": "2.10"}
    out.update(extra or {})
    return out


FR_OFF = {"comm_lib_version": "", "nccl_comm_state": {}, "pg_config": {}, "pg_status": {}, "version": "2.10"}
"""A rank with TORCH_FR_BUFFER_SIZE unset: no entries at all (recorded from torch 2.13)."""


STACK_SLEEPING = """\
# ft-monitor stack dump of pid 4242 (signal SIGUSR2): roll call 1
Thread 0x00007f5d691566c0 (most recent call first):
  File "/work/ft_client/wire/transport.py", line 295 in _recv_exact_blocking
  File "/work/ft_client/client/control.py", line 31 in _run
  File "/usr/lib/python3.11/threading.py", line 975 in run

Current thread 0x00007f5d6a1c9740 (most recent call first):
  File "/job/train.py", line 43 in write_metrics
  File "/job/train.py", line 97 in train
  File "/job/train.py", line 120 in <module>
"""

STACK_IN_ALL_REDUCE = """\
Current thread 0x00007f0000000001 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3245 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/job/train.py", line 57 in train
  File "/job/train.py", line 120 in <module>
"""


def ev(rank: int, fr: dict[str, Any] | None = None, stack: str | None = STACK_IN_ALL_REDUCE, *,
       status: str = ANSWERED, fr_note: str | None = None) -> RankEvidence:
    return RankEvidence(rank, "node0", status, local_rank=rank, pid=100 + rank, stack=stack,
                        fr=digest(fr) if fr is not None else None, fr_note=fr_note)


HUNG = HungRank(rank=1, host="node0", pid=101, message="section 'step' open for 4.0 s, timeout 4.0 s",
                reason="section", section="step", iteration=20)
FACTS = RollCallFacts(incident=1, timeout_s=5.0, started_time=1000.0, duration_s=0.05, flight_recorder=True)


# -- the trace reader ---------------------------------------------------------------------------
def test_digest_reads_what_gloo_writes() -> None:
    d = digest(trace(5, 4))
    assert d.recording and d.entries == 5 and d.problems == []
    g = d.groups["0"]
    assert (g.last_enqueued, g.last_completed, g.desc) == (5, 4, "default_pg")
    assert [(c.seq, c.op) for c in g.pending] == [(5, "all_reduce")]
    assert g.op_at(5) == "all_reduce" and g.op_at(4) is None


def test_digest_of_a_recorder_that_is_off_says_so() -> None:
    d = digest(FR_OFF)
    assert not d.recording and "recorder is off" in d.problems[0]
    assert not digest("not json").recording and not digest(None).recording


def test_digest_never_raises_on_odd_fields() -> None:
    t = trace(3, 2)
    del t["pg_status"]
    t["entries"].append({"pg_id": True})
    t["entries"].append("junk")
    d = digest(t)
    assert d.groups["0"].last_enqueued == 3 and d.groups["0"].last_completed == 2
    assert any("no pg_status" in p for p in d.problems)
    assert op_name("nccl:all_gather") == "all_gather" and op_name(None) == "collective"


def test_digest_round_trips_through_its_wire_form() -> None:
    d = digest(trace(6, 5))
    assert FrDigest.from_wire(json.loads(json.dumps(d.to_wire()))) == d


# -- the stack reader ------------------------------------------------------------------------------
def test_stacks_find_the_main_thread_and_the_users_frame() -> None:
    threads = stacks.parse(STACK_SLEEPING)
    assert len(threads) == 2 and threads[1].current
    main = stacks.main_thread(threads)
    assert main is threads[1]
    assert stacks.where(main) == "train.py:43 in write_metrics"
    assert not stacks.in_collective(main)
    waiting = stacks.main_thread(stacks.parse(STACK_IN_ALL_REDUCE))
    assert stacks.where(waiting) == "train.py:57 in train"  # library frames skipped
    assert stacks.innermost(waiting) == "distributed_c10d.py:3245 in all_reduce"
    assert stacks.in_collective(waiting) and stacks.collective_call(waiting) == "all_reduce"
    assert stacks.parse("garbage\n\x00") == [] and stacks.where(None) is None


SP = "/venv/lib/python3.11/site-packages"
STACK_LIGHTNING_STEP = f"""Current thread 0x00007f07ffc72b80 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/job/train.py", line 40 in write_metrics_to_stuck_filesystem
  File "/job/train.py", line 54 in training_step
  File "{SP}/lightning/pytorch/strategies/strategy.py", line 634 in wrapped_forward
  File "{SP}/torch/nn/modules/module.py", line 1789 in _call_impl
  File "{SP}/torch/nn/parallel/distributed.py", line 1715 in _run_ddp_forward
  File "{SP}/torch/nn/parallel/distributed.py", line 1890 in forward
  File "{SP}/lightning/pytorch/loops/optimization/automatic.py", line 319 in _training_step
  File "/job/train.py", line 94 in main
"""
STACK_LIGHTNING_BACKWARD = f"""Current thread 0x00007fef0ec82b80 (most recent call first):
  File "{SP}/torch/autograd/graph.py", line 979 in _engine_run_backward
  File "{SP}/torch/autograd/__init__.py", line 395 in backward
  File "{SP}/lightning/pytorch/core/module.py", line 1137 in backward
  File "{SP}/torch/optim/sgd.py", line 116 in step
  File "/job/train.py", line 94 in main
"""


def test_a_step_hung_inside_ddps_forward_is_not_waiting_and_its_peer_in_backward_is() -> None:
    """Lightning runs training_step from inside DDP's forward: the hung rank's stack has DDP's
    frames further out. The innermost frame that is torch's waiting code or the user's decides
    (before: any DDP frame counted, both ranks read as waiting, and the verdict fell back to
    the rank reported first, the waiting one: a real 2-rank Lightning run named rank 0)."""
    hung = stacks.main_thread(stacks.parse(STACK_LIGHTNING_STEP))
    waiting = stacks.main_thread(stacks.parse(STACK_LIGHTNING_BACKWARD))
    assert not stacks.in_collective(hung) and stacks.where(hung) == "train.py:40 in write_metrics_to_stuck_filesystem"
    assert stacks.in_collective(waiting) and stacks.collective_call(waiting) == "backward"


STACK_DATA_WAIT = f"""Current thread 0x00007f9593fdeb80 (most recent call first):
  File "/usr/lib/python3.11/selectors.py", line 415 in select
  File "/usr/lib/python3.11/multiprocessing/queues.py", line 113 in get
  File "{SP}/torch/utils/data/dataloader.py", line 1291 in _try_get_data
  File "{SP}/torch/utils/data/dataloader.py", line 1464 in _get_data
  File "{SP}/lightning/pytorch/loops/fetchers.py", line 134 in __next__
  File "/job/train.py", line 135 in main
"""


def test_a_rank_waiting_for_its_data_loader_worker_is_said_to_be() -> None:
    """A hung data-loader worker leaves its rank in the DataLoader's queue read, outside every
    collective: the verdict names the rank and says it waits for a worker."""
    data = stacks.main_thread(stacks.parse(STACK_DATA_WAIT))
    assert not stacks.in_collective(data)
    assert stacks.waits_for_data(data) == "dataloader.py:1291 in _try_get_data"
    assert stacks.waits_for_data(stacks.main_thread(stacks.parse(STACK_LIGHTNING_STEP))) is None
    assert stacks.waits_for_data(stacks.main_thread(stacks.parse(STACK_LIGHTNING_BACKWARD))) is None


def _async_save_stack(background: str) -> str:
    return f"""Thread 0x00007fdef1b476c0 (most recent call first):
{background}  File "{SP}/torch/distributed/checkpoint/state_dict_saver.py", line 196 in save
  File "{SP}/torch/distributed/checkpoint/_async_thread_executor.py", line 30 in save_wrapper
  File "/usr/lib/python3.11/concurrent/futures/thread.py", line 58 in run
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap
Current thread 0x00007fdf1c420b80 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait
  File "/usr/lib/python3.11/concurrent/futures/_base.py", line 451 in result
  File "/job/train.py", line 110 in main
  File "/job/train.py", line 125 in <module>
"""


STACK_SAVE_STUCK = _async_save_stack(
    '  File "/job/train.py", line 38 in write_to_stuck_filesystem\n'
    f'  File "{SP}/torch/distributed/checkpoint/state_dict_saver.py", line 500 in write_data\n')
STACK_SAVE_GATHER = _async_save_stack(
    f'  File "{SP}/torch/distributed/distributed_c10d.py", line 4287 in all_gather\n'
    f'  File "{SP}/torch/distributed/checkpoint/utils.py", line 135 in gather_object\n')


def test_ranks_waiting_for_their_async_saves_are_told_apart_by_the_saves_threads() -> None:
    """dcp.async_save: every rank's main thread waits alike in future.result(); the background
    threads say which rank is behind (in its storage writer) and which wait (in the gather)."""
    stuck, gather = stacks.parse(STACK_SAVE_STUCK), stacks.parse(STACK_SAVE_GATHER)
    for threads in (stuck, gather):
        assert stacks.async_save_thread(threads) is not None
        assert stacks.working_thread(threads) is not stacks.main_thread(threads)
    assert not stacks.in_collective(stacks.working_thread(stuck))
    assert stacks.where(stacks.working_thread(stuck)) == "train.py:38 in write_to_stuck_filesystem"
    assert stacks.in_collective(stacks.working_thread(gather))
    assert stacks.collective_call(stacks.working_thread(gather)) == "all_gather"
    plain = stacks.parse(STACK_SLEEPING)  # no future waited for: the main thread is where the rank is
    assert stacks.async_save_thread(plain) is None and stacks.working_thread(plain) is stacks.main_thread(plain)


# -- the verdict -----------------------------------------------------------------------------------
def test_flight_recorder_names_the_rank_that_never_entered_the_collective() -> None:
    evidence = [ev(0, trace(5, 4)), ev(1, trace(4, 4), STACK_SLEEPING), ev(2, trace(5, 4)), ev(3, trace(5, 4))]
    d = diagnose(HUNG, evidence, FACTS, world_size=4)
    v = d.verdict
    assert v.line == ("rank 1 never entered all_reduce #5 on the default group (train.py:43 in write_metrics); "
                      "ranks 0,2,3 wait in all_reduce #5")
    assert (v.basis, v.behind, v.waiting, v.seq, v.op, v.group) == ("flight_recorder", [1], [0, 2, 3], 5,
                                                                      "all_reduce", "0")
    doc = json.loads(json.dumps(d.document(2000.0)))
    assert doc["schema"] == SCHEMA and doc["version"] == 1 and doc["missing_ranks"] == []
    assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2, 3] and all(r["stack"] for r in doc["ranks"])
    assert doc["ranks"][1]["where"] == "train.py:43 in write_metrics"
    assert doc["process_groups"][0]["ranks"]["1"] == {"last_enqueued": 4, "last_completed": 4}


def test_diagnosis_json_names_the_culprit_as_hung_and_the_waiting_rank_whose_monitor_fired_as_reporter() -> None:
    """Rank 0's monitor fired first (it waited for rank 1 in all_reduce): diagnosis.json's ``hung``
    was rank 0 while ``verdict.behind`` was [1]. The culprit is decided once; rank 0's notice is
    ``reported_by``."""
    from dataclasses import replace

    evidence = [ev(0, trace(5, 4)), ev(1, trace(4, 4), STACK_SLEEPING)]
    reported = replace(HUNG, rank=0, pid=100, message="section 'step' open for 4.0 s, timeout 4.0 s")
    doc = diagnose(reported, evidence, FACTS, world_size=2).document(2000.0)
    assert doc["verdict"]["behind"] == [1]
    assert doc["hung"]["rank"] == 1 and doc["hung"]["message"] == doc["verdict"]["line"]
    assert doc["hung"]["pid"] == evidence[1].pid and doc["hung"]["host"] == evidence[1].host
    assert doc["reported_by"]["rank"] == 0 and doc["reported_by"]["pid"] == 100
    assert doc["reported_by"]["section"] == "step" and doc["reported_by"]["reason"] == "section"
    own = diagnose(HUNG, evidence, FACTS, world_size=2).document(2000.0)  # the culprit's own monitor fired
    assert own["hung"]["rank"] == 1 and own["hung"]["section"] == "step" and own["reported_by"] is None


def test_the_first_collective_not_entered_is_named_when_others_ran_ahead() -> None:
    # rank 0 issued two async collectives (#5, #6); rank 1 stopped after #4
    d = diagnose(HUNG, [ev(0, trace(6, 4)), ev(1, trace(4, 4), STACK_SLEEPING)], FACTS)
    assert d.verdict.seq == 5 and d.verdict.behind == [1] and d.verdict.waiting == [0]


def test_a_rank_without_a_trace_is_the_suspect_when_every_traced_rank_waits() -> None:
    # rank 1 holds the GIL: its control thread never wrote its trace
    note = "not written in time (the rank's control thread did not run: does its main thread hold the GIL?)"
    evidence = [ev(0, trace(5, 4)), ev(1, None, STACK_SLEEPING, fr_note=note), ev(2, trace(5, 4))]
    v = diagnose(HUNG, evidence, FACTS).verdict
    assert v.basis == "flight_recorder+stacks" and v.behind == [1] and v.waiting == [0, 2] and v.seq == 5
    assert v.line.startswith("rank 1 did not reach all_reduce #5 on the default group (no Flight Recorder trace: "
                             "not written in time")
    assert v.line.endswith("train.py:43 in write_metrics); ranks 0,2 wait in all_reduce #5")


def test_without_flight_recorder_stacks_tell_who_is_outside_the_collective() -> None:
    off = "Flight Recorder off (flight_recorder_entries is 0)"
    evidence = [ev(0, fr_note=off), ev(1, stack=STACK_SLEEPING, fr_note=off), ev(2, fr_note=off)]
    v = diagnose(HUNG, evidence, FACTS).verdict
    assert v.basis == "stacks" and v.behind == [1] and v.waiting == [0, 2]
    assert v.line == ("rank 1 is not in a collective (train.py:43 in write_metrics); ranks 0,2 wait in all_reduce "
                      "(train.py:57 in train)")


def test_with_no_evidence_the_monitors_verdict_stands_and_missing_ranks_are_listed() -> None:
    evidence = [ev(1, stack=None, status=NO_ANSWER)]
    d = diagnose(HUNG, evidence, FACTS, world_size=3)
    assert d.verdict.basis == "monitor" and d.verdict.behind == [1]
    assert d.verdict.line.startswith("rank 1 hung: section 'step' open for 4.0 s")
    assert d.missing_ranks == [0, 2]


def test_other_groups_are_compared_too() -> None:
    sub0 = trace(3, 2, pg=1)
    sub1 = trace(2, 2, pg=1)
    v = diagnose(HUNG, [ev(0, sub0), ev(1, sub1, STACK_SLEEPING)], FACTS).verdict
    assert v.group == "1" and v.line.startswith("rank 1 never entered all_reduce #3 on group 1 ")


# -- what travels ----------------------------------------------------------------------------------
def test_evidence_round_trips_and_bad_evidence_is_refused() -> None:
    e = ev(2, trace(5, 4))
    assert RankEvidence.from_wire(json.loads(json.dumps(e.to_wire()))) == e
    with pytest.raises(EvidenceError):
        RankEvidence.from_wire({"rank": 1, "status": "fine"})
    with pytest.raises(EvidenceError):
        RankEvidence.from_wire({"rank": -1, "status": ANSWERED})
    big = RankEvidence.from_wire({**e.to_wire(), "stack": "x" * 100_000})
    assert big.stack is not None and len(big.stack) == 32 * 1024


def test_roll_call_store_messages_are_signed_and_checked() -> None:  # an answer may exceed 16 KiB: its own bound
    ch = StoreChannel(b"s" * 32, "run-1")
    req = RollCallRequest(3, 1, "node0", 0, 5.0, round=2)
    assert ch.decode("k", ch.encode("k", req), RollCallRequest) == req
    answer = RollCallAnswer(3, "node1", 1, "c2VhbGVk" * 300_000, round=2, asker=0)  # sealed evidence: rollcall_wire
    raw = ch.encode("a", answer)
    assert ch.decode("a", raw, RollCallAnswer) == answer
    with pytest.raises(StoreMessageError, match="bad signature"):
        StoreChannel(b"t" * 32, "run-1").decode("a", raw, RollCallAnswer)
    with pytest.raises(StoreMessageError, match="replayed"):
        ch.decode("other", raw, RollCallAnswer)


def test_monitor_snapshot_is_checked_field_by_field() -> None:
    snap = MonitorSnapshot(connected=True, rank=1, pid=42, phase="hung", alive=True, stack_dump="/x/s.txt",
                           stack_from=10, stack_to=20, stack_captured=True, notes=["n"])
    assert MonitorSnapshot.from_wire(snap.to_wire()) == snap
    with pytest.raises(SnapshotError, match="unknown field"):
        MonitorSnapshot.from_wire({**snap.to_wire(), "evil": 1})
    with pytest.raises(SnapshotError, match="stack_from"):
        MonitorSnapshot.from_wire({**snap.to_wire(), "stack_from": -1})


def test_dump_mode_groups_later_notices_into_the_incident() -> None:
    assert not same_incident(10.0, None)
    assert same_incident(10.0, 12.0)  # stuck since before the roll call
    assert not same_incident(13.0, 12.0)  # made progress after it: a new incident
