"""A small real Hugging Face Trainer run (CPU, DDP on gloo) with ft-monitor's Trainer callback.

    ft-launcher --nproc-per-node 2 --max-restarts 1 --ft-cfg-path examples/ft_hf.yaml \\
        examples/train_hf.py --ckpt-dir /tmp/ft-hf-ckpt --hang rank=1,step=12,attempt=0

The only ft-monitor line is the callback (``FtTrainerCallback()``); the rest is a plain
Trainer script: ``save_steps`` writes ``checkpoint-N`` every few steps, and
``train(resume_from_checkpoint=True)`` resumes from the last one after a restart. The model
is a torch module (no download: nothing reaches the Hub) whose ``forward`` returns the loss,
as the Trainer expects. The callback times every optimizer step as the ``step`` section and
every checkpoint write as ``checkpointing``, learns their timeouts before each checkpoint
and keeps them in it (``trainer_state.json``).

``--hang rank=R,step=S,attempt=A`` makes rank R hang in its training step S of attempt A
(TORCHELASTIC_RESTART_COUNT), in ``write_metrics_to_stuck_filesystem`` so that the stack
dump says where; ``--die rank=R,step=S,attempt=A`` makes it SIGKILL itself there instead.
``--grad-accum N`` accumulates gradients over N micro-batches a step. ``--snapshot-every K``
keeps an `ft_client.snapshot` every K steps (``FtTrainerCallback(snapshot_every=K)``), and the
restart resumes from the folder ``checkpoint_to_resume`` gives: the snapshot written out as
``checkpoint-N`` where it is newer than the last one saved. Each rank prints ``[rank R] attempt
A: resumed at step N`` and ``[rank R] attempt A: finished N steps, loss L``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

import ft_client
from ft_client.integrations.transformers import FtTrainerCallback


def write_metrics_to_stuck_filesystem() -> None:
    """Stands for an NFS write or a data-loader worker that never returns."""
    while True:
        time.sleep(1)


BATCH = 16


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


class Samples(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """512 fixed samples, as the Trainer's default collator takes them: a dict a sample."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(512, 16, generator=g), torch.randn(512, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Regression(nn.Module):
    """A torch module the Trainer accepts: ``forward`` takes the batch's keys and returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.net(x)
        if labels is None:
            return {"logits": out}
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


class SlowTrainer(Trainer):
    """The Trainer, with a training step that takes ``step_time`` longer (a real model's work)
    and can be made to hang (``hang``: rank, step, attempt)."""

    def __init__(self, *args: Any, step_time: float, hang: dict[str, int] | None, die: dict[str, int] | None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_time = step_time
        self.hang, self.die = hang, die
        self.last_loss = float("nan")

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        h = self.hang
        if h and (rank(), self.state.global_step, attempt()) == (h["rank"], h["step"], h["attempt"]):
            print(f"[rank {rank()}] hanging at step {self.state.global_step}", flush=True)
            write_metrics_to_stuck_filesystem()
        d = self.die
        if d and (rank(), self.state.global_step, attempt()) == (d["rank"], d["step"], d["attempt"]):
            print(f"[rank {rank()}] SIGKILL at step {self.state.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.step_time)
        loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)
        self.last_loss = loss.item()
        return loss


class Announce(TrainerCallback):
    """Says where each attempt starts (the Trainer has loaded the checkpoint by then)."""

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        print(f"[rank {rank()}] attempt {attempt()}: resumed at step {state.global_step}", flush=True)


def spec(text: str | None) -> dict[str, int] | None:
    if not text:
        return None
    parts = dict(item.split("=", 1) for item in text.split(","))
    return {k: int(parts[k]) for k in ("rank", "step", "attempt")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--ckpt-dir", default="/tmp/ft-hf-ckpt")
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--hang", default=None, help="rank=R,step=S,attempt=A")
    p.add_argument("--die", default=None, help="rank=R,step=S,attempt=A: the rank SIGKILLs itself there")
    p.add_argument("--snapshot-every", type=int, default=0, help="an in-memory snapshot every K steps (0: none)")
    args = p.parse_args()
    torch.manual_seed(0)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed and not dist.is_initialized():
        # on CPU (use_cpu=True) the Trainer does not pass ddp_timeout to init_process_group: a
        # group made here first, with the collective timeout ft-launcher checked, is used as it is
        dist.init_process_group("gloo", timeout=ft_client.process_group_timeout() or timedelta(minutes=5))
    training_args = TrainingArguments(
        output_dir=args.ckpt_dir, max_steps=args.steps, save_steps=args.ckpt_every,
        per_device_train_batch_size=BATCH, gradient_accumulation_steps=args.grad_accum,
        learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", seed=0,
        use_cpu=True, ddp_backend="gloo" if distributed else None, report_to=[], disable_tqdm=True,
        logging_steps=10, dataloader_num_workers=0, ddp_find_unused_parameters=False,
    )
    ft = FtTrainerCallback(snapshot_every=args.snapshot_every)
    trainer = SlowTrainer(model=Regression(), args=training_args, train_dataset=Samples(),
                          callbacks=[ft, Announce()], step_time=args.step_time,
                          hang=spec(args.hang), die=spec(args.die))
    trainer.train(resume_from_checkpoint=ft.checkpoint_to_resume(trainer))  # None: a fresh start
    print(f"[rank {rank()}] attempt {attempt()}: finished {trainer.state.global_step} steps, "
          f"loss {trainer.last_loss:.6f}", flush=True)
    # The process group is left to ft_client's exit teardown, which waits for gloo's worker threads
    # to be idle first: destroyed here, the model freed when main() returns could run the group's
    # destructor with the GIL held while a gloo worker waited for the GIL, and the rank never
    # exited (seen in the test command's run; docs/integrations.md, the DCP section).


if __name__ == "__main__":
    main()
