"""Two wrapped calls in one process (gloo, CPU), the first ended in a way that left the
Wrapper's watcher thread blocked on main, for tests/test_inprocess_hygiene.py (issue 39,
item 3; tests/workers/inprocess_hygiene.py has the other endings).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python inprocess_endings.py ENDING

ENDING is how the first call ends:

* ``own_interrupt``: the function raises RestartInterrupt itself, on every rank and in every
  iteration, with max_iterations = 1: RestartLimitError after one restart.
* ``ctrl_c``: rank 0's function returns, and Ctrl-C (SIGINT) reaches rank 0 while it waits for
  rank 1 to finish (the completion wait; torch's store wait is not interrupted, so the
  KeyboardInterrupt comes when the wait ends, at completion_timeout); rank 1 is still in its
  function, and leaves it when it learns that rank 0 left.

The exception is kept, and the rank prints the ft threads still alive and whether the
Wrapper's store port (MASTER_PORT + 1) can be listened on again (the host, rank 0), then runs
a second wrapped call in which rank 1 raises once: it must restart and return from its
iteration 1.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch.distributed as dist
from inprocess_hygiene import first_call_and_leftovers, second_call  # beside this script

from ft_client.inprocess import CallWrapper, RestartInterrupt, Wrapper


def say(*parts: object) -> None:
    print(" ".join(map(str, parts)), flush=True)


def in_completion_wait(main: int) -> bool:
    """The main thread is inside the Wrapper's completion wait (coordinate.complete)."""
    frame = sys._current_frames().get(main)
    while frame is not None:
        if frame.f_code.co_name == "complete" and frame.f_code.co_filename.endswith("coordinate.py"):
            return True
        frame = frame.f_back
    return False


def ctrl_c_in_the_completion_wait(limit: float) -> None:
    """Send SIGINT to the main thread once it waits for the other rank (at most ``limit`` s)."""
    main = threading.main_thread().ident or 0
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if in_completion_wait(main):
            signal.pthread_kill(main, signal.SIGINT)
            return
        time.sleep(0.01)


def main() -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a script started from a shell
    ending = sys.argv[1]
    rank = int(os.environ["RANK"])
    port = int(os.environ["MASTER_PORT"]) + 1

    wrapper = Wrapper(soft_timeout=30, hard_timeout=60, barrier_timeout=20, completion_timeout=5,
                      monitor_thread_interval=0.01, max_iterations=1 if ending == "own_interrupt" else 5)

    @wrapper
    def first(call: CallWrapper) -> str:
        call.init_process_group("gloo")
        dist.barrier()
        dist.destroy_process_group()
        if ending == "own_interrupt":
            raise RestartInterrupt(f"raised by the function in iteration {call.iteration} (test)")
        if rank == 0:  # ctrl_c
            threading.Thread(target=ctrl_c_in_the_completion_wait, args=(30,), name="test-ctrl-c").start()
            return f"first done in iteration {call.iteration}"
        end = time.monotonic() + 40  # rank 1 waits in its function until it learns that rank 0 left
        while time.monotonic() < end:
            time.sleep(0.05)
        return "rank 1 never learned that rank 0 left"

    kept = first_call_and_leftovers(first, rank, port)

    code = second_call(rank, barrier_timeout=30, completion_timeout=30)
    del kept
    return code


if __name__ == "__main__":
    sys.exit(main())
