"""Machine-wide readings: /proc/meminfo, /proc/vmstat, PSI pressure and the target's /dev/shm.

Stdlib only and cheap: every function here runs once per tick. Nothing raises on a missing or
unreadable file; the value that could not be read is ``None``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from dlmon.model.snapshot import Pressure, ShmSample

__all__ = [
    "MeminfoReading",
    "parse_meminfo",
    "parse_pressure",
    "parse_vmstat_oom_kill",
    "read_meminfo",
    "read_oom_kill_count",
    "read_pressure",
    "read_shm",
    "read_text",
]


_READ_SIZE = 65536


def parse_count(token: str) -> int | None:
    """A kernel counter: ASCII digits only (``int()`` also takes "-5", "1_000" and "٣"), at most
    as many as 2**64 - 1 has; anything else is None."""
    token = token.strip()
    if not token.isascii() or not token.isdigit() or len(token) > 20:
        return None
    return int(token)


def read_text(path: str) -> str | None:
    """The whole file as text, or None when it cannot be read (missing, permission, EOPNOTSUPP)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    # os-level reads: a buffered file object costs more than the read of a small proc file
    try:
        chunks = [os.read(fd, _READ_SIZE)]
        while chunks[-1]:
            chunks.append(os.read(fd, _READ_SIZE))
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")


# --------------------------------------------------------------------------- /proc/meminfo


@dataclass(frozen=True, slots=True)
class MeminfoReading:
    total_bytes: int | None = None
    available_bytes: int | None = None
    free_bytes: int | None = None
    shmem_bytes: int | None = None
    dirty_bytes: int | None = None
    swap_total_bytes: int | None = None
    swap_free_bytes: int | None = None


_MEMINFO_KEYS = {
    "MemTotal": "total_bytes",
    "MemAvailable": "available_bytes",
    "MemFree": "free_bytes",
    "Shmem": "shmem_bytes",
    "Dirty": "dirty_bytes",
    "SwapTotal": "swap_total_bytes",
    "SwapFree": "swap_free_bytes",
}


def parse_meminfo(text: str) -> MeminfoReading:
    """Parse /proc/meminfo text; lines look like ``MemTotal:   24684084 kB``."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        attr = _MEMINFO_KEYS.get(key)
        if attr is None or not sep:
            continue
        parts = rest.split()
        if not parts:
            continue
        number = parse_count(parts[0])
        if number is None:
            continue
        unit = parts[1].lower() if len(parts) > 1 else ""
        values[attr] = number * 1024 if unit == "kb" else number
        if len(values) == len(_MEMINFO_KEYS):
            break
    return MeminfoReading(**values)


def read_meminfo(proc_root: str = "/proc") -> MeminfoReading:
    text = read_text(f"{proc_root}/meminfo")
    return MeminfoReading() if text is None else parse_meminfo(text)


# --------------------------------------------------------------------------- /proc/vmstat


def parse_vmstat_oom_kill(text: str) -> int | None:
    """The ``oom_kill`` counter of /proc/vmstat text (kernel >= 4.13), or None when absent."""
    if text.startswith("oom_kill "):
        start = len("oom_kill ")
    else:
        i = text.find("\noom_kill ")
        if i < 0:
            return None
        start = i + len("\noom_kill ")
    end = text.find("\n", start)
    return parse_count(text[start : end if end >= 0 else len(text)])


def read_oom_kill_count(proc_root: str = "/proc") -> int | None:
    text = read_text(f"{proc_root}/vmstat")
    return None if text is None else parse_vmstat_oom_kill(text)


# --------------------------------------------------------------------------- PSI


def parse_pressure(text: str) -> tuple[float | None, float | None]:
    """``(some avg10, full avg10)`` of one PSI file, e.g. ``some avg10=0.89 avg60=... total=...``."""
    some: float | None = None
    full: float | None = None
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind not in ("some", "full"):
            continue
        for token in rest.split():
            name, _, value = token.partition("=")
            if name == "avg10":
                try:
                    avg10: float | None = float(value)
                except ValueError:
                    break
                if not (avg10 is not None and math.isfinite(avg10) and avg10 >= 0):
                    avg10 = None  # "nan", "inf", "-1": no share of time a kernel writes
                if kind == "some":
                    some = avg10
                else:
                    full = avg10
                break
    return some, full


def _read_psi_file(directory: str, resource: str, cgroup: bool | None) -> tuple[float | None, float | None]:
    if cgroup is True:
        names: tuple[str, ...] = (f"{resource}.pressure",)
    elif cgroup is False:
        names = (resource,)
    elif os.path.basename(directory.rstrip("/")) == "pressure":  # most likely /proc/pressure
        names = (resource, f"{resource}.pressure")
    else:
        names = (f"{resource}.pressure", resource)
    for name in names:
        text = read_text(f"{directory}/{name}")
        if text is not None:
            return parse_pressure(text)
    return None, None


def read_pressure(directory: str = "/proc/pressure", cgroup: bool | None = None) -> Pressure | None:
    """PSI avg10 from ``directory``.

    ``cgroup=True``: a cgroup v2 directory (``io.pressure``, ``memory.pressure``, ``cpu.pressure``);
    ``cgroup=False``: /proc/pressure (``io``, ``memory``, ``cpu``); ``None``: try both namings (the
    plain one first when the directory is called ``pressure``). None when no file could be read
    (no PSI in the kernel, ``psi=0`` on the command line).
    """
    io_some, io_full = _read_psi_file(directory, "io", cgroup)
    mem_some, mem_full = _read_psi_file(directory, "memory", cgroup)
    cpu_some, _ = _read_psi_file(directory, "cpu", cgroup)
    if all(v is None for v in (io_some, io_full, mem_some, mem_full, cpu_some)):
        return None
    return Pressure(
        io_some_avg10=io_some,
        io_full_avg10=io_full,
        memory_some_avg10=mem_some,
        memory_full_avg10=mem_full,
        cpu_some_avg10=cpu_some,
    )


# --------------------------------------------------------------------------- /dev/shm


def _statvfs_shm(path: str) -> ShmSample | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    frsize = st.f_frsize or st.f_bsize
    return ShmSample(
        path=path,
        total_bytes=st.f_blocks * frsize,
        used_bytes=(st.f_blocks - st.f_bfree) * frsize,
        available_bytes=st.f_bavail * frsize,
    )


def read_shm(pid: int | None, proc_root: str = "/proc", fallback: str = "/dev/shm") -> ShmSample | None:
    """statvfs of the /dev/shm the target sees (its mount namespace), else of ``fallback``.

    ``{proc_root}/{pid}/root/dev/shm`` is the target's /dev/shm even when it runs in a container or
    after ``unshare -m``; it is unreadable without ptrace rights over the target, and then our own
    /dev/shm is the best guess. ``ShmSample.path`` is the path that was measured.
    """
    if pid is not None:
        sample = _statvfs_shm(f"{proc_root}/{pid}/root/dev/shm")
        if sample is not None:
            return sample
    return _statvfs_shm(fallback)
