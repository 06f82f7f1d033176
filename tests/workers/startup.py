"""A worker for the start-up deadline's end-to-end tests (tests/test_startup_e2e.py).

    python tests/workers/startup.py sleep   # hangs before anything (under `ft-monitor serve -- CMD`)
    python tests/workers/startup.py fast    # connects, one heartbeat, shuts down, exits 0
    python tests/workers/startup.py step    # connects, one heartbeat, hangs in a "step" section
    python tests/workers/startup.py         # under ft-launcher with 2 ranks, by attempt:

What each rank does depends on the attempt (TORCHELASTIC_RESTART_COUNT); in every
attempt but the last, one rank hangs before it connects to its monitor, the other
connects first (so it is not a start-up hang) and waits:

    attempt 0: rank 1 sleeps before anything (sleep_before_init); rank 0 connects, then waits
               in init_process_group for rank 1
    attempt 1: rank 0 waits in init_process_group for rank 1, which connected and waits
    attempt 2: rank 0 is stuck importing a module (stuck_at_import.py); rank 1 connected, waits
    attempt 3: both connect, init_process_group, a few steps, exit 0

Nothing here imports torch or ft_client before the point where it hangs.
"""

from __future__ import annotations

import os
import sys
import time


def sleep_before_init() -> None:
    time.sleep(600)


def connect() -> object:
    from ft_client import RankMonitorClient

    client = RankMonitorClient()
    client.init_workload_monitoring()
    return client


def wait_to_be_stopped() -> None:
    time.sleep(600)


def train(client: object) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for _ in range(3):
        with client.section("step"):  # type: ignore[attr-defined]
            dist.all_reduce(torch.ones(4))
        client.send_heartbeat()  # type: ignore[attr-defined]
    dist.barrier()
    print(f"[rank {dist.get_rank()}] finished", flush=True)
    client.shutdown_workload_monitoring()  # type: ignore[attr-defined]
    dist.destroy_process_group()


def main() -> None:
    if sys.argv[1:] == ["sleep"]:
        sleep_before_init()
    if sys.argv[1:] == ["fast"]:
        client = connect()
        client.send_heartbeat()  # type: ignore[attr-defined]
        client.shutdown_workload_monitoring()  # type: ignore[attr-defined]
        print("fast worker done", flush=True)
        return
    if sys.argv[1:] == ["step"]:
        client = connect()
        client.send_heartbeat()  # type: ignore[attr-defined]
        with client.section("step"):  # type: ignore[attr-defined]
            print("in step", flush=True)
            wait_to_be_stopped()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    print(f"[rank {rank}] attempt {attempt} pid {os.getpid()}", flush=True)
    hangs = {0: 1, 1: 0, 2: 0}.get(attempt)  # the rank that hangs before connecting
    if rank == hangs:
        if attempt == 0:
            sleep_before_init()
        elif attempt == 1:
            import torch.distributed as dist

            dist.init_process_group("gloo")  # rank 1 never joins
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import stuck_at_import  # noqa: F401
        raise SystemExit("not reached")
    client = connect()
    if hangs is None or attempt == 0:
        train(client)
    else:
        wait_to_be_stopped()


if __name__ == "__main__":
    main()
