"""The in-process restart's timing decisions, pure (no thread, signal, store or clock of
their own: the caller passes ``now``, a ``time.monotonic()`` reading). interrupt.py and
call.py act on them.

* `interrupt_action`: what the interrupt signal's handler does when it lands in the main
  thread. The interrupt is raised once per restart; it is never raised into code that is
  handling an exception (an ``except`` or ``finally`` block, a context manager's
  ``__exit__``), so that the function's cleanup runs to its end while it unwinds. Only a
  function that is found running again outside every handler, ``reinterrupt_interval``
  after the interrupt was raised (it swallowed it), gets it again.
* `signal_due`: when the monitor thread sends the next signal: every ``interrupt_interval``
  until the interrupt was raised (a signal that lands while the monitor client is busy, or
  while the main thread is unwinding an exception of its own, is let pass, and a later one
  raises), then only every ``reinterrupt_interval``, to find a function that went on.
* `ping_timed_out`, `must_kill`: the soft timeout (no ``ping()``) and the hard one (the main
  thread has not left the function ``hard_timeout - soft_timeout`` after the fault), both off
  while `CallWrapper.disable_hang_protection` is active.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

REINTERRUPT_INTERVAL = 5.0
"""The default of the Wrapper's ``reinterrupt_interval`` (seconds)."""


class Interrupt(enum.Enum):
    """What the interrupt signal's handler does."""

    PASS = "pass"
    """Nothing: not (or no longer) in the function, no fault seen yet, or the monitor client is
    mid-call (no lock may stay held); the next signal decides again."""
    HOLD = "hold"
    """Nothing: the main thread is unwinding (handling an exception: it is leaving, its cleanup
    runs to its end), or the interrupt was raised less than ``reinterrupt_interval`` ago."""
    DEFER = "defer"
    """Inside ``atomic()``: raised when the outermost block ends."""
    RAISE = "raise"
    """Raise `RestartInterrupt` now."""


@dataclass(frozen=True, slots=True)
class MainThread:
    """What the handler knows of the main thread when the signal lands."""

    interruptible: bool
    """Inside the wrapped function (or the ``initialize`` hook)."""
    fault_seen: bool
    """The monitor thread acted on this iteration's fault (the abort hook ran)."""
    busy: bool
    """The monitor client is inside a call (its lock held)."""
    atomic: bool
    """Inside ``CallWrapper.atomic()``."""
    unwinding: bool
    """Handling an exception: in an ``except`` or ``finally`` block, or an ``__exit__``."""
    raised_at: float | None
    """When the interrupt was raised in this iteration (None: not yet)."""


def interrupt_action(main: MainThread, now: float, reinterrupt_interval: float) -> Interrupt:
    if not main.interruptible or not main.fault_seen or main.busy:
        return Interrupt.PASS
    if main.atomic:
        return Interrupt.DEFER
    if main.unwinding:
        return Interrupt.HOLD
    if main.raised_at is not None and now - main.raised_at < reinterrupt_interval:
        return Interrupt.HOLD
    return Interrupt.RAISE


def signal_due(now: float, last_signal: float | None, raised: bool, interrupt_interval: float,
               reinterrupt_interval: float) -> bool:
    """Whether the monitor thread sends the interrupt signal now (``last_signal``: when it sent
    the last one in this iteration; ``raised``: the interrupt was raised in this iteration)."""
    if last_signal is None:
        return True
    return now - last_signal >= (reinterrupt_interval if raised else interrupt_interval)


def ping_timed_out(now: float, last_ping: float | None, soft_timeout: float, protected: bool) -> bool:
    """No ``ping()`` for ``soft_timeout`` (once the first ping of the iteration was made)."""
    return protected and last_ping is not None and now - last_ping > soft_timeout


def must_kill(now: float, fault_at: float, protected_since: float, grace: float, protected: bool) -> bool:
    """The main thread has not left the function ``grace`` (``hard_timeout - soft_timeout``) after
    the fault, or after hang protection came back on (``protected_since``), whichever is later."""
    return protected and now - max(fault_at, protected_since) > grace
