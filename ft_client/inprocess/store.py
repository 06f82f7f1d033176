"""The Wrapper's coordination through a torch.distributed store.

Key space: ``ft_inprocess/<run id>/<attempt>/iter/<N>/...``: a fresh space for every
process-level attempt (torchrun's restart count) and every in-process iteration,
so a key of an earlier attempt or iteration is never read as a current one.

Per iteration:

* ``outcome``: how the iteration ends, written once (compare-and-set, the first
  writer wins): a `FaultRecord` (restart) or ``done`` (every rank completed).
  Every rank's watcher thread blocks on it (`wait_outcome`), so learning of a
  fault costs the store nothing while all is well.
* ``completed``: count of ranks whose function returned; the last one writes ``done``.
* ``barrier`` / ``barrier_done``: the restart barrier; the last rank to arrive
  writes ``barrier_done``, the others wait for it.
* ``user/``: the `CallWrapper.store` of the iteration (e.g. for ``init_process_group``).

The base store is torchrun's agent store when there is one (ft-launcher and
torchrun set ``TORCHELASTIC_USE_AGENT_STORE``), else a TCPStore hosted by rank 0
at ``MASTER_PORT + 1``, or an in-process HashStore for a single rank.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

KEY_ROOT = "ft_inprocess"
STORE_PORT_OFFSET = 1
"""Without an agent store, rank 0 hosts the Wrapper's store at MASTER_PORT + this."""
DONE = b'{"done": true}'
GLOO_DEFAULT_GROUP_KEY = "0//cpu//0/"
"""+ rank: where a gloo default group's rank publishes its address (torch 2.13)."""
MAX_REASON = 4096


@dataclass(frozen=True, slots=True)
class FaultRecord:
    """A fault as stored: why, which rank is at fault, who wrote it and when (wall clock)."""

    reason: str
    rank: int | None
    source: str
    by: int
    time: float

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, by: int) -> FaultRecord:
        """Read a stored value; anything unreadable is still a fault (of unknown cause)."""
        try:
            d = json.loads(raw)
            reason, rank, source, writer, when = d["reason"], d["rank"], d["source"], d["by"], d["time"]
        except (ValueError, TypeError, KeyError) as e:
            return cls(f"unreadable fault record {raw[:80]!r} ({e})", None, "unknown", by, time.time())
        if not (isinstance(reason, str) and isinstance(source, str) and isinstance(writer, int)
                and (rank is None or isinstance(rank, int)) and isinstance(when, (int, float))
                and math.isfinite(when)):
            return cls(f"unreadable fault record {raw[:80]!r} (a field of the wrong type)", None, "unknown", by,
                       time.time())
        return cls(reason[:MAX_REASON], rank, source[:64], writer, float(when))


def namespace() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    return f"{KEY_ROOT}/{run_id}/{attempt}/"


def is_timeout(e: BaseException) -> bool:
    """A store wait that timed out (rather than a store that is gone)."""
    import torch.distributed as dist

    return isinstance(e, dist.DistStoreError) and not isinstance(e, dist.DistNetworkError) \
        and "timeout" in str(e).lower()


class RestartStore:
    """The keys of one Wrapper call over a base store (one client connection)."""

    def __init__(self, base: Any, world_size: int, *, hosted: bool = False, prefix: str | None = None) -> None:
        self.base = base
        self.world_size = world_size
        self.hosted = hosted
        """A rank hosts the store (no agent store): the host must not exit before the others
        are done with it (`leave`)."""
        self.prefix = namespace() if prefix is None else prefix

    def key(self, iteration: int, name: str) -> str:
        return f"{self.prefix}iter/{iteration}/{name}"

    def clone(self) -> RestartStore | None:
        """The same keys over a second client connection (a thread blocked in a wait holds
        its connection), or None where the store cannot be cloned."""
        try:
            base = self.base.clone()
        except (AttributeError, RuntimeError, NotImplementedError):
            return None
        return RestartStore(base, self.world_size, prefix=self.prefix)

    def user_store(self, iteration: int) -> Any:
        from torch._C._distributed_c10d import PrefixStore

        return PrefixStore(self.key(iteration, "user/"), self.base)

    # -- outcome -------------------------------------------------------------------
    def report(self, iteration: int, record: FaultRecord) -> tuple[bool, FaultRecord | None]:
        """Write ``record`` as the iteration's outcome unless one is there. Returns (ours
        won, the outcome in force: None when the iteration is already done)."""
        value = record.to_bytes()
        current = bytes(self.base.compare_set(self.key(iteration, "outcome"), b"", value))
        if current == DONE:
            return False, None
        return current == value, record if current == value else FaultRecord.from_bytes(current, record.by)

    def outcome(self, iteration: int, by: int) -> FaultRecord | bool | None:
        """The iteration's outcome: its fault, True when done, None while it runs."""
        key = self.key(iteration, "outcome")
        if not self.base.check([key]):
            return None
        return self._read(key, by)

    def wait_outcome(self, iteration: int, by: int, timeout: float) -> FaultRecord | bool | None:
        """Block until the iteration has an outcome (None after ``timeout`` seconds)."""
        key = self.key(iteration, "outcome")
        try:
            self.base.wait([key], timedelta(seconds=timeout))
        except Exception as e:
            if is_timeout(e):
                return None
            raise
        return self._read(key, by)

    def _read(self, key: str, by: int) -> FaultRecord | bool:
        raw = bytes(self.base.get(key))
        return True if raw == DONE else FaultRecord.from_bytes(raw, by)

    def complete(self, iteration: int) -> None:
        """This rank's function returned; the last rank to do so ends the iteration (done)."""
        if self.base.add(self.key(iteration, "completed"), 1) >= self.world_size:
            self.base.compare_set(self.key(iteration, "outcome"), b"", DONE)

    # -- barriers ------------------------------------------------------------------
    def barrier(self, iteration: int, name: str, timeout: float) -> int | None:
        """Every rank arrives, or None within ``timeout``: then how many arrived."""
        count = self.key(iteration, name)
        done = self.key(iteration, f"{name}_done")
        if self.base.add(count, 1) >= self.world_size:
            self.base.set(done, b"1")
        try:
            self.base.wait([done], timedelta(seconds=timeout))
        except Exception as e:
            if is_timeout(e):
                return int(self.base.add(count, 0))
            raise
        return None

    def leave(self, iteration: int, rank: int, timeout: float) -> None:
        """The Wrapper call is over on this rank: the host (rank 0) waits until every rank
        said so (bounded), so that the store outlives their last use; the others wait
        (bounded) until the host has closed it, so that their next wrapped call reaches
        the host's next store, not this one."""
        count = self.key(iteration, "exit")
        if self.base.add(count, 1) >= self.world_size:
            self.base.set(self.key(iteration, "exit_done"), b"1")
        if rank == 0:
            try:
                self.base.wait([self.key(iteration, "exit_done")], timedelta(seconds=timeout))
            except Exception as e:
                if not is_timeout(e):
                    raise
            return
        try:  # a key nobody writes: the wait ends when the host closes the store (or at the timeout)
            self.base.wait([self.key(iteration, "closed")], timedelta(seconds=timeout))
        except Exception:  # noqa: BLE001 - closed (the connection ends) or timed out: either way, gone
            pass

    def claim_outside(self, iteration: int, rank: int, *, reporter: bool) -> None:
        """This rank was outside every collective when the restart interrupted it: claim the
        iteration's ``outside`` key (the rank whose own monitor reported the fault overwrites;
        the others only take it while empty). One store operation, only for such a rank."""
        value = str(rank).encode()
        if reporter:
            self.base.set(self.key(iteration, "outside"), value)
        else:
            self.base.compare_set(self.key(iteration, "outside"), b"", value)

    def outside(self, iteration: int) -> int | None:
        """The rank that claimed ``outside`` (read after the restart barrier), or None."""
        key = self.key(iteration, "outside")
        if not self.base.check([key]):
            return None
        raw = bytes(self.base.get(key))
        return int(raw) if raw.isdigit() and len(raw) < 10 else None

    def forget(self, iteration: int) -> None:
        """Delete an iteration's keys (every rank is past it): ours, and the address keys
        that torch's gloo process group init wrote on the iteration's user store (torch
        2.13's key names; a key that is not there is no error)."""
        user = self.user_store(iteration)
        for store, key in [*((self.base, self.key(iteration, name)) for name in
                             ("outcome", "completed", "barrier", "barrier_done", "exit", "exit_done",
                              "outside")),
                           *((user, f"{GLOO_DEFAULT_GROUP_KEY}{r}") for r in range(self.world_size))]:
            try:
                store.delete_key(key)
            except Exception:  # noqa: BLE001 - best effort: a leftover key is never read again
                pass


def base_store(rank: int, world_size: int, timeout: float) -> tuple[Any, bool]:
    """(store, hosted by a rank) for a Wrapper without a store_factory."""
    from torch._C._distributed_c10d import HashStore, TCPStore

    if world_size <= 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return HashStore(), False
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    t = timedelta(seconds=timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent hosts a store
        return TCPStore(host, port, world_size, False, timeout=t, wait_for_workers=False), False
    return TCPStore(host, port + STORE_PORT_OFFSET, world_size, rank == 0, timeout=t, wait_for_workers=False), True
