"""A gloo rank that leaves its process group to the interpreter (tests/test_exit_teardown.py).

    python tests/workers/gloo_exit.py leave RANK WORLD INIT INSTALL HOW
        trains a few DDP steps and all-reduces, then leaves without destroy_process_group();
        INSTALL 1: with ft_client's exit teardown; HOW raise: rank 0 raises after its last step
    python tests/workers/gloo_exit.py stuck RANK INIT
        rank 0 leaves with an all-reduce in flight that rank 1 (asleep) never joins
"""

from __future__ import annotations

import sys
import time
import warnings

warnings.simplefilter("ignore")  # torch's import-time warnings (the test reads stderr)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ft_client.startup import exit_teardown  # noqa: E402


def leave(rank: int, world: int, init: str, install: bool, how: str) -> None:
    if install:
        exit_teardown.install()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    t = torch.ones(1000)
    for _ in range(3):
        model(torch.randn(8, 64)).sum().backward()
        dist.all_reduce(t)
    if how == "raise" and rank == 0:
        raise RuntimeError("rank 0 fails after its last step")


def stuck(rank: int, init: str) -> None:
    exit_teardown.install()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    print("ready", flush=True)
    if rank == 1:
        time.sleep(300)
    dist.all_reduce(torch.ones(10), async_op=True)


if __name__ == "__main__":
    if sys.argv[1] == "leave":
        leave(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1", sys.argv[6])
    else:
        stuck(int(sys.argv[2]), sys.argv[3])
