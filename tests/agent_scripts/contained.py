"""A training job for tests/integration/agent/test_agent_container.py, in new pid and mount namespaces.

It starts the agent itself, iterates a DataLoader with two persistent workers forever, and
reports ``@@ {json}`` lines on stdout: ``started`` with its own pid and its workers' pids as it
sees them (of its namespace), and ``worker_lost`` when a worker was killed (it then idles, so
that its agent can still be read).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import dlmon.agent

dlmon.agent.start()

import torch  # noqa: E402 -- after start(), as a user would write it
from torch.utils.data import DataLoader, Dataset  # noqa: E402


def emit(ev: str, **kw: Any) -> None:
    print("@@ " + json.dumps({"ev": ev, **kw}), flush=True)


class Slow(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 10**9

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.002)
        return torch.zeros(8)


def main() -> None:
    loader = DataLoader(Slow(), batch_size=4, num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    emit("started", pid=os.getpid(), worker_pids=[int(w.pid) for w in it._workers])  # type: ignore[attr-defined]
    try:
        while True:
            next(it)
            time.sleep(0.01)
    # a worker killed: "DataLoader worker (pid(s) ...) exited unexpectedly", or, when the main
    # process was reading that worker's pipe as it died, ConnectionResetError
    except (RuntimeError, OSError) as exc:
        emit("worker_lost", error=str(exc)[:200])
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
