"""Tearing down a gloo process group before the interpreter does, so that a run exits with its status.

A process that leaves a gloo process group for the interpreter to clean up can die of
SIGABRT at exit, after its work is done (measured on torch 2.13, CPU, two ranks: 13 of 30
fault-free all-reduce runs and 5 of 30 DDP runs had a rank end with -6, in a bare script
with no ft-monitor part). gloo's worker threads
("pt_gloo_runloop") destroy a finished collective's work object after its ``wait()`` has
returned; the work holds the Python tensors, so the worker takes the GIL to let go of
them. If the main thread has begun finalising the interpreter by then, the worker's
attempt to take the GIL ends the thread (``pthread_exit``), the unwind crosses a C++
frame that may not throw, and ``std::terminate`` aborts the process: "terminate called
without an active exception". torchrun counts that as a failure and restarts the job; a
rank that raised exits -6 instead of 1, and the report names a signal instead of the
exception.

`install` (called by the first `RankMonitorClient` to connect and by the in-process
`Wrapper`) registers an ``atexit`` handler, which runs while the interpreter is still
whole. If the default group is still initialised and its backend is gloo, the handler:

1. lets the worker threads finish: it releases the GIL and watches each "pt_gloo_runloop"
   thread (state and context switches in /proc) until every one of them sits still,
   blocked, across a 10 ms look. A worker that wanted the GIL took it meanwhile, or is
   seen running; an idle worker waits on a condition variable and does not move;
2. calls ``destroy_process_group()``. Where nothing else holds the group, its destructor
   joins the (now idle) workers. Where something does (a DDP model's reducer keeps the
   group alive in C++ even after ``del model``), the workers stay, idle, and need nothing
   from the interpreter any more.

Both steps are bounded: gloo's destructor first lets the queued work run, and a
collective whose peers are gone or stuck would hold it until the group's own timeout
(30 min by default). A faulthandler watchdog, which needs no GIL, prints every thread's
stack and ends the process with status 1 after ``FT_EXIT_TEARDOWN_TIMEOUT`` seconds
(default 10; ``0`` or ``off`` turns the handler off); the stacks show the main thread in
this module's ``teardown``.

A group that the script destroyed itself is not touched, nor are NCCL groups (their
teardown has its own rules: ``destroy_process_group`` at the end of the script, as torch
asks). Stdlib only; torch is used only when the script imported it.
"""

from __future__ import annotations

import atexit
import faulthandler
import math
import os
import sys
import threading
import time
from collections.abc import Mapping

from ft_client import logs

TIMEOUT_ENV = "FT_EXIT_TEARDOWN_TIMEOUT"
"""Seconds the exit teardown may take before the process ends with status 1; 0 or off: no teardown."""
DEFAULT_TIMEOUT = 10.0

log = logs.logger("ft_client.startup.exit_teardown")

_lock = threading.Lock()
_installed = False


def timeout(environ: Mapping[str, str] | None = None) -> float | None:
    """The teardown's bound in seconds, or None when it is turned off. A value that is not a
    number >= 0 falls back to the default, with a warning: the exit path must not raise."""
    text = (os.environ if environ is None else environ).get(TIMEOUT_ENV, "").strip().lower()
    if not text:
        return DEFAULT_TIMEOUT
    if text in ("off", "none", "false", "no"):
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        log.warning("%s=%r is not a number of seconds >= 0; using %g", TIMEOUT_ENV, text[:40], DEFAULT_TIMEOUT)
        return DEFAULT_TIMEOUT
    return seconds or None


def install() -> None:
    """Register the exit teardown (once per process; later calls do nothing)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    atexit.register(_at_exit)


def _at_exit() -> None:
    bound = timeout()
    if bound is None:
        return
    dist = sys.modules.get("torch.distributed")
    if dist is None:  # the script never used torch.distributed
        return
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return
        backend = str(dist.get_backend()).lower()
    except Exception:  # noqa: BLE001 - a half-torn-down torch: leave it to the interpreter
        return
    if "gloo" not in backend or "nccl" in backend:
        return
    teardown(dist, bound)


def teardown(dist: object, bound: float) -> None:
    """Let gloo's workers settle, then ``dist.destroy_process_group()``, under a watchdog that
    ends the process with status 1 after ``bound`` seconds; never raises."""
    faulthandler.dump_traceback_later(bound, exit=True, file=sys.stderr)
    try:
        if not settle(time.monotonic() + bound / 2):
            log.warning("gloo's worker threads were still busy at exit; destroying the process group anyway")
        dist.destroy_process_group()  # type: ignore[attr-defined]
    except Exception as e:  # noqa: BLE001 - exiting: say it, and let the exit go on
        log.warning("destroying the process group at exit failed: %s", e)
    finally:
        faulthandler.cancel_dump_traceback_later()


WORKER_NAME = "pt_gloo_runloop"
LOOK = 0.01
"""Seconds a worker must sit still, blocked, to count as idle."""


def settle(deadline: float, look: float = LOOK, task_dir: str = "/proc/self/task") -> bool:
    """Release the GIL until every gloo worker thread of this process is blocked and did not
    move across ``look`` seconds (True), or ``deadline`` (monotonic) passes (False)."""
    while True:
        before = worker_activity(task_dir)
        time.sleep(look)  # the GIL is free: a worker that waits for it takes it now
        after = worker_activity(task_dir)
        if all(a is not None and a == before.get(tid) for tid, a in after.items()):
            return True
        if time.monotonic() >= deadline:
            return False


def worker_activity(task_dir: str = "/proc/self/task") -> dict[str, tuple[int, int] | None]:
    """Thread id -> (voluntary, involuntary context switches) of each gloo worker thread that
    is blocked now, or None for one that is running or runnable."""
    out: dict[str, tuple[int, int] | None] = {}
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/comm") as f:
                if f.read().strip() != WORKER_NAME:
                    continue
            with open(f"{task_dir}/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
            state = fields.get("State", "").split()
            out[tid] = None if not state or state[0] in ("R", "D") else (
                int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"]))
        except (OSError, KeyError, ValueError):
            continue  # the thread ended meanwhile
    return out
