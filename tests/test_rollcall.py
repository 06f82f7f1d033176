"""The launcher's roll call in-process: two "nodes" sharing a fake rendezvous store, each
with fake local evidence; what a monitor's answer says once its files are read."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ft_monitor.launcher.diagnosis import ANSWERED, NO_ANSWER, NOT_RUNNING, HungRank, RankEvidence
from ft_monitor.launcher.rollcall import Rank, RollCaller, evidence_from
from ft_monitor.launcher.store_auth import StoreChannel
from ft_monitor.snapshot import MonitorSnapshot
from tests.test_diagnosis import STACK_IN_ALL_REDUCE, STACK_SLEEPING, trace

CHANNEL = StoreChannel(b"k" * 32, "run")
HUNG = HungRank(1, "a", 101, "section 'step' open for 4.0 s, timeout 4.0 s", "section", "step")


class FakeStore:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.count = 0
        self.lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        with self.lock:
            self.data[key] = value

    def get(self, key: str) -> bytes:
        with self.lock:
            return self.data[key]

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.data for k in keys)

    def add(self, key: str, n: int) -> int:
        with self.lock:
            self.count += n
            return self.count


class Node(RollCaller):
    def __init__(self, host: str, evidence: list[RankEvidence], timeout: float = 3.0) -> None:
        super().__init__(lambda lr: Path("/nonexistent"), host, timeout, False)
        self.evidence = evidence

    def local(self, ranks: list[Rank], incident: int, budget: float) -> list[RankEvidence]:
        return self.evidence


def test_the_owner_gets_the_other_nodes_ranks_through_the_store() -> None:
    store = FakeStore()
    a = Node("a", [RankEvidence(0, "a", ANSWERED, stack=STACK_IN_ALL_REDUCE),
                   RankEvidence(1, "a", ANSWERED, stack=STACK_SLEEPING)])
    b = Node("b", [RankEvidence(2, "b", ANSWERED, stack=STACK_IN_ALL_REDUCE),
                   RankEvidence(3, "b", ANSWERED, stack=STACK_IN_ALL_REDUCE)])
    answered: list[bool] = []
    helper = threading.Thread(target=lambda: answered.append(
        b.answer_pending([], store=store, channel=CHANNEL, group_rank=1, wait=5.0)))
    helper.start()
    d = a.run(HUNG, [], store=store, channel=CHANNEL, group_rank=0, group_world_size=2, world_size=4, attempt=0)
    helper.join(10)
    assert answered == [True] and b.answered_recently()
    assert [e.rank for e in d.evidence] == [0, 1, 2, 3] and d.missing_ranks == []
    assert d.roll_call.nodes_answered == ["a", "b"] and d.verdict.behind == [1] and d.verdict.waiting == [0, 2, 3]
    assert not a.answer_pending([], store=store, channel=CHANNEL, group_rank=0)  # its own request: skipped


def test_a_node_that_never_answers_costs_the_bound_and_no_more() -> None:
    a = Node("a", [RankEvidence(1, "a", ANSWERED, stack=STACK_SLEEPING)], timeout=0.3)
    t0 = time.monotonic()
    d = a.run(HUNG, [], store=FakeStore(), channel=CHANNEL, group_rank=0, group_world_size=2, world_size=4,
              attempt=0)
    assert time.monotonic() - t0 < 0.3 + 1.0
    assert d.missing_ranks == [0, 2, 3] and d.roll_call.nodes_answered == ["a"]


def test_a_forged_request_is_ignored_and_does_not_block_the_next() -> None:
    store = FakeStore()
    store.set("ft_launcher/roll_call/1", b'{"v":1,"kind":"roll_call","mac":"00"}')
    b = Node("b", [])
    assert not b.answer_pending([], store=store, channel=CHANNEL, group_rank=1)
    assert b.answered == 1


def test_a_forged_answer_is_said_once_and_the_node_counts_as_silent(caplog: pytest.LogCaptureFixture) -> None:
    from ft_monitor.launcher.rollcall import ANSWER_KEY

    store = FakeStore()
    store.set(ANSWER_KEY.format(1, 1), b'{"v":1,"kind":"roll_call_answer","mac":"00"}')
    a = Node("a", [RankEvidence(1, "a", ANSWERED, stack=STACK_SLEEPING)], timeout=0.4)
    with caplog.at_level(logging.WARNING, logger="ft_monitor.launcher"):
        d = a.run(HUNG, [], store=store, channel=CHANNEL, group_rank=0, group_world_size=2, world_size=2,
                  attempt=0)
    assert d.roll_call.nodes_answered == ["a"] and d.missing_ranks == [0]
    assert sum("ignored a roll call answer" in r.getMessage() for r in caplog.records) == 1  # not every 50 ms


def test_a_monitors_answer_is_read_into_evidence(tmp_path: Path) -> None:
    dump = tmp_path / "rank1-stack.txt"
    dump.write_text("old dump\n" + STACK_SLEEPING)
    fr = tmp_path / "rank1-fr1.json"
    fr.write_text(json.dumps(trace(4, 4)))
    me = Rank(1, 1, os.getpid())
    snap = MonitorSnapshot(connected=True, rank=1, pid=os.getpid(), phase="hung", alive=True, stack_dump=str(dump),
                           stack_from=len("old dump\n"), stack_to=dump.stat().st_size, stack_captured=True,
                           flight_recorder=str(fr))
    ev = evidence_from(me, "a", snap, None, True)
    assert ev.status == ANSWERED and ev.stack == STACK_SLEEPING and ev.fr is not None and ev.fr.recording
    assert ev.files == {"stack_dump": str(dump), "flight_recorder": str(fr)}
    fr.write_text(json.dumps({"ft_error": "torch is not imported in this process"}))
    ev = evidence_from(me, "a", snap, None, True)
    assert ev.fr is None and ev.fr_note == "the rank wrote no trace: torch is not imported in this process"
    missing = MonitorSnapshot(**{**snap.to_wire(), "flight_recorder": None,
                                 "notes": ["Flight Recorder: not written in time (...)"]})
    assert evidence_from(me, "a", missing, None, True).fr_note == "not written in time (...)"
    assert evidence_from(me, "a", None, "its monitor did not answer", True).status == NO_ANSWER
    gone = Rank(2, 2, 2**22 + 12345)  # no such process
    assert evidence_from(gone, "a", None, "x", True).status == NOT_RUNNING


def test_the_rank_writes_its_trace_or_why_there_is_none(tmp_path: Path) -> None:
    import subprocess
    import sys

    from ft_monitor.fr_digest import digest
    from tests.procs import ROOT

    # A file rendezvous: a port picked free here was once taken before the child bound it.
    with_torch = tmp_path / "fr.json"
    code = ("import sys, torch, torch.distributed as dist\n"
            f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'rdzv'}', rank=0, world_size=1)\n"
            "dist.all_reduce(torch.ones(2)); dist.barrier()\n"
            "from ft_client.flight_recorder import write_trace\n"
            f"print(write_trace({str(with_torch)!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "TORCH_FR_BUFFER_SIZE": "16"})
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr
    d = digest(json.loads(with_torch.read_text()))
    assert d.recording and d.groups["0"].last_enqueued == 2 and d.groups["0"].last_op == "barrier"
    without = tmp_path / "none.json"
    code = f"from ft_client.flight_recorder import write_trace; print(write_trace({str(without)!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == "torch is not imported in this process", out.stderr
    assert json.loads(without.read_text()) == {"ft_error": "torch is not imported in this process"}


def test_a_rank_is_running_until_it_exits_a_zombie_is_not() -> None:
    from ft_monitor import procinfo

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert procinfo.running(os.getpid()) and procinfo.running(child.pid)
        child.stdin.close()  # type: ignore[union-attr]
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
        assert not procinfo.running(child.pid)
    finally:
        child.kill()
        child.wait(10)
    assert not procinfo.running(child.pid)
