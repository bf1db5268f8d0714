"""What ``attach --inject`` does to a running 4-worker DataLoader training: its pause and its pace.

Each run starts a fresh training that never heard of dlmon (one long epoch of a persistent
iterator, 4 fork workers, a 10 ms step) and writes ``time.monotonic()`` after every batch to a
pipe. Runs alternate, interleaved pairs: a *load* run loads the agent with ``inject()`` after a
warm-up, a *control* run is watched for the same windows and loaded with nothing. For each run:

- pace: batches/s in the window after the load (from 1 s after it, for ``--window`` s) over the
  window of the same length before it; the load's figure is the median of its runs' ratios over
  the median of the control runs' (the machine's drift and load cancel out);
- pause: the largest gap between two batches around the load, less the median gap (a batch's
  own time), and the same for the control run at the same moment.

    python benchmarks/inject_training.py --pairs 20 [--window 3]
"""

from __future__ import annotations

import argparse
import itertools
import os
import select
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dlmon.launch.inject import inject

TARGET = """
import os, struct, sys, time
import torch
from torch.utils.data import DataLoader, Dataset

class Rows(Dataset):
    def __len__(self):
        return 10_000_000
    def __getitem__(self, i):
        return torch.full((16,), float(i))

fd = int(sys.argv[1])
loader = DataLoader(Rows(), batch_size=32, num_workers=4, persistent_workers=True)
for batch in loader:
    time.sleep(0.01)
    os.write(fd, struct.pack("<d", time.monotonic()))
"""
RECORD = struct.calcsize("<d")
READY_TIMEOUT_S = 120.0
WARM_S = 2.0  # after the first batch: workers started, prefetch queues full


def read_batches(fd: int, until: float, out: list[float]) -> None:
    buf = b""
    while time.monotonic() < until:
        if select.select([fd], [], [], 0.05)[0]:
            buf += os.read(fd, 65536)
            whole = len(buf) - len(buf) % RECORD
            out.extend(struct.unpack_from("<d", buf, off)[0] for off in range(0, whole, RECORD))
            buf = buf[whole:]


def rate(ts: list[float], start: float, end: float) -> float:
    return sum(1 for t in ts if start <= t < end) / (end - start)


def one_run(load: bool, window: float) -> tuple[float, float, float]:
    """(after/before pace, pause beyond a batch's own time in s, inject() wall s)."""
    r, w = os.pipe()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="dlmon-bench-")
    proc = subprocess.Popen(
        [sys.executable, "-c", TARGET, str(w)],
        pass_fds=(w,),
        env=env,
        stderr=subprocess.DEVNULL,  # torch's warning about 4 workers on a small machine
        start_new_session=True,
    )
    os.close(w)
    batches: list[float] = []
    took = 0.0
    try:
        ready_by = time.monotonic() + READY_TIMEOUT_S
        while not batches:
            if proc.poll() is not None or time.monotonic() >= ready_by:
                raise SystemExit(f"the training never made a batch (exit {proc.poll()})")
            read_batches(r, time.monotonic() + 0.2, batches)
        read_batches(r, time.monotonic() + WARM_S + window, batches)
        t0 = time.monotonic()
        if load:
            inject(proc.pid)
            took = time.monotonic() - t0
        t1 = t0 + took + 1.0  # the after window: from a second after the load
        read_batches(r, t1 + window + 0.2, batches)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # its workers too
        proc.wait()
        os.close(r)
    before = rate(batches, t0 - window, t0)
    after = rate(batches, t1, t1 + window)
    gaps = [b - a for a, b in itertools.pairwise(batches)]
    around = [b - a for a, b in itertools.pairwise(t for t in batches if t0 - 0.05 <= t <= t0 + took + 0.5)]
    pause = max(around, default=float("nan")) - statistics.median(gaps)
    return after / before, pause, took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--window", type=float, default=3.0, help="seconds of each pace window")
    args = parser.parse_args()
    loads: list[tuple[float, float, float]] = []
    controls: list[tuple[float, float, float]] = []
    for i in range(args.pairs):
        for load in (i % 2 == 0, i % 2 == 1):  # interleaved: the order alternates pair by pair
            row = one_run(load, args.window)
            (loads if load else controls).append(row)
            kind = "load   " if load else "control"
            pause = f"pause {row[1] * 1e3:6.1f} ms"
            print(
                f"pair {i} {kind}: pace after/before {row[0]:.3f}  {pause}  inject() {row[2]:.2f} s",
                flush=True,
            )
    for name, rows in (("load", loads), ("control", controls)):
        paces = [x[0] for x in rows]
        pauses = [x[1] * 1e3 for x in rows]
        print(
            f"{name}: pace ratio median {statistics.median(paces):.3f} (min {min(paces):.3f}); "
            f"pause median {statistics.median(pauses):.1f} ms, max {max(pauses):.1f} ms"
        )
    print(f"inject() wall: median {statistics.median(x[2] for x in loads):.2f} s")
    pace = statistics.median(x[0] for x in loads) / statistics.median(x[0] for x in controls)
    print(f"batches/s after the load, against the control runs: {pace:.3f}")


if __name__ == "__main__":
    main()
