"""A small real DDP training run (CPU, gloo) instrumented with ft_client.

    ft-launcher --nproc-per-node 2 --max-restarts 2 --ft-cfg-path examples/ft.yaml \\
        examples/train_ddp.py --ckpt-dir /tmp/ft-demo-ckpt --hang rank=1,step=12,attempt=0

What it shows:
* `step` and `ckpt` sections and a heartbeat per step;
* learned timeouts: at every checkpoint after the first the client learns the
  step and ckpt timeouts from what all ranks observed, and keeps them in the
  checkpoint (three lines: load_state_dict, calculate_and_set_section_timeouts,
  state_dict);
* resuming from the last checkpoint after a restart;
* ``--hang rank=R,step=S,attempt=A`` (or env FT_DEMO_HANG) makes rank R hang at
  step S of attempt A (TORCHELASTIC_RESTART_COUNT; -1: every attempt), in a function named
  ``write_metrics_to_stuck_filesystem`` so the stack dump says where.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ft_client
from ft_client import RankMonitorClient


def parse_spec(text: str | None) -> dict[str, int] | None:
    if not text:
        return None
    parts = dict(item.split("=", 1) for item in text.split(","))
    return {k: int(parts[k]) for k in ("rank", "step", "attempt")}


def write_metrics_to_stuck_filesystem() -> None:
    """Stands for an NFS write or a data-loader worker that never returns."""
    while True:
        time.sleep(3600)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(64, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--ckpt-dir", default="/tmp/ft-demo-ckpt")
    p.add_argument("--step-time", type=float, default=0.05, help="extra seconds of 'work' per step")
    p.add_argument("--hang", default=os.environ.get("FT_DEMO_HANG"), help="rank=R,step=S,attempt=A")
    p.add_argument("--crash", default=None, help="rank=R,step=S,attempt=A: raise an error there")
    p.add_argument("--control", default=os.environ.get("FT_DEMO_CONTROL"), metavar="STEP:ACTION",
                   help="local rank 0 sends a workload control request (ShutdownWorkload, ExcludeThisNode) at "
                        "STEP of the first attempt (or env FT_DEMO_CONTROL, e.g. set for one node only)")
    args = p.parse_args()

    # the configured process_group_timeout (checked at launch against the monitor's timeouts)
    dist.init_process_group("gloo", timeout=ft_client.process_group_timeout())
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    hang = parse_spec(args.hang)
    crash = parse_spec(args.crash)
    ckpt_path = Path(args.ckpt_dir) / "ckpt.pt"

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    client = RankMonitorClient()

    start = 0
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start = ckpt["step"]
        client.load_state_dict(ckpt.get("ft", {}))  # learned timeouts from the last run
        print(f"[rank {rank}] attempt {attempt}: resumed at step {start}", flush=True)
    client.init_workload_monitoring()
    learned = sorted(client.timeouts.learned)
    print(f"[rank {rank}] attempt {attempt}: timeouts in force {client.timeouts.to_wire()}"
          + (f" (learned: {', '.join(learned)})" if learned else ""), flush=True)

    loss = torch.tensor(0.0)
    for step in range(start, args.steps):
        with client.section("step"):
            x, y = batch(step, rank)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(args.step_time)
            if hang and (rank, step) == (hang["rank"], hang["step"]) and hang["attempt"] in (attempt, -1):
                print(f"[rank {rank}] attempt {attempt}: hanging at step {step} (on purpose)", flush=True)
                write_metrics_to_stuck_filesystem()
        client.send_heartbeat()
        if crash and (rank, step) == (crash["rank"], crash["step"]) and crash["attempt"] in (attempt, -1):
            raise RuntimeError(f"rank {rank} crashed at step {step} (on purpose)")
        if args.control and attempt == 0:
            at, action = args.control.split(":")
            if step == int(at) and os.environ.get("LOCAL_RANK") == "0":
                client.send_workload_control_request(action, f"demo: requested at step {step}")
                time.sleep(3600)  # the launcher stops us
        if (step + 1) % args.ckpt_every == 0:
            # Learn timeouts from what every rank observed (a collective); not
            # enough data yet (no checkpoint section completed) is not an error.
            client.calculate_and_set_section_timeouts(calc_out_of_section=False, skip_if_not_ready=True)
            with client.section("ckpt"):
                if rank == 0:
                    ckpt_path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = ckpt_path.with_suffix(".tmp")
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                                "ft": client.state_dict()}, tmp)
                    os.replace(tmp, ckpt_path)
                dist.barrier()
    print(f"[rank {rank}] attempt {attempt}: finished {args.steps} steps, loss {loss.item():.4f}", flush=True)
    client.shutdown_workload_monitoring()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
