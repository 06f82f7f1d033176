"""Counters in a torch.distributed store that anyone who reaches it may have spoiled: added to
on a connection of their own, so that a spoiled one costs that connection and nothing else.

torch's TCPStore server answers an ``add`` to a value that is not a decimal number (another
user's ``set(key, "x")``: the store knows no users) by closing the connection the ``add``
came on ("Error processing client message: stoll" in the server's log; the legacy backend
does the same). A launcher that polled its roll-call bell with ``add(bell, 0)`` on the
agent's store lost the agent's only connection to the rendezvous: both launchers of a job
exited 2 (RendezvousConnectionError) within 1.5 s, and a Wrapper lost the connection its
process group's store shares (issue 38).

`Counters` makes its adds on a private clone of the store (``Store.clone()``: a new
connection to the same server, with the same key prefix), opened at the first add and
reopened after a loss. An add that lost the clone while a fresh clone still reaches the
server found a spoiled counter: `Counters.add` returns None ("unknown"), logs it once, and
does not touch that key again for SPOILED_RETRY seconds (each try costs a connection and a
line in the server's log). Callers treat None as "the count cannot be trusted": they check
the signed values the count only points at, which they do anyway. An add whose fresh clone
cannot reach the server either raises, as the plain store would: the store is gone.

A store without ``clone`` (torch's python EtcdStore, a HashStore in tests) adds on itself:
it has no connection that a bad value could close (EtcdStore raises ValueError), and that
error is the same None here. torch has ``clone`` from 2.8; before, a plain TCPStore gets a new
client instead, and a PrefixStore adds on itself too (`ft_client.torch_features.store_connection`).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ft_client.errors import FtError
from ft_client.torch_features import store_connection

log = logging.getLogger("ft_client.store")


class StoreGoneError(FtError, RuntimeError):
    """The store whose counters these are was closed (``counters_of`` holds it weakly)."""

SPOILED_RETRY = 30.0
"""Seconds a counter found spoiled is left alone before it is added to again."""


class Counters:
    """The counters of one store (``base``), added to on a private connection."""

    def __init__(self, base: Any, clock: Callable[[], float] = time.monotonic, *, weak: bool = False) -> None:
        self._base: Callable[[], Any] = weakref.ref(base) if weak else (lambda: base)
        """``base``, held weakly by `counters_of`'s cache (its key)."""
        self._clock = clock
        self._conn: Any = None
        self._own = True
        """Whether ``base`` can be cloned (False: adds go to ``base`` itself)."""
        self._spoiled: dict[str, float] = {}
        self._lock = threading.Lock()
        self.losses = 0
        """Private connections the server closed (spoiled counters found)."""

    def _private(self) -> Any:
        if self._conn is None and self._own:
            try:
                self._conn = store_connection(self._store())  # clone(), or before torch 2.8 a new TCPStore client
            except (AttributeError, NotImplementedError, RuntimeError, TypeError):
                self._conn = None
            if self._conn is None:
                self._own = False  # a python store (etcd) without a connection to lose; a PrefixStore before 2.8
        return self._conn if self._own else self._store()  # never kept: the cache holds its key weakly

    def _store(self) -> Any:
        base = self._base()
        if base is None:
            raise StoreGoneError("the store of these counters is gone (it was closed)")
        return base

    def spoiled(self, key: str) -> bool:
        """Whether ``key`` was found spoiled less than SPOILED_RETRY seconds ago."""
        until = self._spoiled.get(key)
        return until is not None and self._clock() < until

    def add(self, key: str, amount: int) -> int | None:
        """``add(key, amount)``'s result, or None when ``key`` does not hold a number (now or
        within SPOILED_RETRY). Raises what the store raises when it cannot be reached."""
        with self._lock:
            if self.spoiled(key):
                return None
            conn = self._private()
            try:
                return int(conn.add(key, amount))
            except ValueError:  # a python store's int() of the value (EtcdStore)
                self._spoil(key)
                return None
            except RuntimeError:  # torch's DistNetworkError (the server closed it), or DistStoreError
                if not self._own:
                    raise
                self._conn = None  # the next add opens another
                self.losses += 1
                # Is the server still there? Asked on the caller's own connection, which an add
                # never touched: it raises at once when the server is gone (the job's store host
                # exited), where a new connection would wait out its connect timeout first (30 s
                # and a retry: a rank outlived a store host by 47-66 s)
                self._store().check([key])
                self._spoil(key)
                return None

    def _spoil(self, key: str) -> None:
        if key not in self._spoiled:
            log.warning("the counter %s in the store does not hold a number (set by someone who reaches the "
                        "store?): it is not trusted, and the values it counts are checked one by one", key)
        self._spoiled[key] = self._clock() + SPOILED_RETRY


_by_store: weakref.WeakKeyDictionary[Any, Counters] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def counters_of(store: Any) -> Counters:
    """The `Counters` of ``store``: one private connection per store object, closed with it."""
    with _cache_lock:
        try:
            got = _by_store.get(store)
        except TypeError:  # a store that cannot be weakly referenced: counters of its own each time
            return Counters(store)
        if got is None:
            got = _by_store[store] = Counters(store, weak=True)
        return got
