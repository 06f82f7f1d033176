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
dump says where; ``--die rank=R,step=S,attempt=A`` makes it SIGKILL itself there instead,
and ``--raise rank=R,step=S,attempt=A`` raise a RuntimeError.
``--workers N`` loads batches in N data-loader worker processes (started by ``--worker-start
fork`` or ``spawn``); ``--worker-hang rank=R,step=S,attempt=A`` makes the worker loading rank
R's batch S hang instead, the rank waiting for it. ``--snapshot-every K`` keeps an
`ft_client.snapshot` of Lightning's checkpoint every K steps (``FtCallback(snapshot_every=K)``),
which a restart resumes from where it is newer than ``last.ckpt``. ``--compile BACKEND``
compiles the model (torch.compile): its first steps take far longer than the rest, which a
`warmup` entry in the config times (examples/ft_lightning_compile.yaml). Each rank prints
``[rank R] attempt A: resumed at step N`` and ``[rank R] attempt A: finished N steps, loss L``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader

import ft_client
from ft_client.integrations.lightning import FtCallback


def write_metrics_to_stuck_filesystem() -> None:
    """Stands for an NFS write or a data-loader worker that never returns."""
    while True:
        time.sleep(1)


BATCH = 16


class Samples(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """512 fixed samples; with ``hang``, rank R's data-loader worker that loads its batch S (of
    attempt A) hangs at that batch's first sample. A worker's batches are every Wth of its rank's
    (W workers, in turn), so worker S % W hangs after loading S // W batches."""

    def __init__(self, hang: dict[str, int] | None) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(512, 16, generator=g), torch.randn(512, 1, generator=g)
        self.hang = hang
        self.loaded = 0  # samples this copy (one per worker) has loaded

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, worker = self.hang, torch.utils.data.get_worker_info()
        if h and worker is not None and int(os.environ.get("RANK", "-1")) == h["rank"] \
                and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == h["attempt"] \
                and worker.id == h["step"] % worker.num_workers \
                and self.loaded == h["step"] // worker.num_workers * BATCH:
            print(f"[rank {h['rank']}] data-loader worker pid {os.getpid()} hanging at batch {h['step']}", flush=True)
            write_metrics_to_stuck_filesystem()
        self.loaded += 1
        return self.x[i], self.y[i]


class Regression(L.LightningModule):
    def __init__(self, step_time: float, hang: dict[str, int] | None, compile_backend: str | None = None,
                 die: dict[str, int] | None = None, fail: dict[str, int] | None = None) -> None:
        super().__init__()
        self.die = die
        self.fail = fail
        self.last_loss = float("nan")
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        if compile_backend:
            self.net = torch.compile(self.net, backend=compile_backend)  # type: ignore[assignment]
        self.step_time = step_time
        self.hang = hang
        self.took: list[float] = []
        self._began = 0.0

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        self._began = time.monotonic()

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        self.took.append(time.monotonic() - self._began)

    def on_train_end(self) -> None:
        if self.took:
            later = max(self.took[3:], default=0.0)
            print(f"[rank {self.global_rank}] first step took {self.took[0]:.3f} s, the slowest after the "
                  f"third {later:.3f} s", flush=True)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        h, attempt = self.hang, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if h and (self.global_rank, self.global_step, attempt) == (h["rank"], h["step"], h["attempt"]):
            print(f"[rank {self.global_rank}] hanging at step {self.global_step}", flush=True)
            write_metrics_to_stuck_filesystem()
        d = self.die
        if d and (self.global_rank, self.global_step, attempt) == (d["rank"], d["step"], d["attempt"]):
            print(f"[rank {self.global_rank}] SIGKILL at step {self.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        f = self.fail
        if f and (self.global_rank, self.global_step, attempt) == (f["rank"], f["step"], f["attempt"]):
            raise RuntimeError(f"rank {self.global_rank} failed at step {self.global_step} (on purpose)")
        time.sleep(self.step_time)
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.last_loss = loss.item()
        self.log("loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def on_train_start(self) -> None:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        print(f"[rank {self.global_rank}] attempt {attempt}: resumed at step {self.global_step}", flush=True)


def spec(text: str | None) -> dict[str, int] | None:
    if not text:
        return None
    parts = dict(item.split("=", 1) for item in text.split(","))
    return {k: int(parts[k]) for k in ("rank", "step", "attempt")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--ckpt-dir", default="/tmp/ft-pl-ckpt")
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--hang", default=None, help="rank=R,step=S,attempt=A")
    p.add_argument("--die", default=None, help="rank=R,step=S,attempt=A: the rank SIGKILLs itself there")
    p.add_argument("--raise", dest="fail", default=None, help="rank=R,step=S,attempt=A: the rank raises there")
    p.add_argument("--snapshot-every", type=int, default=0, help="an in-memory snapshot every K steps (0: none)")
    p.add_argument("--workers", type=int, default=0, help="data-loader worker processes")
    p.add_argument("--worker-start", choices=("fork", "spawn"), default="fork")
    p.add_argument("--worker-hang", default=None, help="rank=R,step=S,attempt=A: a data-loader worker hangs")
    p.add_argument("--compile", default=None, metavar="BACKEND", help="torch.compile the model (inductor, aot_eager)")
    args = p.parse_args()
    hang, worker_hang = spec(args.hang), spec(args.worker_hang)
    torch.manual_seed(0)
    data = Samples(worker_hang)
    pg_timeout = ft_client.process_group_timeout() or timedelta(minutes=5)
    ckpt = ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, every_n_train_steps=args.ckpt_every,
                           save_top_k=0)
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", os.environ.get("NNODES", "1")) or 1),
        strategy=DDPStrategy(process_group_backend="gloo", timeout=pg_timeout),
        max_steps=args.steps, callbacks=[FtCallback(snapshot_every=args.snapshot_every), ckpt], logger=False,
        enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    last = Path(args.ckpt_dir) / "last.ckpt"
    loader = DataLoader(data, batch_size=BATCH, shuffle=False, num_workers=args.workers,
                        multiprocessing_context=args.worker_start if args.workers else None,
                        persistent_workers=args.workers > 0)
    model = Regression(args.step_time, hang, args.compile, spec(args.die), spec(args.fail))
    trainer.fit(model, loader, ckpt_path="last" if last.is_file() else None)
    print(f"[rank {trainer.global_rank}] attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}: "
          f"finished {trainer.global_step} steps, loss {model.last_loss:.6f}", flush=True)


if __name__ == "__main__":
    main()
