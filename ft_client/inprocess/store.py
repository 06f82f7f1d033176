"""The Wrapper's coordination through a torch.distributed store.

Key space: ``ft_inprocess/<run id>/<attempt>/iter/<N>/...``: a fresh space for every
process-level attempt (torchrun's restart count) and every in-process iteration,
so a key of an earlier attempt or iteration is never read as a current one.

Per iteration:

* ``outcome``: how the iteration ends, written once (compare-and-set, the first
  writer wins): a `FaultRecord` (restart) or ``done`` (every rank completed).
  Every rank's watcher thread blocks on it (`wait_outcome`), so learning of a
  fault costs the store nothing while all is well.
* ``completed``, ``completed/<rank>``: the ranks whose function returned (a signed key
  each, then a count); the last one checks every rank's key and writes ``done``.
* ``barrier``, ``barrier/<rank>``, ``barrier_done``: the restart barrier, the same way;
  the last rank to arrive writes ``barrier_done``, the others wait for it.
* ``exit``, ``exit/<rank>``, ``exit_done``: the ranks that left the Wrapper (the host waits).
* ``outside``: the rank that was outside every collective when a hang was reported
  (the last rank at the restart barrier puts it in ``barrier_done``: one read, not N).

After the restart barrier each rank deletes its own keys of the iteration and rank 0 the
shared ones (`RestartStore.forget`): an incident costs each rank a constant number of
store calls whatever the job's size, and leaves two keys (docs/architecture.md, "Scale").

Every value but the counts is signed (ft_client.store.signed) with the job's in-process key
(ft_client.store.jobkey) and bound to its key, run, attempt and iteration; anything else
found there (the store has no authentication) is refused, logged once, and never acted
on. Counts are not trusted: they only tell a rank when to check the signed keys. They are
added to on a connection of their own (ft_client.store.counter): torch's store server closes the
connection of an ``add`` to a value someone ``set`` to a non-number, and that must not be the
connection the process group's store shares; a spoiled count makes every arriving rank check.
* ``user/``: the `CallWrapper.store` of the iteration (e.g. for ``init_process_group``).

The base store is, in this order: the store ft-launcher names in ``FT_INPROCESS_STORE``
(its rendezvous store); torchrun's agent store (torchrun sets
``TORCHELASTIC_USE_AGENT_STORE``); an in-process HashStore for a single rank; else a
TCPStore hosted by rank 0 at ``MASTER_PORT + 1`` (as the reference does). That last port
is not reserved by anyone: ft-launcher, which gives every attempt a fresh worker store
(docs/launcher.md), names its own store instead, because on a busy machine
``MASTER_PORT + 1`` was once taken by another connection and rank 0 failed with
EADDRINUSE, costing a process restart.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from ft_client import env, logs
from ft_client.errors import FtError
from ft_client.store.counter import Counters
from ft_client.store.signed import Signer, StoreMessageError
from ft_client.store.signed import rank_field as _rank_field
from ft_client.torch_features import store_connection

log = logs.logger("ft_client.inprocess")

KEY_ROOT = "ft_inprocess"
STORE_PORT_OFFSET = 1
"""Without an agent store, rank 0 hosts the Wrapper's store at MASTER_PORT + this."""
GLOO_DEFAULT_GROUP_KEY = "0//cpu//0/"
"""+ rank: where a gloo default group's rank publishes its address (torch 2.13)."""
MAX_REASON = 4096
MAX_SOURCE = 64
POLL_INTERVAL = 0.05
"""Seconds between reads of a key that holds a refused (forged) value, until an authentic one replaces it."""
MAX_CLAIMS = 16
"""Forged values a writer replaces at one key before it gives up on the store (and acts on its own record)."""
MAX_REFUSALS_LOGGED = 100

OUTCOME, ARRIVAL, ALL_ARRIVED, OUTSIDE = "inprocess_outcome", "inprocess_arrival", "inprocess_all_arrived", \
    "inprocess_outside"
"""The kinds of signed value (ft_client.store.signed) the Wrapper stores."""


@dataclass(frozen=True, slots=True)
class FaultRecord:
    """A fault as stored: why, which rank is at fault, who wrote it and when (wall clock)."""

    reason: str
    rank: int | None
    source: str
    by: int
    time: float

    def body(self) -> dict[str, Any]:
        return {"done": False, "reason": self.reason, "rank": self.rank, "source": self.source, "by": self.by,
                "time": self.time}

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> FaultRecord:
        """The fault of an authentic outcome's body; StoreMessageError for a field of the wrong type."""
        reason, source, when = body.get("reason"), body.get("source"), body.get("time")
        if not isinstance(reason, str) or not isinstance(source, str):
            raise StoreMessageError("fields reason and source must be text")
        if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
            raise StoreMessageError("field time must be a finite number")
        return cls(reason[:MAX_REASON], _rank_field(body, "rank", optional=True), source[:MAX_SOURCE],
                   _rank_field(body, "by"), float(when))  # type: ignore[arg-type]


DONE_BODY: dict[str, Any] = {"done": True}
Outcome = FaultRecord | bool
"""A fault, or True: every rank completed the iteration."""


def parse_outcome(body: Mapping[str, Any]) -> Outcome:
    """An authentic outcome's body: the iteration is done, or its fault."""
    done = body.get("done")
    if done is True:
        if len(body) != 1:
            raise StoreMessageError("a done outcome holds nothing else")
        return True
    if done is not False:
        raise StoreMessageError("field done must be true or false")
    return FaultRecord.from_body(body)


def run_id(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get("TORCHELASTIC_RUN_ID") or "local"


def attempt(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get("TORCHELASTIC_RESTART_COUNT") or "0"


def namespace() -> str:
    return f"{KEY_ROOT}/{run_id()}/{attempt()}/"


def is_timeout(e: BaseException) -> bool:
    """A store wait that timed out (rather than a store that is gone)."""
    import torch.distributed as dist

    return isinstance(e, dist.DistStoreError) and not isinstance(e, dist.DistNetworkError) \
        and "timeout" in str(e).lower()


_OURS = object()
T = TypeVar("T")


class RestartStore:
    """The keys of one Wrapper call over a base store (one client connection).

    Every value that decides something is signed (``signer``: the job's in-process key,
    ft_client.store.jobkey) and bound to its key, the run, the attempt and the iteration; a value
    that is not (forged, replayed, garbage) is refused, logged once, and never acted on: a
    reader waits for an authentic value to replace it, a writer replaces it (compare-and-set).
    """

    def __init__(self, base: Any, world_size: int, signer: Signer, *, rank: int = 0, hosted: bool = False,
                 prefix: str | None = None, attempt_id: str | None = None,
                 refused: set[bytes] | None = None) -> None:
        self.base = base
        self.world_size = world_size
        self.signer = signer
        self.rank = rank
        self.hosted = hosted
        """A rank hosts the store (no agent store): the host must not exit before the others
        are done with it (`leave`)."""
        self.prefix = namespace() if prefix is None else prefix
        self.attempt = attempt() if attempt_id is None else attempt_id
        self._refused: set[bytes] = set() if refused is None else refused
        """Refused values already logged (shared with clones)."""
        self._own: dict[int, list[str]] = {}
        """iteration -> the keys of its own this rank wrote there (deleted by `forget`)."""
        self._outside: dict[int, int | None] = {}
        """iteration -> the ``outside`` claim as the restart barrier's ``barrier_done`` carried it."""
        self._counters = Counters(base)
        """The counts' own connection (opened at the first count)."""

    def key(self, iteration: int, name: str) -> str:
        return f"{self.prefix}iter/{iteration}/{name}"

    def close(self, closed: Any) -> None:
        """Let go of the base store (the wrapped call ended): ``closed`` stands for it from now
        on, in the counters too (they held the base: on the rank that hosts the store, its
        listening port stayed bound while anything, a kept exception's frames, held this)."""
        self.base = closed
        self._counters = Counters(closed)

    def clone(self) -> RestartStore | None:
        """The same keys over a second client connection (a thread blocked in a wait holds
        its connection), or None where the store cannot be cloned."""
        try:
            base = store_connection(self.base)  # clone(), or before torch 2.8 a new TCPStore client
        except (AttributeError, RuntimeError, NotImplementedError):
            return None
        if base is None:
            return None
        return RestartStore(base, self.world_size, self.signer, rank=self.rank, prefix=self.prefix,
                            attempt_id=self.attempt, refused=self._refused)

    def user_store(self, iteration: int) -> Any:
        from torch._C._distributed_c10d import PrefixStore

        return PrefixStore(self.key(iteration, "user/"), self.base)

    def user_key(self, iteration: int, name: str) -> str:
        """Where ``name`` of `user_store` ``(iteration)`` lies in the base store (PrefixStore's join)."""
        return f"{self.key(iteration, 'user/')}/{name}"

    # -- signed values -------------------------------------------------------------
    def _bind(self, iteration: int) -> dict[str, Any]:
        return {"attempt": self.attempt, "iteration": iteration}

    def seal(self, iteration: int, kind: str, key: str, body: Mapping[str, Any]) -> bytes:
        return self.signer.seal(kind, key, body, self._bind(iteration))

    def open(self, iteration: int, kind: str, key: str, raw: object) -> dict[str, Any] | None:
        """The body of the authentic ``kind`` value ``raw`` read at ``key``, or None (refused:
        logged once per distinct value)."""
        try:
            return self.signer.open(kind, key, raw, self._bind(iteration))
        except StoreMessageError as e:
            self._refuse(key, raw, e)
            return None

    def _refuse(self, key: str, raw: object, why: Exception) -> None:
        value = bytes(raw[:256]) if isinstance(raw, (bytes, bytearray)) else repr(raw).encode()[:256]
        if value not in self._refused and len(self._refused) < MAX_REFUSALS_LOGGED:
            self._refused.add(value)
            log.warning("rank %d: ignored a value in the in-process restart store at %s that is not an authentic "
                        "record of this job (%s): %r", self.rank, key, why, value[:80])

    def _outcome_of(self, iteration: int, key: str, raw: object) -> Outcome | None:
        body = self.open(iteration, OUTCOME, key, raw)
        if body is None:
            return None
        try:
            return parse_outcome(body)
        except StoreMessageError as e:
            self._refuse(key, raw, e)
            return None

    def _claim(self, iteration: int, key: str, value: bytes) -> Outcome | object | None:
        """Store ``value`` at ``key`` unless an authentic outcome is there: _OURS, the outcome
        in force, or None when forged values kept taking the key (MAX_CLAIMS times)."""
        expected = b""
        for _ in range(MAX_CLAIMS):
            current = bytes(self.base.compare_set(key, expected, value))
            if current == value:
                return _OURS
            if expected and current == expected:  # the refused value was removed: the key is empty
                expected = b""
                continue
            found = self._outcome_of(iteration, key, current)
            if found is not None:
                return found
            expected = current  # refused: replace it
        return None

    def _await(self, key: str, read: Callable[[bytes], T], timeout: float,
               stop: threading.Event | None = None) -> T | None:
        """Block until ``key`` holds a value ``read`` accepts (its result), or None after
        ``timeout`` seconds (or once ``stop`` is set). A refused value is read again every
        POLL_INTERVAL until an authentic one replaces it."""
        end = time.monotonic() + timeout
        try:
            self.base.wait([key], timedelta(seconds=timeout))
        except Exception as e:
            if is_timeout(e):
                return None
            raise
        while True:
            got = read(bytes(self.base.get(key)))
            if got is not None:
                return got
            left = end - time.monotonic()
            if left <= 0 or (stop is not None and stop.is_set()):
                return None
            if stop is not None:
                stop.wait(min(POLL_INTERVAL, left))
            else:
                time.sleep(min(POLL_INTERVAL, left))

    # -- outcome -------------------------------------------------------------------
    def report(self, iteration: int, record: FaultRecord) -> tuple[bool, FaultRecord | None]:
        """Write ``record`` as the iteration's outcome unless an authentic one is there (a
        forged value is replaced). Returns (ours won, the outcome in force: None when the
        iteration is already done)."""
        key = self.key(iteration, "outcome")
        got = self._claim(iteration, key, self.seal(iteration, OUTCOME, key, record.body()))
        if got is _OURS or got is None:  # None: the key is taken by forgeries; this rank acts on its own record
            return True, record
        if got is True:
            return False, None
        assert isinstance(got, FaultRecord)
        return False, got

    def outcome(self, iteration: int) -> Outcome | None:
        """The iteration's authentic outcome: its fault, True when done, None while it runs."""
        key = self.key(iteration, "outcome")
        if not self.base.check([key]):
            return None
        return self._outcome_of(iteration, key, bytes(self.base.get(key)))

    def wait_outcome(self, iteration: int, timeout: float, stop: threading.Event | None = None) -> Outcome | None:
        """Block until the iteration has an authentic outcome (None after ``timeout`` seconds,
        or once ``stop``, a threading.Event, is set)."""
        key = self.key(iteration, "outcome")
        def read(raw: bytes) -> Outcome | None:
            return self._outcome_of(iteration, key, raw)

        return self._await(key, read, timeout, stop)

    def complete(self, iteration: int) -> None:
        """This rank's function returned; the last rank to do so ends the iteration (done)."""
        if self._arrive(iteration, "completed"):
            key = self.key(iteration, "outcome")
            self._claim(iteration, key, self.seal(iteration, OUTCOME, key, DONE_BODY))

    # -- barriers ------------------------------------------------------------------
    def _arrive(self, iteration: int, name: str) -> bool:
        """This rank arrives at ``name`` (a signed key of its own, then the shared count):
        True when, by the count, it may be the last, and every rank's arrival is authentic
        (a forged count only makes a rank check)."""
        mine = self.key(iteration, f"{name}/{self.rank}")
        self.base.set(mine, self.seal(iteration, ARRIVAL, mine, {"rank": self.rank}))
        self._own.setdefault(iteration, []).append(mine)
        count = self._counters.add(self.key(iteration, name), 1)
        if count is not None and count < self.world_size:  # None: spoiled by someone else, so every rank checks
            return False
        return self.arrived(iteration, name) >= self.world_size

    def arrived(self, iteration: int, name: str) -> int:
        """How many ranks have an authentic arrival at ``name``."""
        keys = [self.key(iteration, f"{name}/{r}") for r in range(self.world_size)]
        if self.base.check(keys) and hasattr(self.base, "multi_get"):
            values = dict(zip(keys, self.base.multi_get(keys), strict=True))
        else:
            values = {k: self.base.get(k) for k in keys if self.base.check([k])}
        count = 0
        for r, k in enumerate(keys):
            body = self.open(iteration, ARRIVAL, k, values[k]) if k in values else None
            count += body is not None and body.get("rank") == r
        return count

    def _all_arrived(self, iteration: int, name: str, timeout: float) -> bool:
        done = self.key(iteration, f"{name}_done")
        return self._await(done, lambda raw: self._all_arrived_of(iteration, name, done, raw), timeout) is not None

    def _all_arrived_of(self, iteration: int, name: str, key: str, raw: object) -> dict[str, Any] | None:
        """An authentic ``<name>_done``'s body; the restart barrier's carries the ``outside``
        claim (kept for `outside`)."""
        body = self.open(iteration, ALL_ARRIVED, key, raw)
        if body is None or name != "barrier":
            return body
        try:
            self._outside[iteration] = _rank_field(body, "outside", optional=True)
        except StoreMessageError as e:
            self._refuse(key, raw, e)
            return None
        return body

    def _announce_all_arrived(self, iteration: int, name: str) -> None:
        """The last rank to arrive says so; at the restart barrier, with the ``outside`` claim
        (made before every claimant's arrival), so that no rank has to read it."""
        done = self.key(iteration, f"{name}_done")
        body: dict[str, Any] = {}
        if name == "barrier":
            outside = self._read_outside(iteration)
            if outside is not None:
                body["outside"] = outside
        self.base.set(done, self.seal(iteration, ALL_ARRIVED, done, body))

    def barrier(self, iteration: int, name: str, timeout: float) -> int | None:
        """Every rank arrives, or None within ``timeout``: then how many arrived."""
        if self._arrive(iteration, name):
            self._announce_all_arrived(iteration, name)
        if self._all_arrived(iteration, name, timeout):
            return None
        return self.arrived(iteration, name)

    def leave(self, iteration: int, timeout: float) -> None:
        """The Wrapper call is over on this rank: the host (rank 0) waits until every rank
        said so (bounded), so that the store outlives their last use; the others wait
        (bounded) until the host has closed it, so that their next wrapped call reaches
        the host's next store, not this one."""
        if self._arrive(iteration, "exit"):
            self._announce_all_arrived(iteration, "exit")
        if self.rank == 0:
            self._all_arrived(iteration, "exit", timeout)
            return
        try:  # a key nobody writes: the wait ends when the host closes the store (or at the timeout)
            self.base.wait([self.key(iteration, "closed")], timedelta(seconds=timeout))
        except Exception:  # noqa: BLE001 - closed (the connection ends) or timed out: either way, gone
            pass

    def claim_outside(self, iteration: int, *, reporter: bool) -> None:
        """This rank was outside every collective when the restart interrupted it: claim the
        iteration's ``outside`` key (the rank whose own monitor reported the fault overwrites;
        the others only take it while it holds no authentic claim). Only for such a rank."""
        key = self.key(iteration, "outside")
        value = self.seal(iteration, OUTSIDE, key, {"rank": self.rank})
        if reporter:
            self.base.set(key, value)
            return
        expected = b""
        for _ in range(MAX_CLAIMS):
            current = bytes(self.base.compare_set(key, expected, value))
            if current == value or self._outside_of(iteration, key, current) is not None:
                return
            expected = b"" if expected and current == expected else current

    def _outside_of(self, iteration: int, key: str, raw: object) -> int | None:
        body = self.open(iteration, OUTSIDE, key, raw)
        if body is None:
            return None
        try:
            return _rank_field(body, "rank")
        except StoreMessageError as e:
            self._refuse(key, raw, e)
            return None

    def outside(self, iteration: int) -> int | None:
        """The rank that claimed ``outside`` (after the restart barrier: as its ``barrier_done``
        carried it, without a store call), or None."""
        if iteration in self._outside:
            return self._outside[iteration]
        return self._read_outside(iteration)

    def _read_outside(self, iteration: int) -> int | None:
        key = self.key(iteration, "outside")
        if not self.base.check([key]):
            return None
        return self._outside_of(iteration, key, bytes(self.base.get(key)))

    def forget(self, iteration: int) -> None:
        """Right after the restart barrier of ``iteration`` (every rank is past the function
        and its watcher): delete what no rank reads any more. Each rank deletes its own keys
        there (its arrivals, and the address its default gloo group wrote on the iteration's
        user store, torch 2.13's key name); rank 0 the shared keys nobody reads after the
        barrier (outcome, the counts), and the two that were read after the previous
        barrier (``barrier_done``, ``outside``). So each incident costs every rank one or two
        deletes (not one per rank of the job) and leaves two keys behind, until the next
        one. A key that is not there is no error."""
        keys = [*self._own.pop(iteration, ()), self.user_key(iteration, f"{GLOO_DEFAULT_GROUP_KEY}{self.rank}")]
        if self.rank == 0:
            keys += [self.key(iteration, name) for name in ("outcome", "completed", "barrier")]
            if iteration > 0:
                keys += [self.key(iteration - 1, name) for name in ("barrier_done", "outside")]
        self._outside.pop(iteration - 1, None)
        for key in keys:
            try:
                self.base.delete_key(key)
            except Exception:  # noqa: BLE001 - best effort: a leftover key is never read again
                pass


class StoreAddressError(FtError, ValueError):
    """``FT_INPROCESS_STORE`` does not hold a ``host:port``."""


def store_address(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) from ``FT_INPROCESS_STORE``; StoreAddressError if malformed."""
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise StoreAddressError(f"{env.INPROCESS_STORE}={text[:100]!r}: not a host:port")
    return host, int(port)


def base_store(rank: int, world_size: int, timeout: float) -> tuple[Any, bool]:
    """(store, hosted by a rank) for a Wrapper without a store_factory."""
    from torch._C._distributed_c10d import HashStore, TCPStore

    t = timedelta(seconds=timeout)
    named = os.environ.get(env.INPROCESS_STORE)
    if named:  # ft-launcher's rendezvous store
        host, port = store_address(named)
        return TCPStore(host, port, world_size, False, timeout=t, wait_for_workers=False), False
    if world_size <= 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return HashStore(), False
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent hosts a store
        return TCPStore(host, port, world_size, False, timeout=t, wait_for_workers=False), False
    return TCPStore(host, port + STORE_PORT_OFFSET, world_size, rank == 0, timeout=t, wait_for_workers=False), True
