"""A plain Lightning job: a train loader and a validation loader, as a user writes them.

Usage: lightning_train.py OUT.json [--persistent] [--epochs N] [--slow-train]
It times its own training steps (a Callback) and writes them to OUT.json: the truth that dlmon's
figures are compared with. Nothing in it knows about dlmon.
"""

from __future__ import annotations

import json
import sys
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

OUT = sys.argv[1]
PERSISTENT = "--persistent" in sys.argv
EPOCHS = int(sys.argv[sys.argv.index("--epochs") + 1]) if "--epochs" in sys.argv else 4
SLOW_TRAIN = "--slow-train" in sys.argv  # the training itself waits on its loader


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int, sleep_s: float) -> None:
        self.n = n
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.sleep_s)
        return torch.full((8,), float(i % 7)), torch.tensor(float(i % 3))


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _i: int) -> torch.Tensor:
        time.sleep(0.04)  # the "GPU" step: the training is compute-bound, not input-bound
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _i: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepClock(L.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []
        self.epochs = 0

    def on_train_batch_start(self, *_a: object) -> None:
        self.starts.append(time.time())

    def on_train_epoch_end(self, *_a: object) -> None:
        self.epochs += 1


train_loader = DataLoader(
    Samples(160, 0.04 if SLOW_TRAIN else 0.0), batch_size=4, num_workers=2, persistent_workers=PERSISTENT
)
val_loader = DataLoader(Samples(20, 0.008), batch_size=4, num_workers=1, persistent_workers=PERSISTENT)
clock = StepClock()
trainer = L.Trainer(
    max_epochs=EPOCHS,
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    callbacks=[clock],
)
t0 = time.time()
trainer.fit(Model(), train_dataloaders=train_loader, val_dataloaders=val_loader)
with open(OUT, "w") as f:
    json.dump({"train_batch_starts": clock.starts, "epochs": clock.epochs, "t0": t0, "t1": time.time()}, f)
time.sleep(1.0)  # so that the last reading sees the end of the job
