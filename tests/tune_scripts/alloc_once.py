"""Allocates batch_size x 4 MiB once, at the first batch, and then stays flat (issue 26: batch 64 was
stopped as 'would OOM' in a 700 MiB cgroup although it runs for good at ~0.4 GiB)."""

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
    buffer = None
    while True:
        for (x,) in loader:
            if buffer is None:
                buffer = torch.ones(x.shape[0], 1024 * 1024)  # 4 MiB per sample, once
            time.sleep(0.05)


if __name__ == "__main__":
    main()
