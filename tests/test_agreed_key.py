"""Issue 56: without a job secret, the launchers of a static or c10d rendezvous agree on a job key
through the rendezvous store (ft_monitor/launcher/store/agreed_key.py), in process against a real
TCPStore: every launcher of a round gets the same key, each round its own, a value someone else
put at the key is refused by a total parser, and etcd agrees on nothing. The two-node runs are in
test_e2e_truth_nosecret.py."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed import PrefixStore, TCPStore

from ft_client.store.jobkey import INPROCESS
from ft_client.store.signed import derive_key
from ft_monitor.launcher.store.agreed_key import (
    KEY,
    PREFIX,
    AgreedKeyError,
    agree,
    agrees,
    encode_key,
    parse_key,
    round_key,
    start_line,
)
from ft_monitor.launcher.store.store_auth import CrashRecord, StoreChannel, StoreMessageError


@pytest.fixture
def port() -> Iterator[int]:
    """The port of a store's host (as node 0's launcher hosts the rendezvous store)."""
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield host.port
    del host


def _client(port: int) -> TCPStore:
    """One launcher's connection to the store."""
    return TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))


def _round(port: int, run: str, number: int) -> PrefixStore:
    return PrefixStore(f"torch.rendezvous.{run}.{number}", _client(port))  # c10d's prefix of a round


def _handler(backend: str) -> Any:
    return SimpleNamespace(get_backend=lambda: backend)


def test_two_launchers_agree_on_one_key_per_round_and_sign_each_others_records(port: int) -> None:
    mine = agree(_round(port, "job", 0))
    theirs = agree(_round(port, "job", 0))
    assert mine == theirs and len(mine) == 32
    assert _client(port).get(f"torch.rendezvous.job.0/{KEY}") == encode_key(mine)
    # a later round (a node replaced, a restart) agrees anew; another run id too
    later = agree(_round(port, "job", 1))
    assert later == agree(_round(port, "job", 1)) and later != mine
    assert agree(_round(port, "other-job", 0)) not in (mine, later)
    # what one node signs with it, the other reads; a record of the next round's key is refused here
    record = CrashRecord(3, "rank 3 (pid 9) was killed by SIGKILL", "node-b")
    raw = StoreChannel(theirs, "job", 0).encode("ft_launcher/crash/1", record)
    assert StoreChannel(mine, "job", 0).decode("ft_launcher/crash/1", raw, CrashRecord) == record
    with pytest.raises(StoreMessageError, match="bad signature"):
        StoreChannel(later, "job", 0).decode("ft_launcher/crash/1", raw, CrashRecord)


@pytest.mark.parametrize("value", [b"x", b"", PREFIX, PREFIX + b"0" * 63, PREFIX + b"0" * 65, PREFIX + b"G" * 64,
                                   PREFIX + b"A" * 64, b"ft-launcher-job-key/v2:" + b"0" * 64, b"\xff" * 87,
                                   PREFIX + "é".encode() * 32, b"0" * 64])
def test_a_value_at_the_key_that_no_launcher_offered_is_refused(port: int, value: bytes,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    store = _round(port, "job", 0)
    store.set(KEY, value)  # someone else got there first
    if not value:  # an empty value is no offer: the first launcher's takes its place
        assert agree(_round(port, "job", 0)) == parse_key(store.get(KEY))
        return
    try:  # (not pytest.raises: its traceback would keep the store's connection open after the test)
        agree(_round(port, "job", 0))
        refused = ""
    except AgreedKeyError as e:
        refused = str(e)
    assert refused.startswith(f"the value at {KEY} ({len(value)} bytes) is not"), refused
    with caplog.at_level(logging.WARNING, "ft_monitor.launcher"):
        assert round_key(_handler("c10d"), _round(port, "job", 0), 0) is None
    assert "no job key in rendezvous round 0" in caplog.text and "not shared across nodes" in caplog.text
    assert store.get(KEY) == value  # refused, not overwritten: nothing is guessed


@pytest.mark.parametrize("raw", [None, 7, "a" * 87, [PREFIX], {"k": 1}, 1.5, object()])
def test_the_parser_is_total(raw: object) -> None:
    with pytest.raises(AgreedKeyError):
        parse_key(raw)
    assert parse_key(bytearray(encode_key(b"k" * 32))) == b"k" * 32
    assert parse_key(memoryview(encode_key(b"k" * 32))) == b"k" * 32
    with pytest.raises(AgreedKeyError, match="32 bytes, not 3"):
        encode_key(b"abc")


def test_only_static_and_c10d_agree_and_etcd_is_told_how_to_set_a_secret(port: int) -> None:
    host = _client(port)
    assert agrees("static") and agrees("c10d")
    assert not any(agrees(b) for b in ("etcd", "etcd-v2", "my-plugin", None, 3))
    for backend in ("etcd", "etcd-v2"):
        assert round_key(_handler(backend), _round(port, "job", 0), 0) is None
    assert not host.check([f"torch.rendezvous.job.0/{KEY}"])  # etcd offered nothing
    assert round_key(_handler("static"), PrefixStore("job", host), 0) == parse_key(host.get(f"job/{KEY}"))

    def broken() -> str:
        raise RuntimeError("no backend")

    assert round_key(SimpleNamespace(get_backend=broken), host, 0) is None
    warn, line = start_line("etcd-v2", "2")
    assert warn and "not shared across nodes" in line and "FT_JOB_SECRET_FILE=/path/to/a/0600/file" in line
    warn, line = start_line("c10d", "2")
    assert not warn and "agree on a job key through the c10d rendezvous store" in line and '"The job secret"' in line
    assert "\n" not in line


def test_the_workers_in_process_key_comes_from_the_agreed_key() -> None:
    # without a secret, several nodes: the workers' $FT_INPROCESS_KEY was unset and each worker warned and
    # signed with a public key; now it is derived from the round's agreed key, the same on every node
    from ft_monitor.launcher.agent.runtime import FtRuntime

    ft: Any = FtRuntime.__new__(FtRuntime)
    ft.job_secret, ft.local_key, ft.agreed_key = None, None, b"a" * 32
    assert ft.launcher_key == b"a" * 32
    assert ft.inprocess_key("job") == derive_key(b"a" * 32, INPROCESS, "job").hex()
    ft.job_secret = b"s" * 32  # a secret given wins
    assert ft.launcher_key == b"s" * 32
    ft.job_secret, ft.agreed_key = None, None
    assert ft.launcher_key is None and ft.inprocess_key("job") is None


def test_a_hang_on_one_node_is_the_root_on_the_node_whose_ranks_then_lost_a_peer(port: int) -> None:
    # issue 56: a rank hung on node 1, its node stopped its group, and node 0's ranks, waiting on it in a
    # collective, failed with "Connection closed by peer" before their own monitors fired: node 0 had no
    # record of the hang (a hang record is not a crash record) and named its own rank. Now the hung rank's
    # node publishes the round's crash record too, under the agreed key, and node 0 names it
    from ft_monitor.launcher.agent.hangs import HangHandling
    from ft_monitor.launcher.incident.crash import FailedRank, decide_crash, on_another_node
    from ft_monitor.launcher.incident.crossnode import NodeMessages
    from ft_monitor.launcher.incident.decide import WorkerRef
    from ft_monitor.launcher.store.store_auth import HangRecord

    def node(group_rank: int) -> tuple[Any, Any]:
        store = _round(port, "job", 4)
        wg = SimpleNamespace(store=store, group_world_size=2, group_rank=group_rank,
                             spec=SimpleNamespace(rdzv_handler=SimpleNamespace(get_run_id=lambda: "job")))
        messages = NodeMessages(round_key(_handler("c10d"), store, 4))
        messages.round = 4
        return wg, messages

    (wg1, nodes1), (wg0, nodes0) = node(1), node(0)
    assert nodes0.job_secret == nodes1.job_secret is not None
    hung: Any = HangHandling.__new__(HangHandling)
    hung.nodes = nodes1
    decision = SimpleNamespace(victim_of=None, worker=WorkerRef(3, 1, 900),
                               root_cause=HangRecord(3, 1.0, "section 'step' open for 2.0 s, timeout 2.0 s", "node-b"))
    hung._publish_hang_root(wg1, decision)
    record = nodes0.crash_elsewhere(wg0, 4)
    assert record is not None and (record.rank, record.host) == (3, socket.gethostname()), record
    here = decide_crash([FailedRank(0, 100, 1, "RuntimeError: [pair.cc:553] Connection closed by peer", raised_at=2.0)])
    v = on_another_node(record.rank, record.how, "node-b", here)
    assert v.message.startswith("rank 3 (pid 900) hung: section 'step' open for 2.0 s, timeout 2.0 s on node-b "
                                "(another node); failed because of it: rank 0 (pid 100)"), v.message
    # a node that was only the victim of another's hang publishes nothing; another round's record is not read
    hung.nodes = nodes0
    hung._publish_hang_root(wg0, SimpleNamespace(**{**vars(decision), "victim_of": decision.root_cause}))
    assert nodes1.crash_elsewhere(wg1, 4) is None and nodes0.crash_elsewhere(wg0, 5) is None
