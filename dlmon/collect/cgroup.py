"""The memory cgroup of a process: its effective limit, usage, OOM kills and (v2) pressure.

Locating the cgroup (``/proc/PID/cgroup`` + ``/proc/self/mountinfo``) is done once per target by
:func:`locate_memory_cgroup` / :class:`CgroupMemoryReader`; each tick only reads a handful of small
files in the located directory. Nothing here raises on a missing or unreadable file.

cgroup v2: ``memory.max`` (``max`` = unlimited) of the cgroup and of every ancestor up to the mount
root, the smallest one is the effective limit; ``memory.current``; ``oom_kill`` of
``memory.events``; ``{memory,io,cpu}.pressure``.

cgroup v1 (also on a hybrid system, where the memory controller lives on v1):
``memory.limit_in_bytes`` of the cgroup and its visible ancestors and ``hierarchical_memory_limit``
of ``memory.stat`` (the smallest limit on the way up), ``memory.usage_in_bytes``, ``oom_kill`` of
``memory.oom_control``. Limits of 2**60 bytes or more mean "unlimited" (the kernel reports
PAGE_COUNTER_MAX * PAGE_SIZE).

Usage and limit are compared at the same level: when the limit sits on an ancestor (Slurm puts it
on the job, the task runs in a step below it), usage, page cache and OOM kills are read there too,
as that is the counter the kernel compares with the limit. Usage includes page cache; the
**working set** is usage - inactive_file (v2 ``inactive_file``, v1 ``total_inactive_file``), the
figure the kubelet and cAdvisor act on: a job streaming its dataset fills the cgroup with cache the
kernel reclaims before it kills anything.
"""

from __future__ import annotations

import os
import posixpath
import time
from dataclasses import dataclass

from dlmon.collect.system import read_pressure, read_text
from dlmon.model.snapshot import CgroupMemory

__all__ = [
    "NOT_VISIBLE",
    "UNLIMITED_THRESHOLD",
    "CgroupLocation",
    "CgroupMemoryReader",
    "Mount",
    "ProcCgroup",
    "UsableCores",
    "locate_memory_cgroup",
    "parse_mountinfo",
    "parse_proc_cgroup",
    "read_cgroup_memory",
]

UNLIMITED_THRESHOLD = 2**60
NOT_VISIBLE = "cgroup not visible from here (the target is outside dlmon's cgroup namespace)"


@dataclass(frozen=True, slots=True)
class Mount:
    """One cgroup line of /proc/PID/mountinfo."""

    root: str  # field 4: the directory of the hierarchy that is mounted here ("/" usually)
    mount_point: str
    fstype: str  # "cgroup" (v1) or "cgroup2"
    super_options: tuple[str, ...]  # v1: the controllers, e.g. ("rw", "memory")


@dataclass(frozen=True, slots=True)
class ProcCgroup:
    """What /proc/PID/cgroup says about memory."""

    v1_memory_path: str | None  # path in the v1 hierarchy that has the memory controller
    v2_path: str | None  # path of the ``0::`` line


@dataclass(frozen=True, slots=True)
class CgroupLocation:
    version: int  # 1 or 2
    path: str  # cgroup path of ``directory``, relative to the hierarchy (as in /proc/PID/cgroup)
    directory: str  # where the files are read
    ancestors: tuple[str, ...]  # directory's parents up to and including the mount root
    fallback: bool = False  # the target's own path was not visible: the mount root is read instead


def _unescape_mountinfo(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal
    if "\\" not in field:
        return field
    out: list[str] = []
    i = 0
    while i < len(field):
        if field[i] == "\\" and len(field[i + 1 : i + 4]) == 3 and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> tuple[Mount, ...]:
    """The cgroup and cgroup2 mounts of /proc/PID/mountinfo text, in file order."""
    mounts: list[Mount] = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        rparts = right.split()
        if not rparts or rparts[0] not in ("cgroup", "cgroup2"):
            continue
        lparts = left.split()
        if len(lparts) < 5:
            continue
        options = tuple(rparts[2].split(",")) if len(rparts) > 2 else ()
        mounts.append(
            Mount(
                root=_unescape_mountinfo(lparts[3]),
                mount_point=_unescape_mountinfo(lparts[4]),
                fstype=rparts[0],
                super_options=options,
            )
        )
    return tuple(mounts)


def parse_proc_cgroup(text: str) -> ProcCgroup:
    """/proc/PID/cgroup lines are ``hierarchy-ID:controller-list:path``; v2 is ``0::path``."""
    v1_memory: str | None = None
    v2: str | None = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1_memory = path
    return ProcCgroup(v1_memory_path=v1_memory, v2_path=v2)


def _find_mount(mounts: tuple[Mount, ...], version: int) -> Mount | None:
    if version == 2:
        found = [m for m in mounts if m.fstype == "cgroup2"]
    else:
        found = [m for m in mounts if m.fstype == "cgroup" and "memory" in m.super_options]
    # prefer a mount of the whole hierarchy over a bind mount of a subtree; of equals the last,
    # as a later mount on the same mount point shadows the earlier one
    whole = [m for m in found if m.root == "/"]
    return (whole or found)[-1] if found else None


def _resolve(mount_point: str, mount_root_field: str, path: str) -> tuple[str, str] | None:
    """(cgroup path, directory) of ``path`` under a mount of ``mount_root_field``; None if outside."""
    if ".." in path.split("/"):
        return None  # outside our cgroup namespace: handled by the caller
    path = posixpath.normpath("/" + path.lstrip("/")) if path else "/"
    root = posixpath.normpath(mount_root_field or "/")
    if root == "/":
        rel = path
    elif path == root or path.startswith(root + "/"):
        rel = path[len(root) :] or "/"
    else:
        return None
    directory = mount_point.rstrip("/") + (rel if rel != "/" else "")
    return path, directory or "/"


def _ancestors(directory: str, stop: str) -> tuple[str, ...]:
    """directory's parents up to and including ``stop`` (directory itself excluded)."""
    out: list[str] = []
    stop = posixpath.normpath(stop)
    d = posixpath.normpath(directory)
    while d != stop:
        parent = posixpath.dirname(d)
        if parent == d or not (parent + "/").startswith(stop.rstrip("/") + "/"):
            break
        out.append(parent)
        d = parent
    return tuple(out)


def _detect_version(mount_root: str) -> int | None:
    if os.path.exists(f"{mount_root}/cgroup.controllers"):
        return 2
    if os.path.exists(f"{mount_root}/memory.limit_in_bytes") or os.path.exists(
        f"{mount_root}/memory.usage_in_bytes"
    ):
        return 1
    return None


def locate_memory_cgroup(
    pid: int | str,
    proc_root: str = "/proc",
    mount_root: str | None = None,
    mountinfo_path: str | None = None,
) -> tuple[CgroupLocation | None, str | None]:
    """Find the directory of ``pid``'s memory cgroup: ``(location, None)`` or ``(None, reason)``.

    ``mount_root`` overrides the mount point of the memory hierarchy (tests, or a cgroupfs mounted
    somewhere the mountinfo does not say); the version is still taken from /proc/PID/cgroup and
    mountinfo, or guessed from the files in ``mount_root`` when mountinfo cannot be read.
    ``mountinfo_path`` defaults to ``{proc_root}/self/mountinfo``.
    """
    cg_text = read_text(f"{proc_root}/{pid}/cgroup")
    if cg_text is None:
        return None, f"cannot read {proc_root}/{pid}/cgroup"
    proc_cg = parse_proc_cgroup(cg_text)
    mi_text = read_text(mountinfo_path or f"{proc_root}/self/mountinfo")
    mounts = parse_mountinfo(mi_text) if mi_text is not None else ()

    version: int | None
    mount: Mount | None = None
    if proc_cg.v1_memory_path is not None:
        # the kernel lists the memory controller on a v1 line: it is bound to v1 (hybrid or legacy)
        version, path = 1, proc_cg.v1_memory_path
        mount = _find_mount(mounts, 1)
    elif proc_cg.v2_path is not None:
        version, path = 2, proc_cg.v2_path
        mount = _find_mount(mounts, 2)
    else:
        return None, "no memory cgroup in /proc/PID/cgroup"

    if mount_root is not None:
        mount_point = mount_root
        root_field = mount.root if mount is not None else "/"
        if mi_text is None:
            version = _detect_version(mount_root) or version
    elif mount is not None:
        mount_point, root_field = mount.mount_point, mount.root
    else:
        return None, f"cgroup v{version} memory hierarchy is not mounted"

    if ".." in path.split("/"):
        # the kernel shows a cgroup outside our cgroup namespace as /../..: its files cannot be
        # reached from here, and the mount root is dlmon's own cgroup, not the target's
        return None, NOT_VISIBLE
    resolved = _resolve(mount_point, root_field, path)
    fallback = False
    if resolved is None or not os.path.isdir(resolved[1]):
        # cgroup namespace / the container's own cgroup mounted at the root: the path of
        # /proc/PID/cgroup is not visible under the mount, but the mount root is the target's cgroup
        if not os.path.isdir(mount_point):
            return None, f"{mount_point} is not a directory"
        resolved = (posixpath.normpath(root_field or "/"), mount_point)
        fallback = True
    cg_path, directory = resolved
    ancestors = _ancestors(directory, mount_point)
    return (
        CgroupLocation(
            version=version,
            path=cg_path,
            directory=directory,
            ancestors=ancestors,
            fallback=fallback,
        ),
        None,
    )


def _read_int(path: str) -> int | None:
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def _limit(value: int | None) -> int | None:
    if value is None or value >= UNLIMITED_THRESHOLD or value < 0:
        return None
    return value


def _read_v2_max(path: str) -> tuple[bool, int | None]:
    """(readable, limit): ``max`` -> (True, None)."""
    text = read_text(path)
    if text is None:
        return False, None
    s = text.strip()
    if s == "max":
        return True, None
    try:
        return True, _limit(int(s))
    except ValueError:
        return False, None


def _keyed_value(text: str | None, key: str) -> int | None:
    if text is None:
        return None
    prefix = key + " "
    if text.startswith(prefix):
        start = len(prefix)
    else:
        i = text.find("\n" + prefix)
        if i < 0:
            return None
        start = i + 1 + len(prefix)
    end = text.find("\n", start)
    try:
        return int(text[start : end if end >= 0 else len(text)])
    except ValueError:
        return None


def _min_limit(values: list[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _working_set(usage: int | None, inactive_file: int | None) -> int | None:
    if usage is None:
        return None
    return max(0, usage - (inactive_file or 0)) if inactive_file is not None else None


def _limiting_level(levels: list[tuple[str, int | None]]) -> tuple[int | None, str]:
    """(smallest limit, the directory that sets it): the deepest of equal limits; the first
    directory (the target's own) when nothing is limited."""
    best: tuple[int | None, str] = (None, levels[0][0])
    for directory, limit in levels:
        if limit is not None and (best[0] is None or limit < best[0]):
            best = (limit, directory)
    return best


def _relative(loc: CgroupLocation, directory: str) -> str:
    """The cgroup path of ``directory``, one of ``loc.directory`` and its ancestors."""
    up = 0
    d = posixpath.normpath(loc.directory)
    while d != posixpath.normpath(directory) and up < 64:
        d = posixpath.dirname(d)
        up += 1
    path = loc.path
    for _ in range(up):
        path = posixpath.dirname(path) or "/"
    return path


def read_location(loc: CgroupLocation) -> CgroupMemory | None:
    """The values of an already located cgroup; None when its directory is gone."""
    d = loc.directory
    if loc.version == 2:
        readable, own = _read_v2_max(f"{d}/memory.max")
        own_current = _read_int(f"{d}/memory.current")
        if not readable and own_current is None and not os.path.isdir(d):
            return None
        levels = [(d, own)] + [(a, _read_v2_max(f"{a}/memory.max")[1]) for a in loc.ancestors]
        limit, at = _limiting_level(levels)
        current = own_current if at == d else _read_int(f"{at}/memory.current")
        stat = read_text(f"{at}/memory.stat")
        inactive = _keyed_value(stat, "inactive_file")
        return CgroupMemory(
            version=2,
            path=loc.path,
            limit_bytes=limit,
            current_bytes=current,
            oom_kill_count=_keyed_value(read_text(f"{at}/memory.events"), "oom_kill"),
            pressure=read_pressure(d, cgroup=True),
            working_set_bytes=_working_set(current, inactive),
            cache_bytes=_keyed_value(stat, "file"),
            inactive_file_bytes=inactive,
            usage_path=_relative(loc, at),
        )
    own_current = _read_int(f"{d}/memory.usage_in_bytes")
    own_raw = _read_int(f"{d}/memory.limit_in_bytes")
    if own_current is None and own_raw is None and not os.path.isdir(d):
        return None
    own_stat = read_text(f"{d}/memory.stat")
    levels = [(d, _limit(own_raw))] + [
        (a, _limit(_read_int(f"{a}/memory.limit_in_bytes"))) for a in loc.ancestors
    ]
    limit, at = _limiting_level(levels)
    hier = _limit(_keyed_value(own_stat, "hierarchical_memory_limit"))
    current = own_current if at == d else _read_int(f"{at}/memory.usage_in_bytes")
    if hier is not None and (limit is None or hier < limit):
        # set above what this mount shows: the highest readable level is the closest we have
        limit, at, current = hier, d, own_current
        for directory, _ in reversed(levels[1:]):
            usage = _read_int(f"{directory}/memory.usage_in_bytes")
            if usage is not None:
                at, current = directory, usage
                break
    stat = own_stat if at == d else read_text(f"{at}/memory.stat")
    inactive = _keyed_value(stat, "total_inactive_file")
    return CgroupMemory(
        version=1,
        path=loc.path,
        limit_bytes=limit,
        current_bytes=current,
        oom_kill_count=_keyed_value(read_text(f"{at}/memory.oom_control"), "oom_kill"),
        pressure=None,
        working_set_bytes=_working_set(current, inactive),
        cache_bytes=_keyed_value(stat, "total_cache"),
        inactive_file_bytes=inactive,
        usage_path=_relative(loc, at),
    )


class CgroupMemoryReader:
    """Created once per target: locates its memory cgroup, then ``.read()`` every tick.

    When the located directory disappears (the target was moved to another cgroup, or the cgroup
    was removed) the reader locates again, at most every ``relocate_interval_s`` seconds.
    ``reason`` says why the last ``read()`` returned None.
    """

    __slots__ = (
        "_cgroup_text",
        "_last_locate",
        "location",
        "mount_root",
        "mountinfo_path",
        "pid",
        "proc_root",
        "reason",
        "relocate_interval_s",
    )

    def __init__(
        self,
        pid: int,
        proc_root: str = "/proc",
        mount_root: str | None = None,
        mountinfo_path: str | None = None,
        relocate_interval_s: float = 10.0,
    ) -> None:
        self.pid = pid
        self.proc_root = proc_root
        self.mount_root = mount_root
        self.mountinfo_path = mountinfo_path
        self.relocate_interval_s = relocate_interval_s
        self.location: CgroupLocation | None = None
        self.reason: str | None = None
        self._last_locate = 0.0
        self._cgroup_text: str | None = None
        self.locate()

    def locate(self) -> CgroupLocation | None:
        self._last_locate = time.monotonic()
        self._cgroup_text = read_text(f"{self.proc_root}/{self.pid}/cgroup")
        self.location, self.reason = locate_memory_cgroup(
            self.pid, self.proc_root, self.mount_root, self.mountinfo_path
        )
        return self.location

    def _moved(self) -> bool:
        """/proc/PID/cgroup changed since the last locate (a launcher moved the job after start)."""
        text = read_text(f"{self.proc_root}/{self.pid}/cgroup")
        return text is not None and text != self._cgroup_text

    def read(self) -> CgroupMemory | None:
        if self._moved():
            self.locate()
            return None if self.location is None else self._read_located(self.location)
        loc = self.location
        if loc is not None:
            value = read_location(loc)
            if value is not None:
                return value
            self.reason = f"{loc.directory} is gone"
        if time.monotonic() - self._last_locate < self.relocate_interval_s:
            return None
        loc = self.locate()
        if loc is None:
            return None
        return self._read_located(loc)

    def _read_located(self, loc: CgroupLocation) -> CgroupMemory | None:
        value = read_location(loc)
        if value is None:
            self.reason = f"{loc.directory} is gone"
        return value


def read_cgroup_memory(
    pid: int,
    proc_root: str = "/proc",
    mount_root: str | None = None,
    mountinfo_path: str | None = None,
) -> CgroupMemory | None:
    """One-shot: locate and read. A monitor should keep a :class:`CgroupMemoryReader` instead."""
    loc, _ = locate_memory_cgroup(pid, proc_root, mount_root, mountinfo_path)
    return None if loc is None else read_location(loc)


# --------------------------------------------------------------------------- usable cores


def _cpu_cgroup_dirs(pid: int | str, proc_root: str) -> tuple[int, list[str]] | None:
    """(version, [the target's cpu cgroup directory and its visible ancestors]) or None."""
    cg_text = read_text(f"{proc_root}/{pid}/cgroup")
    mi_text = read_text(f"{proc_root}/self/mountinfo")
    if cg_text is None or mi_text is None:
        return None
    mounts = parse_mountinfo(mi_text)
    v1_path = v2_path = None
    for line in cg_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
        elif "cpu" in parts[1].split(","):
            v1_path = parts[2]
    if v1_path is not None:
        found = [m for m in mounts if m.fstype == "cgroup" and "cpu" in m.super_options]
        version, path = 1, v1_path
    elif v2_path is not None:
        found = [m for m in mounts if m.fstype == "cgroup2"]
        version, path = 2, v2_path
    else:
        return None
    if not found or ".." in path.split("/"):
        return None
    mount = ([m for m in found if m.root == "/"] or found)[-1]
    resolved = _resolve(mount.mount_point, mount.root, path)
    directory = resolved[1] if resolved is not None and os.path.isdir(resolved[1]) else mount.mount_point
    return version, [directory, *_ancestors(directory, mount.mount_point)]


def _quota_cores(version: int, directory: str) -> float | None:
    if version == 2:
        text = read_text(f"{directory}/cpu.max")
        parts = text.split() if text else []
        if len(parts) == 2 and parts[0] != "max":
            try:
                return _cores(int(parts[0]), int(parts[1]))
            except ValueError:
                return None
        return None
    quota = _read_int(f"{directory}/cpu.cfs_quota_us")
    period = _read_int(f"{directory}/cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    return _cores(quota, period)  # quota -1: no quota


def _cores(quota: int, period: int) -> float | None:
    """quota / period, or None for no quota (-1), a zero or negative period, a quota no float
    holds (OverflowError) or a ratio too small for one (a period the kernel never accepts)."""
    if quota <= 0 or period <= 0:
        return None
    try:
        cores = quota / period
        return cores if cores > 0.0 else None
    except OverflowError:
        return None


class UsableCores:
    """The cores the target may use: its CPU affinity (a cpuset narrows it) and the CPU quota of
    its cgroup and ancestors (v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``, v2 ``cpu.max``),
    whichever is smaller. The cgroup is located once; ``read()`` is a syscall and a few small files.
    """

    def __init__(self, pid: int, proc_root: str = "/proc", refresh_s: float = 5.0) -> None:
        self.pid = pid
        self._dirs = _cpu_cgroup_dirs(pid, proc_root)
        self.refresh_s = refresh_s
        self._last: tuple[float, float | None] | None = None

    def read(self) -> float | None:
        """As of at most ``refresh_s`` ago: affinity and quotas are set at launch and rarely
        changed, and their reads cost as much as the rest of the machine-wide files together."""
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.refresh_s:
            return self._last[1]
        value = self.read_now()
        self._last = (now, value)
        return value

    def read_now(self) -> float | None:
        try:
            affinity: float | None = float(len(os.sched_getaffinity(self.pid)))
        except (AttributeError, OSError):
            affinity = None
        quotas: list[float] = []
        if self._dirs is not None:
            version, dirs = self._dirs
            quotas = [q for q in (_quota_cores(version, d) for d in dirs) if q is not None]
        options = [v for v in (affinity, min(quotas) if quotas else None) if v is not None]
        return round(min(options), 2) if options else None
