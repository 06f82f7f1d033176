"""A small real PyTorch Lightning run (CPU, DDP on gloo) with ft-monitor's Lightning callback.

    ft-launcher --nproc-per-node 2 --max-restarts 1 --ft-cfg-path examples/ft_lightning.yaml \\
        examples/train_lightning.py --ckpt-dir /tmp/ft-pl-ckpt --hang rank=1,step=12,attempt=0

The only ft-monitor line is the callback (``FtCallback()``); the rest is a plain Lightning
script: a ``ModelCheckpoint`` that keeps ``last.ckpt`` every few steps, and ``fit(...,
ckpt_path="last")``, which resumes from it after a restart. The callback times every batch
as the ``step`` section and every checkpoint write as ``checkpointing``, learns their
timeouts after each checkpoint and keeps them in the checkpoint.

``--hang rank=R,step=S,attempt=A`` makes rank R hang in its training step S of attempt A
(TORCHELASTIC_RESTART_COUNT), in ``write_metrics_to_stuck_filesystem`` so that the stack
dump says where. Each rank prints ``[rank R] attempt A: resumed at step N`` and ``[rank R]
attempt A: finished N steps``.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ft_client
from ft_client.integrations.lightning import FtCallback


def write_metrics_to_stuck_filesystem() -> None:
    """Stands for an NFS write or a data-loader worker that never returns."""
    while True:
        time.sleep(1)


class Regression(L.LightningModule):
    def __init__(self, step_time: float, hang: dict[str, int] | None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.step_time = step_time
        self.hang = hang

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        h, attempt = self.hang, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if h and (self.global_rank, self.global_step, attempt) == (h["rank"], h["step"], h["attempt"]):
            print(f"[rank {self.global_rank}] hanging at step {self.global_step}", flush=True)
            write_metrics_to_stuck_filesystem()
        time.sleep(self.step_time)
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def on_train_start(self) -> None:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        print(f"[rank {self.global_rank}] attempt {attempt}: resumed at step {self.global_step}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--ckpt-dir", default="/tmp/ft-pl-ckpt")
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--hang", default=None, help="rank=R,step=S,attempt=A")
    args = p.parse_args()
    hang = None
    if args.hang:
        parts = dict(item.split("=", 1) for item in args.hang.split(","))
        hang = {k: int(parts[k]) for k in ("rank", "step", "attempt")}
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 16), torch.randn(512, 1))
    pg_timeout = ft_client.process_group_timeout() or timedelta(minutes=5)
    ckpt = ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, every_n_train_steps=args.ckpt_every,
                           save_top_k=0)
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", os.environ.get("NNODES", "1")) or 1),
        strategy=DDPStrategy(process_group_backend="gloo", timeout=pg_timeout),
        max_steps=args.steps, callbacks=[FtCallback(), ckpt], logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    last = Path(args.ckpt_dir) / "last.ckpt"
    trainer.fit(Regression(args.step_time, hang), DataLoader(data, batch_size=16, shuffle=False),
                ckpt_path="last" if last.is_file() else None)
    print(f"[rank {trainer.global_rank}] attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}: "
          f"finished {trainer.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
