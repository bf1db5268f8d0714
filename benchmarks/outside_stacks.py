"""How long reading a DataLoader worker's stack from outside takes, and how long the worker stops.

A worker forked before an injected agent has no stack handler: dlmon reads its stack with
``py-spy dump --nonblocking`` (no thread stopped) or gdb's ``py-bt`` (the worker stopped for the
read). A torch job with 2 fork workers, one hung in ``hang_here``, the other heartbeating from a
thread of its own every 1 ms through a pipe: the largest gap in its beats during a read is how long
that read stopped it.

    python benchmarks/outside_stacks.py --runs 10
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dlmon.collect import outside_stacks

JOB = """
import os, struct, sys, threading, time
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info
W = int(sys.argv[1])

def hang_here():
    threading.Event().wait()

def beat():
    while True:
        os.write(W, struct.pack("d", time.monotonic()))
        time.sleep(0.001)

class Items(Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        if get_worker_info().id == 0:
            hang_here()
        threading.Thread(target=beat, daemon=True).start()
        threading.Event().wait()

it = iter(DataLoader(Items(), batch_size=1, num_workers=2))
print(*[w.pid for w in it._workers], flush=True)
next(it)
"""


def gaps(fd: int, stop: threading.Event, out: list[float]) -> None:
    last = None
    while not stop.is_set():
        if not select.select([fd], [], [], 0.1)[0]:
            continue
        data = os.read(fd, 8 * 512)
        for (t,) in struct.iter_unpack("d", data[: len(data) // 8 * 8]):
            if last is not None:
                out.append(t - last)
            last = t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    r, w = os.pipe()
    job = subprocess.Popen(
        [sys.executable, "-c", JOB, str(w)],
        stdout=subprocess.PIPE,
        text=True,
        pass_fds=(w,),
        start_new_session=True,
    )
    try:
        assert job.stdout is not None
        hung, beating = (int(x) for x in job.stdout.readline().split())
        time.sleep(3.0)
        ways = {
            "no read (the machine's own gaps)": sys.executable,
            "py-spy --nonblocking": shutil.which("py-spy"),
            "gdb py-bt": shutil.which("gdb"),
        }
        for name, tool in ways.items():
            if tool is None or (name == "gdb py-bt" and outside_stacks.gdb_extension(hung) is None):
                print(f"{name}: not available here")
                continue
            walls: list[float] = []
            pauses: list[float] = []
            for _ in range(args.runs):
                seen: list[float] = []
                stop = threading.Event()
                reader = threading.Thread(target=gaps, args=(r, stop, seen))
                reader.start()
                time.sleep(0.2)
                t0 = time.perf_counter()
                if name.startswith("no read"):
                    time.sleep(0.5)
                    got = outside_stacks.OutsideStack("none", None, (outside_stacks.StackFrame("-", 0, "-"),))
                elif name.startswith("py-spy"):
                    got = outside_stacks._py_spy(tool, beating, "_worker_loop")
                else:
                    ext = outside_stacks.gdb_extension(beating)
                    assert ext is not None
                    got = outside_stacks._py_bt(tool, ext, beating)
                walls.append(time.perf_counter() - t0)
                time.sleep(0.2)
                stop.set()
                reader.join()
                assert got is not None and got.frames, name
                pauses.append(max(seen) * 1000)
            print(
                f"{name}: read wall median {statistics.median(walls) * 1000:.0f} ms (max "
                f"{max(walls) * 1000:.0f}); the worker's longest beat gap median "
                f"{statistics.median(pauses):.1f} ms (max {max(pauses):.1f})"
            )
    finally:
        os.killpg(job.pid, 9)  # its workers too
        job.wait()


if __name__ == "__main__":
    main()
