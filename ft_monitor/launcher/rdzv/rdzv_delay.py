"""A restart's rendezvous without torch's first-run delay.

torch's ``DynamicRendezvousHandler.next_rendezvous`` sleeps a random 0-0.3 s before it
joins "if this is our first run", to skew the nodes' first joins, and tells a first run by
its cached state being in round 0. After a first rendezvous that state is still round 0,
so the first restart pays the delay too: 150 ms on average, the largest and most variable
phase of a warm restart (docs/benchmarks.md, "Warm restarts"). `no_first_run_delay` drops
that one delay for the rendezvous of a restart; every other wait of the handler (its retry
back-off) is left alone. A torch without the module-level ``_delay`` is left as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def no_first_run_delay() -> Iterator[bool]:
    """While inside, torch's random first-run delay (a ``(low, high)`` range) returns at
    once; a fixed delay (a number of seconds) still sleeps. Yields whether it applied."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    except ImportError:
        yield False
        return
    original = getattr(dr, "_delay", None)
    if not callable(original):
        yield False
        return

    def delay(seconds: Any) -> None:
        if isinstance(seconds, tuple):  # the first-run skew, (0, 0.3)
            return
        original(seconds)

    setattr(dr, "_delay", delay)  # noqa: B010 - torch does not export it
    try:
        yield True
    finally:
        setattr(dr, "_delay", original)  # noqa: B010
