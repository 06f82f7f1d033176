"""Issue 38 (high): a counter in the rendezvous store that another user `set` to a non-number.
torch's store server closes the connection of an ``add`` to it; ft's counters are added to on a
connection of their own (ft_client.store.counter), so the launcher's rendezvous connection and
the Wrapper's store (which its process group shares) live on. Every test runs against a real
TCPStore on a real socket, the attacker another client of it; test_e2e_diagnosis.py's runs as
another user (tests/workers/store_ops.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed import HashStore, PrefixStore, TCPStore

from ft_client import torch_features
from ft_client.inprocess.store import RestartStore
from ft_client.store.counter import SPOILED_RETRY, Counters, counters_of
from ft_monitor.launcher.store.store_board import INDEX_RETRY, Board, IndexReader, index_limit, parse_index
from tests import test_rollcall_attacks as attacks
from tests.test_inprocess_parts import SIGNER
from tests.test_rollcall import FakeStore

pytestmark = pytest.mark.compat  # also run on the oldest and newest torch (scripts/test-compat)

PREFIX = "torch.rendezvous.run.0"
"""Round 0's prefix of test_rollcall_attacks' stores (its ``client``)."""
port = attacks.port  # the store fixture, the same
needs_clone = pytest.mark.skipif(not torch_features.store_clone(),
                                 reason=torch_features.STORE_CLONE.line(str(torch_features.version())))
"""The counters of a store under a PrefixStore have a connection of their own from torch 2.8
(``Store.clone``); before, they share the store's (ft_client/torch_features.py, named at start)."""


def client(port: int) -> PrefixStore:
    return attacks.client(port, 0)


def plant(port: int, key: str, value: bytes) -> None:
    """Someone else sets ``key``, through a client of their own (the store knows no users; the
    end-to-end test in test_e2e_diagnosis.py writes as uid 65534). A ``set`` has no reply: the
    ``check`` after it waits until the server has it."""
    other = client(port)
    other.set(key, value)
    assert other.check([key])


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@needs_clone
def test_a_spoiled_counter_costs_a_private_connection_and_never_the_stores_own(port: int) -> None:
    store = client(port)
    clock = Clock()
    counters = Counters(store, clock)
    assert counters.add("bell", 1) == 1
    plant(port, "bell", b"x")
    with pytest.raises(RuntimeError):  # what the plain store does: its connection is closed
        client(port).add("bell", 0)
    assert counters.add("bell", 0) is None and counters.losses == 1
    assert store.check(["bell"]) and store.get("bell") == b"x"  # the store's own connection lives on
    assert counters.add("bell", 0) is None and counters.losses == 1  # left alone: no connection per poll
    assert counters.add("other", 2) == 2  # the private connection was reopened for the rest
    clock.now += SPOILED_RETRY
    plant(port, "bell", b"7")
    assert counters.add("bell", 1) == 8 and counters.losses == 1  # trusted again once it holds a number


def test_a_counter_of_a_store_that_is_gone_raises(port: int) -> None:
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=2))
    counters = Counters(PrefixStore(PREFIX, TCPStore("127.0.0.1", master.port, is_master=False,
                                                     wait_for_workers=False, timeout=timedelta(seconds=2))))
    assert counters.add("bell", 1) == 1
    del master
    with pytest.raises(RuntimeError):
        counters.add("bell", 1)


def test_a_counter_whose_server_left_raises_without_waiting_out_a_connect_timeout() -> None:
    """The job's store host exited (a rank that gave up): the add's error is raised, not
    followed by a new connection that waits out its timeout (the Wrapper's store: 30 s, then a
    retry) before it raises too. A rank outlived its store host by 47-66 s that way."""
    timeout = 120.0
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
    counters = Counters(PrefixStore(PREFIX, TCPStore("127.0.0.1", master.port, is_master=False,
                                                     wait_for_workers=False, timeout=timedelta(seconds=timeout))))
    assert counters.add("bell", 1) == 1
    del master
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        counters.add("bell", 1)
    assert time.monotonic() - start < timeout / 2  # not a connect timeout (any load leaves this far apart)


def test_a_store_without_clone_adds_on_itself_and_a_bad_value_is_none() -> None:
    store = FakeStore()
    store.set("bell", b"x")
    assert Counters(store).add("bell", 0) is None
    assert Counters(store).add("fine", 3) == 3


def test_counters_of_a_store_are_one_connection_closed_with_it(port: int) -> None:
    store = client(port)
    assert counters_of(store) is counters_of(store)
    assert counters_of(client(port)) is not counters_of(store)


@needs_clone
def test_a_board_whose_bell_is_spoiled_still_finds_every_value_and_keeps_its_connection(port: int) -> None:
    writer, reader = client(port), client(port)
    board = Board("askers", "bell", "request/{}".format, 4)
    board.publish(writer, 2, b"two")
    assert Board("askers", "bell", "request/{}".format, 4).look(reader, [1, 2, 3]) == {2: b"two"}
    plant(port, "bell", b"x")
    board.publish(writer, 3, b"three")  # its count is spoiled: published and listed all the same
    fresh = Board("askers", "bell", "request/{}".format, 4)
    assert fresh.look(reader, [1, 2, 3]) == {2: b"two", 3: b"three"}
    assert fresh.look(reader, [1, 2, 3]) == {2: b"two", 3: b"three"}  # spoiled: every look is a forced one
    for store in (writer, reader):
        assert store.check(["request/3"])  # the connections the caller gave it


def test_an_index_grown_by_another_user_is_read_once_and_the_keys_one_by_one_after(port: int) -> None:
    writer, reader = client(port), client(port)
    board = Board("askers", "bell", "request/{}".format, 4)
    board.publish(writer, 1, b"one")
    plant(port, "askers", b"0," * (4 << 20))  # 8 MiB
    gets: list[int] = []

    class Watched:
        def __getattr__(self, name: str) -> Any:
            if name == "get":
                return lambda key: (gets.append(1), reader.get(key))[1]
            return getattr(reader, name)

    clock = Clock()
    board.index = IndexReader("askers", 4, clock)
    assert board.look(Watched(), [1, 2, 3], force=True) == {1: b"one"}  # the index found too long: the keys
    assert board.index.too_long == 1
    board.publish(writer, 2, b"two")
    gets.clear()
    assert board.look(Watched(), [1, 2, 3]) == {1: b"one", 2: b"two"}
    assert board.index.too_long == 1 and len(gets) == 0  # not read again (the values came by multi_get)
    clock.now += INDEX_RETRY
    board.look(Watched(), [1, 2, 3], force=True)
    assert board.index.too_long == 2  # read again after INDEX_RETRY


@needs_clone
def test_a_restart_barrier_whose_count_is_spoiled_still_completes(port: int) -> None:
    """The Wrapper's barrier counts on its own connection; a spoiled count makes each rank check the
    signed arrivals, and the last one to arrive ends the barrier."""
    stores = [RestartStore(client(port), 2, SIGNER, rank=r, prefix="t/", attempt_id="0") for r in range(2)]
    plant(port, stores[0].key(1, "completed"), b"x")
    stores[0].complete(1)
    assert stores[0].outcome(1) is None
    stores[1].complete(1)
    assert stores[0].outcome(1) is True and stores[1].outcome(1) is True
    assert stores[0].base.check([stores[0].key(1, "outcome")])  # the base connection lives on


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=1, max_value=5_000), st.binary(max_size=64))
def test_only_the_first_limit_bytes_of_any_index_are_parsed(nodes: int, junk: bytes) -> None:
    """A 40 MiB index was split whole (+361-570 MiB RSS per launcher): now only what the nodes
    could have written is parsed, whatever follows."""
    limit = index_limit(nodes)
    head = (junk + b"," * limit)[:limit]
    assert parse_index(head + b"0," * 1000, nodes) == parse_index(head, nodes)


def test_a_hash_store_counts_as_a_store_of_its_own() -> None:
    store = HashStore()
    counters = Counters(store)
    assert counters.add("n", 2) == 2 and counters.add("n", 0) == 2


@pytest.fixture(scope="module")
def shared_port() -> Iterator[int]:
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield master.port
    del master


@needs_clone
@settings(max_examples=10, deadline=None)
@given(value=st.one_of(st.binary(max_size=40),
                       st.integers(min_value=-(2**70), max_value=2**70).map(lambda n: str(n).encode()),
                       st.sampled_from([b"x", b"", b" 3", b"1.5", b"-", b"99999999999999999999999", b"\x00"])))
def test_any_value_someone_sets_at_a_counter_gives_a_count_or_none_and_spares_the_store(shared_port: int,
                                                                                         value: bytes) -> None:
    """Issue 38: a counter holding anything (another user's ``set``) is a number or None; the
    store's own connection is never the one the server closes."""
    store, attacker = client(shared_port), client(shared_port)
    attacker.set("bell", value)
    assert attacker.check(["bell"])  # a set has no reply: this waits until the server has it
    got = Counters(store, Clock()).add("bell", 0)
    assert got is None or isinstance(got, int)
    assert store.check(["bell"])  # the caller's own connection still answers
