"""Which of the job's processes hold a GPU's device node open: in a container's pid namespace,
the one tie between NVML's host pids and the job's processes.

A process can have a CUDA context on GPU N only while it holds ``/dev/nvidiaN`` open; the
driver may open the nodes of every visible GPU at start-up, so holding one does not prove use.
Counting both sides gives a bound that is certain: NVML lists ``n`` processes on a GPU, ``h`` of
the job's processes hold its node, so at least ``n - h`` of those ``n`` are not the job's (all of
them when none of the job's processes holds it).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable
from typing import Final

from dlmon.model.snapshot import GpuDevice

__all__ = ["DeviceHolders", "device_holders", "with_other_processes"]

#: fds read per process per tick at most (a job with thousands of open files costs no more).
MAX_FDS_PER_PROCESS: Final = 4096
#: How long a process's nodes are taken as read: CUDA opens them at start-up and keeps them (a
#: scan of 9 processes with 200 fds each costs ~8 ms of CPU: not every tick).
REFRESH_S: Final = 10.0


def device_holders(
    pids: Iterable[int], proc_root: str = "/proc", dev_root: str = "/dev"
) -> dict[int, set[int]]:
    """Per N of ``/dev/nvidiaN``: the pids (of ``pids``) that hold it open."""
    prefix = f"{dev_root.rstrip('/')}/nvidia"
    holders: dict[int, set[int]] = {}
    for pid in pids:
        try:
            entries = os.scandir(f"{proc_root}/{pid}/fd")
        except OSError:  # gone, or not ours to read
            continue
        with entries:
            for number, entry in enumerate(entries):
                if number >= MAX_FDS_PER_PROCESS:
                    break
                try:
                    target = os.readlink(entry.path)
                except OSError:
                    continue
                minor = target[len(prefix) :] if target.startswith(prefix) else ""
                if minor.isdigit():
                    holders.setdefault(int(minor), set()).add(pid)
    return holders


def with_other_processes(gpus: tuple[GpuDevice, ...], holders: dict[int, set[int]]) -> tuple[GpuDevice, ...]:
    """Each device NVML's processes are counted on (a container) with how many of them are
    certainly not the job's (see the module docstring); unchanged where its node is not known."""
    out = []
    for gpu in gpus:
        listed = gpu.unattributed_processes
        if listed is None or gpu.minor_number is None or gpu.stale_age_s is not None:
            out.append(gpu)
            continue
        ours = len(holders.get(gpu.minor_number, ()))
        out.append(dataclasses.replace(gpu, other_processes=max(0, listed - ours)))
    return tuple(out)


class DeviceHolders:
    """:func:`device_holders` read again for a process every ``refresh_s``, at once for a new one."""

    def __init__(
        self,
        proc_root: str = "/proc",
        dev_root: str = "/dev",
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._proc_root = proc_root
        self._dev_root = dev_root
        self._refresh_s = refresh_s
        self._clock = clock
        self._known: dict[int, tuple[float, frozenset[int]]] = {}  # pid -> (read at, its minors)

    def read(self, pids: Iterable[int]) -> dict[int, set[int]]:
        now = self._clock()
        wanted = set(pids)
        stale = [p for p in wanted if p not in self._known or now - self._known[p][0] >= self._refresh_s]
        fresh = device_holders(stale, self._proc_root, self._dev_root)
        for pid in stale:
            self._known[pid] = (now, frozenset(m for m, holders in fresh.items() if pid in holders))
        for pid in [p for p in self._known if p not in wanted]:
            del self._known[pid]
        holders: dict[int, set[int]] = {}
        for pid in wanted:
            for minor in self._known[pid][1]:
                holders.setdefault(minor, set()).add(pid)
        return holders
