"""A DataLoader job whose worker 1 SIGKILLs itself after ~60 batches, then the trainer lives on.

    python worker_death_job.py SECONDS

torch raises in the trainer when the worker dies (from its SIGCHLD handler, once per worker
that exits, wherever the trainer is): every RuntimeError is swallowed so the job keeps running
for SECONDS with the iterator alive, as a training that handles the error would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

KILL_AT_INDEX = 16 * 60


class SelfKilling(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        if info is not None and info.id == 1 and i >= KILL_AT_INDEX:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.zeros(16)


def sleep_until(end: float) -> None:
    while time.monotonic() < end:
        with contextlib.suppress(RuntimeError):
            time.sleep(0.2)


def main() -> None:
    end = time.monotonic() + float(sys.argv[1])
    held = []
    try:
        it = iter(DataLoader(SelfKilling(), batch_size=16, num_workers=2))
        held.append(it)
        for _ in it:
            time.sleep(0.02)
            if time.monotonic() >= end:
                return
    except RuntimeError:
        pass
    sleep_until(end)


if __name__ == "__main__":
    main()
