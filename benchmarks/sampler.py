"""What one dlmon tick costs on a big DataLoader-like tree, next to its floor and to psutil.

Builds a real tree: 1 main process that fills ``--gib`` GiB, then forks ``--workers`` workers
that each read every page of it (like forked DataLoader workers over an in-memory dataset: every
worker maps the whole GiB, so smaps_rollup must walk it) and rename themselves
``pt_data_worker``. Then, once per second of wall time (the budget is per wall second):

- dlmon: ``Sampler.sample()`` with the default budget — CPU seconds of this thread;
- floor: a bare loop doing only the raw reads of the same files dlmon read on that tick
  (held fds + pread for the per-tick files, smaps_rollup of exactly the processes dlmon read);
- psutil: ``memory_full_info()`` (plus cpu/io) on every process, every tick — the naive way,
  measured on the first ``--psutil-ticks`` ticks only, as it is slow.

All three run in the same tick, side by side, so machine noise hits them alike.

    python benchmarks/sampler.py                 # 32 workers x 1 GiB shared, 60 ticks
    python benchmarks/sampler.py --workers 8 --gib 0.5 --ticks 20
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import statistics
import sys
import time

import psutil

from dlmon.collect.sampler import Sampler

PR_SET_NAME = 15


def build_tree(workers: int, gib: float) -> int:
    """Fork the tree; returns the main pid once every worker has touched the memory."""
    ready_r, ready_w = os.pipe()
    main = os.fork()
    if main:
        os.close(ready_w)
        for _ in range(workers):
            os.read(ready_r, 1)
        os.close(ready_r)
        return main
    os.close(ready_r)
    os.setsid()
    data = bytearray(int(gib * 1024**3))
    for i in range(0, len(data), 4096):
        data[i] = 1
    libc = ctypes.CDLL(None)
    for _ in range(workers):
        if os.fork() == 0:
            libc.prctl(PR_SET_NAME, b"pt_data_worker", 0, 0, 0)
            total = 0
            for i in range(0, len(data), 4096):
                total += data[i]
            os.write(ready_w, b"x")
            signal.pause()
            os._exit(0)
    signal.pause()
    os._exit(0)


class Floor:
    """The same reads as dlmon, with nothing else: held fds, pread, no parsing."""

    PER_TICK = ("stat", "status", "io")

    def __init__(self, pids: list[int], sampler: Sampler, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self.shm_path = f"{proc_root}/{sampler.pid}/root/dev/shm"
        self.fds = {
            (pid, name): os.open(f"{proc_root}/{pid}/{name}", os.O_RDONLY)
            for pid in pids
            for name in self.PER_TICK
        }
        self.pids = pids
        self.system_files = [
            f"{proc_root}/meminfo",
            f"{proc_root}/vmstat",
            f"{proc_root}/diskstats",
            *(f"{proc_root}/pressure/{r}" for r in ("io", "memory", "cpu")),
            *cgroup_files(sampler),
        ]

    def tick(self, smaps_pids: list[int]) -> None:
        for fd in self.fds.values():
            os.pread(fd, 8192, 0)
        for pid in self.pids:
            os.listdir(f"{self.proc_root}/{pid}/fd")
            for tid in os.listdir(f"{self.proc_root}/{pid}/task"):
                with open(f"{self.proc_root}/{pid}/task/{tid}/children", "rb") as fh:
                    fh.read()
        for pid in smaps_pids:
            with open(f"{self.proc_root}/{pid}/smaps_rollup", "rb") as fh:
                fh.read()
        for path in self.system_files:
            with open(path, "rb") as fh:
                fh.read()
        os.statvfs(self.shm_path)


def cgroup_files(sampler: Sampler) -> list[str]:
    """The memory cgroup files dlmon reads each tick."""
    location = sampler._cgroup.location
    if location is None:
        return []
    d = location.directory
    if location.version == 1:
        names = ("memory.usage_in_bytes", "memory.limit_in_bytes", "memory.stat", "memory.oom_control")
        return [f"{d}/{n}" for n in names]
    names = (
        "memory.max",
        "memory.current",
        "memory.events",
        "memory.pressure",
        "io.pressure",
        "cpu.pressure",
    )
    return [f"{d}/{n}" for n in names] + [f"{a}/memory.max" for a in location.ancestors]


def psutil_tick(procs: list[psutil.Process]) -> None:
    for p in procs:
        with p.oneshot():
            p.memory_full_info()
            p.cpu_percent()
            p.io_counters()
            p.num_threads()
            p.num_fds()


def cpu(fn: object, *args: object) -> float:
    start = time.thread_time()
    fn(*args)  # type: ignore[operator]
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--ticks", type=int, default=60)
    parser.add_argument("--psutil-ticks", type=int, default=5)
    args = parser.parse_args()

    started = time.monotonic()
    main_pid = build_tree(args.workers, args.gib)
    built = time.monotonic() - started
    print(f"tree: 1 main + {args.workers} workers sharing {args.gib} GiB, built in {built:.1f} s")
    try:
        sampler = Sampler(main_pid)
        ours: list[float] = []
        floor_costs: list[float] = []
        psutil_costs: list[float] = []
        floor: Floor | None = None
        procs: list[psutil.Process] = []
        smaps_reads = 0
        next_tick = time.monotonic()
        for tick in range(args.ticks):
            ours.append(cpu(sampler.sample))
            read_now = [pid for pid, _ in sampler.processes.smaps_reads_last_tick]
            smaps_reads += len(read_now)
            if floor is None:
                pids = [pid for pid, _ in sampler.processes.roles()]
                floor = Floor(pids, sampler)
                procs = [psutil.Process(pid) for pid in pids]
            floor_costs.append(cpu(floor.tick, read_now))
            if tick < args.psutil_ticks:
                psutil_costs.append(cpu(psutil_tick, procs))
            next_tick += 1.0
            time.sleep(max(0.0, next_tick - time.monotonic()))
        workers = len(sampler.sample().workers())
    finally:
        os.killpg(main_pid, signal.SIGKILL)
        os.waitpid(main_pid, 0)

    # The first tick reads every PSS at once (to fill the screen): report it apart.
    steady = slice(1, None)
    ours_mean = statistics.fmean(ours[steady])
    floor_mean = statistics.fmean(floor_costs[steady])
    psutil_mean = statistics.fmean(psutil_costs)
    print(f"workers found: {workers}/{args.workers}; smaps_rollup reads: {smaps_reads} in {args.ticks} ticks")
    print(f"first tick (reads every PSS): dlmon {ours[0] * 1e3:.1f} ms, floor {floor_costs[0] * 1e3:.1f} ms")
    print()
    print("| per tick, steady state (CPU) | ms/tick | % of one core at 1 Hz | vs floor |")
    print("|---|---:|---:|---:|")
    for name, value in (
        ("dlmon sampler", ours_mean),
        ("floor (raw reads, same schedule)", floor_mean),
        ("psutil memory_full_info, every process", psutil_mean),
    ):
        print(f"| {name} | {value * 1e3:.2f} | {value * 100:.2f}% | {value / floor_mean:.2f}x |")
    print()
    print(f"dlmon / floor = {ours_mean / floor_mean:.2f} (target <= 1.3)")
    print(f"dlmon = {ours_mean * 100:.2f}% of one core at 1 Hz (target <= 1%)")
    print(f"psutil / dlmon = {psutil_mean / ours_mean:.0f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
