"""torch's ``etcd`` rendezvous state, read by a parser that refuses what is not one (issue 49).

torch's older ``etcd`` handler (etcd_rendezvous.py) keeps the rendezvous at one key,
``<prefix>run_<id>/rdzv/active_version``, as JSON, and reads it at every look: each monitor
tick of the agent (``num_nodes_waiting``), each rendezvous step, its shutdown (``set_closed``),
all through ``EtcdRendezvous.get_rdzv_state``, which is ``json.loads`` of whatever is there.
Anyone who reaches etcd can write that key. Garbage there was a JSONDecodeError, 200,000 ``[``
a RecursionError, ``5`` or ``{}`` a TypeError or KeyError later on: out of the agent mid-job,
behind torch's traceback of the failed shutdown, and the launcher ended with exit 2
("configuration error, not requeued"), naming neither etcd nor the key. Before the
rendezvous, torch retried the same unreadable key every second until its timeout.

`guard` puts `parse_state` at that seam: the handler's ``get_rdzv_state`` reads the key with
torch's own client and path and parses the value here. A value that is not the state torch
writes (a JSON object whose ``status`` is one of torch's, with the fields torch reads for that
status, of their types) is refused with `EtcdStateError`, a RendezvousError (torch re-raises
those at once, before or after the workers started) naming the key and why; the launcher
says it in one line and ends with the exit code of a store failure (rdzv/store_gone.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousError

from ft_client.errors import FtError

STATE_PATH = "/rdzv/active_version"
"""Where torch's ``etcd`` handler keeps its state, under its run's folder."""
MAX_STATE_BYTES = 2 << 20
"""A longer value is refused unparsed: more than etcd takes in one request by default (1.5 MiB,
``--max-request-bytes``), so every state etcd accepts by default is parsed."""
FIELDS: dict[str, tuple[str, ...]] = {
    # what torch's handler reads of a state of each status, besides the status
    "setup": (),
    "closed": (),
    "joinable": ("version", "participants"),
    "frozen": ("version", "participants", "keep_alives"),
    "final": ("version", "participants", "keep_alives", "num_workers_waiting"),
}


class EtcdStateError(FtError, RendezvousError):
    """torch's rendezvous state in etcd is not one (its ``key`` and the ``reason``)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"the rendezvous state at {key} cannot be parsed: {reason}")
        self.key, self.reason = key, reason


def _field_ok(name: str, v: object) -> bool:
    if name == "version":
        return isinstance(v, str) and len(v) <= 64
    if name == "participants":
        return isinstance(v, list) and all(type(r) is int and r >= 0 for r in v)
    if name == "keep_alives":
        return isinstance(v, list) and all(isinstance(k, str) for k in v)
    return type(v) is int and v >= 0  # num_workers_waiting


def parse_state(value: object, key: str) -> dict[str, Any]:
    """The state torch's handler wrote at ``key``, or EtcdStateError saying why ``value`` is not
    one (pure: never anything else)."""
    if not isinstance(value, str):
        raise EtcdStateError(key, f"a value of type {type(value).__name__}, not JSON text")
    if len(value) > MAX_STATE_BYTES:
        raise EtcdStateError(key, f"{len(value)} characters (at most {MAX_STATE_BYTES})")
    try:
        state = json.loads(value)
    except RecursionError:
        raise EtcdStateError(key, f"not JSON: nested too deep ({len(value)} characters)") from None
    except ValueError as e:
        raise EtcdStateError(key, f"not JSON: {str(e)[:120]} ({len(value)} characters)") from None
    if not isinstance(state, dict):
        raise EtcdStateError(key, f"not a rendezvous state: a JSON {type(state).__name__}, not an object")
    status = state.get("status")
    if not isinstance(status, str) or status not in FIELDS:
        raise EtcdStateError(key, f"not a rendezvous state: no status among {', '.join(FIELDS)}")
    for name in FIELDS[status]:
        if name not in state or not _field_ok(name, state[name]):
            raise EtcdStateError(key, f"a {status} state without a valid {name!r}")
    return state


def guard(handler: Any) -> bool:
    """Make torch's ``etcd`` handler read its state through `parse_state` (other handlers, or one
    whose internals differ: left as they are). Whether it did."""
    impl = getattr(handler, "_rdzv_impl", None)
    if impl is None or not all(callable(getattr(impl, n, None)) for n in ("get_rdzv_state", "get_path")) \
            or getattr(impl, "client", None) is None:
        return False
    impl.get_rdzv_state = _checked(impl)
    return True


def _checked(impl: Any) -> Callable[[], tuple[Any, dict[str, Any]]]:
    def get_rdzv_state() -> tuple[Any, dict[str, Any]]:
        """torch's ``EtcdRendezvous.get_rdzv_state``: the etcd result and its state, parsed here."""
        key = impl.get_path(STATE_PATH)
        active_version = impl.client.get(key=key)
        return active_version, parse_state(getattr(active_version, "value", None), key)
    return get_rdzv_state
