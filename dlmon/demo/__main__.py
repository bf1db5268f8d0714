"""A small synthetic training for ``dlmon demo``: a real DataLoader with workers, no downloads.

Scenarios, each the real mechanism, not a simulation of its numbers:

- ``healthy``: a tensor-backed dataset; workers stay flat.
- ``leak``: the Dataset holds a Python list of Python objects. Every read in a forked worker
  touches refcounts, copying the page into the worker: RSS stays flat while USS grows
  (pytorch/pytorch#13246).
- ``io-bound``: samples are files read from disk, dropped from the page cache after each read,
  so every epoch really reads the disk.
- ``slow-workers``: a CPU-heavy transform per sample; the model waits for data.

Run it under dlmon (``dlmon demo``) or alone: ``python -m dlmon.demo --scenario leak``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

SCENARIOS = ("healthy", "leak", "io-bound", "slow-workers")
SAMPLE_SHAPE = (3, 32, 32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dlmon.demo", description=__doc__.splitlines()[0])
    p.add_argument("--scenario", choices=SCENARIOS, default="healthy")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--duration", type=float, default=0.0, help="seconds to run; 0 = until stopped")
    p.add_argument("--items", type=int, default=0, help="dataset size (default depends on the scenario)")
    p.add_argument(
        "--step-ms",
        type=float,
        default=-1.0,
        help="extra milliseconds per training step, as a bigger model would take "
        "(default: 30 for leak, so pages are copied over minutes as in a real run; else 0)",
    )
    return p.parse_args(argv)


def build_dataset(scenario: str, items: int, workdir: str) -> Any:
    import torch
    from torch.utils.data import Dataset

    class TensorImages(Dataset[tuple[Any, int]]):
        """healthy: one uint8 tensor; forked workers share its pages and never copy them."""

        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(0)
            self.images = torch.randint(0, 256, (n, *SAMPLE_SHAPE), dtype=torch.uint8, generator=g)
            self.labels = torch.randint(0, 10, (n,), generator=g)

        def __len__(self) -> int:
            return len(self.images)

        def __getitem__(self, i: int) -> tuple[Any, int]:
            return self.images[i].float().div_(255), int(self.labels[i])

    class PythonObjectRecords(Dataset[tuple[Any, int]]):
        """leak: an index of file names as a Python list of str, as metadata often is. Reading
        an item in a forked worker increments its refcount, which writes the page, which the
        kernel then copies into the worker: USS grows page by page while RSS stays flat.
        (Strings are not tracked by the GC, so the growth is gradual, as in pytorch#13246.)"""

        def __init__(self, n: int) -> None:
            self.records = [f"train/{i:08d}.jpg {i % 10}" for i in range(n)]

        def __len__(self) -> int:
            return len(self.records)

        def __getitem__(self, i: int) -> tuple[Any, int]:
            record = self.records[i]
            label = int(record[-1])
            image = torch.full(SAMPLE_SHAPE, (i % 255) / 255.0)
            return image, label

    class FilesOnDisk(Dataset[tuple[Any, int]]):
        """io-bound: one file per sample; the page cache is dropped after each read."""

        def __init__(self, n: int, root: str) -> None:
            self.paths = []
            block = os.urandom(256 * 1024)
            for i in range(n):
                path = os.path.join(root, f"{i:06d}.bin")
                with open(path, "wb") as fh:
                    fh.write(block)
                    fh.flush()
                    os.fsync(fh.fileno())
                    os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                self.paths.append(path)

        def __len__(self) -> int:
            return len(self.paths)

        def __getitem__(self, i: int) -> tuple[Any, int]:
            fd = os.open(self.paths[i], os.O_RDONLY)
            try:
                data = os.read(fd, 256 * 1024)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            image = torch.frombuffer(bytearray(data[: 3 * 32 * 32]), dtype=torch.uint8)
            return image.view(SAMPLE_SHAPE).float().div_(255), i % 10

    class HeavyTransform(TensorImages):
        """slow-workers: a per-sample transform that costs a few milliseconds of CPU."""

        def __getitem__(self, i: int) -> tuple[Any, int]:
            image, label = super().__getitem__(i)
            for _ in range(40):
                image = torch.fft.ifft2(torch.fft.fft2(image)).real
            return image, label

    if scenario == "healthy":
        return TensorImages(items or 20_000)
    if scenario == "leak":
        return PythonObjectRecords(items or 3_000_000)
    if scenario == "io-bound":
        return FilesOnDisk(items or 1024, workdir)
    return HeavyTransform(items or 20_000)


def worker_init(_worker_id: int) -> None:
    import torch

    torch.set_num_threads(1)  # many workers x many intra-op threads oversubscribes the cores


def _say_dashboard_gone() -> None:
    print("dlmon demo: dlmon went away (the terminal closed?); the demo stops with it", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from dlmon.launch.lifeline import hold_from_env

    # under `dlmon demo` the synthetic training ends with its dashboard, however that ends
    hold_from_env(on_cut=_say_dashboard_gone)
    try:
        import torch
        from torch import nn
        from torch.utils.data import DataLoader
    except ImportError:
        print("dlmon demo needs PyTorch: pip install 'dlmon[demo]'", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    workdir = tempfile.mkdtemp(prefix="dlmon-demo-")
    try:
        print(
            f"dlmon demo: scenario {args.scenario}, {args.workers} workers, batch {args.batch_size}",
            flush=True,
        )
        dataset = build_dataset(args.scenario, args.items, workdir)
        loader = DataLoader(
            dataset,
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=args.workers,
            persistent_workers=args.workers > 0,
            worker_init_fn=worker_init if args.workers > 0 else None,
        )
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(8),
            nn.Flatten(),
            nn.Linear(16 * 64, 10),
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loss_fn = nn.CrossEntropyLoss()
        step_s = (args.step_ms if args.step_ms >= 0 else (30.0 if args.scenario == "leak" else 0.0)) / 1000
        deadline = time.monotonic() + args.duration if args.duration > 0 else None
        epoch = 0
        while deadline is None or time.monotonic() < deadline:
            epoch += 1
            started, batches = time.monotonic(), 0
            for images, labels in loader:
                optimizer.zero_grad()
                loss = loss_fn(model(images), labels)
                loss.backward()
                optimizer.step()
                if step_s:
                    time.sleep(step_s)
                batches += 1
                if batches % 50 == 0:
                    rate = batches / (time.monotonic() - started)
                    print(
                        f"epoch {epoch} batch {batches} loss {loss.item():.3f} ({rate:.0f} batches/s)",
                        flush=True,
                    )
                if deadline is not None and time.monotonic() >= deadline:
                    break
            print(f"epoch {epoch} done: {batches} batches in {time.monotonic() - started:.1f} s", flush=True)
    except KeyboardInterrupt:
        print("dlmon demo: interrupted", flush=True)
        return 130
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
