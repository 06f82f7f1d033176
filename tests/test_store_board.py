"""store_board.py (issue 28): a look costs one store operation while nothing is new, reads
only what was listed since, and never waits for a key an index or counter points at."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ft_monitor.launcher.store.store_board import Board, parse_index
from tests.test_rollcall import FakeStore


class Counting(FakeStore):
    def __init__(self, extended: bool = True) -> None:
        super().__init__(extended)
        self.ops = 0

    def __getattribute__(self, name: str):  # type: ignore[no-untyped-def]
        if name in ("set", "get", "check", "add", "append", "multi_get", "delete_key"):
            object.__setattr__(self, "ops", object.__getattribute__(self, "ops") + 1)
        return object.__getattribute__(self, name)


def board(nodes: int = 100) -> Board:
    return Board("idx", "count", "value/{}".format, nodes)


@given(st.binary(max_size=2000), st.integers(min_value=0, max_value=2000))
def test_any_index_bytes_give_ranks_below_the_node_count(raw: bytes, nodes: int) -> None:
    assert all(0 <= g < nodes for g in parse_index(raw, nodes))


def test_an_index_lists_ranks_once_and_skips_what_is_not_one() -> None:
    assert parse_index(b"3,1,3,,x,-2,99,0,", 10) == {0, 1, 3}
    assert parse_index("3,", 10) == set()  # not bytes
    assert parse_index(b"1" * 11 + b",2,", 10) == {2}


def test_a_look_costs_one_operation_while_nothing_is_new_whatever_the_nodes() -> None:
    store = Counting()
    writer, reader = board(), board()
    writer.publish(store, 7, b"seven")
    store.ops = 0
    assert reader.look(store, range(100)) == {7: b"seven"}
    assert store.ops == 5  # add, check(index), get(index), check(listed), multi_get
    store.ops = 0
    for _ in range(10):
        assert reader.look(store, range(100)) == {}
    assert store.ops == 10
    writer.publish(store, 9, b"nine")
    assert reader.look(store, [9]) == {9: b"nine"}  # only the wanted and listed


def test_a_counter_moved_or_an_index_entry_planted_by_someone_else_waits_for_nothing() -> None:
    store = FakeStore()
    store.add("count", 100)  # no index at all: nothing listed, and no get of a missing key
    assert board().look(store, range(100)) == {}
    store.append("idx", "5,6,")  # listed, never stored
    store.add("count", 1)
    assert board().look(store, range(100)) == {}
    store.set("value/6", b"planted")  # listed and stored: read, for the caller to judge
    assert board().look(store, range(100), force=True) == {6: b"planted"}


def test_without_the_extended_api_a_look_reads_every_wanted_key_when_the_counter_moved() -> None:
    store = Counting(extended=False)
    b = board(4)
    b.publish(store, 2, b"two")  # set + add: no append
    assert "idx" not in store.data
    assert b.look(store, range(4)) == {2: b"two"}
    assert b.look(store, range(4)) == {}  # the counter did not move
    assert b.look(store, range(4), force=True) == {2: b"two"}


def test_clear_deletes_the_index_and_the_counter() -> None:
    store = FakeStore()
    board().publish(store, 1, b"one")
    board().clear(store)
    assert set(store.data) == {"value/1"}


def test_only_a_rendezvous_with_a_prefix_per_round_has_its_last_round_tidied() -> None:
    """A static rendezvous shares one store prefix between attempts: deleting "the last
    round's" keys there would delete the new round's (torch's rank assignment among them)."""
    from types import SimpleNamespace

    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    from ft_monitor.launcher.rdzv.rounds import rounds_apart

    dynamic = SimpleNamespace(_state_holder=SimpleNamespace(state=SimpleNamespace(round=3)))
    assert rounds_apart(dynamic)
    assert not rounds_apart(StaticTCPRendezvous("127.0.0.1", 1, 0, 2, "run", 30))
    assert not rounds_apart(None)
