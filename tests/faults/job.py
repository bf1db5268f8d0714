"""A real training job for the fault suite and benchmarks/faults.py, configured by one JSON argument.

A tiny model trained on generated data through a real torch DataLoader with worker processes.
Every ``report_s`` it prints ``@@ {"ev": "progress", "batches": N, "t": monotonic}`` so a test
can compute the training's own batches/s over any window (with and without a fault). Options:
workers, persistent, epochs (0: forever), batches (per epoch), batch, sample_sleep_s, dim,
leak_mb_per_epoch (kept in the main process, from leak_from_s until leak_until_s seconds after
the start when that is set, then freed), io_burst_every (epochs) and io_burst_mb (written
and fsynced), agent (start dlmon.agent in the script).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

CFG: dict[str, Any] = {
    "workers": 2, "persistent": True, "epochs": 0, "batches": 40, "batch": 16, "sample_sleep_s": 0.0,
    "dim": 64, "leak_mb_per_epoch": 0, "io_burst_every": 0, "io_burst_mb": 32, "agent": False,
    "report_s": 0.2, "leak_from_s": 0.0, "leak_until_s": 0.0,
}  # fmt: skip
CFG.update(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})

if CFG["agent"]:
    import dlmon.agent

    dlmon.agent.start()

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

torch.set_num_threads(1)


class Generated(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int, dim: int, sleep_s: float) -> None:
        self.n, self.dim, self.sleep_s = n, dim, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        g = torch.Generator().manual_seed(i)
        return torch.randn(self.dim, generator=g), torch.tensor(i % 2)


def emit(ev: str, **kw: Any) -> None:
    print("@@ " + json.dumps({"ev": ev, "t": time.monotonic(), **kw}), flush=True)


def main() -> None:
    dim = int(CFG["dim"])
    data = Generated(int(CFG["batches"]) * int(CFG["batch"]), dim, float(CFG["sample_sleep_s"]))
    workers = int(CFG["workers"])
    loader = DataLoader(
        data,
        batch_size=int(CFG["batch"]),
        num_workers=workers,
        persistent_workers=bool(CFG["persistent"]) and workers > 0,
        shuffle=True,
    )
    model = torch.nn.Sequential(torch.nn.Linear(dim, 128), torch.nn.ReLU(), torch.nn.Linear(128, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    leak: list[bytearray] = []
    batches = 0
    last = time.monotonic()
    epoch = 0
    started = time.monotonic()
    emit("start", pid=os.getpid())
    while CFG["epochs"] == 0 or epoch < int(CFG["epochs"]):
        emit("epoch", epoch=epoch)
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            batches += 1
            now = time.monotonic()
            if now - last >= float(CFG["report_s"]):
                emit("progress", batches=batches, epoch=epoch)
                last = now
        epoch += 1
        age = time.monotonic() - started
        until = float(CFG["leak_until_s"])
        if until and age >= until and leak:
            leak.clear()  # the leak is fixed: memory comes back
            emit("leak_freed", epoch=epoch)
        if CFG["leak_mb_per_epoch"] and float(CFG["leak_from_s"]) <= age and (not until or age < until):
            chunk = bytearray(int(CFG["leak_mb_per_epoch"]) << 20)
            for i in range(0, len(chunk), 4096):
                chunk[i] = 1
            leak.append(chunk)
        if CFG["io_burst_every"] and epoch % int(CFG["io_burst_every"]) == 0:
            with tempfile.NamedTemporaryFile(dir=os.environ.get("DLMON_JOB_TMP")) as fh:
                block = os.urandom(1 << 20)
                for _ in range(int(CFG["io_burst_mb"])):
                    fh.write(block)
                fh.flush()
                os.fsync(fh.fileno())
    emit("progress", batches=batches, epoch=epoch)
    emit("done", batches=batches)


if __name__ == "__main__":
    main()
