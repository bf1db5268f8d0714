"""Parsers for /proc/PID files, and a handle that keeps their fds open.

An fd opened on /proc/PID/stat stays bound to that process: after it exits, reads fail with
ESRCH even if the pid is reused, so a handle can never mix two processes. ``os.pread`` at
offset 0 makes the kernel regenerate the file, so fds are opened once and read again on each
tick that needs the file (stat every tick; status and io when the process moved, processes.py).

Anything opened by path (smaps_rollup, the fd and task directories, or every file of a handle
that holds no fds because dlmon reached its fd cap) is checked after the open: the held stat fd
still reads, or a stat read by path afterwards shows the same start time. Either proves the
process lived past the open, so the path cannot have reached a newer process with a reused pid;
children files are then opened relative to the verified task directory fd. (Start times count
10 ms clock ticks: a handle without fds cannot tell a process from one that reused its pid within
the same clock tick it started in, which needs the pid space to wrap in 10 ms.)
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass

from dlmon.model.format import DEAD_STATES

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
    pgrp: int  # the process group: what ``dlmon run`` looks for in the training's leftovers
    minor_faults: int  # minflt: every copy-on-write break and first touch of a page counts one
    major_faults: int  # majflt: a page read in from disk or swap
    utime_ticks: int
    stime_ticks: int
    num_threads: int
    start_time: int
    rss_pages: int


def parse_stat(raw: bytes) -> StatFields:
    # comm may contain spaces and parentheses: it ends at the last ')'.
    close = raw.rindex(b")")
    comm = raw[raw.index(b"(") + 1 : close].decode("utf-8", "replace")
    # Only the first 22 fields are split off (the line has ~50), and the fields are passed by
    # position: read for every process every tick, this is the cheapest parse (6.1 -> 2.8 us).
    rest = raw[close + 2 :].split(None, 22)
    return StatFields(
        comm,  # comm
        rest[0].decode(),  # state
        int(rest[1]),  # ppid
        int(rest[2]),  # pgrp
        int(rest[7]),  # minor_faults
        int(rest[9]),  # major_faults
        int(rest[11]),  # utime_ticks
        int(rest[12]),  # stime_ticks
        int(rest[17]),  # num_threads
        int(rest[19]),  # start_time
        int(rest[21]),  # rss_pages
    )


MAX_COUNTER_DIGITS = 20  # 2**64 - 1 has 20 digits


class FieldPicker:
    """Pulls only the named keys out of a ``Key: value [kB]`` file.

    /proc/PID/status has ~55 lines and is read for every process that moved; splitting all of
    them in Python cost more than reading the file, and a regex over every line start still
    cost 1.6x the read. ``bytes.find`` per wanted key (C, memchr-fast) costs less than the read.
    """

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = tuple((key, b"\n" + key.encode() + b":", len(key) + 2) for key in keys)

    def __call__(self, raw: bytes) -> dict[str, int]:
        out: dict[str, int] = {}
        find = raw.find
        for key, needle, skip in self._keys:
            start = find(needle) + skip  # just after "\nKey:"
            if start < skip:
                if not raw.startswith(needle[1:]):
                    continue
                start = skip - 1  # the first line has no newline before it
            end = find(b"\n", start)
            parts = raw[start:end].split() if end >= 0 else raw[start:].split()
            if not parts or not parts[0].isdigit() or len(parts[0]) > MAX_COUNTER_DIGITS:
                continue  # not a number, or one no kernel counter holds (int() refuses 4300+ digits)
            out[key] = int(parts[0]) * 1024 if parts[1:2] == [b"kB"] else int(parts[0])
        return out


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
    """One process's /proc files, read by held fds (``hold_fds``) or by path with identity
    checks. Not thread-safe: one sampler owns it."""

    __slots__ = ("_base", "_closed", "_fds", "first_stat", "hold_fds", "pid", "start_time")

    def __init__(self, pid: int, proc_root: str = "/proc", *, hold_fds: bool = True) -> None:
        self.pid = pid
        self._base = f"{proc_root}/{pid}"
        self._fds: dict[str, int] = {}
        self._closed = False
        self.hold_fds = hold_fds
        self.start_time = -1
        self.first_stat = self.stat()  # read once at the open: the caller's first tick uses it
        self.start_time = self.first_stat.start_time

    def _open(self, name: str, flags: int = os.O_RDONLY) -> int:
        if self._closed:  # reopening by path could reach a new process with a reused pid
            raise ProcessGone(f"{self._base} was closed")
        try:
            return os.open(f"{self._base}/{name}", flags | os.O_CLOEXEC)
        except OSError as exc:
            raise _translate(exc) from exc

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            fd = self._open(name)
            if "stat" in self._fds:  # once per file per handle: held from now on, so verify it
                try:
                    self._verify()
                except BaseException:
                    os.close(fd)
                    raise
            self._fds[name] = fd
        return fd

    def _verify(self) -> None:
        """Raise ProcessGone unless this process is still alive, after an open by path."""
        if self.hold_fds:
            self.read("stat")
        else:
            self._stat_by_path()

    def _stat_by_path(self) -> StatFields:
        fd = self._open("stat")
        try:
            raw = _read_fd(fd)
        finally:
            os.close(fd)
        try:
            stat = parse_stat(raw)
        except (ValueError, IndexError) as exc:  # truncated read of an exiting process
            raise ProcessGone(str(exc)) from exc
        if self.start_time >= 0 and stat.start_time != self.start_time:
            raise ProcessGone(f"{self._base} now belongs to another process")
        return stat

    def read(self, name: str) -> bytes:
        if not self.hold_fds:
            return self.read_once(name)
        data = _read_fd(self._fd(name))
        if not data and name == "stat":
            raise ProcessGone(f"{self._base}/stat is empty")
        return data

    def read_once(self, name: str) -> bytes:
        """Read without keeping an fd: for files read rarely (smaps_rollup, cmdline)."""
        fd = self._open(name)
        try:
            self._verify()
            return _read_fd(fd)
        finally:
            os.close(fd)

    def stat(self) -> StatFields:
        if not self.hold_fds:
            return self._stat_by_path()
        fd = self._fds.get("stat")
        if fd is not None:  # the every-tick path, in one call: one read of the held fd, parsed
            try:
                raw = os.pread(fd, _READ_SIZE, 0)
            except OSError as exc:
                raise _translate(exc) from exc
            if raw and len(raw) < _READ_SIZE:
                try:
                    return parse_stat(raw)
                except (ValueError, IndexError) as exc:  # truncated read of an exiting process
                    raise ProcessGone(str(exc)) from exc
        try:
            return parse_stat(self.read("stat"))
        except (ValueError, IndexError) as exc:  # truncated read of an exiting process
            raise ProcessGone(str(exc)) from exc

    def stat_unless(self, previous: tuple[bytes, StatFields] | None) -> tuple[bytes, StatFields]:
        """(the stat line, its fields); ``previous`` itself when the held fd reads exactly its
        bytes: an idle process's line does not change (CPU times, faults, the CPU it last ran
        on, RSS: all stand still), so there is nothing to parse. Read by path (no held fd), the
        line is always parsed and given as b"", which no reading equals."""
        fd = self._fds.get("stat") if self.hold_fds else None
        if fd is not None:
            try:
                raw = os.pread(fd, _READ_SIZE, 0)
            except OSError as exc:
                raise _translate(exc) from exc
            if raw and len(raw) < _READ_SIZE:
                if previous is not None and raw == previous[0]:
                    return previous
                try:
                    return raw, parse_stat(raw)
                except (ValueError, IndexError) as exc:  # truncated read of an exiting process
                    raise ProcessGone(str(exc)) from exc
        return b"", self.stat()

    def _open_dir(self, name: str) -> int:
        """An open fd on a directory of this process, verified to be this process's."""
        fd = self._open(name, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self._verify()
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _listdir(self, name: str) -> list[str]:
        fd = self._open_dir(name)
        try:
            return os.listdir(fd)
        except OSError as exc:
            raise _translate(exc) from exc
        finally:
            os.close(fd)

    def count_fds(self) -> int:
        return len(self._listdir("fd"))

    def thread_ids(self) -> list[int]:
        return [int(n) for n in self._listdir("task") if n.isdigit()]

    def children(self, tids: list[int] | None = None) -> list[int]:
        """Direct children, from every thread's ``children`` file (needs CONFIG_PROC_CHILDREN)."""
        return [pid for kids in self.children_by_thread(tids).values() for pid in kids]

    def children_by_thread(self, tids: list[int] | None = None) -> dict[int, list[int]]:
        """Children per thread of ``tids`` (default: every thread). A child is listed under the
        thread that forked it. Opened relative to the verified task directory."""
        task_fd = self._open_dir("task")
        try:
            if tids is None:
                try:
                    tids = [int(n) for n in os.listdir(task_fd) if n.isdigit()]
                except OSError as exc:
                    raise _translate(exc) from exc
            out: dict[int, list[int]] = {}
            for tid in tids:
                try:
                    fd = os.open(f"{tid}/children", os.O_RDONLY | os.O_CLOEXEC, dir_fd=task_fd)
                except OSError:
                    continue  # the thread exited meanwhile
                try:
                    out[tid] = [int(p) for p in _read_fd(fd).split()]
                except (OSError, ProcessGone, AccessDenied):
                    continue
                finally:
                    os.close(fd)
            return out
        finally:
            os.close(task_fd)

    @property
    def held_fd_count(self) -> int:
        return len(self._fds)

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


def read_boot_time(proc_root: str = "/proc") -> float | None:
    """:func:`boot_time`, or None when /proc/stat cannot say (the dashboard's uptime)."""
    try:
        return boot_time(proc_root)
    except (OSError, ValueError, IndexError, RuntimeError):
        return None


# ---- one-off reads by path, for the commands (launch, export, the CLI) ----------------------
# No handle and no held fd: each reads a file once, and a process that is gone (or unreadable)
# gives None. The sampler's own reads go through ProcHandle above.


def read_stat(pid: int, proc_root: str = "/proc") -> StatFields | None:
    """/proc/PID/stat parsed by :func:`parse_stat`; None when gone or unreadable."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as fh:
            return parse_stat(fh.read())
    except (OSError, ValueError, IndexError):
        return None


def start_ticks(pid: int, proc_root: str = "/proc") -> int | None:
    """The process's start time in clock ticks after boot (stat field 22): tells a reused pid apart."""
    stat = read_stat(pid, proc_root)
    return None if stat is None else stat.start_time


def status_value(pid: int, key: str, proc_root: str = "/proc") -> int | None:
    """The first number of ``key`` in /proc/PID/status (``Tgid``...); None when gone,
    unreadable, or not there."""
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    return FieldPicker((key,))(raw).get(key)


def ns_inode(path: str) -> int | None:
    """The inode of a namespace link (``/proc/PID/ns/mnt``...): equal inodes, one namespace; None
    when gone or not ours to read."""
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def nspids(pid: int | str, proc_root: str = "/proc") -> tuple[int, ...] | None:
    """The process's pid in each pid namespace it is in, outermost (this /proc's) first, the
    one it sees itself as last (the ``NSpid`` line of /proc/PID/status); None when gone or
    unreadable, or on a kernel without the line (before 4.1)."""
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    start = raw.find(b"\nNSpid:")
    if start < 0:
        return None
    end = raw.find(b"\n", start + 1)
    parts = raw[start + 7 : end if end >= 0 else len(raw)].split()
    if not parts or not all(p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts)


def thread_group_of(pid: int, proc_root: str = "/proc") -> int | None:
    """The process (Tgid) that ``pid`` belongs to: /proc/TID exists for threads too, unlisted."""
    return status_value(pid, "Tgid", proc_root)


def real_uid(pid: int, proc_root: str = "/proc") -> int | None:
    """The real uid of ``pid`` (the first number of its status Uid line); None when gone or unreadable."""
    return status_value(pid, "Uid", proc_root)


def exe_path(pid: int, proc_root: str = "/proc") -> str | None:
    """Where /proc/PID/exe leads (the executable), None when it cannot be read."""
    try:
        return os.readlink(f"{proc_root}/{pid}/exe")
    except OSError:
        return None


def smaps_unreadable(pid: int, proc_root: str = "/proc") -> str | None:
    """Why /proc/PID/smaps_rollup cannot be read by this user ("permission denied"), else None."""
    try:
        with open(f"{proc_root}/{pid}/smaps_rollup", "rb") as fh:
            fh.read(1)
    except PermissionError as exc:
        return (exc.strerror or "permission denied").lower()
    except OSError:
        return None
    return None


def group_members(pgid: int, proc_root: str = "/proc") -> list[tuple[int, str]]:
    """Live processes of process group ``pgid``: (pid, command line)."""
    out = []
    for pid in all_pids(proc_root):
        stat = read_stat(pid, proc_root)
        if stat is not None and stat.pgrp == pgid and stat.state not in DEAD_STATES:
            out.append((pid, read_cmdline(pid, proc_root)))
    return out


def processes_with_environ(
    entry: bytes, exclude: int | None = None, proc_root: str = "/proc"
) -> list[tuple[int, str]]:
    """Live processes whose environment (its first MiB) holds ``entry`` (``NAME=value``):
    (pid, command line). One environ read per process this user may read."""
    out = []
    for pid in all_pids(proc_root):
        if pid == exclude:
            continue
        try:
            with open(f"{proc_root}/{pid}/environ", "rb") as fh:
                data = fh.read(1 << 20)
        except OSError:
            continue
        if entry not in data.split(b"\0"):
            continue
        stat = read_stat(pid, proc_root)
        if stat is not None and stat.state not in DEAD_STATES:
            out.append((pid, read_cmdline(pid, proc_root)))
    return out
