"""Two ranks started by torch.multiprocessing.spawn, each iterating a DataLoader.

Run with the bootstrap directory on PYTHONPATH. Each rank reports its pid and its workers'
pids, then waits until the file named by the first argument exists.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch.multiprocessing as mp
from torch.utils.data import DataLoader


def emit(ev: str, **kw: Any) -> None:
    print("@@ " + json.dumps({"ev": ev, "t": time.monotonic_ns(), **kw}), flush=True)


def rank_main(rank: int, go_path: str) -> None:
    dl = DataLoader(list(range(40)), batch_size=4, num_workers=1)
    n = sum(1 for _ in dl)
    it = iter(dl)
    next(it)
    emit("rank", rank=rank, pid=os.getpid(), batches=n + 1, worker_pids=[w.pid for w in it._workers])
    while not os.path.exists(go_path):
        time.sleep(0.05)


if __name__ == "__main__":
    emit("ready", pid=os.getpid())
    mp.spawn(rank_main, args=(sys.argv[1],), nprocs=2, join=True)
    emit("done")
