"""A tiny DDP training under torchrun (gloo, CPU): DistributedDataParallel over a linear model, a
DataLoader with 2 workers per rank. ``--slow-rank R --sleep-ms M`` makes rank R's dataset sleep M ms
per sample (a slower disk or decoder on that rank only; with ``--slow-when FILE``, only while FILE
exists); the other ranks then wait in the all-reduce, outside their loaders. The rest of each step
sleeps ``--step-ms``. Runs for ``--seconds`` and prints each rank's own step timing."""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset


class Samples(Dataset[torch.Tensor]):
    def __init__(self, sleep_s: float, slow_when: str | None = None) -> None:
        self.sleep_s = sleep_s
        self.slow_when = slow_when

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.sleep_s and (self.slow_when is None or os.path.exists(self.slow_when)):
            time.sleep(self.sleep_s)
        return torch.full((16,), float(i % 7))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--sleep-ms", type=float, default=0.0)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--slow-rank-workers", type=int, default=2, help="num_workers on the slow rank")
    ap.add_argument("--every-rank-ms", type=float, default=0.0, help="every rank's dataset sleeps this")
    ap.add_argument("--slow-when", metavar="FILE", help="the slow rank sleeps only while FILE exists")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sleep_s = (args.every_rank_ms + (args.sleep_ms if rank == args.slow_rank else 0.0)) / 1000
    model = DistributedDataParallel(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    workers = args.slow_rank_workers if rank == args.slow_rank else 2
    loader = DataLoader(
        Samples(sleep_s, args.slow_when), batch_size=8, num_workers=workers, persistent_workers=True
    )
    steps = 0
    start = time.monotonic()
    end = start + args.seconds
    while time.monotonic() < end:
        for batch in loader:
            opt.zero_grad()
            model(batch).sum().backward()  # the gradient all-reduce: fast ranks wait here
            opt.step()
            time.sleep(args.step_ms / 1000)  # the rest of the step
            steps += 1
            # every rank must run the same number of steps: rank 0 decides when to stop
            done = torch.tensor([1 if time.monotonic() >= end else 0])
            dist.broadcast(done, 0)
            if done.item():
                break
        else:
            continue
        break
    print(f"rank {rank} pid {os.getpid()} steps {steps} steps_per_s {steps / (time.monotonic() - start):.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
