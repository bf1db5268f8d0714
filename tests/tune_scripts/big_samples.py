"""Samples of 1 MiB each: with workers, every batch travels through /dev/shm."""

import argparse

import torch
from torch.utils.data import DataLoader, Dataset


class Big(Dataset):
    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        return torch.full((256 * 1024,), float(i % 5))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=4)
    a = p.parse_args()
    loader = DataLoader(Big(), batch_size=a.batch_size, num_workers=0)
    while True:
        for x in loader:
            x.sum()


if __name__ == "__main__":
    main()
