"""`Wrapper`: run a training function, and on a fault on any rank abort the
collectives, interrupt it, and run it again in the same process. This module is the
restart loop (one iteration after another, and what ends one); the other jobs have
their own modules: the options (config.py), what a call shares (call.py: `CallWrapper`
and the run's state), how a fault reaches the main thread (interrupt.py), the meetings
in the store (coordinate.py), the recovery between iterations (recovery.py) and the
exceptions (errors.py). Their public names are importable from here too.

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
   waits are interrupted too and ``except Exception`` does not swallow it), raised
   once per restart (never into an ``except`` or ``finally`` block: the function's
   cleanup runs to its end; again only into a function that went on after it,
   ``reinterrupt_interval`` later), and deferred while the main thread is inside
   `CallWrapper.atomic()`.
3. The main thread forgets the process groups, runs ``finalize`` and
   ``health_check`` (a failure ends the Wrapper with an `InProcessError`: the
   process exits and the process-level restart takes over), meets the others at a
   store barrier (``barrier_timeout``: a rank that died makes the others give up
   instead of waiting forever) and calls the function again with ``iteration + 1``.

A rank whose main thread does not leave the function (a C call holding the GIL, a
swallowed interrupt, a cleanup that never ends) dumps its stacks and kills itself
``hard_timeout - soft_timeout`` after the fault (or after the end of a
`CallWrapper.disable_hang_protection` block), when its monitor thread can still run; when it
cannot, the rank's monitor daemon (``on_hang: inprocess``) stops it after
``inprocess_restart_timeout``.
"""

from __future__ import annotations

import functools
import gc
import inspect
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ft_client import logs
from ft_client.inprocess import abort as aborting
from ft_client.inprocess import coordinate, events, interrupt, recovery
from ft_client.inprocess.call import CallWrapper, Run
from ft_client.inprocess.compose import Compose
from ft_client.inprocess.config import IGNORED, UNSUPPORTED, Seconds, WrapperConfig
from ft_client.inprocess.coordinate import HANG_SOURCES
from ft_client.inprocess.coordinate import culprit as _culprit  # noqa: F401 - tests import it from here
from ft_client.inprocess.errors import (
    BarrierTimeoutError,
    DistributedInitializedError,
    HealthCheckError,
    HookError,
    InProcessError,
    RestartInterrupt,
    RestartLimitError,
)
from ft_client.inprocess.interrupt import WATCH_CHUNK
from ft_client.inprocess.interrupt import on_interrupt as _on_interrupt
from ft_client.startup import exit_teardown

__all__ = [
    "Wrapper", "CallWrapper", "Compose", "RestartInterrupt", "InProcessError", "HealthCheckError",
    "RestartLimitError", "BarrierTimeoutError", "DistributedInitializedError", "HookError", "HANG_SOURCES",
    "WATCH_CHUNK", "MONITOR_JOIN_TIMEOUT", "UNSUPPORTED", "IGNORED", "Seconds",
]

log = logs.logger("ft_client.inprocess")

F = TypeVar("F", bound=Callable[..., Any])
_Run = Run  # its name here before the split; tests import it from here

MONITOR_JOIN_TIMEOUT = 10.0
"""Seconds the main thread waits for the monitor thread to finish (a stuck abort hook)."""


class Wrapper(WrapperConfig):
    """Decorate the training function; calling it runs it with in-process restarts.

    ``initialize``, ``abort``, ``finalize`` and ``health_check`` are callables taking
    the `CallWrapper` (``initialize`` runs at the start of every iteration, inside it;
    ``finalize`` and ``health_check`` after a fault). Durations are seconds or
    ``timedelta``. ``store_factory(**store_kwargs)`` builds the base torch.distributed
    store (default: torchrun's agent store when there is one, else a TCPStore hosted by
    rank 0 at MASTER_PORT + 1). ``call_wrapper_arg`` names the keyword the `CallWrapper`
    is passed as when the function does not annotate a parameter with `CallWrapper`.
    ``max_iterations`` bounds the in-process restarts (None: unbounded). The options are
    checked by `config.WrapperConfig`, whose signature this class has.
    """

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
        aborting.import_group_defaults()
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        run = Run(coordinate.make_store(self, rank, world, next(coordinate.calls)), rank, world,
                  self.reinterrupt_interval)
        exit_teardown.install()  # the function's gloo group, left to the interpreter, could abort the exit
        gc.freeze()  # see recovery.collect
        previous = signal.signal(self.interrupt_signal, functools.partial(_on_interrupt, run))
        events.set_fault_handler(functools.partial(interrupt.on_reported_fault, run))
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
                recovery.after_fault(self, run, call)
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
                    coordinate.leave(self, run, finished)
            finally:
                run.close()

    def _one_iteration(self, fn: Callable[..., Any], run: Run, call: CallWrapper, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
        run.new_iteration()
        if run.restart is not None:
            run.restart.times["entered"] = time.time()
            events.announce_entering(run.restart)
        stop = threading.Event()
        threads = [threading.Thread(target=interrupt.monitor, args=(self, run, call, stop),
                                    name="ft-inprocess-monitor", daemon=True)]
        if run.watch is not None:
            threads.append(threading.Thread(target=interrupt.watch, args=(run, run.watch, run.iteration, stop),
                                            name="ft-inprocess-watch", daemon=True))
        for t in threads:
            t.start()
        done = False
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
            run.waiting = coordinate.waited(e)
            if run.interrupted_at is None and run.report(  # not ours: the function (or a hook) raised it
                    f"rank {run.rank}: RestartInterrupt raised by the training function: {e}", run.rank, "exception"):
                log.warning("rank %d: the training function raised RestartInterrupt itself; every rank restarts "
                            "in-process (iteration %d)", run.rank, run.iteration + 1)
            return _RESTART
        except BaseException as e:  # out of the training function: a fault
            run.waiting = coordinate.waited(e)  # e.g. a collective that the abort made fail
            if isinstance(e, (KeyboardInterrupt, SystemExit)) and not run.fault_seen.is_set():
                run.report(f"rank {run.rank} left the Wrapper: {type(e).__name__}", run.rank, "exit")
                raise
            if run.report(f"rank {run.rank}: {type(e).__name__}: {e}", run.rank, "exception"):
                log.error("rank %d: %s out of the training function; restarting in-process (iteration %d)",
                          run.rank, type(e).__name__, run.iteration + 1, exc_info=e)
            return _RESTART
        else:
            done = coordinate.complete(self, run)
            if done:  # every rank finished: the result
                return result
            return _RESTART  # a peer faulted while this rank was done: restart with it
        finally:
            stop.set()
            run.wake.set()
            try:
                if not done and run.fault is None:
                    # the iteration ends on this rank with no outcome it knows of (e.g. Ctrl-C in the
                    # completion wait): record one, so that the watchers (this rank's among them) wake up
                    leaving = sys.exc_info()[1]
                    run.report(f"rank {run.rank} left the Wrapper: {type(leaving).__name__}", run.rank, "exit")
            finally:
                for t in threads:
                    t.join(MONITOR_JOIN_TIMEOUT)
                    if t.is_alive():
                        log.error("rank %d: the in-process %s thread is stuck; going on without it", run.rank,
                                  t.name)


_RESTART = object()


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
