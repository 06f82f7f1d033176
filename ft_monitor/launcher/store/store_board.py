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

Issue 38: anyone who reaches the store can spoil both hints. The counter is added to on a
private connection (ft_client.store.counter: torch's server closes the connection of an
``add`` to a value that is not a number, and the agent's own connection must never be the
one closed); a spoiled counter makes every look a forced one. The index may be grown by
another user to any size (40 MiB in the review: each launcher split all of it every second,
+361-570 MiB RSS): the store cannot say how long a value is before it is read, so an index
longer than `index_limit` (what the job's nodes could have appended, 16 entries a node) is
read once, found too long, logged, and not read again for INDEX_RETRY seconds; meanwhile the
board reads every wanted node's key as without the extended API (O(M) small reads, correct).
Only the first `index_limit` bytes of any index are ever parsed.

A store without torch's extended API (``has_extended_api()`` false: no ``append`` nor
``multi_get``, as torch's etcd store) gets no index: a look whose counter moved reads every
wanted node's key, one ``check`` and one ``get`` each, as before the board.

Issue 43, against a real etcd (bench/sim_nodes.py ``--stores etcd``): torch's EtcdStore answers
every ``get`` and ``check`` by reading its whole etcd folder (every key of every run and round
of that etcd: it cannot delete one), so reading the keys of 64 nodes read that folder 64 times
(the slow-rank exchange of 64 nodes took 29-53 s). With an etcd rendezvous the launcher gives
torch's EtcdStore a ``multi_get`` that reads the folder once for all its keys
(`read_etcd_folder_once`), which `read_all` uses (0.2-0.7 s). A counter is still added 0 to there:
EtcdStore's ``add`` reads the one key (and writes twice), 2-2.5 ms whatever the folder holds,
where a ``check`` and a ``get`` read the folder twice (20 ms at 2,000 keys).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from ft_client.store.counter import counters_of

log = logging.getLogger("ft_monitor.launcher")

ENTRIES_PER_NODE = 16
"""Publications a node may list on one board in one round before the board stops trusting the index."""
ENTRY_BYTES = 11
"""The longest entry an index holds: a group rank of up to 10 digits and its comma."""
INDEX_RETRY = 60.0
"""Seconds an index found too long is left unread (its board reads the nodes' keys instead)."""


def index_limit(nodes: int) -> int:
    """The most bytes the index of a board of ``nodes`` nodes can honestly hold."""
    return (max(nodes, 1) * ENTRIES_PER_NODE + 64) * ENTRY_BYTES


def parse_index(raw: object, nodes: int) -> set[int]:
    """The group ranks listed in ``raw`` (``"0,3,3,"``), those below ``nodes``, read from its first
    `index_limit` bytes; anything else is ignored."""
    if not isinstance(raw, (bytes, bytearray)):
        return set()
    out: set[int] = set()
    for token in bytes(memoryview(raw)[:index_limit(nodes)]).split(b","):
        if 0 < len(token) <= 10 and token.isdigit():
            g = int(token)
            if g < nodes:
                out.add(g)
    return out


class IndexReader:
    """Reads one index of ``nodes`` nodes, and remembers one found too long (`read` gives None
    for INDEX_RETRY seconds after, without a store operation)."""

    def __init__(self, key: str, nodes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.key = key
        self.nodes = nodes
        self._clock = clock
        self._unread_until = 0.0
        self.too_long = 0
        """Reads that found the index too long."""

    def read(self, store: Any) -> set[int] | None:
        """The listed group ranks (empty when there is no index), or None when the index is too long
        to trust (the caller reads its nodes' keys one by one)."""
        if self._clock() < self._unread_until:
            return None
        if not store.check([self.key]):
            return set()
        raw = store.get(self.key)
        limit = index_limit(self.nodes)
        if len(raw) <= limit:
            return parse_index(raw, self.nodes)
        if not self.too_long:
            log.warning("ft-launcher: the index %s in the rendezvous store holds %d bytes, more than %d nodes could "
                        "have written (%d): someone who reaches the store grew it; the nodes' keys are read one by "
                        "one instead, and the index is read again in %.0f s",
                        self.key, len(raw), self.nodes, limit, INDEX_RETRY)
        self.too_long += 1
        self._unread_until = self._clock() + INDEX_RETRY
        return None


def first_sight(seen: set[bytes], raw: object, cap: int = 100) -> bool:
    """Whether ``raw`` (a value read from the store) is new to ``seen``, which keeps a 16-byte
    digest of each (at most ``cap``), never the value: a bad value may be megabytes long."""
    digest = hashlib.blake2b(raw if isinstance(raw, (bytes, bytearray)) else repr(raw).encode(),
                             digest_size=16).digest()
    if digest in seen or len(seen) >= cap:
        return False
    seen.add(digest)
    return True


def extended(store: Any) -> bool:
    """Whether ``store`` has torch's extended API (append, multi_get: TCPStore, PrefixStore of one)."""
    try:
        return bool(store.has_extended_api())
    except Exception:  # noqa: BLE001 - no such method, or a store that cannot say: the plain API
        return False


def etcd_multi_get(self: Any, keys: list[str]) -> list[bytes]:
    """``multi_get`` for torch's EtcdStore (``self``), which has none of its own: one read of its
    etcd folder for all ``keys`` (waiting, as its ``get`` does, until they are all there or
    the store's timeout), where torch's base class reads the folder once per key."""
    wanted = [self.prefix + self._encode(k) for k in keys]
    found = self._try_wait_get(wanted)
    if found is None:
        raise LookupError(f"{len(keys)} key(s) not all found in EtcdStore ({keys[0]!r}, ...)")
    return [self._decode(found[k]) for k in wanted]


def read_etcd_folder_once() -> bool:
    """Give torch's EtcdStore `etcd_multi_get` (once; torch's own multi_get users, the agent's
    rank assignment among them, get it too, through a PrefixStore as well). Not where torch
    defines a ``multi_get`` of its own or lacks the helpers it uses. Whether it has it."""
    try:
        from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore
    except ImportError:
        return False
    if vars(EtcdStore).get("multi_get") is etcd_multi_get:
        return True
    if "multi_get" in vars(EtcdStore) or not all(callable(getattr(EtcdStore, n, None))
                                                 for n in ("_try_wait_get", "_encode", "_decode")):
        return False
    EtcdStore.multi_get = etcd_multi_get  # type: ignore[method-assign]
    return True


def reads_folder_once(store: Any) -> bool:
    """Whether ``store`` (or the store under its prefix) is an EtcdStore with `etcd_multi_get`."""
    base = getattr(store, "underlying_store", store)
    return getattr(type(base), "multi_get", None) is etcd_multi_get


def read_all(store: Any, keys: list[str]) -> list[bytes]:
    """The values of ``keys`` (all in the store): one ``multi_get``, or a ``get`` each."""
    if not keys:
        return []
    if extended(store) or reads_folder_once(store):
        return list(store.multi_get(keys))
    return [store.get(k) for k in keys]


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
        self.index = IndexReader(index_key, nodes)

    def publish(self, store: Any, group_rank: int, value: bytes) -> str:
        """Set this node's value, then list and count it; its key."""
        key = self.key_of(group_rank)
        store.set(key, value)
        if extended(store):
            store.append(self.index_key, f"{group_rank},")
        counters_of(store).add(self.count_key, 1)  # None: spoiled, and its readers look anyway
        return key

    def count(self, store: Any) -> int | None:
        """The counter, or None when it does not hold a number (ft_client.store.counter)."""
        return counters_of(store).add(self.count_key, 0)

    def look(self, store: Any, wanted: Iterable[int], force: bool = False) -> dict[int, bytes]:
        """The values of the ``wanted`` nodes that are listed, read when the counter moved since
        the last look (or with ``force`` whenever it is not 0, or whenever the counter is
        spoiled); {} when nothing new."""
        wanted = set(wanted)
        count = self.count(store)
        if count == 0 or (count is not None and count == self.seen_count and not force):
            self.seen_count = count
            return {}
        self.seen_count = count
        listed = self.index.read(store) if extended(store) else None
        if listed is None:  # no index, or one not to trust: every wanted node's key
            keys = existing(store, [self.key_of(g) for g in sorted(wanted)])
            by_key = {self.key_of(g): g for g in wanted}
            return {by_key[k]: raw for k, raw in zip(keys, read_all(store, keys), strict=True)}
        listed_wanted = sorted(listed & wanted)  # a counter moved by someone else: nothing listed (never wait)
        if not listed_wanted:
            return {}
        keys = existing(store, [self.key_of(g) for g in listed_wanted])
        if not keys:
            return {}
        by_key = {self.key_of(g): g for g in listed_wanted}
        return {by_key[k]: raw for k, raw in zip(keys, read_all(store, keys), strict=True)}

    def clear(self, store: Any) -> None:
        """Delete the index and the counter (the values are their writers' to delete)."""
        store.delete_key(self.index_key)
        store.delete_key(self.count_key)
