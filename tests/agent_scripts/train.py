"""A small training-like job for tests/integration/agent/test_agent.py, configured by one JSON argument.

It reports what it knows about itself (its own batch counts and timestamps, its iterators'
worker pids) as lines ``@@ {json}`` on stdout, and waits for commands on stdin at the points
where the test polls the agent, so that the test compares the agent with the script's truth.
The agent is started by the bootstrap sitecustomize on PYTHONPATH, or by the script itself
when the config says ``"start": true``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

CFG: dict[str, Any] = json.loads(sys.argv[1])

if CFG.get("start"):
    import dlmon.agent

    dlmon.agent.start()

import torch  # noqa: E402 -- after start(), as a user would write it
from torch.utils.data import DataLoader, Dataset, get_worker_info  # noqa: E402


def emit(ev: str, **kw: Any) -> None:
    print("@@ " + json.dumps({"ev": ev, "t": time.monotonic_ns(), **kw}), flush=True)


def wait_cmd() -> str:
    return sys.stdin.readline().strip()


def here() -> int:
    return sys._getframe(1).f_lineno


class SleepDataset(Dataset[torch.Tensor]):
    """Sleeps a known time per sample; each sample carries its index and the worker that made it."""

    def __init__(self, n: int, sleep_s: float) -> None:
        self.n = n
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        info = get_worker_info()
        return torch.tensor([float(i), float(info.id if info is not None else -1)])


def worker_pids(it: Any) -> list[int]:
    return [int(w.pid) for w in getattr(it, "_workers", [])]


def mode_rate() -> None:
    """Iterate for run_s seconds; log every batch's call and return times and its worker."""
    nw, bs = CFG["num_workers"], CFG["batch_size"]
    ds = SleepDataset(100_000, CFG["sample_sleep_s"])
    dl, site = DataLoader(ds, batch_size=bs, num_workers=nw), here()
    it = iter(dl)
    log: list[tuple[int, int, int, int]] = []  # (t_call, t_return, worker, samples)
    t_end = None
    while True:
        t_call = time.monotonic_ns()
        batch = next(it)
        t_ret = time.monotonic_ns()
        log.append((t_call, t_ret, int(batch[0, 1]), int(batch.shape[0])))
        if len(log) == 1:
            emit("started", site=site, worker_pids=worker_pids(it), num_threads=torch.get_num_threads())
            t_end = time.monotonic() + CFG["run_s"]
        time.sleep(CFG["step_sleep_s"])
        if t_end is not None and time.monotonic() >= t_end:
            break
    emit("done", log=log, worker_pids=worker_pids(it))
    wait_cmd()


def mode_kill() -> None:
    """A worker is SIGKILLed by the test; torch raises; the script says when it caught that."""
    ds = SleepDataset(100_000, 0.01)
    dl = DataLoader(ds, batch_size=2, num_workers=2)
    it = iter(dl)
    try:
        next(it)
        emit("pids", worker_pids=worker_pids(it))
        while True:
            next(it)
            time.sleep(0.005)
    except RuntimeError as exc:
        emit("caught", message=str(exc))
    wait_cmd()


def mode_trainval() -> None:
    """A train loader and a validation loader iterated side by side."""
    train_ds = SleepDataset(10_000, 0.002)
    val_ds = SleepDataset(10_000, 0.001)
    train, train_site = DataLoader(train_ds, batch_size=4, num_workers=2), here()
    val, val_site = DataLoader(val_ds, batch_size=2, num_workers=1), here()
    ti, vi = iter(train), iter(val)
    nt = nv = 0
    for step in range(60):
        next(ti)
        nt += 1
        if step % 3 == 0:
            next(vi)
            nv += 1
        if step == 30:
            emit("mid", train_pids=worker_pids(ti), val_pids=worker_pids(vi))
            wait_cmd()
    emit(
        "done",
        train_batches=nt,
        val_batches=nv,
        train_site=train_site,
        val_site=val_site,
        train_pids=worker_pids(ti),
        val_pids=worker_pids(vi),
    )
    wait_cmd()


def mode_epochs() -> None:
    """Three epochs; the test polls in the middle of each one."""
    persistent = CFG["persistent"]
    ds = SleepDataset(12, 0.001)
    dl = DataLoader(ds, batch_size=2, num_workers=2, persistent_workers=persistent)
    total = 0
    for epoch in range(3):
        it = iter(dl)
        for i, _batch in enumerate(it):
            total += 1
            if i == 2:
                emit("mid", epoch=epoch, worker_pids=worker_pids(it))
                wait_cmd()
    emit("done", batches=total)
    wait_cmd()


def mode_spawn() -> None:
    """Workers started with the spawn context: they must not serve agents of their own."""
    ds = SleepDataset(1000, 0.001)
    dl = DataLoader(ds, batch_size=2, num_workers=1, multiprocessing_context="spawn")
    it = iter(dl)
    next(it)
    emit("mid", worker_pids=worker_pids(it))
    wait_cmd()
    emit("done")
    wait_cmd()


if __name__ == "__main__":
    emit("ready", pid=os.getpid())
    {
        "rate": mode_rate,
        "kill": mode_kill,
        "trainval": mode_trainval,
        "epochs": mode_epochs,
        "spawn": mode_spawn,
    }[CFG["mode"]]()
