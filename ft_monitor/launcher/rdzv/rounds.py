"""Which rendezvous round a node is in: the number every launcher message is bound to
(store_auth.StoreChannel), and whether a round's keys can be tidied once the next is joined."""

from __future__ import annotations

import re
from typing import Any

ETCD_VERSION = re.compile(r"/rdzv/v_(\d{1,9})/kv/?$")
"""The folder of torch's ``etcd`` handler's store for one rendezvous version (etcd_rendezvous.py:
``<prefix>/run_<run id>/rdzv/v_<version>/kv``)."""


def rendezvous_round(handler: Any, joined: int, store: Any = None) -> int:
    """The rendezvous round just joined, the same number on every node: torch's dynamic
    handler's own (its store prefix names it too); torch's ``etcd`` handler's rendezvous
    version, read from the folder of the round's ``store`` (issue 43: a launcher that replaced
    a dead one counted its joins from 0 while the survivor was at 1, and each refused the
    other's hang records and roll call as replayed); else (a static rendezvous, whose one store
    every attempt shares, and whose nodes all restart together) ``joined``, the count of
    rendezvous this agent has done before."""
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    number = getattr(state, "round", None)
    if isinstance(number, int) and not isinstance(number, bool) and 0 <= number < 2**31:
        return number
    prefix = getattr(store, "prefix", None)
    version = ETCD_VERSION.search(prefix) if isinstance(prefix, str) else None
    return int(version.group(1)) if version else joined


def rounds_apart(handler: Any) -> bool:
    """Whether each rendezvous round has a store prefix of its own (torch's dynamic handler:
    ``torch.rendezvous.<run id>.<round>``), so that a round's keys can be deleted once the next
    is joined; a static rendezvous shares one prefix between every attempt, and nothing is."""
    return isinstance(getattr(getattr(getattr(handler, "_state_holder", None), "state", None), "round", None), int)
