"""A wrapped function whose ``finally:`` takes 0.5 s, interrupted by an in-process restart
(gloo, CPU), for tests/test_inprocess_cleanup.py.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python inprocess_cleanup.py WHERE [--reinterrupt S]

In iteration 0 rank 1 reports a fault (as its monitor daemon's ABORT would) and waits in
Python; rank 0 waits in Python (WHERE = ``sleep``: the restart's RestartInterrupt unwinds
it) or in a collective its peer never joins (WHERE = ``collective``: the abort makes the
collective fail). Both are interrupted; each one's ``finally:`` sleeps 0.5 s and prints
how long it took. Iteration 1 returns. ``--reinterrupt S`` passes
``reinterrupt_interval=S`` to the Wrapper (the default otherwise).
"""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist

from ft_client.inprocess import CallWrapper, Wrapper, events

CLEANUP = 0.5


def say(*parts: object) -> None:
    print(" ".join(map(str, parts)), flush=True)


def wait_for_the_interrupt(limit: float) -> None:
    """Wait in Python (a sleep the interrupt ends), at most ``limit`` seconds."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        time.sleep(0.05)
    raise SystemExit(f"never interrupted within {limit:g} s")


def main() -> int:
    where = sys.argv[1]
    rank = int(os.environ["RANK"])
    options = {}
    if "--reinterrupt" in sys.argv:
        options["reinterrupt_interval"] = float(sys.argv[sys.argv.index("--reinterrupt") + 1])

    @Wrapper(soft_timeout=30, hard_timeout=60, barrier_timeout=30, completion_timeout=30,
             monitor_thread_interval=0.01, max_iterations=2, **options)
    def train(call: CallWrapper) -> str:
        call.init_process_group("gloo")
        dist.barrier()
        if call.iteration > 0:
            dist.barrier()
            dist.destroy_process_group()
            return f"done in iteration {call.iteration}"
        try:
            if rank == 1:
                events.report_fault(events.Fault(f"rank {rank}: test fault", rank))
                wait_for_the_interrupt(60)
            elif where == "collective":
                dist.barrier()  # rank 1 never joins: the abort makes it fail
                raise SystemExit("the collective returned")
            else:
                wait_for_the_interrupt(60)
        finally:
            started = time.monotonic()
            unwinding = sys.exc_info()[0]
            say(f"rank {rank} cleanup starts in iteration {call.iteration}, unwinding "
                f"{unwinding.__name__ if unwinding else None}")
            time.sleep(CLEANUP)
            say(f"rank {rank} cleanup done in iteration {call.iteration} after {time.monotonic() - started:.2f} s")
        return "not reached"

    try:
        say(f"rank {rank} returned: {train()}")
    except BaseException as e:  # noqa: BLE001 - printed for the test
        say(f"rank {rank} ended: {type(e).__name__}: {e}")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
