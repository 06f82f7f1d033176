"""A job's identity where torch gives it none (``--rdzv-id`` left at its default ``none``: every
static-rendezvous job, and a c10d job started without one).

The report merges run folders by the run id of their ``attempt_start`` events, and every such
job's was ``none``: ``ft-monitor report`` drew two unrelated jobs as one. The launchers agree on
a random value through the rendezvous store instead (the trust torch already places in it): each
proposes its own with one ``compare_set`` on `KEY`, and the first one there is every node's.
A launcher proposes the value it agreed on before, so a store made anew for a later attempt
keeps the job's identity. What the store holds is read by a total parser: a value that is not
one of ours leaves the launcher with its own proposal (its page may then stand apart; nothing
else follows from it).
"""

from __future__ import annotations

import re
import secrets
from typing import Any

KEY = "ft_launcher/job_identity"
DEFAULT_RUN_ID = "none"
"""torchrun's ``--rdzv-id`` when none is given."""
_VALUE = re.compile(rb"[0-9a-f]{16}")


def proposal() -> str:
    """A fresh identity: 16 hex characters."""
    return secrets.token_hex(8)


def parse(raw: object) -> str | None:
    """``raw`` as an identity, or None: never raises."""
    if not isinstance(raw, (bytes, bytearray)) or _VALUE.fullmatch(bytes(raw)) is None:
        return None
    return bytes(raw).decode()


def agree(store: Any, mine: str) -> str:
    """The identity the job's launchers agree on through ``store`` (``mine`` where the store
    holds another's value that is not an identity); one store operation."""
    got = parse(store.compare_set(KEY, "", mine))
    return got if got is not None else mine


def run_id(torch_run_id: str, identity: str) -> str:
    """The run id events carry: torch's, or ``none-<identity>`` where torch's is the default."""
    return torch_run_id if torch_run_id != DEFAULT_RUN_ID else f"{DEFAULT_RUN_ID}-{identity}"
