"""`Wrapper` and `CallWrapper`: run a training function, and on a fault on any rank
abort the collectives, interrupt it, and run it again in the same process.

How a fault travels (one incident, every wait bounded):

1. Some rank sees it first: an exception out of the function, no `ping()` for
   ``soft_timeout``, or its monitor daemon's hang verdict (ABORT, handed over by
   the client through `events`). It writes the fault as the iteration's outcome in
   the store (`store.RestartStore`); the first writer wins, later ones are the
   same incident.
2. A watcher thread in every rank blocks on that key and wakes the rank's monitor
   thread, which tells the monitor client (`events.announce_aborting`), runs
   ``abort`` (default `AbortTorchDistributed`) before anything else, so that every
   collective in flight fails at once instead of waiting for a peer that will
   never come, and then interrupts the main thread: a signal whose handler raises
   `RestartInterrupt` (a BaseException, so ``time.sleep``, ``select`` and socket
   waits are interrupted too and ``except Exception`` does not swallow it), sent
   again until the main thread has left the function, and deferred while it is
   inside `CallWrapper.atomic()`.
3. The main thread forgets the process groups, runs ``finalize`` and
   ``health_check`` (a failure ends the Wrapper with an `InProcessError`: the
   process exits and the process-level restart takes over), meets the others at a
   store barrier (``barrier_timeout``: a rank that died makes the others give up
   instead of waiting forever) and calls the function again with ``iteration + 1``.

A rank whose main thread does not leave the function (a C call holding the GIL, a
swallowed interrupt) dumps its stacks and kills itself ``hard_timeout -
soft_timeout`` after the fault, when its monitor thread can still run; when it
cannot, the rank's monitor daemon (``on_hang: inprocess``) stops it after
``inprocess_restart_timeout``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import gc
import inspect
import itertools
import logging
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import timedelta
from typing import Any, TypeVar

from ft_client import exit_teardown, jobkey
from ft_client.collectives import waits_for_peers
from ft_client.errors import FtError
from ft_client.inprocess import abort as aborting
from ft_client.inprocess import events, timeline
from ft_client.inprocess.store import FaultRecord, RestartStore, base_store, namespace, run_id
from ft_client.signed import Signer

log = logging.getLogger("ft_client.inprocess")

F = TypeVar("F", bound=Callable[..., Any])
Seconds = float | timedelta

WATCH_CHUNK = 3600.0
"""Seconds a watcher's store wait lasts before it is renewed (each renewal logs a line in torch)."""
MONITOR_JOIN_TIMEOUT = 10.0
"""Seconds the main thread waits for the monitor thread to finish (a stuck abort hook)."""
UNSUPPORTED = ("rank_assignment", "rank_filter", "completion", "terminate")
"""nvidia-resiliency-ext options that change what runs; refused (docs/inprocess.md says why)."""
IGNORED = ("monitor_process_interval", "heartbeat_interval", "heartbeat_timeout", "progress_watchdog_interval",
           "last_call_wait", "termination_grace_time", "monitor_process_logfile", "monitor_process_pidfile")
"""nvidia-resiliency-ext options of its separate monitor process, whose job the rank's
monitor daemon does here: accepted and ignored."""


class RestartInterrupt(BaseException):  # noqa: N818 - named for what it does, like KeyboardInterrupt
    """Raised in the main thread to leave the training function for an in-process restart.
    A BaseException on purpose: ``except Exception`` in user code must not swallow it."""


class InProcessError(FtError):
    """The in-process restart cannot go on; the process should exit (the launcher restarts it)."""


class HealthCheckError(InProcessError):
    """The ``health_check`` hook failed after a fault."""


class RestartLimitError(InProcessError):
    """``max_iterations`` in-process restarts were used."""


class BarrierTimeoutError(InProcessError, TimeoutError):
    """Not every rank reached the restart barrier within ``barrier_timeout`` (one died?)."""


class DistributedInitializedError(InProcessError, ValueError):
    """torch.distributed was initialised before the wrapped call (a ValueError, as the reference raises)."""


class _ClosedStore:
    """Stands for the Wrapper's store once the wrapped call has ended: the store is let go
    (its port freed) even where an exception or the caller still holds a `CallWrapper`."""

    def __getattr__(self, name: str) -> Any:
        raise InProcessError("the Wrapper's store was closed when the wrapped call ended; a CallWrapper is only "
                             "valid during its call")


_CLOSED = _ClosedStore()
_calls = itertools.count()
"""Wrapped calls made in this process: every rank makes them in the same order, so the
n-th call of each rank uses the n-th key space (a second call never reads the first's keys)."""


def _seconds(name: str, value: Seconds) -> float:
    s = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not s > 0:
        raise InProcessError(f"{name} = {value!r}: must be a positive number of seconds (or a timedelta)")
    return s


class CallWrapper:
    """What the wrapped function (and each hook) gets: the restart iteration, a store for
    this iteration, `ping()` for progress and `atomic()` for code that must not be interrupted."""

    def __init__(self, run: _Run, iteration: int) -> None:
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
        arrives inside is raised when the block ends."""
        run = self._run
        run.atomic_depth += 1
        try:
            yield
        finally:
            run.atomic_depth -= 1
            if run.atomic_depth == 0 and run.interrupt_pending and run.interruptible:
                run.interrupt_pending = False
                raise RestartInterrupt("in-process restart (deferred until atomic() ended)")

    def init_process_group(self, backend: str = "gloo", **kwargs: Any) -> None:
        """``torch.distributed.init_process_group`` on this iteration's store, rank and world size."""
        import torch.distributed as dist

        kwargs.setdefault("store", self.store)
        kwargs.setdefault("rank", self.rank)
        kwargs.setdefault("world_size", self.world_size)
        dist.init_process_group(backend, **kwargs)
        if self._run.restart is not None and self._run.restart.iteration == self.iteration:
            self._run.restart.times.setdefault("pg_ready", time.time())


class _Run:
    """One call of the wrapped function across its iterations, shared by the main thread,
    the monitor and watcher threads, and the client's control thread."""

    def __init__(self, store: RestartStore, rank: int, world_size: int) -> None:
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
        backward, or done with the function), or outside every collective (see `_culprit`)."""

    def new_iteration(self) -> None:
        self.fault = None
        self.waiting = True
        self.handled = False
        self.fault_seen.clear()
        self.left_function.clear()
        self.wake.clear()
        self.last_ping = None
        self.interrupt_pending = False
        self.times = {}
        self.sockets_before = set(aborting.socket_fds())

    def close(self) -> None:
        """Let go of the store (main thread, the call is over): every reference the Wrapper
        made to it is replaced, so that the store, and its listening port on the rank that
        hosts it, go when the last of the caller's own references does, even while an
        exception's frames still hold this run or a CallWrapper."""
        for store in (self.store, self.watch):
            if store is not None:
                store.base = _CLOSED
        for call in list(self.calls):
            call.store = _CLOSED
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


class Wrapper:
    """Decorate the training function; calling it runs it with in-process restarts.

    ``initialize``, ``abort``, ``finalize`` and ``health_check`` are callables taking
    the `CallWrapper` (``initialize`` runs at the start of every iteration, inside it;
    ``finalize`` and ``health_check`` after a fault). Durations are seconds or
    ``timedelta``. ``store_factory(**store_kwargs)`` builds the base torch.distributed
    store (default: torchrun's agent store when there is one, else a TCPStore hosted by
    rank 0 at MASTER_PORT + 1). ``call_wrapper_arg`` names the keyword the `CallWrapper`
    is passed as when the function does not annotate a parameter with `CallWrapper`.
    ``max_iterations`` bounds the in-process restarts (None: unbounded).
    """

    def __init__(
        self,
        *,
        store_factory: Callable[..., Any] | None = None,
        store_kwargs: dict[str, Any] | None = None,
        initialize: Callable[[CallWrapper], Any] | None = None,
        abort: Callable[[CallWrapper], Any] | None = None,
        finalize: Callable[[CallWrapper], Any] | None = None,
        health_check: Callable[[CallWrapper], Any] | None = None,
        monitor_thread_interval: Seconds = 1.0,
        soft_timeout: Seconds = 60.0,
        hard_timeout: Seconds = 90.0,
        barrier_timeout: Seconds = 120.0,
        completion_timeout: Seconds = 120.0,
        max_iterations: int | None = None,
        interrupt_signal: int = signal.SIGURG,
        interrupt_interval: Seconds = 0.1,
        call_wrapper_arg: str = "call",
        enabled: bool = True,
        **reference_options: Any,
    ) -> None:
        refused = [k for k in UNSUPPORTED if reference_options.get(k) is not None]
        if refused:
            raise InProcessError(f"Wrapper option(s) {', '.join(refused)} are not supported: ranks keep their "
                                 "rank across in-process restarts, and a rank that cannot go on is restarted with "
                                 "its process (see docs/inprocess.md)")
        unknown = sorted(set(reference_options) - set(UNSUPPORTED) - set(IGNORED))
        if unknown:
            raise TypeError(f"Wrapper() got unexpected keyword argument(s): {', '.join(unknown)}")
        ignored = sorted(k for k in reference_options if k in IGNORED)
        if ignored:
            log.info("Wrapper option(s) %s ignored: they configure nvidia-resiliency-ext's monitor process, whose "
                     "job the rank's ft-monitor daemon does", ", ".join(ignored))
        self.monitor_thread_interval = _seconds("monitor_thread_interval", monitor_thread_interval)
        self.soft_timeout = _seconds("soft_timeout", soft_timeout)
        self.hard_timeout = _seconds("hard_timeout", hard_timeout)
        self.barrier_timeout = _seconds("barrier_timeout", barrier_timeout)
        self.completion_timeout = _seconds("completion_timeout", completion_timeout)
        self.interrupt_interval = _seconds("interrupt_interval", interrupt_interval)
        if self.hard_timeout <= self.soft_timeout:
            raise InProcessError(f"hard_timeout = {self.hard_timeout:g} s must be above soft_timeout = "
                                 f"{self.soft_timeout:g} s: the difference is how long an interrupted rank has to "
                                 "leave the function")
        if max_iterations is not None and max_iterations < 0:
            raise InProcessError(f"max_iterations = {max_iterations}: must be None or >= 0")
        self.store_factory = store_factory
        self.store_kwargs = dict(store_kwargs or {})
        self.initialize = initialize
        self.abort = abort if abort is not None else aborting.AbortTorchDistributed()
        self.finalize = finalize
        self.health_check = health_check
        self.max_iterations = max_iterations
        self.interrupt_signal = interrupt_signal
        self.call_wrapper_arg = call_wrapper_arg
        self.enabled = enabled

    # -- decoration --------------------------------------------------------------
    def __call__(self, fn: F) -> F:
        if not self.enabled:
            return fn
        param = self._call_wrapper_param(fn)

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return self._run(fn, param, args, kwargs)

        return wrapped  # type: ignore[return-value]

    def _call_wrapper_param(self, fn: Callable[..., Any]) -> str | None:
        """The parameter that takes the CallWrapper: annotated with it (also as a string,
        or Optional[CallWrapper]), else the one named ``call_wrapper_arg``, else none."""
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return None
        for name, p in params.items():
            ann = p.annotation
            if ann is CallWrapper or "CallWrapper" in (ann if isinstance(ann, str) else repr(ann)):
                return name
        if self.call_wrapper_arg in params:
            return self.call_wrapper_arg
        return None

    # -- running -------------------------------------------------------------------
    def _run(self, fn: Callable[..., Any], param: str | None, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        if threading.current_thread() is not threading.main_thread():
            raise InProcessError("a Wrapper must be called from the main thread (it is interrupted by a signal)")
        _refuse_initialized()
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        run = _Run(self._store(rank, world, next(_calls)), rank, world)
        exit_teardown.install()  # the function's gloo group, left to the interpreter, could abort the exit
        gc.freeze()  # see _collect
        previous = signal.signal(self.interrupt_signal, functools.partial(_on_interrupt, run))
        events.set_fault_handler(functools.partial(self._on_reported_fault, run))
        finished = False
        stopped = False
        try:
            while True:
                call = CallWrapper(run, run.iteration)
                if param is not None:
                    kwargs[param] = call
                outcome = self._one_iteration(fn, run, call, args, kwargs)
                if outcome is not _RESTART:
                    finished = True
                    return outcome
                self._after_fault(run, call)
        except (KeyboardInterrupt, SystemExit):
            stopped = True  # the process is being stopped: it leaves at once (its fault is recorded)
            raise
        finally:
            events.set_fault_handler(None)
            signal.signal(self.interrupt_signal, previous)
            gc.unfreeze()
            aborting.bury()
            try:
                if run.store.hosted and not stopped:  # a rank hosts the store: it must outlive the others' use
                    self._leave(run, finished)
            finally:
                run.close()

    def _leave(self, run: _Run, finished: bool) -> None:
        """Meet the other ranks on the way out (bounded): after a result the host closes its
        store after their last use; after a fault it closes it at once (the others end too,
        or learn from the closed store that they must). The others wait until it has, so a
        rank's next wrapped call cannot reach the old store."""
        if finished:
            run.store.leave(run.iteration, self.completion_timeout)
            return
        if run.rank == 0:
            return
        try:  # an exception is on its way out: it is the one the caller sees
            run.store.leave(run.iteration, self.barrier_timeout)
        except Exception as e:  # noqa: BLE001 - the store is gone (its host ended): nothing to meet
            log.info("rank %d: leaving the in-process restart store: %s", run.rank, e)

    def _store(self, rank: int, world: int, number: int) -> RestartStore:
        prefix = namespace() + (f"call{number}/" if number else "")
        if self.store_factory is not None:
            base, hosted = self.store_factory(**self.store_kwargs), False
        else:
            base, hosted = base_store(rank, world, max(self.barrier_timeout, self.completion_timeout, 30.0))
        from torch._C._distributed_c10d import HashStore

        run = run_id()
        if isinstance(base, HashStore):  # in this process only: no one else can write to it
            key = jobkey.JobKey(os.urandom(32), "a random key (the store is in this process)")
        else:
            key = jobkey.inprocess_key(os.environ, run)
        log.debug("rank %d: the in-process restart store's records are signed with %s", rank, key.origin)
        return RestartStore(base, world, Signer(key.key, run), rank=rank, hosted=hosted, prefix=prefix)

    def _one_iteration(self, fn: Callable[..., Any], run: _Run, call: CallWrapper, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
        run.new_iteration()
        if run.restart is not None:
            run.restart.times["entered"] = time.time()
            events.announce_entering(run.restart)
        stop = threading.Event()
        threads = [threading.Thread(target=self._monitor, args=(run, call, stop), name="ft-inprocess-monitor",
                                    daemon=True)]
        if run.watch is not None:
            threads.append(threading.Thread(target=self._watch, args=(run, run.watch, run.iteration, stop),
                                            name="ft-inprocess-watch", daemon=True))
        for t in threads:
            t.start()
        try:
            try:
                run.interruptible = True
                if self.initialize is not None:
                    self.initialize(call)
                result = fn(*args, **kwargs)
            finally:
                run.interruptible = False
                run.last_ping = None  # out of the function: nothing to time until the next iteration
                run.left_function.set()
                run.times.setdefault("left", time.time())
        except RestartInterrupt as e:
            run.waiting = _waited(e)
            return _RESTART
        except BaseException as e:  # out of the training function: a fault
            run.waiting = _waited(e)  # e.g. a collective that the abort made fail
            if isinstance(e, (KeyboardInterrupt, SystemExit)) and not run.fault_seen.is_set():
                run.report(f"rank {run.rank} left the Wrapper: {type(e).__name__}", run.rank, "exit")
                raise
            if run.report(f"rank {run.rank}: {type(e).__name__}: {e}", run.rank, "exception"):
                log.error("rank %d: %s out of the training function; restarting in-process (iteration %d)",
                          run.rank, type(e).__name__, run.iteration + 1, exc_info=e)
            return _RESTART
        else:
            try:
                run.store.complete(run.iteration)
                outcome = self._wait_outcome(run)
            except Exception as e:
                raise InProcessError(f"rank {run.rank}: the in-process restart store is unreachable: {e}") from e
            if outcome is True:
                aborting.bury()  # past a store wait: their worker threads are idle
                return result
            if not isinstance(outcome, FaultRecord):
                why = f"not every rank finished within completion_timeout = {self.completion_timeout:g} s"
                run.report(f"rank {run.rank}: {why}", None, "exit")
                raise InProcessError(f"rank {run.rank}: {why}")
            run.note_fault(outcome)  # a peer faulted while this rank was done: restart with it
            return _RESTART
        finally:
            stop.set()
            run.wake.set()
            for t in threads:
                t.join(MONITOR_JOIN_TIMEOUT)
                if t.is_alive():
                    log.error("rank %d: the in-process %s thread is stuck; going on without it", run.rank, t.name)

    def _wait_outcome(self, run: _Run) -> FaultRecord | bool | None:
        """This rank finished: wait (bounded) until every rank did, or a fault ends the iteration."""
        if run.watch is not None:
            return run.store.wait_outcome(run.iteration, self.completion_timeout)
        end = time.monotonic() + self.completion_timeout
        while time.monotonic() < end:
            outcome = run.store.outcome(run.iteration)
            if outcome is not None:
                return outcome
            time.sleep(min(self.monitor_thread_interval, 0.05))
        return None

    def _after_fault(self, run: _Run, call: CallWrapper) -> None:
        fault = run.fault or FaultRecord("unknown", None, "unknown", run.rank, time.time())
        self._handle_fault(run, call)  # where the monitor thread had not yet
        aborting.release_process_groups()
        _collect()
        if self.finalize is not None:
            self.finalize(call)
        if self.health_check is not None:
            try:
                self.health_check(call)
            except Exception as e:
                raise HealthCheckError(f"rank {run.rank}: health check failed after a fault: {e}") from e
        run.times["finalized"] = time.time()
        if self.max_iterations is not None and run.iteration + 1 > self.max_iterations:
            raise RestartLimitError(f"rank {run.rank}: max_iterations = {self.max_iterations} in-process restarts "
                                    f"used; last fault: {fault.reason}")
        try:
            if not run.waiting and fault.source in HANG_SOURCES:
                run.store.claim_outside(run.iteration, reporter=fault.rank == run.rank)
            arrived = run.store.barrier(run.iteration, "barrier", self.barrier_timeout)
            if arrived is None:
                fault = _culprit(fault, run.store.outside(run.iteration))
        except Exception as e:
            raise InProcessError(f"rank {run.rank}: the in-process restart store is unreachable: {e}") from e
        if arrived is not None:
            raise BarrierTimeoutError(f"rank {run.rank}: {arrived} of {run.world_size} ranks reached the restart "
                                      f"barrier within barrier_timeout = {self.barrier_timeout:g} s")
        run.times["barrier"] = time.time()
        aborting.bury()
        run.store.forget(run.iteration - 1)
        run.iteration += 1
        run.restart = events.Restart(run.iteration, events.Fault(fault.reason, fault.rank, run.iteration - 1,
                                                                 fault.source), dict(run.times))
        b = timeline.breakdown(fault.time, [run.times])
        log.warning("rank %d: in-process restart %d after: %s (%s)", run.rank, run.iteration, fault.reason,
                    timeline.describe(b))

    def _handle_fault(self, run: _Run, call: CallWrapper) -> None:
        """Announce the restart and run the abort hook, once per iteration (monitor thread,
        or the main thread when the fault came from the function itself)."""
        with run.lock:
            if run.handled:
                return
            run.handled = True
        events.announce_aborting(run.iteration + 1)
        try:
            self.abort(call)
        except Exception:
            log.exception("rank %d: the abort hook failed", run.rank)
        run.times["aborted"] = time.time()

    # -- threads ---------------------------------------------------------------------
    def _watch(self, run: _Run, store: RestartStore, iteration: int, stop: threading.Event) -> None:
        """Block on the iteration's outcome; a fault wakes the monitor thread."""
        while not stop.is_set():
            try:
                outcome = store.wait_outcome(iteration, WATCH_CHUNK, stop)
            except Exception as e:  # the store is gone (its host died): nothing to coordinate with
                if not stop.is_set():
                    run.note_fault(FaultRecord(f"rank {run.rank}: the in-process restart store is unreachable: {e}",
                                               None, "store", run.rank, time.time()))
                return
            if isinstance(outcome, FaultRecord):
                run.note_fault(outcome)
            if outcome is not None:
                return

    def _monitor(self, run: _Run, call: CallWrapper, stop: threading.Event) -> None:
        """The iteration's monitor thread; its hooks (abort) get the ``call`` the function got."""
        last_signal = fault_at = 0.0
        grace = self.hard_timeout - self.soft_timeout
        while not stop.is_set():
            acting = run.fault is not None
            run.wake.wait(min(self.monitor_thread_interval, self.interrupt_interval) if acting
                          else self.monitor_thread_interval)
            run.wake.clear()
            if stop.is_set():
                return
            if "torch.distributed" in sys.modules:
                aborting.hold_groups()
            now = time.monotonic()
            if run.fault is None:
                if run.last_ping is not None and now - run.last_ping > self.soft_timeout:
                    run.report(f"rank {run.rank}: no ping() for {now - run.last_ping:.1f} s (soft_timeout "
                               f"{self.soft_timeout:g} s)", run.rank, "timeout")
                elif run.watch is None:  # no watcher: poll the store
                    try:
                        outcome = run.store.outcome(run.iteration)
                    except Exception as e:
                        outcome = FaultRecord(f"rank {run.rank}: the in-process restart store is unreachable: {e}",
                                              None, "store", run.rank, time.time())
                    if isinstance(outcome, FaultRecord):
                        run.note_fault(outcome)
                if run.fault is None:
                    continue
            if not run.fault_seen.is_set():
                log.debug("rank %d: fault seen in iteration %d: %s", run.rank, run.iteration, run.fault.reason)
                self._handle_fault(run, call)  # abort first, interrupt second
                run.fault_seen.set()
                fault_at = now
            if run.left_function.is_set():
                return
            if now - last_signal >= self.interrupt_interval:  # again until the main thread is out
                last_signal = now
                signal.pthread_kill(threading.main_thread().ident or 0, self.interrupt_signal)
            if now - fault_at > grace:
                log.critical("rank %d: the training function did not return %.1f s after an in-process restart "
                             "was requested (hard_timeout - soft_timeout); dumping stacks and killing this process",
                             run.rank, now - fault_at)
                faulthandler.dump_traceback(sys.stderr, all_threads=True)
                os.kill(os.getpid(), signal.SIGKILL)

    def _on_reported_fault(self, run: _Run, fault: events.Fault) -> None:
        """A fault from outside the function (the monitor daemon's ABORT), any thread."""
        iteration = run.iteration if fault.iteration is None else fault.iteration
        if iteration != run.iteration:
            log.info("rank %d: ignoring a fault of in-process iteration %d (now in %d): %s", run.rank, iteration,
                     run.iteration, fault.reason)
            return
        run.report(fault.reason, fault.rank, fault.source, iteration)


_RESTART = object()
HANG_SOURCES = ("monitor", "timeout")
"""Faults that are a verdict on a rank's progress (its monitor's, or its own ping timeout)."""


def _refuse_initialized() -> None:
    """The Wrapper makes the process groups itself (on its store, rebuilt on each restart):
    one made before the call could not be aborted or rebuilt."""
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise DistributedInitializedError(
            "torch.distributed is already initialized: the in-process Wrapper must be called before "
            "init_process_group (initialise it inside the wrapped function, e.g. with "
            "call.init_process_group(), so that it is rebuilt on each restart), or destroy the group first")


def _waited(e: BaseException) -> bool:
    """Whether the exception that ended the function was raised while waiting for other ranks
    (inside torch.distributed or backward: the interrupt, or a collective the abort failed)."""
    return waits_for_peers(f.f_code.co_filename for f, _ in traceback.walk_tb(e.__traceback__))


def _culprit(fault: FaultRecord, outside: int | None) -> FaultRecord:
    """The fault as every rank records it (REENTERED, the launcher's row): a hang verdict on a
    rank that was waiting in a collective names the rank that was outside every one instead
    (with a heartbeat timeout, a rank waiting for the hung one can be reported first)."""
    if fault.source not in HANG_SOURCES or outside is None or outside == fault.rank:
        return fault
    return replace(fault, rank=outside, reason=f"rank {outside} was outside every collective while the others "
                                              f"waited in one; reported first: {fault.reason}")


def _collect() -> None:
    """Collect the aborted iteration's objects now (GPU memory, sockets), not at a random
    later allocation. Objects alive when the Wrapper started, or after an earlier restart's
    collection, are frozen (``gc.freeze``: unfrozen when the Wrapper returns), so this scans
    only what the aborted iteration created: with torch loaded, a full collection of this
    process takes 0.07-0.3 s, most of it spent on objects that are not garbage."""
    gc.collect()
    gc.freeze()


def _on_interrupt(run: _Run, signum: int, frame: Any) -> None:
    """The interrupt signal's handler (main thread): leave the function unless inside atomic(),
    or while the monitor client is mid-frame or mid-request (the monitor thread sends the
    signal again every interrupt_interval)."""
    if not run.interruptible or not run.fault_seen.is_set() or events.busy():
        return
    if run.atomic_depth > 0:
        run.interrupt_pending = True
        return
    raise RestartInterrupt(f"in-process restart (iteration {run.iteration + 1})")
