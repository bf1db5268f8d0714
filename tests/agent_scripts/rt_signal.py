"""A training whose workers idle, for tests/integration/deaths/test_stack_dumps_and_kernel_log.py.

Argument: JSON ``{"mode": ...}``:
- ``user_handler``: the program handles the stack signal itself (SIGRTMIN+7 here): its handler
  appends a line to ``marker``; workers are forked with it in place.
Prints ``@@ {"ev": "pids", "pid": trainer, "workers": [...]}`` once the workers run, then waits
for a line on stdin.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

CFG: dict[str, Any] = json.loads(sys.argv[1])


def on_user_signal(signum: int, frame: Any) -> None:
    with open(CFG["marker"], "a") as f:
        f.write(f"{os.getpid()}\n")


class Idle(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.05)
        return torch.zeros(2)


def main() -> None:
    if CFG["mode"] == "user_handler":
        signal.signal(signal.SIGRTMIN + 7, on_user_signal)
    dl = DataLoader(Idle(), batch_size=1, num_workers=2)
    it = iter(dl)
    next(it)
    workers = [w.pid for w in it._workers]  # type: ignore[attr-defined]
    print("@@ " + json.dumps({"ev": "pids", "pid": os.getpid(), "workers": workers}), flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
