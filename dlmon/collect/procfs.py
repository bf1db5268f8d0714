"""Parsers for /proc/PID files, and a handle that keeps their fds open.

An fd opened on /proc/PID/stat stays bound to that process: after it exits, reads fail with
ESRCH even if the pid is reused, so a handle can never mix two processes. ``os.pread`` at
offset 0 makes the kernel regenerate the file, so fds are opened once and read every tick.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from dataclasses import dataclass

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_READ_SIZE = 8192


class ProcessGone(Exception):
    """The process exited (or was reaped) while we were reading it."""


class AccessDenied(Exception):
    """The kernel refused to show this file (another user's process, hidepid, ptrace rules)."""


@dataclass(frozen=True, slots=True)
class StatFields:
    """The fields of /proc/PID/stat that dlmon uses."""

    comm: str
    state: str
    ppid: int
    minor_faults: int  # minflt: every copy-on-write break and first touch of a page counts one
    utime_ticks: int
    stime_ticks: int
    num_threads: int
    start_time: int
    rss_pages: int


def parse_stat(raw: bytes) -> StatFields:
    # comm may contain spaces and parentheses: it ends at the last ')'.
    close = raw.rindex(b")")
    comm = raw[raw.index(b"(") + 1 : close].decode("utf-8", "replace")
    rest = raw[close + 2 :].split()
    return StatFields(
        comm=comm,
        state=rest[0].decode(),
        ppid=int(rest[1]),
        minor_faults=int(rest[7]),
        utime_ticks=int(rest[11]),
        stime_ticks=int(rest[12]),
        num_threads=int(rest[17]),
        start_time=int(rest[19]),
        rss_pages=int(rest[21]),
    )


class FieldPicker:
    """Pulls only the named keys out of a ``Key: value [kB]`` file, in C (one regex scan).

    /proc/PID/status has ~55 lines and is read for every process every tick; splitting all of
    them in Python cost more than reading the file.
    """

    def __init__(self, keys: tuple[str, ...]) -> None:
        names = b"|".join(re.escape(k.encode()) for k in keys)
        self._pattern = re.compile(rb"^(" + names + rb"):\s+(\d+)( kB)?", re.MULTILINE)

    def __call__(self, raw: bytes) -> dict[str, int]:
        return {
            key.decode(): int(number) * 1024 if kb else int(number)
            for key, number, kb in self._pattern.findall(raw)
        }


def _read_fd(fd: int) -> bytes:
    try:
        chunks = [os.pread(fd, _READ_SIZE, 0)]
        while len(chunks[-1]) == _READ_SIZE:  # rare: a status file larger than one read
            chunks.append(os.pread(fd, _READ_SIZE, _READ_SIZE * len(chunks)))
    except OSError as exc:
        raise _translate(exc) from exc
    return b"".join(chunks)


def _translate(exc: OSError) -> Exception:
    if exc.errno in (errno.ESRCH, errno.ENOENT):
        return ProcessGone(str(exc))
    if exc.errno in (errno.EACCES, errno.EPERM):
        return AccessDenied("permission denied")
    return exc


class ProcHandle:
    """Open fds on one process's /proc files. Not thread-safe: one sampler owns it."""

    __slots__ = ("_base", "_closed", "_fds", "pid", "start_time")

    def __init__(self, pid: int, proc_root: str = "/proc") -> None:
        self.pid = pid
        self._base = f"{proc_root}/{pid}"
        self._fds: dict[str, int] = {}
        self._closed = False
        self.start_time = self.stat().start_time

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            if self._closed:  # reopening by path could reach a new process with a reused pid
                raise ProcessGone(f"{self._base} was closed")
            try:
                fd = os.open(f"{self._base}/{name}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise _translate(exc) from exc
            self._fds[name] = fd
        return fd

    def read(self, name: str) -> bytes:
        fd = self._fd(name)
        data = _read_fd(fd)
        if not data and name == "stat":
            raise ProcessGone(f"{self._base}/stat is empty")
        return data

    def read_once(self, name: str) -> bytes:
        """Read without keeping an fd: for files read rarely (smaps_rollup, cmdline)."""
        if self._closed:
            raise ProcessGone(f"{self._base} was closed")
        try:
            fd = os.open(f"{self._base}/{name}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise _translate(exc) from exc
        try:
            # Our stat fd still reading means the process lived past the open: the path
            # cannot have reached a newer process that reused the pid.
            self.read("stat")
            return _read_fd(fd)
        finally:
            os.close(fd)

    def stat(self) -> StatFields:
        try:
            return parse_stat(self.read("stat"))
        except (ValueError, IndexError) as exc:  # truncated read of an exiting process
            raise ProcessGone(str(exc)) from exc

    def count_fds(self) -> int:
        try:
            return len(os.listdir(f"{self._base}/fd"))
        except OSError as exc:
            raise _translate(exc) from exc

    def children(self) -> list[int]:
        """Direct children, from every thread's ``children`` file (needs CONFIG_PROC_CHILDREN)."""
        try:
            tids = os.listdir(f"{self._base}/task")
        except OSError as exc:
            raise _translate(exc) from exc
        found: list[int] = []
        for tid in tids:
            try:
                with open(f"{self._base}/task/{tid}/children", "rb") as fh:
                    found.extend(int(p) for p in fh.read().split())
            except OSError:
                continue  # the thread exited meanwhile
        return found

    def close(self) -> None:
        self._closed = True
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        self.close()


def children_files_supported(proc_root: str = "/proc") -> bool:
    return os.path.exists(f"{proc_root}/self/task/{os.getpid()}/children") or os.path.exists(
        f"{proc_root}/{os.getpid()}/task/{os.getpid()}/children"
    )


def all_pids(proc_root: str = "/proc") -> list[int]:
    return [int(name) for name in os.listdir(proc_root) if name.isdigit()]


def read_cmdline(pid: int, proc_root: str = "/proc") -> str:
    try:
        with open(f"{proc_root}/{pid}/cmdline", "rb") as fh:
            raw = fh.read()
    except OSError:
        return ""
    return " ".join(part.decode("utf-8", "replace") for part in raw.split(b"\0") if part)


def boot_time(proc_root: str = "/proc") -> float:
    """Unix time of boot, to turn start_time ticks into wall time."""
    with open(f"{proc_root}/stat", "rb") as fh:
        for line in fh:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    raise RuntimeError("no btime in /proc/stat")
