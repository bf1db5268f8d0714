"""Keeps every batch's 'activations' (batch_size x 256 KiB) forever: memory grows with the batch size."""

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=8)
    a = p.parse_args()
    torch.set_num_threads(1)
    loader = DataLoader(TensorDataset(torch.randn(4096, 8)), batch_size=a.batch_size, shuffle=True)
    kept = []
    while True:
        for (x,) in loader:
            kept.append(torch.ones(x.shape[0], 64 * 1024))  # 256 KiB per sample, never freed
            if len(kept) % 4 == 0:
                import time

                time.sleep(0.01)


if __name__ == "__main__":
    main()
