"""A small real training for the death-verdict screenshot: a tensor dataset, 3 DataLoader workers
(persistent, so the one killed is mid-epoch), a conv net, for up to SECONDS (default 600).
regenerate.py SIGKILLs one of its workers; torch then raises in this trainer ("DataLoader worker
... is killed by signal") and the job dies of it, as a real one would."""

from __future__ import annotations

import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 600.0
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = TensorDataset(torch.rand(8192, 3, 32, 32), torch.randint(0, 10, (8192,)))
    loader = DataLoader(data, batch_size=64, shuffle=True, num_workers=3, persistent_workers=True)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 32 * 32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    end = time.monotonic() + seconds
    epoch = 0
    while time.monotonic() < end:
        epoch += 1
        for step, (x, y) in enumerate(loader):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            time.sleep(0.02)
            if step % 20 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.3f}", flush=True)
            if time.monotonic() >= end:
                break


if __name__ == "__main__":
    main()
