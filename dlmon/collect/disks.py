"""Per-disk IO rates from /proc/diskstats, computed exactly as sysstat's ``iostat -x`` does.

Over an interval of ``dt`` seconds between two readings (Δ = current - previous counter):

* r/s = Δreads / dt, w/s likewise
* read bytes/s = Δsectors_read * 512 / dt (diskstats sectors are always 512 bytes), write likewise
* %util = Δio_ticks(ms) / (dt * 1000) * 100, capped at 100
* r_await = Δread_ticks(ms) / Δreads; None when there were no reads (iostat prints 0.00)
* aqu-sz = Δweighted_ticks(ms) / (dt * 1000)

A counter that went backwards (device reset, 32-bit wrap) gives None for every figure that uses
it over that interval, never a negative or huge rate.

/proc/diskstats layouts: 14 fields (kernel < 4.18), 18 (+ discards), 20 (+ flushes, >= 5.5);
the fields used here sit at the same positions in all three.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from dlmon.collect.system import read_text
from dlmon.model.snapshot import DiskSample

__all__ = [
    "SECTOR_BYTES",
    "DiskCounters",
    "DiskStatsReader",
    "compute_disk_sample",
    "parse_diskstats",
]

SECTOR_BYTES = 512
_SKIP_PREFIXES = ("loop", "ram", "zram")


@dataclass(frozen=True, slots=True)
class DiskCounters:
    """The cumulative counters of one /proc/diskstats line that iostat -x uses."""

    reads: int
    read_sectors: int
    read_ticks: int  # ms
    writes: int
    write_sectors: int
    write_ticks: int  # ms
    io_ticks: int  # ms the device had IO in flight
    weighted_ticks: int  # ms * requests in flight


def parse_diskstats(text: str, keep: Callable[[str], bool] | None = None) -> dict[str, DiskCounters]:
    """All devices of /proc/diskstats text (14/18/20 fields per line), in file order; only those
    ``keep`` accepts when given (read every tick: a box's loop devices and partitions cost more
    to build than its disks).

    Lines of other lengths (the 7-field partition lines of kernels before 2.6.25) are skipped.
    """
    out: dict[str, DiskCounters] = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) < 14 or (keep is not None and not keep(f[2])):
            continue
        try:
            out[f[2]] = DiskCounters(
                reads=int(f[3]),
                read_sectors=int(f[5]),
                read_ticks=int(f[6]),
                writes=int(f[7]),
                write_sectors=int(f[9]),
                write_ticks=int(f[10]),
                io_ticks=int(f[12]),
                weighted_ticks=int(f[13]),
            )
        except ValueError:
            continue
    return out


def _delta(cur: int, prev: int) -> int | None:
    d = cur - prev
    return d if d >= 0 else None


def _rate(delta: int | None, dt: float, scale: float = 1.0) -> float | None:
    return None if delta is None else delta * scale / dt


def _await(ticks: int | None, ios: int | None) -> float | None:
    if ticks is None or not ios:  # ios None (went backwards) or 0 (no IO: no await)
        return None
    return ticks / ios


def compute_disk_sample(name: str, prev: DiskCounters, cur: DiskCounters, dt_s: float) -> DiskSample:
    """The iostat -x figures of one disk over ``dt_s`` seconds."""
    if not dt_s > 0:
        return DiskSample(name, None, None, None, None, None, None, None, None)
    d_reads = _delta(cur.reads, prev.reads)
    d_writes = _delta(cur.writes, prev.writes)
    d_rticks = _delta(cur.read_ticks, prev.read_ticks)
    d_wticks = _delta(cur.write_ticks, prev.write_ticks)
    d_io = _delta(cur.io_ticks, prev.io_ticks)
    d_weighted = _delta(cur.weighted_ticks, prev.weighted_ticks)
    dt_ms = dt_s * 1000.0
    return DiskSample(
        name=name,
        reads_per_s=_rate(d_reads, dt_s),
        writes_per_s=_rate(d_writes, dt_s),
        read_bytes_per_s=_rate(_delta(cur.read_sectors, prev.read_sectors), dt_s, SECTOR_BYTES),
        write_bytes_per_s=_rate(_delta(cur.write_sectors, prev.write_sectors), dt_s, SECTOR_BYTES),
        util_percent=None if d_io is None else min(100.0, d_io / dt_ms * 100.0),
        r_await_ms=_await(d_rticks, d_reads),
        w_await_ms=_await(d_wticks, d_writes),
        queue_depth=None if d_weighted is None else d_weighted / dt_ms,
    )


class DiskStatsReader:
    """Keeps the previous /proc/diskstats reading; ``sample(now)`` gives the rates since then.

    Whole disks only: a device is a whole disk when ``{sys_root}/block/{name}`` exists (partitions
    live below their disk in sysfs); loop*, ram* and zram* devices and disks that never did any IO
    are left out, as iostat does by default.
    """

    __slots__ = ("_is_disk", "_prev", "_prev_time", "proc_root", "sys_root")

    def __init__(self, proc_root: str = "/proc", sys_root: str = "/sys") -> None:
        self.proc_root = proc_root
        self.sys_root = sys_root
        self._prev: dict[str, DiskCounters] = {}
        self._prev_time: float | None = None
        self._is_disk: dict[str, bool] = {}

    def _whole_disk(self, name: str) -> bool:
        known = self._is_disk.get(name)
        if known is None:
            known = not name.startswith(_SKIP_PREFIXES) and os.path.exists(
                f"{self.sys_root}/block/{name.replace('/', '!')}"
            )
            self._is_disk[name] = known
        return known

    def sample(self, now: float | None = None) -> tuple[DiskSample, ...]:
        """Read /proc/diskstats; ``now`` is ``time.monotonic()`` at the reading."""
        text = read_text(f"{self.proc_root}/diskstats")
        if now is None:
            now = time.monotonic()
        if text is None:
            return ()
        return self.sample_text(text, now)

    def sample_text(self, text: str, now: float) -> tuple[DiskSample, ...]:
        """As :meth:`sample`, from /proc/diskstats text already read."""
        counters = parse_diskstats(text, self._whole_disk)
        if len(self._is_disk) > 4 * text.count("\n") + 64:  # forget devices that went away
            self._is_disk = {n: v for n, v in self._is_disk.items() if n in counters}
        disks = {name: c for name, c in counters.items() if c.reads or c.writes}
        dt = None if self._prev_time is None else now - self._prev_time
        out: list[DiskSample] = []
        for name, cur in disks.items():
            prev = self._prev.get(name)
            if prev is None or dt is None:
                out.append(DiskSample(name, None, None, None, None, None, None, None, None))
            else:
                out.append(compute_disk_sample(name, prev, cur, dt))
        self._prev = disks
        self._prev_time = now
        return tuple(out)
