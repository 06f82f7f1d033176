"""How a fault reaches the main thread, during an iteration: the watcher thread (blocks on
the iteration's outcome in the store), the monitor thread (the ping timeout, the store
poll without a watcher, the abort hook once per iteration, the interrupt signal sent
until the interrupt was raised, the kill after ``hard_timeout``), the signal's handler
that raises `RestartInterrupt` once per restart (never into an ``except`` or ``finally``
block: the function's cleanup runs to its end), and the faults the monitor daemon
reports (ABORT, through `events`). The timing rules are decide.py's."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Any

from ft_client import logs
from ft_client.inprocess import abort as aborting
from ft_client.inprocess import decide, events
from ft_client.inprocess.call import CallWrapper, Run
from ft_client.inprocess.config import WrapperConfig
from ft_client.inprocess.errors import RestartInterrupt
from ft_client.inprocess.store import FaultRecord, RestartStore

log = logs.logger("ft_client.inprocess")

WATCH_CHUNK = 3600.0
"""Seconds a watcher's store wait lasts before it is renewed (each renewal logs a line in torch)."""


def handle_fault(cfg: WrapperConfig, run: Run, call: CallWrapper) -> None:
    """Announce the restart and run the abort hook, once per iteration (monitor thread,
    or the main thread when the fault came from the function itself)."""
    with run.lock:
        if run.handled:
            return
        run.handled = True
    events.announce_aborting(run.iteration + 1)
    try:
        cfg.abort(call)
    except Exception:
        log.exception("rank %d: the abort hook failed", run.rank)
    run.times["aborted"] = time.time()


def watch(run: Run, store: RestartStore, iteration: int, stop: threading.Event) -> None:
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


def monitor(cfg: WrapperConfig, run: Run, call: CallWrapper, stop: threading.Event) -> None:
    """The iteration's monitor thread; its hooks (abort) get the ``call`` the function got."""
    last_signal: float | None = None
    fault_at = 0.0
    grace = cfg.hard_timeout - cfg.soft_timeout
    while not stop.is_set():
        acting = run.fault is not None
        run.wake.wait(min(cfg.monitor_thread_interval, cfg.interrupt_interval) if acting
                      else cfg.monitor_thread_interval)
        run.wake.clear()
        if stop.is_set():
            return
        if "torch.distributed" in sys.modules:
            aborting.hold_groups()
        now = time.monotonic()
        protected = run.unprotected == 0
        if run.fault is None:
            if decide.ping_timed_out(now, run.last_ping, cfg.soft_timeout, protected):
                assert run.last_ping is not None
                run.report(f"rank {run.rank}: no ping() for {now - run.last_ping:.1f} s (soft_timeout "
                           f"{cfg.soft_timeout:g} s)", run.rank, "timeout")
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
            handle_fault(cfg, run, call)  # abort first, interrupt second
            run.fault_seen.set()
            fault_at = now
        if run.left_function.is_set():
            return
        if decide.signal_due(now, last_signal, run.interrupted_at is not None, cfg.interrupt_interval,
                             cfg.reinterrupt_interval):
            last_signal = now  # until raised; then only to find a function that went on
            signal.pthread_kill(threading.main_thread().ident or 0, cfg.interrupt_signal)
        if decide.must_kill(now, fault_at, run.protected_since, grace, protected):
            log.critical("rank %d: the training function did not return %.1f s after an in-process restart "
                         "was requested (hard_timeout - soft_timeout); dumping stacks and killing this process",
                         run.rank, now - max(fault_at, run.protected_since))
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
            os.kill(os.getpid(), signal.SIGKILL)


def on_reported_fault(run: Run, fault: events.Fault) -> None:
    """A fault from outside the function (the monitor daemon's ABORT), any thread."""
    iteration = run.iteration if fault.iteration is None else fault.iteration
    if iteration != run.iteration:
        log.info("rank %d: ignoring a fault of in-process iteration %d (now in %d): %s", run.rank, iteration,
                 run.iteration, fault.reason)
        return
    run.report(fault.reason, fault.rank, fault.source, iteration)


def on_interrupt(run: Run, signum: int, frame: Any) -> None:
    """The interrupt signal's handler (main thread): leave the function, once per restart
    (`decide.interrupt_action`: not inside atomic(), not while the monitor client is mid-frame
    or mid-request, not into an except or finally block)."""
    action = decide.interrupt_action(
        decide.MainThread(interruptible=run.interruptible, fault_seen=run.fault_seen.is_set(),
                          busy=events.busy() if run.interruptible and run.fault_seen.is_set() else False,
                          atomic=run.atomic_depth > 0, unwinding=sys.exc_info()[1] is not None,
                          raised_at=run.interrupted_at),
        time.monotonic(), run.reinterrupt_interval)
    if action is decide.Interrupt.DEFER:
        run.interrupt_pending = True
    elif action is decide.Interrupt.RAISE:
        again = run.interrupted_at is not None
        run.interrupted()
        raise RestartInterrupt(f"in-process restart (iteration {run.iteration + 1})"
                               + (": raised again, the function went on after the first one" if again else ""))
