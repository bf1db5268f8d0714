"""Two loaders the user wrote over one dataset (train, and an evaluation of the training set),
both iterated: two rows, each named where it was built. Prints the rows as one JSON line."""

from __future__ import annotations

import json

import dlmon.agent

dlmon.agent.start()

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

data = torch.zeros(16, 2)
train = DataLoader(data, batch_size=2, shuffle=True)
train_eval = DataLoader(data, batch_size=8)
for _ in range(2):
    for _b in train:
        pass
    for _b in train_eval:
        pass
rows = [
    {k: r[k] for k in ("name", "batches_total", "iterated", "replaced_by")}
    for r in dlmon.agent.counters()["loaders"]
]
print(json.dumps(rows), flush=True)
