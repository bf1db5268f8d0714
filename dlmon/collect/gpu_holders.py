"""Which of the job's processes hold a GPU's device node open: in a container's pid namespace,
the one tie between NVML's host pids and the job's processes.

A process can have a CUDA context on GPU N only while it holds ``/dev/nvidiaN`` open; the
driver may open the nodes of every visible GPU at start-up, so holding one does not prove use.
Counting both sides gives a bound that is certain: NVML lists ``n`` processes on a GPU, ``h`` of
the job's processes hold its node, so at least ``n - h`` of those ``n`` are not the job's (all of
them when none of the job's processes holds it). That needs every one of the job's processes
read in full: one that is not (not ours to read, too many fds) gives no bound at all.
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
    pids: Iterable[int],
    proc_root: str = "/proc",
    dev_root: str = "/dev",
    *,
    unknown: set[int] | None = None,
    max_fds: int = MAX_FDS_PER_PROCESS,
) -> dict[int, set[int]]:
    """Per N of ``/dev/nvidiaN``: the pids (of ``pids``) that hold it open. A pid whose fds
    could not all be read (not ours to read, or more than ``max_fds``) is added to ``unknown``:
    it may hold any node, so no bound may count it as holding none. A pid gone holds none."""
    prefix = f"{dev_root.rstrip('/')}/nvidia"
    holders: dict[int, set[int]] = {}
    for pid in pids:
        try:
            entries = os.scandir(f"{proc_root}/{pid}/fd")
        except FileNotFoundError:  # gone
            continue
        except OSError:  # not ours to read (another user's, or not dumpable)
            if unknown is not None:
                unknown.add(pid)
            continue
        with entries:
            for number, entry in enumerate(entries):
                if number >= max_fds:
                    if unknown is not None:
                        unknown.add(pid)
                    break
                try:
                    target = os.readlink(entry.path)
                except FileNotFoundError:  # closed since listed
                    continue
                except OSError:  # listed, but its targets not ours to read (not dumpable)
                    if unknown is not None:
                        unknown.add(pid)
                    break
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
        max_fds: int = MAX_FDS_PER_PROCESS,
    ) -> None:
        self._proc_root = proc_root
        self._dev_root = dev_root
        self._refresh_s = refresh_s
        self._clock = clock
        self._max_fds = max_fds
        # pid -> (read at, its minors; None: its fds could not all be read)
        self._known: dict[int, tuple[float, frozenset[int] | None]] = {}

    def read(self, pids: Iterable[int]) -> dict[int, set[int]] | None:
        """Per N: which of ``pids`` hold ``/dev/nvidiaN``; None when one of them could not be
        read in full (then no GPU's processes are certainly not the job's)."""
        now = self._clock()
        wanted = set(pids)
        stale = [p for p in wanted if p not in self._known or now - self._known[p][0] >= self._refresh_s]
        unknown: set[int] = set()
        fresh = device_holders(stale, self._proc_root, self._dev_root, unknown=unknown, max_fds=self._max_fds)
        for pid in stale:
            minors = (
                None if pid in unknown else frozenset(m for m, holders in fresh.items() if pid in holders)
            )
            self._known[pid] = (now, minors)
        for pid in [p for p in self._known if p not in wanted]:
            del self._known[pid]
        holders: dict[int, set[int]] = {}
        for pid in wanted:
            minors = self._known[pid][1]
            if minors is None:
                return None
            for minor in minors:
                holders.setdefault(minor, set()).add(pid)
        return holders
