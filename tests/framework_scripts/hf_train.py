"""A plain Hugging Face Trainer job on CPU: a tiny model, a map-style dataset, DataLoader workers
(``dataloader_num_workers``), evaluation every few steps. No hub download (HF_HUB_OFFLINE=1).

Usage: hf_train.py OUT.json
It times its own steps (a TrainerCallback) and writes them to OUT.json. Nothing in it knows dlmon.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

OUT = sys.argv[1]


class Samples(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((8,), float(i % 5)), "labels": torch.tensor(float(i % 3))}


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        time.sleep(0.06)  # the "GPU" step: 120 steps last ~8 s, a steady span of a dozen 0.5 s readings
        out = self.net(x).squeeze(-1)
        loss = torch.nn.functional.mse_loss(out, labels) if labels is not None else out.sum()
        return {"loss": loss, "logits": out}


class StepClock(TrainerCallback):
    def __init__(self) -> None:
        self.starts: list[float] = []
        self.epochs = 0

    def on_step_begin(self, *_a: object, **_k: object) -> None:
        self.starts.append(time.time())

    def on_epoch_end(self, *_a: object, **_k: object) -> None:
        self.epochs += 1


clock = StepClock()
with tempfile.TemporaryDirectory() as out_dir:
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        num_train_epochs=2,
        dataloader_num_workers=2,
        eval_strategy="steps",
        eval_steps=40,
        save_strategy="no",
        report_to=[],
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=Tiny(), args=args, train_dataset=Samples(240), eval_dataset=Samples(24), callbacks=[clock]
    )
    t0 = time.time()
    trainer.train()
    t1 = time.time()
with open(OUT, "w") as f:
    json.dump({"train_batch_starts": clock.starts, "epochs": clock.epochs, "t0": t0, "t1": t1}, f)
time.sleep(1.0)  # so that the last reading sees the end of the job
