"""Keeps the last 64 steps' 'activations' (batch_size x 64 KiB each): memory ramps up over ~3 s to
batch_size x 4 MiB and stays there. Batch 8: 32 MiB; batch 256: 1 GiB."""

import argparse
import time

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
            kept.append(torch.ones(x.shape[0], 16 * 1024))  # 64 KiB per sample
            del kept[:-64]
            time.sleep(0.05)


if __name__ == "__main__":
    main()
