"""A small DDP training for the screenshot of a torchrun job: gloo on CPU, each rank a
DistributedSampler over a tensor dataset with 2 DataLoader workers, a conv net wrapped in
DistributedDataParallel, for up to SECONDS (default 600). Run by regenerate.py as
``dlmon run -- python -m torch.distributed.run --nproc_per_node 2 ddp_job.py``."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 600.0
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = TensorDataset(torch.rand(4096, 3, 32, 32), torch.randint(0, 10, (4096,)))
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=32, sampler=sampler, num_workers=2, persistent_workers=True)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 32 * 32, 10))
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    end = time.monotonic() + seconds
    epoch = 0
    while time.monotonic() < end:
        epoch += 1
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            time.sleep(0.03)
            if rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step}", flush=True)
            if time.monotonic() >= end:
                break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
