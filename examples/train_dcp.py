"""A DDP run (CPU, gloo) that checkpoints with torch.distributed.checkpoint (DCP), as large jobs
do: ``dcp.save``, or ``dcp.async_save`` whose writes run in the background while training
goes on. Each save runs in the ``ckpt`` section; an async save's section is its wait for the
previous one (``future.result()``) and the staging, so that a save whose background work
hangs is caught when the next one waits for it.

    ft-launcher --nproc-per-node 2 --max-restarts 1 --ft-cfg-path examples/ft.yaml \\
        examples/train_dcp.py --ckpt-dir /tmp/ft-dcp --async-save --stall-write rank=1,save=2,attempt=0

``--stall-write rank=R,save=N,attempt=A``: rank R's Nth save of attempt A never finishes
writing (its storage writer blocks in ``write_data``, in ``write_to_stuck_filesystem``).
Each rank prints ``[rank R] attempt A: resumed at step N`` and ``finished N steps``.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.nn.parallel import DistributedDataParallel as DDP

import ft_client
from ft_client import RankMonitorClient


def write_to_stuck_filesystem() -> None:
    """Stands for a parallel filesystem that stopped answering."""
    while True:
        time.sleep(1)


class StallingWriter(FileSystemWriter):
    """A FileSystemWriter whose data never gets written (the save's background work hangs)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        write_to_stuck_filesystem()
        return super().write_data(plan, planner)


def spec(text: str | None, keys: tuple[str, ...]) -> dict[str, int] | None:
    if not text:
        return None
    parts = dict(item.split("=", 1) for item in text.split(","))
    return {k: int(parts[k]) for k in keys}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--ckpt-dir", default="/tmp/ft-dcp")
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--async-save", action="store_true", help="dcp.async_save (the writes in the background)")
    p.add_argument("--stall-write", default=None, metavar="rank=R,save=N,attempt=A")
    args = p.parse_args()
    stall = spec(args.stall_write, ("rank", "save", "attempt"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=ft_client.process_group_timeout())
    rank = dist.get_rank()
    # async saves talk among themselves on a group of their own, beside the training's
    saves_group = dist.new_group(backend="gloo") if args.async_save else None
    client = RankMonitorClient()
    client.init_workload_monitoring()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    root = Path(args.ckpt_dir)
    start = 0
    latest = sorted(root.glob("step-*"), key=lambda d: int(d.name.split("-")[1])) if root.is_dir() else []
    done = [d for d in latest if (d / ".metadata").is_file()]
    if done:
        state: dict[str, Any] = {"model": model.state_dict(), "opt": opt.state_dict(), "step": 0, "ft": {}}
        dcp.load(state, checkpoint_id=str(done[-1]))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
        client.load_state_dict(state["ft"])
    print(f"[rank {rank}] attempt {attempt}: resumed at step {start}", flush=True)
    g = torch.Generator().manual_seed(rank)
    pending: Future[Any] | None = None
    saves = 0
    for step in range(start, args.steps):
        with client.section("step"):
            x, y = torch.randn(16, 16, generator=g), torch.randn(16, 1, generator=g)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(args.step_time)
        client.send_heartbeat()
        if (step + 1) % args.ckpt_every == 0:
            saves += 1
            stalled = stall is not None and (rank, saves, attempt) == (stall["rank"], stall["save"], stall["attempt"])
            if saves >= 2:
                client.calculate_and_set_section_timeouts(["step", "ckpt"], skip_if_not_ready=True)
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                     "ft": client.state_dict()}
            writer = (StallingWriter if stalled else FileSystemWriter)(str(root / f"step-{step + 1}"))
            with client.section("ckpt"):
                if pending is not None:
                    pending.result()  # the previous save's background work, finished
                    pending = None
                if args.async_save:
                    pending = dcp.async_save(state, storage_writer=writer, process_group=saves_group)
                else:
                    dcp.save(state, storage_writer=writer)
    with client.section("ckpt"):
        if pending is not None:
            pending.result()
    print(f"[rank {rank}] attempt {attempt}: finished {args.steps} steps", flush=True)
    client.shutdown_workload_monitoring()
    # The process group is left to ft_client's exit teardown (ft_client/startup/exit_teardown.py),
    # which waits for gloo's worker threads to be idle first. Destroyed here, the DDP model freed
    # when main() returns ran the group's destructor with the GIL held, while a gloo worker
    # finishing one of dcp.save's broadcasts waited for the GIL: the rank never exited (1 run in
    # 3, torch 2.13; py-spy: ~ProcessGroupGloo under the Reducer's dealloc, runLoop in decref).


if __name__ == "__main__":
    main()
