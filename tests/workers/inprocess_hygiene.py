"""Two wrapped calls in one process (gloo, CPU), the first ended one way, for the
Wrapper's hygiene tests (tests/test_inprocess_hygiene.py).

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python inprocess_hygiene.py ENDING [--shared-store]

ENDING is how the first call ends: ``result`` (every rank returns), ``exception`` (the
health check fails on every rank after rank 1 raised: HealthCheckError),
``interrupt`` (the finalize hook is interrupted: RestartInterrupt leaves the Wrapper),
``limit`` (rank 1 raises with max_iterations = 0: RestartLimitError). The exception is
kept (as a caller that logs or stores it would), and the rank prints the ft threads
still alive, whether the Wrapper's store port (MASTER_PORT + 1) can be listened on again (the
host, rank 0), then runs a second wrapped call in which rank 1 raises once: it must
restart and return from its iteration 1. With ``--shared-store`` both calls use one
store that outlives them (rank 0 hosts it at MASTER_PORT + 2), as torchrun's agent
store does.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ft_client.inprocess import CallWrapper, RestartInterrupt, Wrapper


def say(*parts: object) -> None:
    print(" ".join(map(str, parts)), flush=True)


def first_call_and_leftovers(first: Callable[[], str], rank: int, port: int) -> BaseException | None:
    """Run the first wrapped call, say how it ended, the ft threads left, and (rank 0) whether the
    store's port is free again; the exception it ended with, if any."""
    kept: BaseException | None = None
    try:
        say(f"rank {rank} first returned: {first()}")
    except BaseException as e:  # noqa: BLE001 - the ending under test
        kept = e
        say(f"rank {rank} first ended: {type(e).__name__}: {e}")
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("ft-"))
    say(f"rank {rank} ft threads: {threads}")
    if rank == 0:
        with socket.socket() as s:  # as the store's listener binds: address reuse (a TIME_WAIT is no listener)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
                s.listen()
                say(f"rank {rank} store port free")
            except OSError as e:
                say(f"rank {rank} store port busy: {e}")
    return kept


def second_call(rank: int, **options: Any) -> int:
    """A second wrapped call in the same process, with a fault in its first iteration: it must work
    whatever the first call's ending left (0), else 3."""

    @Wrapper(soft_timeout=30, hard_timeout=60, monitor_thread_interval=0.01, **options)
    def second(call: CallWrapper) -> str:
        call.init_process_group("gloo")
        dist.barrier()
        if call.iteration == 0 and rank == 1:
            raise ValueError("fault in the second call (test)")
        if call.iteration == 0:  # rank 0 waits in a collective until the abort frees it
            dist.barrier()
        dist.destroy_process_group()
        return f"second done in iteration {call.iteration}"

    try:
        say(f"rank {rank} second returned: {second()}")
    except BaseException as e:  # noqa: BLE001
        say(f"rank {rank} second ended: {type(e).__name__}: {e}")
        return 3
    return 0


def main() -> int:
    ending = sys.argv[1]
    rank = int(os.environ["RANK"])
    port = int(os.environ["MASTER_PORT"]) + 1
    factory = shared = None
    if "--shared-store" in sys.argv:
        shared = dist.TCPStore("127.0.0.1", port + 1, 2, rank == 0, timeout=timedelta(seconds=60),
                               wait_for_workers=False)
        factory = lambda: shared  # noqa: E731

    def health(call: CallWrapper) -> None:
        if ending == "exception":
            raise RuntimeError("health check fails (test)")

    def finalize(call: CallWrapper) -> None:
        if ending == "interrupt":
            raise RestartInterrupt("interrupted while finalizing (test)")

    wrapper = Wrapper(soft_timeout=30, hard_timeout=60, barrier_timeout=20, completion_timeout=20,
                      monitor_thread_interval=0.01, health_check=health, finalize=finalize,
                      max_iterations=0 if ending == "limit" else 5, store_factory=factory)

    @wrapper
    def first(call: CallWrapper) -> str:
        call.init_process_group("gloo")
        dist.barrier()
        faulty = ending != "result" and call.iteration == 0
        if faulty and rank == 1:
            raise ValueError("fault (test)")
        if faulty:  # rank 0 waits in a collective until the abort frees it
            dist.barrier()
        dist.destroy_process_group()
        return f"first done in iteration {call.iteration}"

    kept = first_call_and_leftovers(first, rank, port)

    code = second_call(rank, barrier_timeout=20, completion_timeout=20, store_factory=factory)
    if shared is not None:  # its host (rank 0) stays until every rank is done with it, as torchrun's agent does
        if shared.add("test/bye", 1) == 2:
            shared.set("test/bye_done", b"1")
        if rank == 0:
            shared.wait(["test/bye_done"])
    del kept
    return code


if __name__ == "__main__":
    sys.exit(main())
