"""The ranks' meetings in the Wrapper's store (store.py is the key space and protocol;
this module is when the Wrapper uses it): building the call's store, the completion wait
once the function returned, the restart barrier after a fault (naming the rank that was
outside every collective), and the meeting on the way out of the Wrapper."""

from __future__ import annotations

import itertools
import os
import time
import traceback
from dataclasses import replace

from ft_client import logs
from ft_client.collectives import waits_for_peers
from ft_client.inprocess import abort as aborting
from ft_client.inprocess.call import Run
from ft_client.inprocess.config import WrapperConfig
from ft_client.inprocess.errors import BarrierTimeoutError, InProcessError
from ft_client.inprocess.store import FaultRecord, RestartStore, base_store, namespace, run_id
from ft_client.store import jobkey
from ft_client.store.signed import Signer

log = logs.logger("ft_client.inprocess")

HANG_SOURCES = ("monitor", "timeout")
"""Faults that are a verdict on a rank's progress (its monitor's, or its own ping timeout)."""

calls = itertools.count()
"""Wrapped calls made in this process: every rank makes them in the same order, so the
n-th call of each rank uses the n-th key space (a second call never reads the first's keys)."""


def make_store(cfg: WrapperConfig, rank: int, world: int, number: int) -> RestartStore:
    """The store of this process's ``number``-th wrapped call, its records signed."""
    prefix = namespace() + (f"call{number}/" if number else "")
    if cfg.store_factory is not None:
        base, hosted = cfg.store_factory(**cfg.store_kwargs), False
    else:
        base, hosted = base_store(rank, world, max(cfg.barrier_timeout, cfg.completion_timeout, 30.0))
    from torch._C._distributed_c10d import HashStore

    run = run_id()
    if isinstance(base, HashStore):  # in this process only: no one else can write to it
        key = jobkey.JobKey(os.urandom(32), "a random key (the store is in this process)")
    else:
        key = jobkey.inprocess_key(os.environ, run)
    log.debug("rank %d: the in-process restart store's records are signed with %s", rank, key.origin)
    return RestartStore(base, world, Signer(key.key, run), rank=rank, hosted=hosted, prefix=prefix)


def complete(cfg: WrapperConfig, run: Run) -> bool:
    """This rank's function returned: True when every rank's did; False when a peer's fault
    ends the iteration (noted in ``run``: restart with it). Raises `InProcessError` when
    the store is unreachable or not every rank finished within ``completion_timeout``."""
    try:
        run.store.complete(run.iteration)
        outcome = wait_outcome(cfg, run)
    except Exception as e:
        raise InProcessError(f"rank {run.rank}: the in-process restart store is unreachable: {e}") from e
    if outcome is True:
        aborting.bury()  # past a store wait: their worker threads are idle
        return True
    if not isinstance(outcome, FaultRecord):
        why = f"not every rank finished within completion_timeout = {cfg.completion_timeout:g} s"
        run.report(f"rank {run.rank}: {why}", None, "exit")
        raise InProcessError(f"rank {run.rank}: {why}")
    run.note_fault(outcome)  # a peer faulted while this rank was done: restart with it
    return False


def wait_outcome(cfg: WrapperConfig, run: Run) -> FaultRecord | bool | None:
    """This rank finished: wait (bounded) until every rank did, or a fault ends the iteration."""
    if run.watch is not None:
        return run.store.wait_outcome(run.iteration, cfg.completion_timeout)
    end = time.monotonic() + cfg.completion_timeout
    while time.monotonic() < end:
        outcome = run.store.outcome(run.iteration)
        if outcome is not None:
            return outcome
        time.sleep(min(cfg.monitor_thread_interval, 0.05))
    return None


def restart_barrier(cfg: WrapperConfig, run: Run, fault: FaultRecord) -> FaultRecord:
    """Meet every rank after the fault (bounded by ``barrier_timeout``); the fault as every
    rank records it (`culprit`). Raises `BarrierTimeoutError` when a rank did not come,
    `InProcessError` when the store is unreachable."""
    try:
        if not run.waiting and fault.source in HANG_SOURCES:
            run.store.claim_outside(run.iteration, reporter=fault.rank == run.rank)
        arrived = run.store.barrier(run.iteration, "barrier", cfg.barrier_timeout)
        if arrived is None:
            fault = culprit(fault, run.store.outside(run.iteration))
    except Exception as e:
        raise InProcessError(f"rank {run.rank}: the in-process restart store is unreachable: {e}") from e
    if arrived is not None:
        raise BarrierTimeoutError(f"rank {run.rank}: {arrived} of {run.world_size} ranks reached the restart "
                                  f"barrier within barrier_timeout = {cfg.barrier_timeout:g} s")
    return fault


def leave(cfg: WrapperConfig, run: Run, finished: bool) -> None:
    """Meet the other ranks on the way out (bounded): after a result the host closes its
    store after their last use; after a fault it closes it at once (the others end too,
    or learn from the closed store that they must). The others wait until it has, so a
    rank's next wrapped call cannot reach the old store."""
    if finished:
        run.store.leave(run.iteration, cfg.completion_timeout)
        return
    if run.rank == 0:
        return
    try:  # an exception is on its way out: it is the one the caller sees
        run.store.leave(run.iteration, cfg.barrier_timeout)
    except Exception as e:  # noqa: BLE001 - the store is gone (its host ended): nothing to meet
        log.info("rank %d: leaving the in-process restart store: %s", run.rank, e)


def waited(e: BaseException) -> bool:
    """Whether the exception that ended the function was raised while waiting for other ranks
    (inside torch.distributed or backward: the interrupt, or a collective the abort failed)."""
    frames = [f.f_code.co_filename for f, _ in traceback.walk_tb(e.__traceback__)]
    return waits_for_peers(reversed(frames))  # innermost first


def culprit(fault: FaultRecord, outside: int | None) -> FaultRecord:
    """The fault as every rank records it (REENTERED, the launcher's row): a hang verdict on a
    rank that was waiting in a collective names the rank that was outside every one instead
    (with a heartbeat timeout, a rank waiting for the hung one can be reported first)."""
    if fault.source not in HANG_SOURCES or outside is None or outside == fault.rank:
        return fault
    return replace(fault, rank=outside, reason=f"rank {outside} was outside every collective while the others "
                                              f"waited in one; reported first: {fault.reason}")
