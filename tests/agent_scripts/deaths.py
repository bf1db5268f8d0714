"""Trainings that die or hang in one chosen way, for tests/integration/deaths/test_real_trainings.py.

Argument: JSON ``{"mode": ..., ...}``. Every mode prints ``@@ {json}`` lines (``ready`` with its
pid, ``pids`` with its workers' pids once they deliver) and then does what its name says:

- ``wait``: trains slowly forever (the test kills a worker, or the trainer, from outside).
- ``oom_worker``: worker 1 allocates without end (the cgroup's limit kills it).
- ``oom_trainer``: the trainer allocates without end after a few batches.
- ``shm``: worker 0 fills a file in /dev/shm past the tmpfs's size (SIGBUS).
- ``segv``: worker 1 reads address 0 (SIGSEGV).
- ``hang``: worker 1 sleeps forever in ``hang_here`` on its sample ``hang_at``.
- ``trainer_hang``: after a few batches the trainer waits forever in ``wait_for_peer`` (outside the loader).
- ``fds``: the trainer opens a file per batch and keeps it (an fd leak).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import sys
import threading
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

CFG: dict[str, Any] = json.loads(sys.argv[1])
MODE = CFG["mode"]


def emit(ev: str, **kw: Any) -> None:
    print("@@ " + json.dumps({"ev": ev, "t": time.time(), **kw}), flush=True)


def hang_here() -> None:
    while True:
        time.sleep(3600)


def wait_for_peer() -> None:
    threading.Event().wait()


_hog: list[bytearray] = []


def grow_forever() -> None:
    while True:
        _hog.append(bytearray(b"x" * (8 << 20)))
        time.sleep(0.01)


def fill_shm() -> None:
    path = f"/dev/shm/dlmon-test-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.unlink(path)
    size = 256 << 20
    os.ftruncate(fd, size)  # sparse: the tmpfs only fails when the pages are touched
    m = mmap.mmap(fd, size)
    for off in range(0, size, 4096):
        m[off] = 1  # SIGBUS once the tmpfs is full


class Job(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        wid = info.id if info is not None else -1
        if i >= CFG.get("trigger_at", 40):
            if MODE == "oom_worker" and wid == 1:
                grow_forever()
            if MODE == "shm" and wid == 0:
                fill_shm()
            if MODE == "segv" and wid == 1:
                ctypes.string_at(0)
            if MODE in ("hang", "lone_hang") and wid == 1:
                hang_here()
        time.sleep(CFG.get("sample_s", 0.01))
        return torch.zeros(4)


def slow_second_start(worker_id: int) -> None:
    if os.environ.get("DLMON_TEST_EPOCH") == "1":
        time.sleep(CFG["start_s"])


def epochs() -> None:
    """Two short epochs of a non-persistent loader; the second one's workers take start_s to start."""
    dl = DataLoader(Job(), batch_size=2, num_workers=2, worker_init_fn=slow_second_start)
    for epoch in range(2):
        os.environ["DLMON_TEST_EPOCH"] = str(epoch)  # forked workers see it
        for n, _ in enumerate(dl):
            if n == 5 and epoch == 0:
                emit("pids")
            if n >= 150:
                break
            time.sleep(0.005)
    emit("done")


def main() -> None:
    emit("ready", pid=os.getpid())
    if MODE == "slow_epoch_start":
        epochs()
        return
    extra = {"in_order": False} if MODE == "lone_hang" else {}
    dl = DataLoader(Job(), batch_size=2, num_workers=CFG.get("num_workers", 2), **extra)
    it = iter(dl)
    kept: list[Any] = []
    for n in range(1_000_000):
        next(it)
        if n == 5:
            emit("pids", workers=[int(w.pid) for w in it._workers])  # type: ignore[attr-defined]
        if MODE == "oom_trainer" and n == 30:
            grow_forever()
        if MODE == "trainer_hang" and n == 30:
            emit("hanging")
            wait_for_peer()
        if MODE == "fds":
            kept.append(open(__file__, "rb"))  # noqa: SIM115 -- the leak under test
        time.sleep(CFG.get("step_s", 0.01))
        if n + 1 == CFG.get("steps"):
            emit("done")
            return


if __name__ == "__main__":
    main()
