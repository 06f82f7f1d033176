"""The launcher's roll call in-process: two "nodes" sharing a fake rendezvous store, each
with fake local evidence; what a monitor's answer says once its files are read."""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ft_monitor.core.snapshot import MonitorSnapshot
from ft_monitor.forensics.fr_digest import digest
from ft_monitor.launcher.incident.diagnosis import ANSWERED, NO_ANSWER, NOT_RUNNING, HungRank, RankEvidence
from ft_monitor.launcher.incident.rollcall import Rank, RollCaller, evidence_from
from ft_monitor.launcher.incident.rollcall_wire import ASKERS_KEY, BELL_KEY, answer_key, read_answer, request_key
from ft_monitor.launcher.store.sealed import Sealer, SealError
from ft_monitor.launcher.store.store_auth import RollCallAnswer, RollCallRequest, StoreChannel, StoreMessageError
from tests.test_diagnosis import STACK_IN_ALL_REDUCE, STACK_SLEEPING, trace

SECRET = b"k" * 32
CHANNEL = StoreChannel(SECRET, "run")
HUNG = HungRank(1, "a", 101, "section 'step' open for 4.0 s, timeout 4.0 s", "section", "step")


class FakeStore:
    def __init__(self, extended: bool = True) -> None:
        self.extended = extended
        """torch's extended API (append, multi_get), as a TCPStore has; without it (torch's etcd
        store) the boards keep no index and a look reads every node's key."""
        self.data: dict[str, bytes] = {}
        self.sets: dict[str, list[bytes]] = {}
        """Every value set, by key (the roll call deletes its keys once it is over)."""
        self.lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        with self.lock:
            self.data[key] = value
            self.sets.setdefault(key, []).append(value)

    def get(self, key: str) -> bytes:
        with self.lock:
            return self.data[key]

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.data for k in keys)

    def add(self, key: str, n: int) -> int:
        with self.lock:
            value = int(self.data.get(key, b"0")) + n
            self.data[key] = str(value).encode()
            return value

    def has_extended_api(self) -> bool:
        return self.extended

    def append(self, key: str, value: str | bytes) -> None:
        assert self.extended
        with self.lock:
            self.data[key] = self.data.get(key, b"") + (value.encode() if isinstance(value, str) else value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        assert self.extended
        with self.lock:
            return [self.data[k] for k in keys]

    def delete_key(self, key: str) -> bool:
        with self.lock:
            return self.data.pop(key, None) is not None


class Node(RollCaller):
    """A launcher's roll caller whose monitors are a list of evidence (it counts their dumps)."""

    def __init__(self, host: str, evidence: list[RankEvidence], timeout: float = 3.0) -> None:
        super().__init__(lambda lr: Path("/nonexistent"), host, timeout, False, sealer=Sealer(SECRET))
        self.evidence = evidence
        self.dumped = 0

    def local(self, ranks: list[Rank], incident: int, budget: float) -> list[RankEvidence]:
        self.dumped += 1
        return self.evidence


@pytest.mark.parametrize("extended", [True, False], ids=["tcpstore", "plain-store-api"])
def test_the_owner_gets_the_other_nodes_ranks_through_the_store(extended: bool) -> None:
    store = FakeStore(extended)
    a = Node("a", [RankEvidence(0, "a", ANSWERED, stack=STACK_IN_ALL_REDUCE),
                   RankEvidence(1, "a", ANSWERED, stack=STACK_SLEEPING)])
    b = Node("b", [RankEvidence(2, "b", ANSWERED, stack=STACK_IN_ALL_REDUCE),
                   RankEvidence(3, "b", ANSWERED, stack=STACK_IN_ALL_REDUCE)])
    answered: list[bool] = []
    helper = threading.Thread(target=lambda: answered.append(
        b.answer_pending([], store=store, channel=CHANNEL, group_rank=1, group_world_size=2, wait=5.0)))
    helper.start()
    d = a.run(HUNG, [], store=store, channel=CHANNEL, group_rank=0, group_world_size=2, world_size=4, attempt=0)
    helper.join(10)
    assert answered == [True] and b.answered_recently()
    assert [e.rank for e in d.evidence] == [0, 1, 2, 3] and d.missing_ranks == []
    assert d.roll_call.nodes_answered == ["a", "b"] and d.verdict.behind == [1] and d.verdict.waiting == [0, 2, 3]
    # its own request is not for it; and b takes a's incident 1 once
    assert not a.answer_pending([], store=store, channel=CHANNEL, group_rank=0, group_world_size=2)
    assert not b.answer_pending([], store=store, channel=CHANNEL, group_rank=1, group_world_size=2, wait=0.3)
    assert b.dumped == 1 and b.answered == {0: 1}
    assert store.data.keys() <= {BELL_KEY, ASKERS_KEY}  # the answers and the request left with the roll call


def test_the_nodes_that_answered_take_the_owners_verdict_of_that_roll_call_only() -> None:
    # issue 42 item 3: the node that did not take the roll call kept its first-hang guess
    from ft_monitor.launcher.incident.rollcall_wire import VERDICT_KEY
    from ft_monitor.launcher.store.store_auth import RollCallVerdict

    store = FakeStore()
    a = Node("a", [RankEvidence(1, "a", ANSWERED, stack=STACK_SLEEPING)])
    b = Node("b", [RankEvidence(2, "b", ANSWERED, stack=STACK_IN_ALL_REDUCE)])
    assert b.verdict_answered(store, CHANNEL, 0.0) is None  # answered nothing: no verdict to wait for
    helper = threading.Thread(target=lambda: b.answer_pending([], store=store, channel=CHANNEL, group_rank=1,
                                                              group_world_size=2, wait=5.0))
    helper.start()
    a.run(HUNG, [], store=store, channel=CHANNEL, group_rank=0, group_world_size=2, world_size=4, attempt=0)
    helper.join(10)
    assert b.last_answer == (0, 1) and set(b.last_evidence) == {2}
    assert b.verdict_answered(store, CHANNEL, 0.3) is None  # not published yet: waited for, bounded
    verdict = RollCallVerdict(1, 1, "a", 4242, "rank 1 is not in a collective", "/logs/attempt_0/diagnosis.json")
    a.publish_verdict(store, CHANNEL, 0, verdict)
    assert b.verdict_answered(store, CHANNEL, 1.0) == verdict
    assert VERDICT_KEY.format(0, 1) in a.written  # deleted with the round's keys
    # copied into the next round, or under another incident's key: refused
    b.new_round(b.round + 1)
    b.last_answer = (0, 1)
    assert b.verdict_answered(store, CHANNEL, 0.0) is None
    store.data[VERDICT_KEY.format(0, 2)] = store.data[VERDICT_KEY.format(0, 1)]
    b.new_round(b.round - 1)
    b.last_answer = (0, 2)
    assert b.verdict_answered(store, CHANNEL, 0.0) is None


def test_a_node_that_never_answers_costs_the_bound_and_no_more() -> None:
    a = Node("a", [RankEvidence(1, "a", ANSWERED, stack=STACK_SLEEPING)], timeout=0.3)
    t0 = time.monotonic()
    d = a.run(HUNG, [], store=FakeStore(), channel=CHANNEL, group_rank=0, group_world_size=2, world_size=4,
              attempt=0)
    assert time.monotonic() - t0 < 0.3 + 1.0
    assert d.missing_ranks == [0, 2, 3] and d.roll_call.nodes_answered == ["a"]


def test_a_forged_request_is_said_once_and_the_genuine_one_after_it_is_answered(
        caplog: pytest.LogCaptureFixture) -> None:
    store = FakeStore()
    store.set(request_key(0), b'{"v":1,"kind":"roll_call","mac":"00"}')
    store.append(ASKERS_KEY, "0,")  # listed and rung, as anyone who reaches the store can
    store.add(BELL_KEY, 1)
    b = Node("b", [])
    with caplog.at_level(logging.WARNING, logger="ft_monitor.launcher"):
        assert not b.answer_pending([], store=store, channel=CHANNEL, group_rank=1, group_world_size=2, wait=0.3)
    assert sum("ignored a roll call request" in r.getMessage() for r in caplog.records) == 1  # not every 50 ms
    store.set(request_key(0), CHANNEL.encode(request_key(0), RollCallRequest(1, 1, "a", 0, 3.0)))
    assert b.answer_pending([], store=store, channel=CHANNEL, group_rank=1, group_world_size=2, wait=1.0)


def test_a_forged_answer_is_said_once_and_the_node_counts_as_silent(caplog: pytest.LogCaptureFixture) -> None:
    store = FakeStore()
    store.set(answer_key(0, 1, 1), b'{"v":1,"kind":"roll_call_answer","mac":"00"}')
    a = Node("a", [RankEvidence(1, "a", ANSWERED, stack=STACK_SLEEPING)], timeout=0.4)
    with caplog.at_level(logging.WARNING, logger="ft_monitor.launcher"):
        d = a.run(HUNG, [], store=store, channel=CHANNEL, group_rank=0, group_world_size=2, world_size=2,
                  attempt=0)
    assert d.roll_call.nodes_answered == ["a"] and d.missing_ranks == [0]
    assert sum("ignored a roll call answer" in r.getMessage() for r in caplog.records) == 1  # not every 50 ms


def test_a_request_replayed_in_the_same_round_is_refused_and_dumps_nothing(caplog: pytest.LogCaptureFixture) -> None:
    store = FakeStore()
    a, b = Node("a", [], timeout=0.5), Node("b", [RankEvidence(2, "b", ANSWERED, stack=STACK_IN_ALL_REDUCE)])
    first = []
    for _ in range(2):  # incidents 1 and 2, each answered once
        helper = threading.Thread(target=lambda: b.answer_pending([], store=store, channel=CHANNEL, group_rank=1,
                                                                  group_world_size=2, wait=5.0))
        helper.start()
        a.run(HUNG, [], store=store, channel=CHANNEL, group_rank=0, group_world_size=2, world_size=3, attempt=0)
        helper.join(10)
        first.append(store.sets[request_key(0)][-1])
        assert not store.check([request_key(0)])  # the asker tidied it away
    assert b.dumped == 2 and b.answered == {0: 2}
    store.set(request_key(0), first[0])  # incident 1's genuine request, stored again
    with caplog.at_level(logging.WARNING, logger="ft_monitor.launcher"):
        assert not b.answer_pending([], store=store, channel=CHANNEL, group_rank=1, group_world_size=2, wait=0.3)
    assert b.dumped == 2
    assert [r.getMessage() for r in caplog.records if "ignored a roll call request" in r.getMessage()] == [
        f"ft-launcher: ignored a roll call request in the rendezvous store at {request_key(0)}: incident 1 of node 0, "
        "answered already (replayed)"]


def test_answers_are_sealed_in_the_store_and_altered_or_moved_ones_do_not_open() -> None:
    store = FakeStore()
    secret_stack = STACK_SLEEPING + "  File \"/secret/train.py\", line 7 in hidden_function\n"
    b_rank = RankEvidence(2, "b", ANSWERED, local_rank=0, pid=987654321, stack=secret_stack,
                          native="Thread 987654321 (idle): native_frame_xyz", fr=digest(trace(5, 4)),
                          files={"stack_dump": "/private/evidence/rank2-stack.txt"}, notes=["note-qwerty"])
    a, b = Node("a", []), Node("b", [b_rank])
    helper = threading.Thread(target=lambda: b.answer_pending([], store=store, channel=CHANNEL, group_rank=1,
                                                              group_world_size=2, wait=5.0))
    helper.start()
    d = a.run(HUNG, [], store=store, channel=CHANNEL, group_rank=0, group_world_size=2, world_size=3, attempt=0)
    helper.join(10)
    assert [e for e in d.evidence if e.rank == 2] == [b_rank]  # it crossed the store whole
    assert not store.check([answer_key(0, 1, 1)])  # and left it with the roll call
    (raw,) = store.sets[answer_key(0, 1, 1)]
    for clear in ("hidden_function", "987654321", "native_frame_xyz", "/private/evidence", "note-qwerty",
                  "last_enqueued", "all_reduce", "stack"):
        assert clear.encode() not in raw, clear
    envelope = json.loads(raw)
    read = dict(asker=0, incident=1, group_rank=1, round=0, refused=lambda why: None)
    assert read_answer(CHANNEL, Sealer(SECRET), raw, **read)[1] == [b_rank]  # type: ignore[arg-type]
    # one bit of the ciphertext changed, under a valid signature (as only a holder of the key could sign)
    sealed = base64.b64decode(envelope["body"]["sealed"])
    altered = base64.b64encode(sealed[:20] + bytes([sealed[20] ^ 1]) + sealed[21:]).decode()
    body = {**envelope["body"], "sealed": altered}
    resigned = CHANNEL.encode(answer_key(0, 1, 1), RollCallAnswer.from_body(body))
    with pytest.raises(SealError, match="does not open"):
        read_answer(CHANNEL, Sealer(SECRET), resigned, **read)  # type: ignore[arg-type]
    # the genuine ciphertext moved to another incident, its envelope signed for it
    moved = CHANNEL.encode(answer_key(0, 2, 1), RollCallAnswer.from_body({**envelope["body"], "incident": 2}))
    with pytest.raises(SealError, match="does not open"):
        read_answer(CHANNEL, Sealer(SECRET), moved, **{**read, "incident": 2})  # type: ignore[arg-type]
    with pytest.raises(SealError, match="does not open"):  # another job's key
        read_answer(CHANNEL, Sealer(b"x" * 32), raw, **read)  # type: ignore[arg-type]
    with pytest.raises(StoreMessageError, match="bad signature"):  # the stored value altered in place
        read_answer(CHANNEL, Sealer(SECRET), raw.replace(envelope["body"]["sealed"][:8].encode(), b"AAAAAAAA"),
                    **read)  # type: ignore[arg-type]


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

    from ft_monitor.forensics.fr_digest import digest
    from tests.procs import ROOT

    # A file rendezvous: a port picked free here was once taken before the child bound it.
    with_torch = tmp_path / "fr.json"
    code = ("import sys, torch, torch.distributed as dist\n"
            f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'rdzv'}', rank=0, world_size=1)\n"
            "dist.all_reduce(torch.ones(2)); dist.barrier()\n"
            "from ft_client.client.flight_recorder import write_trace\n"
            f"print(write_trace({str(with_torch)!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "TORCH_FR_BUFFER_SIZE": "16"})
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr
    d = digest(json.loads(with_torch.read_text()))
    from ft_client import torch_features

    if torch_features.flight_recorder().records_gloo:
        assert d.recording and d.groups["0"].last_enqueued == 2 and d.groups["0"].last_op == "barrier"
    else:  # before torch 2.8 the recorder is NCCL's only: a gloo rank writes NCCL's empty trace
        assert not d.recording and d.groups == {} and d.problems, d
    without = tmp_path / "none.json"
    code = f"from ft_client.client.flight_recorder import write_trace; print(write_trace({str(without)!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == "torch is not imported in this process", out.stderr
    assert json.loads(without.read_text()) == {"ft_error": "torch is not imported in this process"}


def test_a_rank_is_running_until_it_exits_a_zombie_is_not() -> None:
    from ft_monitor.processes import procinfo

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


def test_the_round_is_torchs_rendezvous_round_else_the_count_of_rendezvous() -> None:
    from types import SimpleNamespace

    from ft_monitor.launcher.rdzv.rounds import rendezvous_round

    dynamic = SimpleNamespace(_state_holder=SimpleNamespace(state=SimpleNamespace(round=3)))
    assert rendezvous_round(dynamic, 0) == 3
    assert rendezvous_round(SimpleNamespace(), 2) == 2  # a static rendezvous: one store for every attempt
    assert rendezvous_round(SimpleNamespace(_state_holder=SimpleNamespace(state=SimpleNamespace(round=True))), 1) == 1
