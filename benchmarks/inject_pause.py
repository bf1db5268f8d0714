"""How long ``attach --inject`` (gdb, or lldb where gdb is missing; Python 3.9-3.13) pauses a
process that imported torch.

Each run starts a fresh target that imports torch, then writes time.monotonic() to a pipe every
1 ms from its main thread and from a second thread. The largest gap in each stream around the load
is the pause that thread saw: the main thread's includes the time gdb held it (the exec line only
starts the loader's thread; the agent's import then runs beside the training), the other thread's
only the time gdb had every thread stopped.

    python benchmarks/inject_pause.py --runs 10 [--all-symbols | --debugger lldb]
"""

from __future__ import annotations

import argparse
import itertools
import os
import select
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dlmon.launch import gdb_inject
from dlmon.launch import inject as inject_module
from dlmon.launch.inject import inject

TARGET = """
import os, struct, sys, threading, time
import torch
fd = int(sys.argv[1])
def beat(tag):
    while True:
        os.write(fd, struct.pack("<bd", tag, time.monotonic()))
        time.sleep(0.001)
threading.Thread(target=beat, args=(1,), daemon=True).start()
beat(0)
"""
RECORD = struct.calcsize("<bd")
READY_TIMEOUT_S = 120.0  # torch's import on a cold disk


def all_symbols(gdb: str, pid: int, script_path: str, libpython: str | None) -> list[str]:
    return [gdb, "-q", "-batch", "-nx", "-iex", "set auto-load off", "-p", str(pid), "-x", script_path]


def read_beats(fd: int, until: float, beats: dict[int, list[float]]) -> None:
    buf = b""
    while time.monotonic() < until:
        if select.select([fd], [], [], 0.05)[0]:
            buf += os.read(fd, 65536)
            whole = len(buf) - len(buf) % RECORD
            for off in range(0, whole, RECORD):
                tag, t = struct.unpack_from("<bd", buf, off)
                beats[tag].append(t)
            buf = buf[whole:]


def one_run() -> tuple[float, float, float]:
    r, w = os.pipe()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="dlmon-bench-")
    proc = subprocess.Popen([sys.executable, "-c", TARGET, str(w)], pass_fds=(w,), env=env)
    os.close(w)
    beats: dict[int, list[float]] = {0: [], 1: []}
    try:
        ready_by = time.monotonic() + READY_TIMEOUT_S
        while not beats[0]:  # torch imported, beating
            if proc.poll() is not None or time.monotonic() >= ready_by:
                raise SystemExit(f"the target never beat (exit {proc.poll()}): does it import torch?")
            read_beats(r, time.monotonic() + 0.2, beats)
        read_beats(r, time.monotonic() + 0.5, beats)
        t0 = time.monotonic()
        inject(proc.pid)
        took = time.monotonic() - t0
        read_beats(r, time.monotonic() + 0.5, beats)
    finally:
        proc.kill()
        proc.wait()
        os.close(r)

    def largest_gap(ts: list[float]) -> float:
        inside = [t for t in ts if t >= t0 - 0.01]
        return max((b - a for a, b in itertools.pairwise(inside)), default=float("nan"))

    return largest_gap(beats[0]), largest_gap(beats[1]), took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--all-symbols", action="store_true", help="let gdb read every library's symbols")
    parser.add_argument(
        "--debugger", choices=("gdb", "lldb"), default="gdb", help="lldb: as where gdb is missing"
    )
    args = parser.parse_args()
    if args.debugger == "lldb":
        lldb = shutil.which("lldb")
        if lldb is None:
            raise SystemExit("lldb is not installed (apt-get install lldb)")
        inject_module.find_debugger = lambda: lldb
    if args.all_symbols:
        gdb_inject.command = all_symbols  # type: ignore[assignment]
    rows = [one_run() for _ in range(args.runs)]
    for i, (main_gap, other_gap, took) in enumerate(rows):
        gaps = f"main thread {main_gap * 1e3:7.1f} ms  other thread {other_gap * 1e3:7.1f} ms"
        print(f"run {i}: {gaps}  inject() {took:.2f} s")
    for name, col in (("main thread", 0), ("other thread", 1), ("inject() wall", 2)):
        values = [row[col] * (1 if col == 2 else 1e3) for row in rows]
        unit = "s" if col == 2 else "ms"
        print(f"{name}: median {statistics.median(values):.2f} {unit}, max {max(values):.2f} {unit}")


if __name__ == "__main__":
    main()
