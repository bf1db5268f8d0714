"""The kernel's own word on a death: OOM kills and segfaults from ``/dev/kmsg``.

``/dev/kmsg`` is opened non-blocking and positioned at its end when dlmon starts, so only what
happens while dlmon watches is read, and a read never waits. Each ``read`` returns one record
(``prio,seq,usec,flags;text``); the usec stamp is the kernel's monotonic clock, converted to Unix
time with our own clock pair. Records about pids not in the job's tree within the last
``SEEN_GRACE_S`` are dropped (a pid the job used long ago may be another process's now); the
kept ones are bounded. Unreadable (not root, ``dmesg_restrict``, no such device): the reader
says why in ``unavailable`` and returns nothing.
"""

from __future__ import annotations

import errno
import os
import re
import time
from collections import OrderedDict
from collections.abc import Iterable

from dlmon.model.snapshot import KernelEvent

KMSG = "/dev/kmsg"
MAX_EVENTS = 32
MAX_READS_PER_TICK = 2048
MAX_SEEN_PIDS = 8192
# A pid is the job's for this long after it was last seen in the tree: the kernel's line about a
# kill comes within a tick or two; later, the pid may be another process's (pids are reused).
SEEN_GRACE_S = 30.0
_KB = 1024

# 6.x: "Memory cgroup out of memory: Killed process 6152 (python) total-vm:278712kB, anon-rss:65280kB,
#       file-rss:6612kB, shmem-rss:0kB, UID:0 pgtables:196kB oom_score_adj:0"
#      "Out of memory: Killed process 6152 (python) total-vm:..."
_KILLED = re.compile(
    r"(?P<scope>Memory cgroup out of memory|Out of memory)[^:]*: "
    r"Killed process (?P<pid>\d+) \((?P<comm>[^)]*)\)"
    r"(?:.*?total-vm:(?P<vm>\d+)kB)?(?:.*?anon-rss:(?P<anon>\d+)kB)?(?:.*?file-rss:(?P<file>\d+)kB)?"
    r"(?:.*?shmem-rss:(?P<shmem>\d+)kB)?"
)
# "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg=/a/b,
#  task_memcg=/a/b,task=python,pid=6152,uid=0"
_OOM_KILL = re.compile(r"oom-kill:(?P<fields>.*)")
# "python[1234]: segfault at 0 ip 00007f... sp 00007ff... error 4 in libc.so.6[7f..+1a000]"
_SEGFAULT = re.compile(r"(?P<comm>\S+)\[(?P<pid>\d+)\]: segfault at (?P<rest>.*)")


def _kb(v: str | None) -> int | None:
    return int(v) * _KB if v is not None else None


def parse_record(raw: bytes, *, now_unix: float, now_mono: float) -> tuple[str, float | None, str] | None:
    """(text, Unix time, prefix) of one /dev/kmsg record; None when it is not one."""
    head, sep, text = raw.partition(b";")
    if not sep:
        return None
    parts = head.split(b",")
    when: float | None = None
    if len(parts) >= 3:
        try:
            when = now_unix - (now_mono - int(parts[2]) / 1e6)
        except ValueError:
            when = None
    line = text.split(b"\n", 1)[0].decode("utf-8", "replace")
    return line, when, head.decode("ascii", "replace")


def _read_int(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            text = f.read(64).strip()
    except OSError:
        return None
    try:
        return int(text)
    except ValueError:
        return None  # "max"


UNLIMITED_V1 = 1 << 62


def memcg_figures(memcg: str, root: str) -> tuple[int | None, int | None]:
    """(limit, peak usage) of the memory cgroup the kernel named (v1 hierarchy, else v2)."""
    if ".." in memcg.split("/"):
        return None, None
    v1 = f"{root}/memory{memcg}"
    limit = _read_int(f"{v1}/memory.limit_in_bytes")
    if limit is not None:
        return (limit if limit < UNLIMITED_V1 else None), _read_int(f"{v1}/memory.max_usage_in_bytes")
    v2 = f"{root}{memcg}"
    return _read_int(f"{v2}/memory.max"), _read_int(f"{v2}/memory.peak")


class KernelLog:
    """Follows /dev/kmsg for OOM kills and segfaults of the pids it is told about."""

    def __init__(self, path: str = KMSG, cgroup_root: str = "/sys/fs/cgroup") -> None:
        self.unavailable: str | None = None
        self._cgroup_root = cgroup_root
        self._fd: int | None = None
        self._seen: OrderedDict[int, float] = OrderedDict()  # pid -> monotonic time last seen
        self._events: list[KernelEvent] = []
        self._constraints: dict[int, tuple[str | None, str | None]] = {}  # pid -> (constraint, memcg)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            self.unavailable = f"{path}: {exc.strerror or exc}"
            return
        try:
            os.lseek(fd, 0, os.SEEK_END)
        except OSError as exc:
            os.close(fd)
            self.unavailable = f"{path}: cannot seek: {exc.strerror or exc}"
            return
        self._fd = fd

    def sample(self, pids: Iterable[int]) -> tuple[KernelEvent, ...]:
        """Note ``pids`` as the job's, read what the kernel said since, return the kept events."""
        now = time.monotonic()
        for pid in pids:
            self._seen[pid] = now
            self._seen.move_to_end(pid)
        while self._seen and (
            len(self._seen) > MAX_SEEN_PIDS or now - next(iter(self._seen.values())) > SEEN_GRACE_S
        ):
            self._seen.popitem(last=False)
        if self._fd is not None:
            try:
                self._drain()
            except Exception as exc:  # a record we cannot parse must not cost the sample
                self.unavailable = f"{type(exc).__name__}: {exc}"
        return tuple(self._events)

    def _drain(self) -> None:
        fd = self._fd
        assert fd is not None
        now_unix, now_mono = time.time(), time.monotonic()
        for _ in range(MAX_READS_PER_TICK):
            try:
                raw = os.read(fd, 8192)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten before we read it: go on with the next
                    continue
                self.unavailable = f"{KMSG}: {exc.strerror or exc}"
                self.close()
                return
            if not raw:
                return
            rec = parse_record(raw, now_unix=now_unix, now_mono=now_mono)
            if rec is not None:
                self._handle(rec[0], rec[1])

    def _handle(self, line: str, when: float | None) -> None:
        m = _OOM_KILL.match(line)
        if m is not None:
            fields = dict(kv.split("=", 1) for kv in m.group("fields").split(",") if "=" in kv)
            try:
                pid = int(fields.get("pid", ""))
            except ValueError:
                return
            constraint = fields.get("constraint")
            self._constraints[pid] = (constraint, fields.get("oom_memcg"))
            if len(self._constraints) > 4 * MAX_EVENTS:
                self._constraints.pop(next(iter(self._constraints)))
            return
        m = _KILLED.search(line)
        if m is not None:
            pid = int(m.group("pid"))
            if pid not in self._seen:
                return
            constraint, memcg = self._constraints.get(pid, (None, None))
            limit, peak = memcg_figures(memcg, self._cgroup_root) if memcg else (None, None)
            scope = m.group("scope")
            if constraint == "CONSTRAINT_MEMCG" or scope.startswith("Memory cgroup"):
                where: str | None = "cgroup"
            elif constraint in (None, "CONSTRAINT_NONE"):
                where = "machine"
            else:
                where = constraint.lower()
            self._add(
                KernelEvent(
                    kind="oom_kill",
                    pid=pid,
                    comm=m.group("comm"),
                    time=when,
                    constraint=where,
                    memcg=memcg,
                    anon_rss_bytes=_kb(m.group("anon")),
                    file_rss_bytes=_kb(m.group("file")),
                    shmem_rss_bytes=_kb(m.group("shmem")),
                    total_vm_bytes=_kb(m.group("vm")),
                    line=line[:300],
                    memcg_limit_bytes=limit,
                    memcg_peak_bytes=peak,
                )
            )
            return
        m = _SEGFAULT.search(line)
        if m is not None:
            pid = int(m.group("pid"))
            if pid in self._seen:
                self._add(
                    KernelEvent(kind="segfault", pid=pid, comm=m.group("comm"), time=when, line=line[:300])
                )

    def _add(self, event: KernelEvent) -> None:
        self._events.append(event)
        if len(self._events) > MAX_EVENTS:
            del self._events[0]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
