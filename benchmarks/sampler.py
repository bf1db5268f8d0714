"""What one dlmon tick costs on a big DataLoader-like tree, next to its floor and to psutil.

Builds a real tree: 1 main process that fills ``--gib`` GiB, then forks ``--workers`` workers
that each read every page of it (like forked DataLoader workers over an in-memory dataset: every
worker maps the whole GiB, so smaps_rollup must walk it) and rename themselves
``pt_data_worker``. Worker 0 keeps moving: it faults in 64 MiB/s of private pages in a 256 MiB
buffer and drops them when full (a worker whose PSS must stay fresh). Then, once per second of
wall time (the budget is per wall second):

- dlmon: ``Sampler.sample()`` with the default budget: CPU seconds of this thread, split by part
  (``Sampler.last_cost``: per-process reads, discovery, fds, smaps, building rows, NVML, agent
  polls, system files, building the snapshot);
- floor: a bare loop doing only the raw reads of the same files dlmon read on that tick
  (held fds + pread for stat, and for status/io where dlmon read them; the same fd listings
  and children files, smaps_rollup of exactly the processes dlmon read, the same system files);
- psutil: ``memory_full_info()`` (plus cpu/io) on every process, every tick: the naive way,
  measured on the first ``--psutil-ticks`` ticks only, as it is slow.

All three run in the same tick, side by side, so machine noise hits them alike. The tree is run
at each size of ``--gib`` in turn (default 1 and 4 GiB per worker: two smaps_rollup costs, so
the ratio is not flattered by an expensive floor).

    python benchmarks/sampler.py                       # 32 workers, 1 then 4 GiB, 60 ticks each
    python benchmarks/sampler.py --workers 8 --gib 0.5 --ticks 20
    python benchmarks/sampler.py --busy 0.02               # CPU moving in every worker: no quiet row
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import signal
import statistics
import sys
import time
from dataclasses import fields

import psutil

from dlmon.collect.sampler import Sampler, TickCost

PR_SET_NAME = 15
MiB = 1024 * 1024


def build_tree(workers: int, gib: float, moving_worker: bool = False, busy: float = 0.0) -> int:
    """Fork the tree; returns the main pid once every worker has touched the memory.

    ``busy``: the fraction of a core each worker (but a moving one) spends computing, touching no
    new memory, so the CPU columns move every tick while memory stands still."""
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
    for index in range(workers):
        if os.fork() == 0:
            libc.prctl(PR_SET_NAME, b"pt_data_worker", 0, 0, 0)
            total = 0
            for i in range(0, len(data), 4096):
                total += data[i]
            os.write(ready_w, b"x")
            if moving_worker and index == 0:
                keep_moving()
            if busy > 0:
                keep_busy(busy)
            signal.pause()
            os._exit(0)
    signal.pause()
    os._exit(0)


def keep_busy(fraction: float, period: float = 0.1) -> None:
    """Spin ``fraction`` of every ``period`` and sleep the rest, touching no new memory."""
    clock = time.monotonic
    while True:
        start = clock()
        while clock() - start < fraction * period:
            pass
        time.sleep(period * (1.0 - fraction))


def keep_moving(rate: int = 64 * MiB, size: int = 256 * MiB) -> None:
    """Fault in ``rate`` bytes/s of private pages, dropping them all when ``size`` is full."""
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    step = rate // 10
    offset = 0
    while True:
        for i in range(offset, offset + step, 4096):
            buf[i] = 1
        offset += step
        if offset + step > size:
            buf.madvise(mmap.MADV_DONTNEED)
            offset = 0
        time.sleep(0.1)


class Floor:
    """The same reads as dlmon on the same tick, with nothing else: no parsing, no checks."""

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

    def tick(self, sampler: Sampler) -> None:
        tracker = sampler.processes
        # in rotation on a big tree: not every pid; status and io only of the processes that moved
        per_tick = ((("stat",), tracker.read_last_tick), (("status", "io"), tracker.status_read_last_tick))
        for names, pids in per_tick:
            for pid in pids:
                for name in names:
                    fd = self.fds.get((pid, name))
                    if fd is not None:
                        os.pread(fd, 8192, 0)
        for pid in tracker.fd_counts_last_tick:
            os.listdir(f"{self.proc_root}/{pid}/fd")
        for pid, tids in tracker.children_reads_last_tick:
            task = os.open(f"{self.proc_root}/{pid}/task", os.O_RDONLY | os.O_DIRECTORY)
            for tid in os.listdir(task) if tids is None else tids:
                try:
                    fd = os.open(f"{tid}/children", os.O_RDONLY, dir_fd=task)
                except OSError:
                    continue
                os.read(fd, 8192)
                os.close(fd)
            os.close(task)
        for pid, _ in tracker.smaps_reads_last_tick:
            with open(f"{self.proc_root}/{pid}/smaps_rollup", "rb") as fh:
                fh.read()
        for path in self.system_files:
            with open(path, "rb") as fh:
                fh.read()
        os.statvfs(self.shm_path)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


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


def run_size(args: argparse.Namespace, gib: float) -> dict[str, float]:
    started = time.monotonic()
    main_pid = build_tree(args.workers, gib, moving_worker=True, busy=args.busy)
    built = time.monotonic() - started
    print(f"## tree: 1 main + {args.workers} workers sharing {gib:g} GiB (built in {built:.1f} s)")
    costs: list[TickCost] = []
    floor_costs: list[float] = []
    psutil_costs: list[float] = []
    moving_ages: list[float] = []
    warmup_moving_ages: list[float] = []
    all_read_at: int | None = None
    idle_ages: list[float] = []
    oldest_ages: list[float] = []
    smaps_wall: list[float] = []
    rotations: list[int] = []
    shown_again: list[int] = []
    try:
        sampler = Sampler(main_pid)
        floor: Floor | None = None
        procs: list[psutil.Process] = []
        smaps_reads = 0
        moving_pid: int | None = None
        next_tick = time.monotonic()
        for tick in range(args.ticks):
            snapshot = sampler.sample()
            assert sampler.last_cost is not None
            costs.append(sampler.last_cost)
            smaps_reads += len(sampler.processes.smaps_reads_last_tick)
            rotations.append(snapshot.rotation_ticks)
            shown_again.append(snapshot.processes_in_rotation)
            if floor is None:
                pids = [pid for pid, _ in sampler.processes.roles()]
                floor = Floor(pids, sampler)
                procs = [psutil.Process(pid) for pid in pids]
                workers = sorted(snapshot.workers(), key=lambda p: p.start_time)
                moving_pid = workers[0].pid if workers else None
            floor_costs.append(cpu(floor.tick, sampler))
            if tick < args.psutil_ticks:
                psutil_costs.append(cpu(psutil_tick, procs))
            if tick > 0:
                live = [p for p in snapshot.processes if p.state not in ("Z", "X")]
                ages = [p.pss_age_s for p in live if p.pss_age_s is not None]
                oldest_ages.append(max(ages, default=float("nan")))
                if all_read_at is None and len(ages) == len(live):
                    all_read_at = tick  # every process's PSS read once: the warm-up is over
                for p in live:
                    if p.pss_age_s is None:
                        continue
                    if p.pid == moving_pid:
                        (moving_ages if all_read_at is not None else warmup_moving_ages).append(p.pss_age_s)
                    else:
                        idle_ages.append(p.pss_age_s)
            next_tick += 1.0
            time.sleep(max(0.0, next_tick - time.monotonic()))
        for tracked in sampler.processes._tracked.values():
            if tracked.smaps_wall_s is not None:
                smaps_wall.append(tracked.smaps_wall_s)
        found = len(sampler.sample().workers())
        if floor is not None:
            floor.close()
        sampler.close()
    finally:
        os.killpg(main_pid, signal.SIGKILL)
        os.waitpid(main_pid, 0)

    # The first tick reads every PSS it can at once (to fill the screen): report it apart.
    steady = costs[1:]
    ours = statistics.fmean(c.total for c in steady)
    floor_mean = statistics.fmean(floor_costs[1:])
    psutil_mean = statistics.fmean(psutil_costs) if psutil_costs else float("nan")
    print(f"workers found: {found}/{args.workers}; smaps_rollup reads: {smaps_reads} in {args.ticks} ticks;"
          f" one read: {statistics.median(smaps_wall) * 1e3:.1f} ms wall (median)")  # fmt: skip
    print(f"first tick: dlmon {costs[0].total * 1e3:.1f} ms, floor {floor_costs[0] * 1e3:.1f} ms")
    print()
    print("| per tick, steady state (CPU) | ms/tick | % of one core at 1 Hz | vs floor |")
    print("|---|---:|---:|---:|")
    for name, value in (
        ("dlmon sampler", ours),
        ("floor (raw reads, same schedule)", floor_mean),
        ("psutil memory_full_info, every process", psutil_mean),
    ):
        print(f"| {name} | {value * 1e3:.2f} | {value * 100:.2f}% | {value / floor_mean:.2f}x |")
    print()
    print("| dlmon split, steady (CPU) | ms/tick | share |")
    print("|---|---:|---:|")
    for f in fields(TickCost):
        if f.name in ("total", "gpu_wall"):  # gpu_wall is wall time, not CPU
            continue
        part = statistics.fmean(getattr(c, f.name) for c in steady)
        print(f"| {f.name} | {part * 1e3:.3f} | {part / ours:.0%} |")
    fixed = statistics.fmean(c.total - c.smaps for c in steady)
    print(f"| everything but smaps | {fixed * 1e3:.3f} | {fixed / ours:.0%} |")
    print()
    print(f"dlmon / floor = {ours / floor_mean:.2f} (target <= 1.3)")
    print(f"dlmon = {ours * 100:.2f}% of one core at 1 Hz (target <= 1%)")
    print(f"psutil / dlmon = {psutil_mean / ours:.0f}x")
    print(
        f"rotation: workers read every {rotations[-1]} tick(s) at the end (most {max(rotations)});"
        f" rows shown again without a read: {statistics.fmean(shown_again):.1f} per tick"
    )

    def ages(values: list[float]) -> str:
        if not values:
            return "none"
        return f"median {statistics.median(values):.1f} s, max {max(values):.1f} s"

    # Until every process's PSS was read once, never-read processes outrank a moving one (a new
    # worker must get its first PSS within seconds): report that warm-up apart.
    warmup = "never" if all_read_at is None else f"at tick {all_read_at}"
    print(f"every process's PSS read once: {warmup}")
    print(f"moving worker's PSS age: after that {ages(moving_ages)}; before it {ages(warmup_moving_ages)}")
    print(
        f"idle processes' PSS age max {max(idle_ages, default=float('nan')):.1f} s;"
        f" oldest at the last tick {oldest_ages[-1] if oldest_ages else float('nan'):.1f} s"
    )
    print()
    sys.stdout.flush()
    return {
        "gib": gib,
        "dlmon": ours,
        "floor": floor_mean,
        "moving_median": statistics.median(moving_ages) if moving_ages else float("nan"),
        "moving_max": max(moving_ages, default=float("nan")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument(
        "--gib", type=float, nargs="+", default=[1.0, 4.0], help="GiB per worker; one run per size"
    )
    parser.add_argument("--ticks", type=int, default=60)
    parser.add_argument("--psutil-ticks", type=int, default=3)
    parser.add_argument(
        "--busy",
        type=float,
        default=0.0,
        metavar="F",
        help="each worker but the moving one computes F of a core: every row is built every tick",
    )
    args = parser.parse_args()
    results = [run_size(args, gib) for gib in args.gib]
    print(
        "| GiB per worker | dlmon ms/tick | % of a core | floor ms/tick | dlmon / floor"
        " | moving worker's PSS age after warm-up, median / max |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['gib']:g} | {r['dlmon'] * 1e3:.2f} | {r['dlmon'] * 100:.2f}% |"
            f" {r['floor'] * 1e3:.2f} | {r['dlmon'] / r['floor']:.2f}x |"
            f" {r['moving_median']:.0f} / {r['moving_max']:.0f} s |"
        )


if __name__ == "__main__":
    main()
