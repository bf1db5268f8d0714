"""A training whose loader hangs on one batch, for tests/integration/agent/test_agent_safety.py.

Argument: JSON ``{"num_workers": N, "stall_at": I, "stall_s": S}``: sample I sleeps S seconds
(and says so on stdout first); the others are instant, and each step sleeps 2 ms.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

CFG: dict[str, Any] = json.loads(sys.argv[1])


def emit(ev: str, **kw: Any) -> None:
    print("@@ " + json.dumps({"ev": ev, "t": time.monotonic_ns(), **kw}), flush=True)


class Stalling(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == CFG["stall_at"]:
            emit("stalling", index=i)
            time.sleep(CFG["stall_s"])
        return torch.zeros(2)


def main() -> None:
    emit("ready", pid=os.getpid())
    dl = DataLoader(Stalling(), batch_size=1, num_workers=CFG["num_workers"])
    for i, _batch in enumerate(dl):
        time.sleep(0.002)
        if i >= CFG["stall_at"] + 5:
            break
    emit("done")
    sys.stdin.readline()


if __name__ == "__main__":
    main()
