"""A notice board in the rendezvous store: values that nodes publish at their own keys,
listed and counted, so that a reader learns of new ones with one store operation per
look instead of one per node (issue 28).

The launchers' messages to each other (hang records, roll call requests and answers) each
sit at a key of their writer's (``.../<group rank>``), signed for that key (store_auth). A
reader used to `check` every other node's key on every look: O(M) operations per look per
node, O(M^2) for the job. A `Board` adds, beside those keys, two of its own:

* ``index``: the group ranks that published, appended (``"3,"``) after the value is set;
* ``count``: a counter added to after the append.

A reader polls ``add(count, 0)`` (one small operation); only when it moved does it read
the index and then the new values with one `check` and one `multi_get`. The values stay
signed and bound to their own keys exactly as before: the index and the counter are only
hints of where to look. A forged or garbled index entry points at a key the reader then
refuses (or that does not exist: it is skipped, never waited for); a forged value is
re-read when the counter moves again (its real writer adds after setting it); a counter an
attacker resets delays a reader until the counter moves or, where a caller needs a bound,
until its next forced look (``look(force=True)`` reads the index whatever the counter).

`parse_index` is total: any bytes give a set of group ranks below ``nodes``.

A store without torch's extended API (``has_extended_api()`` false: no ``append`` nor
``multi_get``, as torch's etcd store) gets no index: a look whose counter moved reads every
wanted node's key, one ``check`` and one ``get`` each, as before the board.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

MAX_INDEX_ENTRIES = 65536
"""Entries of an index read at most (a node appends one per publication)."""


def parse_index(raw: object, nodes: int) -> set[int]:
    """The group ranks listed in ``raw`` (``"0,3,3,"``), those below ``nodes``; anything else is ignored."""
    if not isinstance(raw, (bytes, bytearray)):
        return set()
    out: set[int] = set()
    for i, token in enumerate(bytes(raw).split(b",")):
        if i >= MAX_INDEX_ENTRIES:
            break
        if 0 < len(token) <= 10 and token.isdigit():
            g = int(token)
            if g < nodes:
                out.add(g)
    return out


def extended(store: Any) -> bool:
    """Whether ``store`` has torch's extended API (append, multi_get: TCPStore, PrefixStore of one)."""
    try:
        return bool(store.has_extended_api())
    except Exception:  # noqa: BLE001 - no such method, or a store that cannot say: the plain API
        return False


def read_all(store: Any, keys: list[str]) -> list[bytes]:
    """The values of ``keys`` (all in the store): one ``multi_get``, or a ``get`` each."""
    if not keys:
        return []
    return list(store.multi_get(keys)) if extended(store) else [store.get(k) for k in keys]


def existing(store: Any, keys: list[str]) -> list[str]:
    """Those of ``keys`` that are in the store: one `check` when all are (the usual case),
    else one per key (a `get` or `multi_get` of a missing key would wait for it)."""
    if not keys:
        return []
    if store.check(keys):
        return keys
    return [k for k in keys if store.check([k])]


class Board:
    """One board: ``key_of(group rank)`` is where a node's value sits."""

    def __init__(self, index_key: str, count_key: str, key_of: Callable[[int], str], nodes: int) -> None:
        self.index_key = index_key
        self.count_key = count_key
        self.key_of = key_of
        self.nodes = nodes
        self.seen_count: int | None = None

    def publish(self, store: Any, group_rank: int, value: bytes) -> str:
        """Set this node's value, then list and count it; its key."""
        key = self.key_of(group_rank)
        store.set(key, value)
        if extended(store):
            store.append(self.index_key, f"{group_rank},")
        store.add(self.count_key, 1)
        return key

    def count(self, store: Any) -> int:
        return int(store.add(self.count_key, 0))

    def look(self, store: Any, wanted: Iterable[int], force: bool = False) -> dict[int, bytes]:
        """The values of the ``wanted`` nodes that are listed, read when the counter moved since
        the last look (or with ``force`` whenever it is not 0); {} when nothing new."""
        wanted = set(wanted)
        count = self.count(store)
        if count == 0 or (count == self.seen_count and not force):
            self.seen_count = count
            return {}
        self.seen_count = count
        if not extended(store):  # no index: every wanted node's key
            keys = existing(store, [self.key_of(g) for g in sorted(wanted)])
            by_key = {self.key_of(g): g for g in wanted}
            return {by_key[k]: store.get(k) for k in keys}
        if not store.check([self.index_key]):  # a counter moved by someone else: nothing listed (never wait)
            return {}
        listed = sorted(parse_index(store.get(self.index_key), self.nodes) & wanted)
        if not listed:
            return {}
        keys = existing(store, [self.key_of(g) for g in listed])
        if not keys:
            return {}
        by_key = {self.key_of(g): g for g in listed}
        return {by_key[k]: raw for k, raw in zip(keys, read_all(store, keys), strict=True)}

    def clear(self, store: Any) -> None:
        """Delete the index and the counter (the values are their writers' to delete)."""
        store.delete_key(self.index_key)
        store.delete_key(self.count_key)
