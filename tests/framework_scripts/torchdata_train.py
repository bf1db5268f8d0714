"""A plain torchdata StatefulDataLoader loop (as torchtitan uses it): workers, epochs ended by
StopIteration, a checkpoint of the loader's state each epoch.

Usage: torchdata_train.py OUT.json
It times its own steps and writes them to OUT.json. Nothing in it knows about dlmon.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

OUT = sys.argv[1]


class Samples(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 160

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((8,), float(i))


loader = StatefulDataLoader(Samples(), batch_size=4, num_workers=2, persistent_workers=True)
starts: list[float] = []
epochs = 0
t0 = time.time()
for _epoch in range(4):
    for batch in loader:
        starts.append(time.time())
        time.sleep(0.04)  # the "GPU" step
        batch.sum()
    epochs += 1
    state = loader.state_dict()  # what a checkpoint saves
t1 = time.time()
with open(OUT, "w") as f:
    json.dump({"train_batch_starts": starts, "epochs": epochs, "t0": t0, "t1": t1}, f)
time.sleep(1.0)  # so that the last reading sees the end of the job
