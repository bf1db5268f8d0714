"""Trainings that die of an exception (or survive one), for tests/integration/deaths/test_last_words.py.

Argument: JSON ``{"mode": ..., ...}``. Prints ``@@ {json}`` lines (``ready`` with its pid,
``pids`` once the workers deliver, ``done`` at a clean end), then:

- ``shm``: keeps every batch (2 MiB each) alive: a small /dev/shm runs out in a worker's collate.
- ``fds``: lowers RLIMIT_NOFILE to ``nofile``, shares by file descriptor, keeps every batch of 16
  tensors: the trainer runs out of descriptors receiving them.
- ``key_error``: the Dataset raises KeyError('label') at sample ``at`` (a bug in the user's code).
- ``memory_error``: workers get an address-space limit; the Dataset's allocation at ``at`` fails
  for real with MemoryError.
- ``cuda_oom``: the Dataset raises torch's CUDA out-of-memory text at ``at`` (a stand-in: no GPU).
- ``cuda_fork``: the Dataset moves a sample to CUDA at ``at`` in a forked worker; torch's own
  ``torch.cuda._lazy_init`` raises "Cannot re-initialize CUDA in forked subprocess". The seam (no
  GPU here): worker_init_fn sets the bad-fork flag a CUDA build sets in a child forked after the
  parent started CUDA (``torch._C._cuda_isInBadFork``, read through ``torch.cuda._is_in_bad_fork``).
- ``pool_fork``: the training loop hands work to a fork-started multiprocessing Pool whose task
  moves a tensor to CUDA: the same RuntimeError, raised in the Pool's process and re-raised in the
  trainer (no DataLoader worker in it). The same seam, set by the Pool's initializer.
- ``trainer_bug``: the training loop itself raises ValueError after a few batches.
- ``thread_bug``: a helper thread raises; the main thread sees it gone and exits 1.
- ``caught``: the Dataset raises at ``at``; the loop catches it, starts a new epoch and exits 0
  (``"new_loader": true``: it goes on with a new DataLoader; ``"exit": N``: it then exits N).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from typing import Any

import torch
import torch.multiprocessing
from torch.utils.data import DataLoader, Dataset

CFG: dict[str, Any] = json.loads(sys.argv[1])
MODE = CFG["mode"]
AT = CFG.get("at", 40)
AT_NEW = [AT]  # a new loader of the 'caught' mode raises no more (its workers fork after the change)


def emit(ev: str, **kw: Any) -> None:
    print("@@ " + json.dumps({"ev": ev, "t": time.time(), **kw}), flush=True)


class Samples(Dataset[Any]):
    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> Any:
        time.sleep(CFG.get("sample_s", 0.002))
        item = {"x": torch.zeros(4)}
        if MODE == "shm":
            return torch.zeros(256, 256)  # 256 KiB: a batch of 8 is 2 MiB of shared memory
        if MODE == "fds":
            return [torch.zeros(2) for _ in range(16)]  # 16 tensors: 16 descriptors per batch
        if i >= AT_NEW[0]:
            if MODE in ("key_error", "caught"):
                return item["label"]
            if MODE == "memory_error":
                return bytearray(1 << 30)
            if MODE == "cuda_oom":
                raise RuntimeError(
                    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                    "15.77 GiB of which 1.02 GiB is free. (a stand-in raised by the test's Dataset)"
                )
            if MODE == "cuda_fork":
                return item["x"].cuda()
        return item["x"]


def forked_after_cuda(worker_id: int) -> None:
    torch.cuda._is_in_bad_fork = lambda: True  # type: ignore[attr-defined]


def to_cuda(i: int) -> int:
    return int(torch.zeros(1).cuda().numel()) + i


def limit_address_space(worker_id: int) -> None:
    """Room for what the worker has mapped and 256 MiB more: a 1 GiB allocation fails."""
    with open("/proc/self/statm") as f:
        vsize = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vsize + (256 << 20), resource.RLIM_INFINITY))


def helper_thread() -> None:
    time.sleep(0.5)
    raise ValueError("the helper thread's bug")


def main() -> None:
    emit("ready", pid=os.getpid())
    if MODE == "fds":
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (CFG.get("nofile", 128), resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        )
    extra: dict[str, Any] = {}
    if MODE == "memory_error":
        extra["worker_init_fn"] = limit_address_space
    if MODE == "cuda_fork":
        extra["worker_init_fn"] = forked_after_cuda
    batch = 8 if MODE == "shm" else 2
    dl = DataLoader(Samples(), batch_size=batch, num_workers=2, **extra)
    helper = None
    if MODE == "thread_bug":
        helper = threading.Thread(target=helper_thread, name="prefetcher", daemon=True)
        helper.start()
    kept: list[Any] = []
    it = iter(dl)
    n = 0
    recovered = False
    while n < CFG.get("steps", 400):
        try:
            b = next(it)
        except KeyError:
            if MODE != "caught" or recovered:
                raise
            recovered = True
            emit("caught")
            if CFG.get("new_loader"):
                dl = DataLoader(Samples(), batch_size=batch, num_workers=2, **extra)
                AT_NEW[0] = 1 << 30
            it = iter(dl)  # a new epoch, new workers
            continue
        n += 1
        if n == 5:
            emit("pids", workers=[int(w.pid) for w in it._workers])  # type: ignore[attr-defined]
        if MODE in ("shm", "fds"):
            kept.append(b)
        if MODE == "pool_fork" and n == 20:
            fork = torch.multiprocessing.get_context("fork")
            with fork.Pool(1, initializer=forked_after_cuda, initargs=(0,)) as pool:
                pool.map(to_cuda, [n])
        if MODE == "trainer_bug" and n == 20:
            raise ValueError(f"loss is nan at step {n}")
        if helper is not None and not helper.is_alive():
            emit("helper_gone")
            sys.exit(1)
        time.sleep(CFG.get("step_s", 0.005))
    emit("done")
    sys.exit(CFG.get("exit", 0))


if __name__ == "__main__":
    main()
