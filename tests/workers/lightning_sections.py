"""A Lightning script written for nvidia-resiliency-ext's ``FaultToleranceSectionsCallback``,
run under ft-launcher without the config that lists its sections (``--ft-cfg-path`` forgotten):
the callback refuses at ``setup``. Used by tests/test_lightning_e2e.py."""

from __future__ import annotations

import os

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ft_client.integrations.lightning import FaultToleranceSectionsCallback


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    print(f"attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}: starting", flush=True)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                        strategy=DDPStrategy(process_group_backend="gloo"), max_steps=4, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[FaultToleranceSectionsCallback(autoresume=False, calculate_timeouts=True)])
    trainer.fit(Tiny(), DataLoader(data, batch_size=4))


if __name__ == "__main__":
    main()
