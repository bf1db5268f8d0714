"""Which Python a process runs, read from /proc without stopping it: for ``attach --inject``."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

# libpython3.11.so.1.0, libpython3.13t.so (free-threaded); an executable named python3.12
LIBPYTHON = re.compile(r"/libpython3\.(\d+)(t?)(?:d?)\.so[^/]*$")
EXE = re.compile(r"python3\.(\d+)(t?)$")


@dataclass(frozen=True)
class TargetPython:
    version: tuple[int, int] | None  # None: not a CPython dlmon can tell
    free_threaded: bool
    libpython: str | None  # the shared library's path; None when linked into the executable
    other: str | None = None  # "PyPy", ..., when it is a Python but not CPython
    uid: int = 0
    gid: int = 0


class ProcAccessError(OSError):
    """/proc/PID/maps could not be read: the same permission ptrace needs."""


def read_target(pid: int) -> TargetPython:
    """Raises ProcessLookupError when pid is gone, ProcAccessError when it is not ours to read."""
    try:
        st = os.stat(f"/proc/{pid}")
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    try:
        with open(f"/proc/{pid}/maps") as fh:
            maps = fh.read()
        exe = os.readlink(f"/proc/{pid}/exe")
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    except PermissionError as exc:
        raise ProcAccessError(exc.errno, exc.strerror) from None
    uid, gid = st.st_uid, st.st_gid
    paths = {line.split(None, 5)[5] for line in maps.splitlines() if len(line.split(None, 5)) == 6}
    if any("pypy" in os.path.basename(p).lower() for p in (*paths, exe)):
        return TargetPython(None, False, None, other="PyPy", uid=uid, gid=gid)
    for path in sorted(paths):
        m = LIBPYTHON.search(path)
        if m:
            return TargetPython((3, int(m.group(1))), m.group(2) == "t", path, uid=uid, gid=gid)
    m = EXE.search(os.path.basename(exe.removesuffix(" (deleted)")))
    if m:
        return TargetPython((3, int(m.group(1))), m.group(2) == "t", None, uid=uid, gid=gid)
    return TargetPython(None, False, None, uid=uid, gid=gid)


def process_state(pid: int) -> tuple[str, int]:
    """(state letter, TracerPid) from /proc/PID/status; ("", 0) when it cannot be read."""
    state, tracer = "", 0
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("State:"):
                    state = line.split()[1]
                elif line.startswith("TracerPid:"):
                    tracer = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return state, tracer


def replaced_library(pid: int, path: str) -> str | None:
    """Why gdb would read the wrong symbols for the mapped ``path``, or None.

    gdb reads a shared library's symbols from its path: a libpython replaced on disk since the
    target mapped it (a package upgrade mid-training) gives breakpoint addresses in the wrong code.
    The mapped file is compared with the path's: through /proc/PID/map_files when we may (root),
    else by the inode in /proc/PID/maps (whose device number on overlayfs is the lower layer's).
    """
    name = path.removesuffix(" (deleted)")
    if name != path:
        return f"{name} was deleted or replaced on disk since process {pid} loaded it"
    try:
        with open(f"/proc/{pid}/maps") as fh:
            maps = fh.read()
    except OSError:
        return None  # gone: gdb says so
    ranges, inode = [], None
    for line in maps.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5] == path + " (deleted)":  # an older copy mapped too
            return f"{path} was deleted or replaced on disk since process {pid} loaded it"
        if len(fields) == 6 and fields[5] == path:
            ranges.append(fields[0])
            inode = int(fields[4])
    if inode is None:
        return None
    try:
        st = os.stat(f"/proc/{pid}/root{path}")
    except OSError:
        return f"{path}, which process {pid} mapped, cannot be read any more"
    try:
        mapped = os.stat(f"/proc/{pid}/map_files/{ranges[0]}")
        same = same_file(mapped, st)
    except OSError:
        same = st.st_ino == inode
    return None if same else f"{path} was replaced on disk since process {pid} loaded it"


def same_file(mapped: os.stat_result, seen: os.stat_result) -> bool:
    """Whether the mapped file (``map_files``) is the file at its path now.

    Not by st_dev: on overlayfs (a Docker training's libpython in an image layer) the map_files
    stat gives the lower layer's device and the path's stat the overlay's, for the same file. The
    inode, size and modification time are the real file's through both; a replaced file (pip, apt:
    a new file renamed over the old) has another inode.
    """
    ours = (mapped.st_ino, mapped.st_size, mapped.st_mtime_ns)
    return ours == (seen.st_ino, seen.st_size, seen.st_mtime_ns)
