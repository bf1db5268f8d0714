"""A loader built with a batch_sampler: its batch size cannot be tuned, its workers can."""

import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

data = TensorDataset(torch.randn(20_000, 8))
loader = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 32, False), num_workers=0)
while True:
    for (x,) in loader:
        x.sum()
