"""Samples are slices of one tensor (free); the training step costs ~5 ms: workers do not help."""

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    data = TensorDataset(torch.randn(50_000, 64))
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=a.batch_size, num_workers=a.workers, shuffle=True)
    w = torch.randn(384, 384)
    while True:
        for (x,) in loader:
            for _ in range(12):  # the "model": compute that does not depend on the input pipeline
                w = torch.tanh(w @ w * 0.01)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


if __name__ == "__main__":
    main()
