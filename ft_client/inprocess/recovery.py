"""Between two iterations, after a fault (main thread, out of the function): the abort
hook where the monitor thread had not run it, the process groups forgotten, the aborted
iteration's garbage collected, ``finalize`` and ``health_check`` (a failure ends the
Wrapper), ``max_iterations``, then `rejoin`: the restart barrier, and the step into the
next iteration with its `events.Restart` record."""

from __future__ import annotations

import gc
import time

from ft_client import logs
from ft_client.inprocess import abort as aborting
from ft_client.inprocess import coordinate, events, timeline
from ft_client.inprocess.call import CallWrapper, Run
from ft_client.inprocess.config import WrapperConfig
from ft_client.inprocess.errors import HealthCheckError, RestartLimitError
from ft_client.inprocess.interrupt import handle_fault
from ft_client.inprocess.store import FaultRecord

log = logs.logger("ft_client.inprocess")


def after_fault(cfg: WrapperConfig, run: Run, call: CallWrapper) -> None:
    """Recover from the iteration's fault and move ``run`` to the next iteration; raises an
    `InProcessError` when the in-process restart cannot go on."""
    fault = run.fault or FaultRecord("unknown", None, "unknown", run.rank, time.time())
    handle_fault(cfg, run, call)  # where the monitor thread had not yet
    aborting.release_process_groups()
    collect()
    if cfg.finalize is not None:
        cfg.finalize(call)
    if cfg.health_check is not None:
        try:
            cfg.health_check(call)
        except Exception as e:
            raise HealthCheckError(f"rank {run.rank}: health check failed after a fault: {e}") from e
    run.times["finalized"] = time.time()
    if cfg.max_iterations is not None and run.iteration + 1 > cfg.max_iterations:
        raise RestartLimitError(f"rank {run.rank}: max_iterations = {cfg.max_iterations} in-process restarts "
                                f"used; last fault: {fault.reason}")
    rejoin(cfg, run, fault)


def rejoin(cfg: WrapperConfig, run: Run, fault: FaultRecord) -> None:
    """The store's part of the recovery, once this rank is out of the function and its
    process groups are released: the restart barrier, the aborted iteration's keys deleted,
    and the step into the next iteration with its `events.Restart` record. Only the store
    and ``run`` are touched (bench/sim_inprocess.py drives it for 1,024 simulated ranks)."""
    fault = coordinate.restart_barrier(cfg, run, fault)
    run.times["barrier"] = time.time()
    aborting.bury()
    run.store.forget(run.iteration)
    run.iteration += 1
    run.restart = events.Restart(run.iteration, events.Fault(fault.reason, fault.rank, run.iteration - 1,
                                                             fault.source), dict(run.times))
    b = timeline.breakdown(fault.time, [run.times])
    log.warning("rank %d: in-process restart %d after: %s (%s)", run.rank, run.iteration, fault.reason,
                timeline.describe(b))


def collect() -> None:
    """Collect the aborted iteration's objects now (GPU memory, sockets), not at a random
    later allocation. Objects alive when the Wrapper started, or after an earlier restart's
    collection, are frozen (``gc.freeze``: unfrozen when the Wrapper returns), so this scans
    only what the aborted iteration created: with torch loaded, a full collection of this
    process takes 0.07-0.3 s, most of it spent on objects that are not garbage."""
    gc.collect()
    gc.freeze()
