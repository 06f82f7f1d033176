"""What one wrapped call shares: `Run`, the state of one call of the wrapped function
across its iterations (the fault this rank knows of, where the main thread is, the
phase times), shared by the main thread, the monitor and watcher threads and the
client's control thread; and `CallWrapper`, what the function and each hook get for
one iteration (its store, `ping()`, `atomic()`, `disable_hang_protection()`)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from ft_client import logs
from ft_client.inprocess import abort as aborting
from ft_client.inprocess import decide, events, timeline
from ft_client.inprocess.errors import InProcessError, RestartInterrupt
from ft_client.inprocess.store import FaultRecord, RestartStore

log = logs.logger("ft_client.inprocess")


class ClosedStore:
    """Stands for the Wrapper's store once the wrapped call has ended: the store is let go
    (its port freed) even where an exception or the caller still holds a `CallWrapper`."""

    def __getattr__(self, name: str) -> Any:
        raise InProcessError("the Wrapper's store was closed when the wrapped call ended; a CallWrapper is only "
                             "valid during its call")


CLOSED = ClosedStore()


class CallWrapper:
    """What the wrapped function (and each hook) gets: the restart iteration, a store for
    this iteration, `ping()` for progress and `atomic()` for code that must not be interrupted."""

    def __init__(self, run: Run, iteration: int) -> None:
        self._run = run
        self.iteration = iteration
        """0 on the first call, +1 for each in-process restart."""
        self.store: Any = run.store.user_store(iteration)
        """A torch.distributed store for this iteration (its keys never collide with an
        earlier iteration's): pass it to ``init_process_group(store=...)``. Closed when the
        wrapped call ends."""
        run.calls.add(self)
        self.rank = run.rank
        self.world_size = run.world_size

    @property
    def store_ports(self) -> set[int]:
        """Ports of the rendezvous stores (their connections survive an abort)."""
        ports = {int(os.environ.get("MASTER_PORT", "29500"))}
        port = getattr(self._run.store.base, "port", None)
        if isinstance(port, int):
            ports.add(port)
        return ports

    def new_tcp_sockets(self) -> set[int]:
        """Socket inodes this process opened since the iteration began."""
        return set(aborting.socket_fds()) - self._run.sockets_before

    def ping(self) -> None:
        """Report progress: no `ping()` for ``soft_timeout`` is a fault (once the first
        ping of the iteration has been made)."""
        run = self._run
        run.last_ping = time.monotonic()
        if run.restart is not None and "first_progress" not in run.restart.times:
            run.restart.progress()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """Code that must not be interrupted (e.g. writing a checkpoint): an interrupt that
        arrives inside is raised when the block ends (unless the block ends with an exception:
        the function is leaving anyway)."""
        run = self._run
        run.atomic_depth += 1
        try:
            yield
        finally:
            run.atomic_depth -= 1
            if run.atomic_depth == 0 and run.interrupt_pending:
                run.interrupt_pending = False
                if run.interruptible and sys.exc_info()[1] is None:
                    run.interrupted()
                    raise RestartInterrupt("in-process restart (deferred until atomic() ended)")

    def _disable_hang_protection(self) -> None:
        """Turn the soft and hard timeouts off until the matching `_enable_hang_protection`
        (the reference's pair; `disable_hang_protection` is the safe way to use them)."""
        if self.iteration == self._run.iteration:
            self._run.unprotected += 1

    def _enable_hang_protection(self) -> None:
        """Undo one `_disable_hang_protection`: when none is left, the timeouts count again
        from now (a ping made before the block does not time out at once)."""
        run = self._run
        if self.iteration != run.iteration or run.unprotected == 0:
            return
        run.unprotected -= 1
        if run.unprotected == 0:
            now = time.monotonic()
            run.protected_since = now
            if run.last_ping is not None:
                run.last_ping = now

    @contextlib.contextmanager
    def disable_hang_protection(self) -> Iterator[None]:
        """No soft timeout (``ping()``) and no hard timeout inside the block: for work known to
        take long and to end (loading a large dataset). A fault still restarts the function
        (the interrupt is raised inside the block too); the monitor daemon's own timeouts
        (sections, heartbeats, ``inprocess_restart_timeout``) still apply. Blocks nest; the
        timeouts count again from the end of the outermost one."""
        self._disable_hang_protection()
        try:
            yield
        finally:
            self._enable_hang_protection()

    def init_process_group(self, backend: str = "gloo", **kwargs: Any) -> None:
        """``torch.distributed.init_process_group`` on this iteration's store, rank and world size."""
        import torch.distributed as dist

        kwargs.setdefault("store", self.store)
        kwargs.setdefault("rank", self.rank)
        kwargs.setdefault("world_size", self.world_size)
        dist.init_process_group(backend, **kwargs)
        if self._run.restart is not None and self._run.restart.iteration == self.iteration:
            self._run.restart.times.setdefault("pg_ready", time.time())


class Run:
    """One call of the wrapped function across its iterations, shared by the main thread,
    the monitor and watcher threads, and the client's control thread."""

    def __init__(self, store: RestartStore, rank: int, world_size: int,
                 reinterrupt_interval: float = decide.REINTERRUPT_INTERVAL) -> None:
        self.store = store
        self.watch = store.clone()
        """A second connection for the watcher thread; None: the monitor thread polls."""
        self.rank = rank
        self.world_size = world_size
        self.iteration = 0
        self.last_ping: float | None = None
        self.atomic_depth = 0
        self.interruptible = False
        self.interrupt_pending = False
        self.interrupted_at: float | None = None
        """When the interrupt was raised into the function in this iteration (monotonic): from
        then on the monitor thread sends the signal only every reinterrupt_interval."""
        self.reinterrupt_interval = reinterrupt_interval
        """The Wrapper's option (the signal's handler reads it here)."""
        self.unprotected = 0
        """Open `CallWrapper.disable_hang_protection` blocks (the timeouts are off while > 0)."""
        self.protected_since = 0.0
        """When the last of them ended (monotonic): the hard timeout counts from then at the earliest."""
        self.sockets_before: set[int] = set()
        self.lock = threading.Lock()
        self.fault: FaultRecord | None = None
        """This iteration's fault, once this rank knows it."""
        self.handled = False
        """The fault was announced and the abort hook ran (exactly once per iteration)."""
        self.fault_seen = threading.Event()
        """The monitor thread acted on this iteration's fault: interrupts may be raised."""
        self.left_function = threading.Event()
        self.wake = threading.Event()
        self.times: dict[str, float] = {}
        """Wall-clock end of each phase of the restart under way (timeline.PHASES)."""
        self.restart: events.Restart | None = None
        """The restart that led into the current iteration (None in iteration 0)."""
        self.calls: weakref.WeakSet[CallWrapper] = weakref.WeakSet()
        """The CallWrappers handed out (their stores are closed with the run)."""
        self.waiting = True
        """Where the fault found the main thread: waiting for other ranks (in torch.distributed or
        backward, or done with the function), or outside every collective (see `coordinate.culprit`)."""

    def new_iteration(self, sockets: set[int] | None = None) -> None:
        """Reset for the next iteration; ``sockets``: the socket inodes this process holds
        now (`new_tcp_sockets` counts from them; default: read from /proc)."""
        self.fault = None
        self.waiting = True
        self.handled = False
        self.fault_seen.clear()
        self.left_function.clear()
        self.wake.clear()
        self.last_ping = None
        self.interrupt_pending = False
        self.interrupted_at = None
        self.unprotected = 0
        self.protected_since = 0.0
        self.times = {}
        self.sockets_before = set(aborting.socket_fds()) if sockets is None else sockets

    def interrupted(self) -> None:
        """The interrupt is being raised into the function (main thread)."""
        self.interrupted_at = time.monotonic()

    def close(self) -> None:
        """Let go of the store (main thread, the call is over): every reference the Wrapper
        made to it is replaced, so that the store, and its listening port on the rank that
        hosts it, go when the last of the caller's own references does, even while an
        exception's frames still hold this run or a CallWrapper."""
        for store in (self.store, self.watch):
            if store is not None:
                store.close(CLOSED)
        for call in list(self.calls):
            call.store = CLOSED
        self.calls.clear()

    def note_fault(self, record: FaultRecord) -> None:
        """This rank learned of the iteration's fault (from the store, or its own report)."""
        with self.lock:
            if self.fault is not None:
                return
            self.fault = record
            self.times.setdefault(timeline.FAULT, record.time)
            self.times["seen"] = time.time()
        self.wake.set()

    def report(self, reason: str, rank: int | None, source: str, iteration: int | None = None) -> bool:
        """Record a fault of this (or ``iteration``'s) iteration unless one is there; True
        if ours is the one."""
        it = self.iteration if iteration is None else iteration
        record = FaultRecord(reason, rank, source, self.rank, time.time())
        try:
            won, current = self.store.report(it, record)
        except Exception as e:  # the store is gone (its host died): this rank still leaves the function
            log.error("rank %d: cannot record a fault in the in-process restart store (%s): %s", self.rank, e, reason)
            won, current = True, FaultRecord(f"{reason} (the in-process restart store is unreachable: {e})", rank,
                                             "store", self.rank, record.time)
        if current is not None and it == self.iteration:
            self.note_fault(current)
        return won
