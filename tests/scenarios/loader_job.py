"""A training-like job for the analysis scenarios: a real torch DataLoader, throttled.

    python loader_job.py --store list|tensor [--items N] [--workers N] [--batch N]
                         [--rate BATCHES_PER_S] [--shuffle] [--persistent] [--seconds S]
                         [--busy-threads N] [--tensor-bytes N] [--fill-shm BYTES]

``--store list`` keeps one Python str object per sample: every read writes its refcount, so
each forked worker copies the page (copy-on-read, pytorch#13246) and its USS climbs while RSS
stays flat. ``--store tensor`` keeps the same bytes in one uint8 tensor: nothing is copied.
``--busy-threads N``: each sample is a matmul on N intra-op threads (oversubscription).
``--tensor-bytes N``: each sample is a float tensor of N bytes (batches go through /dev/shm).
``--fill-shm BYTES``: first write a file of that size to /dev/shm (to make it nearly full).
``--store memmap --memmap PATH``: each sample is a random 64 KiB row of a 1 GiB (``--memmap-bytes``)
np.memmap: workers map more and more file pages (clean, reclaimable), which is no leak.
``--init-sleep S``: each worker sleeps S seconds in worker_init_fn (slow worker start-up).
``--keep-per-epoch BYTES``: the trainer keeps that many bytes at each epoch end (a staircase).
``--preload BYTES --preload-seconds S``: the trainer first loads BYTES over S seconds and keeps them
(a warm-up that levels off).
``--leak-main BYTES_PER_S``: the trainer itself keeps that many bytes per second (a steady leak).
``--step-after-ready S``: after the first batch the trainer spends S seconds in one long step (an
evaluation, a checkpoint), not waiting on the loader.
SIGUSR1 to the trainer ends the job as ``--seconds`` would (exit 0), for a test that stops once it
has seen what it waits for.

Prints READY once the workers are running and the first batch has arrived. A worker killed by a
signal makes the DataLoader raise in the main process: the job reports it and sleeps on, so the
dead worker stays a zombie while the iterator lives.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset


class Strings(Dataset[str]):
    def __init__(self, n: int) -> None:
        self.items = [f"sample-{i:09d}" for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> str:
        return self.items[i]


class Packed(Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.data = torch.zeros((n, 16), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class Busy(Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        a = torch.ones((192, 192))
        for _ in range(6):
            a = a @ a / 192.0
        return a[0, :4].clone()


class Mapped(Dataset[torch.Tensor]):
    """Rows of an np.memmap read at random: file-backed pages, mapped in each worker as read."""

    def __init__(self, path: str, nbytes: int, row_bytes: int = 64 * 1024) -> None:
        import numpy as np

        with open(path, "ab") as fh:  # sparse is enough: holes read through the page cache too
            fh.truncate(max(nbytes, os.path.getsize(path)))
        self.rows = np.memmap(path, dtype=np.uint8, mode="r", shape=(nbytes // row_bytes, row_bytes))

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __getitem__(self, i: int) -> torch.Tensor:
        row = self.rows[i]
        return torch.tensor([int(row[::4096].sum())])  # touch every page of the row


class Big(Dataset[torch.Tensor]):
    def __init__(self, n: int, nbytes: int) -> None:
        self.n = n
        self.shape = (max(1, nbytes // 4),)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full(self.shape, float(i))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", choices=["list", "tensor", "busy", "big", "memmap"], default="list")
    p.add_argument("--memmap", default="", help="file for --store memmap (made sparse if missing)")
    p.add_argument("--memmap-bytes", type=int, default=1 << 30)
    p.add_argument("--items", type=int, default=2_000_000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rate", type=float, default=0.0, help="batches per second; 0 = as fast as possible")
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--busy-threads", type=int, default=1)
    p.add_argument("--tensor-bytes", type=int, default=1 << 20)
    p.add_argument("--fill-shm", type=int, default=0)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--leak-main", type=float, default=0.0)
    p.add_argument("--init-sleep", type=float, default=0.0, help="worker start-up seconds")
    p.add_argument("--keep-per-epoch", type=int, default=0, help="bytes the trainer keeps each epoch")
    p.add_argument("--preload", type=int, default=0, help="bytes the trainer loads at start (warm-up)")
    p.add_argument("--preload-seconds", type=float, default=20.0)
    p.add_argument("--step-after-ready", type=float, default=0.0, help="one long step after READY (s)")
    args = p.parse_args()

    _preloaded = preload(args.preload, args.preload_seconds)  # kept for the whole run
    if args.fill_shm:
        with open(f"/dev/shm/dlmon-fill-{os.getpid()}", "wb") as fh:
            fh.write(b"\0" * args.fill_shm)
    dataset: Dataset[object]
    if args.store == "list":
        dataset = Strings(args.items)  # type: ignore[assignment]
    elif args.store == "tensor":
        dataset = Packed(args.items)  # type: ignore[assignment]
    elif args.store == "busy":
        dataset = Busy(args.items)  # type: ignore[assignment]
    elif args.store == "memmap":
        dataset = Mapped(args.memmap, args.memmap_bytes)  # type: ignore[assignment]
    else:
        dataset = Big(args.items, args.tensor_bytes)  # type: ignore[assignment]

    threads = args.busy_threads
    init_sleep = args.init_sleep

    def init(_: int) -> None:
        torch.set_num_threads(threads)
        time.sleep(init_sleep)  # a slow worker start-up (opening shards, loading an index)

    loader = DataLoader(
        dataset,
        batch_size=args.batch,
        shuffle=args.shuffle,
        num_workers=args.workers,
        persistent_workers=args.persistent and args.workers > 0,
        prefetch_factor=args.prefetch if args.workers > 0 else None,
        worker_init_fn=init,
    )
    signal.signal(signal.SIGUSR1, lambda *_: sys.exit(0))
    end = time.monotonic() + args.seconds
    held: list[object] = []  # the live iterator: while it exists, a dead worker stays a zombie
    try:
        run(loader, end, args.rate, held, Hoard(args.leak_main), args.keep_per_epoch, args.step_after_ready)
    except RuntimeError as exc:  # a worker died (torch's SIGCHLD handler or the next batch)
        print(f"dataloader error: {exc}", file=sys.stderr, flush=True)
        while time.monotonic() < end:
            with contextlib.suppress(RuntimeError):
                time.sleep(1.0)


def preload(nbytes: int, seconds: float) -> list[bytes]:
    """A warm-up: load ``nbytes`` (weights, an index) over ``seconds``, in 64 MiB pieces, then keep it."""
    chunks: list[bytes] = []
    piece = 64 << 20
    pieces = -(-nbytes // piece) if nbytes > 0 else 0
    for _ in range(pieces):
        chunks.append(os.urandom(1 << 20) * 64)
        time.sleep(seconds / pieces)
    return chunks


class Hoard:
    """Keeps ``rate`` bytes per second of touched memory from the first batch on."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.start: float | None = None
        self.kept: list[bytes] = []
        self.size = 0

    def tick(self) -> None:
        if self.rate <= 0:
            return
        now = time.monotonic()
        if self.start is None:
            self.start = now
        want = int((now - self.start) * self.rate)
        while self.size < want:
            chunk = min(1 << 20, want - self.size)
            self.kept.append(b"x" * chunk)
            self.size += chunk


def run(
    loader: DataLoader[object],
    end: float,
    rate: float,
    held: list[object],
    hoard: Hoard,
    keep_per_epoch: int = 0,
    step_after_ready: float = 0.0,
) -> None:
    ready = False
    kept: list[bytes] = []  # --keep-per-epoch: a history kept by the loop, never given back
    period = 1.0 / rate if rate > 0 else 0.0
    next_at = time.monotonic()
    while time.monotonic() < end:
        if keep_per_epoch and ready:
            kept.append(b"k" * keep_per_epoch)  # the staircase: one step at each epoch end
        it = iter(loader)
        held[:] = [it]
        for _ in it:
            if not ready:
                print("READY", flush=True)
                ready = True
                time.sleep(step_after_ready)
            hoard.tick()
            if time.monotonic() >= end:
                return
            if period:
                next_at += period
                delay = next_at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                else:
                    next_at = time.monotonic()


if __name__ == "__main__":
    main()
