"""Issue 24, item 4: a roll call through a real rendezvous store (torch's TCPStore, on a real
socket) while another user who reaches its port adds to counters, copies values between
rounds and plants bad answers (tests/workers/store_ops.py, run as uid 65534 when the tests
run as root; otherwise as a separate process of the same user, which reaches the store the
same way: the store knows no users).

The nodes are `RollCaller`s in threads of this process, each with its own store client
and torch's per-round key prefix; their monitors are evidence lists (tests/test_rollcall.py's
`Node`)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import PrefixStore, TCPStore

from ft_monitor.launcher.incident.diagnosis import ANSWERED, RankEvidence
from ft_monitor.launcher.incident.rollcall_wire import ASKERS_KEY, BELL_KEY, answer_key, encode_answer, request_key
from ft_monitor.launcher.store.sealed import Sealer
from ft_monitor.launcher.store.store_auth import RollCallRequest
from tests import other_user
from tests.procs import ROOT, slack
from tests.test_diagnosis import STACK_IN_ALL_REDUCE, STACK_SLEEPING
from tests.test_rollcall import CHANNEL, HUNG, SECRET, Node

pytestmark = pytest.mark.e2e

NOBODY = 65534
PREFIX = "torch.rendezvous.run.{}/"
"""torch's dynamic rendezvous: every round's keys under its own prefix of the one TCPStore."""


def forge(port: int, ops: list[list[Any]]) -> str:
    """Run ``ops`` against the store as another user (uid 65534 where we can); its output."""
    cmd = [sys.executable, str(ROOT / "tests/workers/store_ops.py"), str(port), json.dumps(ops)]
    if os.geteuid() == 0:
        cmd = other_user.command(cmd)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FT_JOB_SECRET")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180 * slack(), cwd="/", env=env)
    assert out.returncode == 0 and out.stdout.endswith("done\n"), out.stderr
    return out.stdout


@pytest.fixture
def port() -> Iterator[int]:
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield master.port
    del master


def client(port: int, round: int) -> PrefixStore:
    return PrefixStore(PREFIX.format(round).rstrip("/"),
                       TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                timeout=timedelta(seconds=30)))


class Recorder:
    """A node's store client that keeps what the node set (the roll call deletes its keys when it ends)."""

    def __init__(self, store: PrefixStore) -> None:
        self.store = store
        self.sets: dict[str, list[bytes]] = {}

    def set(self, key: str, value: bytes) -> None:
        self.sets.setdefault(key, []).append(value)
        self.store.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def roll_call(a: Node, b: Node, port: int, round: int, *, group_world_size: int = 2, b_rank: int = 1,
              world_size: int = 4, a_store: Any = None, b_store: Any = None) -> tuple[Any, list[bool]]:
    """a (node 0) takes the roll call while b answers from its own thread."""
    answered: list[bool] = []
    b_store = b_store or client(port, round)
    helper = threading.Thread(target=lambda: answered.append(b.answer_pending(
        [], store=b_store, channel=CHANNEL, group_rank=b_rank, group_world_size=group_world_size,
        wait=a.timeout + 5 * slack())))
    helper.start()
    d = a.run(HUNG, [], store=a_store or client(port, round), channel=CHANNEL, group_rank=0,
              group_world_size=group_world_size, world_size=world_size, attempt=0)
    helper.join(30 * slack())
    assert not helper.is_alive()
    return d, answered


SECRET_TEXT = "hidden_function_of_rank_3"
B_EVIDENCE = [RankEvidence(2, "b", ANSWERED, local_rank=0, pid=424242, stack=STACK_IN_ALL_REDUCE),
              RankEvidence(3, "b", ANSWERED, local_rank=1, pid=434343,
                           stack=STACK_IN_ALL_REDUCE + f"  File \"train.py\", line 9 in {SECRET_TEXT}\n",
                           native="Thread 434343 (idle): native_frame_of_rank_3")]


def test_a_counter_another_user_adds_to_steers_nothing_and_reads_no_evidence(port: int) -> None:
    """The review's `add` of 100 to ft_launcher/roll_call_count made the other node poll the
    wrong incident (its ranks missing); and the answers, stacks and pids, were in clear."""
    forge(port, [["add", PREFIX.format(0) + "ft_launcher/roll_call_count", 100],
                 ["add", PREFIX.format(0) + BELL_KEY, 100]])
    a = Node("a", [RankEvidence(0, "a", ANSWERED, stack=STACK_IN_ALL_REDUCE),
                   RankEvidence(1, "a", ANSWERED, stack=STACK_SLEEPING)], timeout=3.0 * slack())
    b = Node("b", B_EVIDENCE)
    b_store = Recorder(client(port, 0))
    d, answered = roll_call(a, b, port, 0, b_store=b_store)
    assert answered == [True] and b.dumped == 1
    assert [e.rank for e in d.evidence] == [0, 1, 2, 3] and d.missing_ranks == []
    assert d.roll_call.nodes_answered == ["a", "b"] and d.verdict.behind == [1]
    gone = forge(port, [["exists", PREFIX.format(0) + answer_key(0, 1, 1)]]).splitlines()[0]
    assert gone == "False"  # the asker deleted the answer once read
    (seen,) = b_store.sets[answer_key(0, 1, 1)]
    assert b'"host":"b"' in seen  # while it was there, anyone who reached the store saw who answered ...
    for clear in (SECRET_TEXT, "424242", "434343", "native_frame", "all_reduce", "File"):
        assert clear.encode() not in seen, clear  # ... but not what it says


def test_a_request_copied_into_the_next_round_dumps_nothing(port: int, caplog: pytest.LogCaptureFixture) -> None:
    """The review copied a signed request to another round's key: it was accepted and the
    healthy ranks were dumped on demand."""
    a = Node("a", [RankEvidence(0, "a", ANSWERED, stack=STACK_SLEEPING)], timeout=2.0 * slack())
    b = Node("b", B_EVIDENCE)
    for n in (a, b):
        n.new_round(0)
    a_store = Recorder(client(port, 0))
    _, answered = roll_call(a, b, port, 0, a_store=a_store)
    assert answered == [True] and b.dumped == 1
    for n in (a, b):
        n.new_round(1)
    (genuine,) = a_store.sets[request_key(0)]  # as another user read it while it was there
    forge(port, [["set", PREFIX.format(1) + request_key(0), genuine.decode("latin-1")],
                 ["append", PREFIX.format(1) + ASKERS_KEY, "0,"], ["add", PREFIX.format(1) + BELL_KEY, 1]])
    with caplog.at_level(logging.WARNING, logger="ft_monitor.launcher"):
        assert not b.answer_pending([], store=client(port, 1), channel=CHANNEL, group_rank=1, group_world_size=2,
                                    wait=1.0)
    assert b.dumped == 1  # nothing dumped for it
    refusals = [r.getMessage() for r in caplog.records if "ignored a roll call request" in r.getMessage()]
    assert refusals == [f"ft-launcher: ignored a roll call request in the rendezvous store at {request_key(0)}: "
                        "a request of rendezvous round 0, not of this round 1 (replayed)"]
    d, answered = roll_call(a, b, port, 1)  # the round's own roll call is answered
    assert answered == [True] and b.dumped == 2 and d.missing_ranks == [1]  # rank 1: no node has it here


def test_bad_answers_do_not_stop_the_collection_of_the_others(port: int, caplog: pytest.LogCaptureFixture) -> None:
    """The review planted a non-ASCII mac: the collection of every answer stopped. Here nodes
    1-3 are silent and another user planted, at their answer keys, a non-ASCII mac, 16 KiB of
    `[`, and node 3's genuine answer to an earlier incident; node 4 answers."""
    earlier = encode_answer(CHANNEL, Sealer(SECRET), RollCallRequest(7, 1, "a", 0, 5.0, 0), "c", 3,
                            [RankEvidence(6, "c", ANSWERED, stack=STACK_SLEEPING)])
    master = client(port, 0)
    master.set(earlier[0], earlier[1])  # as node 3 stored it for incident 7
    p = PREFIX.format(0)
    forge(port, [["set", p + answer_key(0, 1, 1), '{"mac": "\\u00e9"}'],
                 ["set", p + answer_key(0, 1, 2), "[" * 16384],
                 ["copy", p + answer_key(0, 7, 3), p + answer_key(0, 1, 3)]])
    a = Node("a", [RankEvidence(0, "a", ANSWERED, stack=STACK_IN_ALL_REDUCE),
                   RankEvidence(1, "a", ANSWERED, stack=STACK_SLEEPING)], timeout=2.0 * slack())
    b = Node("b", B_EVIDENCE)
    with caplog.at_level(logging.WARNING, logger="ft_monitor.launcher"):
        d, answered = roll_call(a, b, port, 0, group_world_size=5, b_rank=4, world_size=4)
    assert answered == [True]
    assert [e.rank for e in d.evidence] == [0, 1, 2, 3] and d.roll_call.nodes_answered == ["a", "b"]
    ignored = sorted(r.getMessage() for r in caplog.records if "ignored a roll call answer" in r.getMessage())
    assert len(ignored) == 3, ignored  # each said once, though read every 50 ms
    assert [answer_key(0, 1, g) in m for g, m in zip((1, 2, 3), ignored, strict=True)] == [True] * 3
    assert not any("could not read the other nodes" in r.getMessage() for r in caplog.records)


def test_a_hang_record_copied_into_the_next_round_names_no_one(port: int, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 38: node 1's signed hang record of round 0, copied into round 1's prefix and listed
    on its board by another user, made node 0 decide "rank 1 hung first" in round 1, where its
    own rank 0 hung: the signature bound the key and the run id, which c10d keeps across rounds."""
    from types import SimpleNamespace

    from ft_monitor.launcher.incident.crossnode import HANG_COUNT_KEY, HANG_INDEX_KEY, HANG_KEY, NodeMessages
    from ft_monitor.launcher.incident.decide import first_hang
    from ft_monitor.launcher.store.store_auth import HangRecord

    def node(g: int, round: int) -> tuple[NodeMessages, Any]:
        messages = NodeMessages(SECRET)
        messages.round = round
        wg = SimpleNamespace(store=client(port, round), group_rank=g, group_world_size=2,
                             spec=SimpleNamespace(rdzv_handler=SimpleNamespace(get_run_id=lambda: "run")))
        return messages, wg

    old_messages, old_wg = node(1, 0)
    old_messages.exchange_hang_records(old_wg, old_messages.channel(old_wg), HangRecord(1, 1000.0, "old", "n1"))
    here = PREFIX.format(1)
    forge(port, [["copy", f"{PREFIX.format(0)}{HANG_KEY.format(1)}", f"{here}{HANG_KEY.format(1)}"],
                 ["append", f"{here}{HANG_INDEX_KEY}", "1,"], ["add", f"{here}{HANG_COUNT_KEY}", 1]])
    messages, wg = node(0, 1)
    channel = messages.channel(wg)
    mine = HangRecord(0, 2000.0, "section 'step' open", "n0")
    seen = messages.exchange_hang_records(wg, channel, mine)
    assert f"{HANG_KEY.format(1)}" in seen  # the copy was read: it is refused, not missed
    first, ignored = first_hang(mine, channel, seen)
    assert first == mine and len(ignored) == 1 and "round" in ignored[0][1], ignored
