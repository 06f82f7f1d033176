"""A small real FSDP2 training run (CPU, gloo) that snapshots its sharded state in memory.

    ft-launcher --nproc-per-node 2 --max-restarts 1 --ft-cfg-path examples/ft.yaml \\
        examples/train_fsdp2.py --snapshot-every 1 --die rank=1,step=12,attempt=0

A tiny MLP is sharded with ``torch.distributed.fsdp.fully_shard`` (each Linear, then the
root), so its parameters and Adam's moments are DTensors, each rank holding its own shard.
With ``--snapshot-every K``, every K steps each rank saves its shards into memory its monitor
keeps (``ft_client.snapshot``); after a restart the ranks restore the newest step all of them
hold, as DTensors on the model's device mesh (``restore(like=...)``), and load them into the
new model and optimizer. ``--die rank=R,step=S,attempt=A`` makes rank R SIGKILL itself after
step S of attempt A (TORCHELASTIC_RESTART_COUNT); ``--hang rank=R,step=S,attempt=A`` makes it
hang in step S's forward instead (in ``write_metrics_to_stuck_filesystem``), the other ranks
waiting for it in FSDP2's collectives. Each rank prints
``[rank R] attempt A: resumed at step N (...)`` and ``[rank R] attempt A: finished N steps,
loss X`` (X in full: a resumed run's losses equal those of a run without the fault).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import ft_client
from ft_client import RankMonitorClient, snapshot


def spec(text: str | None) -> dict[str, int] | None:
    if not text:
        return None
    parts = dict(item.split("=", 1) for item in text.split(","))
    return {k: int(parts[k]) for k in ("rank", "step", "attempt")}


def write_metrics_to_stuck_filesystem() -> None:
    """Stands for an NFS write or a data-loader worker that never returns."""
    while True:
        time.sleep(1)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def model_and_optimizer(lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 17), nn.ReLU(), nn.Linear(17, 1))
    for layer in model:  # odd sizes: the shards are uneven (17 rows, 9 and 8), one of them empty (1 row, 1 and 0)
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def main() -> None:
    from ft_client import torch_features

    if not torch_features.fsdp2_on_cpu():  # torch 2.6: one line, not fully_shard's traceback mid-step
        raise SystemExit(f"train_fsdp2.py: {torch_features.FSDP2_CPU.line(str(torch_features.version()))}")
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds of 'work' per step")
    p.add_argument("--snapshot-every", type=int, default=0, metavar="K",
                   help="save an in-memory snapshot every K steps (kept by the monitor; 0: off) and resume from it")
    p.add_argument("--die", default=None, metavar="rank=R,step=S,attempt=A",
                   help="rank R SIGKILLs itself after step S of attempt A")
    p.add_argument("--hang", default=None, metavar="rank=R,step=S,attempt=A",
                   help="rank R hangs in step S of attempt A")
    p.add_argument("--ckpt-dir", default=None, help="unused (the test launchers pass it)")
    args = p.parse_args()
    die, hang = spec(args.die), spec(args.hang)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=ft_client.process_group_timeout())
    rank = dist.get_rank()
    client = RankMonitorClient()
    model, opt = model_and_optimizer(args.lr)
    mesh = next(iter(model.parameters())).device_mesh  # type: ignore[attr-defined]  # FSDP2: DTensors

    start = 0
    if args.snapshot_every:  # a collective; at the first start one line says there is nothing yet
        got = snapshot.restore(like={"model": model, "opt": opt})  # DTensors on this model's mesh
        if got is not None:
            start, state = got[0], got[1]
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            client.load_state_dict(state.get("ft", {}))
            shards = [t for t in [*state["model"].values(), *(v for s in state["opt"]["state"].values()
                                                                for v in s.values())] if isinstance(t, DTensor)]
            where = "on the model's mesh" if all(t.device_mesh == mesh for t in shards) else "on other meshes"
            print(f"[rank {rank}] attempt {attempt}: resumed at step {start} (pid {os.getpid()}, from the snapshot "
                  f"in the monitor's memory; {len(shards)} DTensors {where})", flush=True)
    client.init_workload_monitoring()
    loss = torch.tensor(0.0)
    for step in range(start, args.steps):
        with client.section("step"):
            if hang and (rank, step, attempt) == (hang["rank"], hang["step"], hang["attempt"]):
                print(f"[rank {rank}] attempt {attempt}: hanging at step {step} (on purpose)", flush=True)
                write_metrics_to_stuck_filesystem()
            x, y = batch(step, rank)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if args.step_time:
                time.sleep(args.step_time)
        client.send_heartbeat()
        if args.snapshot_every and (step + 1) % args.snapshot_every == 0:
            snapshot.save(step + 1, {"model": model, "opt": opt, "step": step + 1, "ft": client.state_dict()})
        if die and (rank, step, attempt) == (die["rank"], die["step"], die["attempt"]):
            print(f"[rank {rank}] attempt {attempt}: killing myself at step {step} (on purpose)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    print(f"[rank {rank}] attempt {attempt}: finished {args.steps} steps, loss {loss.item()!r} (pid {os.getpid()})",
          flush=True)
    if args.snapshot_every:
        snapshot.wait()  # the last save may still use the side group: finish it before the groups go
    dist.destroy_process_group()
    client.shutdown_workload_monitoring()


if __name__ == "__main__":
    main()
