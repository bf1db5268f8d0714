"""Where dlmon reaches the agent of a job in another mount or pid namespace (a container).

The agent names its socket by the pid it sees itself as and puts it in directories of its own
mount namespace (``dlmon.agent._paths``): a job in a container serves in ``/tmp/dlmon-<uid>``
of the container's file system as ``<pid in the container>.sock``. From the host that
directory is ``/proc/PID/root/tmp/dlmon-<uid>`` (the kernel lets whoever may ptrace the job
read it: its user or root), and that pid is the last entry of NSpid in /proc/PID/status.

The pids the agent reports (its own, its workers') are of its namespace: :class:`HostPids`
turns them back into host pids through the NSpid of the job's child processes. The kernel
translates what SO_PEERCRED gives for the listening process (pid and uid) into dlmon's own
namespaces, so the client's check that the listener IS the target holds as it is.
"""

from __future__ import annotations

import json
import math
import os
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dlmon.agent._paths import (
    candidate_socket_dirs,
    environment_socket_dirs,
    target_environ,
    target_uids,
    tmp_socket_dir,
)
from dlmon.collect import procfs

__all__ = [
    "AgentPlace",
    "HostPids",
    "agent_place",
    "death_line_to_host",
    "death_to_host",
    "namespace_reason",
    "to_host",
]

MAX_DESCENDANTS = 1024  # processes read per mapping at most (a DataLoader has tens of workers)
MAX_REMEMBERED = 4096  # agent pid -> host pid pairs kept for workers that have since died
MAX_TASKS_READ = 4096  # threads' children files read per walk at most (a process may have thousands)
WALK_EVERY_S = 1.0  # the job's processes are walked at most this often: a pid the agent names that
# is none of them (a worker reaped, or a reply made up by the container) is not looked for every poll
MAX_SYMLINKS = 40  # links followed in one path at most, as the kernel does (ELOOP beyond)
PATH_MAX = 4096  # a longer path (or link) the kernel refuses: the agent inside cannot have used it
MAX_PARTS = 1024  # path parts looked at in one resolution: a container's 40 long links cost no more


@dataclass(frozen=True)
class AgentPlace:
    """Where one target's agent serves, as dlmon reaches it."""

    uids: tuple[int, int]  # the target's (real, effective) uid, as seen here
    dirs: tuple[str, ...]  # directories to look in, as dlmon reaches them
    agent_pid: int  # the pid the agent sees itself as: its socket's and journal's name
    root: str  # "" or /proc/PID/root: the target's file system, when its mount namespace is not ours
    translated: bool  # the agent's pids are of a pid namespace below ours: map them to ours


def inner_uid(pid: int, uid: int, proc_root: str = "/proc") -> int:
    """``uid`` (as seen here) as the target sees it, through /proc/PID/uid_map (shown relative to
    our own user namespace); ``uid`` itself when the map cannot be read or does not cover it."""
    try:
        with open(f"{proc_root}/{pid}/uid_map", "rb") as fh:
            lines = fh.read(4096).splitlines()
    except OSError:
        return uid
    for line in lines:
        parts = line.split()
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            inside, outside, count = (int(p) for p in parts)
            if outside <= uid < outside + count:
                return inside + uid - outside
    return uid


def rooted_dirs(pid: int, uid_inside: int, root: str) -> tuple[str, ...]:
    """The directories the agent of ``pid`` computes inside its own file system (its
    ``XDG_RUNTIME_DIR``, ``/run/user/<uid>``, its ``TMPDIR``, ``/tmp``), under ``root``."""
    inside = [
        *environment_socket_dirs(target_environ(pid) or {}, uid_inside),
        tmp_socket_dir("/tmp", uid_inside),
    ]
    out: list[str] = []
    for d in inside:
        parent = resolve_in_root(root, os.path.dirname(os.path.normpath(d)))
        if parent is None:
            continue  # missing, unreadable, or a loop of links: no agent serves there
        full = os.path.join(parent, os.path.basename(d))  # the directory itself: lstat()ed, never followed
        if full not in out:
            out.append(full)
    return tuple(out)


def resolve_in_root(root: str, path: str) -> str | None:
    """``root`` + ``path`` (absolute, in the target's file system) with every symlink in it
    followed as the target would follow it: an absolute link from ``root`` again, ``..`` never
    above ``root``. The kernel would resolve an absolute link met under /proc/PID/root from
    dlmon's own root, so a link planted in a container would lead dlmon to a path of the host.
    None when a part is missing or unreadable, when links loop, or when the path (with its links)
    is longer than any the job could have used. (A part swapped for a link after
    this check is still followed: the agent's socket is then trusted only after SO_PEERCRED.)"""
    if len(path) >= PATH_MAX:
        return None
    todo = [c for c in reversed(path.split("/")) if c not in ("", ".")]
    done: list[str] = []
    links = 0
    looked = 0
    while todo:
        looked += 1
        if looked > MAX_PARTS:
            return None
        part = todo.pop()
        if part == "..":
            if done:
                done.pop()
            continue
        here = os.path.join(root, *done, part)
        try:
            st = os.lstat(here)
            if not stat.S_ISLNK(st.st_mode):
                done.append(part)
                continue
            target = os.readlink(here)
        except OSError:
            return None
        links += 1
        if links > MAX_SYMLINKS:
            return None
        if target.startswith("/"):
            done = []
        todo.extend(c for c in reversed(target.split("/")) if c not in ("", "."))
    return os.path.join(root, *done)


def agent_place(pid: int, proc_root: str = "/proc") -> AgentPlace | None:
    """Where the agent of ``pid`` may serve; None when no such process (or no /proc)."""
    uids = target_uids(pid)
    if uids is None:
        return None
    ns = procfs.nspids(pid, proc_root)
    ours = procfs.nspids("self", proc_root)
    agent_pid = ns[-1] if ns else pid
    translated = ns is not None and ours is not None and len(ns) > len(ours)
    theirs_mnt, ours_mnt = (
        procfs.ns_inode(f"{proc_root}/{pid}/ns/mnt"),
        procfs.ns_inode(f"{proc_root}/self/ns/mnt"),
    )
    if theirs_mnt is None or ours_mnt is None or theirs_mnt == ours_mnt:
        # our own file system (or one we may not read: then the usual places, as before); in
        # another pid namespace (unshare --pid without --mount) the socket has the agent's name
        return AgentPlace(uids, tuple(candidate_socket_dirs(pid, uids[0])), agent_pid, "", translated)
    root = f"{proc_root}/{pid}/root"
    dirs = rooted_dirs(pid, inner_uid(pid, uids[0], proc_root), root)
    return AgentPlace(uids, dirs, agent_pid, root, translated)


def namespace_reason(pid: int, proc_root: str = "/proc") -> str | None:
    """Why the agent of a job in a container cannot be looked for from here; None when nothing
    about namespaces stands in the way."""
    ns = procfs.nspids(pid, proc_root)
    ours = procfs.nspids("self", proc_root)
    if ns is None or ours is None or len(ns) <= len(ours):
        return None  # not in a namespace below ours (or /proc does not say)
    try:
        os.stat(f"{proc_root}/{pid}/ns/mnt")
        # the kernel's ptrace check on following the link, and no read of the container's root
        # directory itself (a listing could wait on a hung network file system)
        os.close(os.open(f"{proc_root}/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
    except FileNotFoundError:
        return None  # gone
    except OSError as exc:
        why = (exc.strerror or str(exc)).lower()
        return (
            f"agent unreachable: pid {pid} runs in a container (pid {ns[-1]} there) whose file system "
            f"({proc_root}/{pid}/root) dlmon may not read ({why}), so its agent's socket cannot be "
            "looked for: run dlmon inside the container, or on the host as the job's user or as root "
            "with CAP_SYS_PTRACE"
        )
    return None


class HostPids:
    """The host pids of the pids one agent in another pid namespace reports (its workers').

    A pid is looked up among the target's descendants whose NSpid is as deep as the target's
    (the same namespace): the last entry is the agent's name for it. Pairs once seen are kept,
    so a worker that has died since is still named by its host pid.
    """

    def __init__(
        self,
        host_pid: int,
        agent_pid: int,
        proc_root: str = "/proc",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._host_pid = host_pid
        self._agent_pid = agent_pid
        self._proc_root = proc_root
        self._clock = clock
        self._walked = -math.inf
        self._tasks_left = 0
        self._known: dict[int, int] = {agent_pid: host_pid}
        self._pid_ns = procfs.ns_inode(f"{proc_root}/{host_pid}/ns/pid")  # None: not ours to read

    def host_pid(self, agent_pid: int) -> int | None:
        return self._known.get(agent_pid)

    def agent_pid(self, host_pid: int) -> int | None:
        for inner, outer in self._known.items():
            if outer == host_pid:
                return inner
        return None

    def learn(self, wanted: Iterable[int]) -> None:
        """Read the target's descendants again when one of ``wanted`` is not known yet, or its
        host pid no longer names it (a pid of the container reused by a new worker)."""
        if all(self._holds(p) for p in wanted):
            return
        now = self._clock()
        if now - self._walked < WALK_EVERY_S:
            return
        self._walked = now
        depth = procfs.nspids(self._host_pid, self._proc_root)
        if depth is None:
            return
        if len(self._known) > MAX_REMEMBERED:
            self._known = {self._agent_pid: self._host_pid}
        for child in self._descendants():
            ns = procfs.nspids(child, self._proc_root)
            if ns is not None and len(ns) == len(depth):
                self._known[ns[-1]] = child

    def _holds(self, agent_pid: int) -> bool:
        host = self._known.get(agent_pid)
        if host is None:
            return False
        ns = procfs.nspids(host, self._proc_root)
        if ns is None or ns[-1] != agent_pid:
            return False
        # the host pid may have gone to another container since, whose process has that pid too
        return self._pid_ns is None or procfs.ns_inode(f"{self._proc_root}/{host}/ns/pid") == self._pid_ns

    def _descendants(self) -> list[int]:
        found: list[int] = []
        seen: set[int] = set()
        frontier = [self._host_pid]
        self._tasks_left = MAX_TASKS_READ
        while frontier and len(found) < MAX_DESCENDANTS:
            kids: list[int] = []
            for parent in frontier:
                kids.extend(self._children(parent))
            kids = [k for k in dict.fromkeys(kids) if k not in seen][: MAX_DESCENDANTS - len(found)]
            found.extend(kids)
            seen.update(kids)
            frontier = kids
        return found

    def _children(self, pid: int) -> list[int]:
        out: list[int] = []
        try:
            tasks = os.listdir(f"{self._proc_root}/{pid}/task")
        except OSError:
            return out
        for tid in tasks[: self._tasks_left]:
            self._tasks_left -= 1
            try:
                with open(f"{self._proc_root}/{pid}/task/{tid}/children", "rb") as fh:
                    out.extend(int(p) for p in fh.read().split() if p.isdigit())
            except OSError:
                continue
        return out


def _pids_in(reply: Mapping[str, Any]) -> set[int]:
    """The workers' pids a reply names (of any shape: the agent is the container's code)."""

    def ints(pids: Any) -> list[int]:
        return [p for p in pids if type(p) is int] if isinstance(pids, list) else []

    wanted: set[int] = set()
    loaders = reply.get("loaders")
    for loader in loaders if isinstance(loaders, list) else ():
        if isinstance(loader, dict):
            wanted.update(ints(loader.get("worker_pids")))
            its = loader.get("iterators")
            for it in its if isinstance(its, list) else ():
                if isinstance(it, dict):
                    wanted.update(ints(it.get("worker_pids")))
    return wanted


def _mapped(pids: Any, host: HostPids) -> Any:
    """Worker pids in host terms, in their worker-id order; 0 (no process) for one not found."""
    if not isinstance(pids, list):
        return pids
    return [host.host_pid(p) or 0 if isinstance(p, int) and not isinstance(p, bool) else p for p in pids]


def to_host(reply: dict[str, Any], host_pid: int, host: HostPids) -> dict[str, Any]:
    """A reply of an agent in another pid namespace with its pids made ours: its own (the
    target's), its workers' (0 for one not found among the target's descendants), and its dead
    workers' (kept as the agent names them when dlmon never saw them alive)."""
    host.learn(_pids_in(reply))
    out = dict(reply, pid=host_pid)
    loaders = reply.get("loaders")
    if isinstance(loaders, list):
        fixed: list[Any] = []
        for loader in loaders:
            if isinstance(loader, dict):
                loader = dict(loader, worker_pids=_mapped(loader.get("worker_pids"), host))
                its = loader.get("iterators")
                if isinstance(its, list):
                    loader["iterators"] = [_iterator_to_host(it, host) for it in its]
            fixed.append(loader)
        out["loaders"] = fixed
    deaths = reply.get("worker_deaths")
    if isinstance(deaths, list):
        out["worker_deaths"] = [death_to_host(d, host) for d in deaths]
    return out


def _iterator_to_host(it: Any, host: HostPids) -> Any:
    return dict(it, worker_pids=_mapped(it.get("worker_pids"), host)) if isinstance(it, dict) else it


def death_line_to_host(line: bytes, host: HostPids) -> bytes:
    """One line of the agent's death journal with the dead worker named by its host pid when known."""
    try:
        death = json.loads(line)
    except (ValueError, RecursionError):
        return line
    mapped = death_to_host(death, host)
    return line if mapped is death else json.dumps(mapped).encode()


def death_to_host(death: Any, host: HostPids) -> Any:
    """One worker death (of a reply or of the journal) named by its host pid when known."""
    if isinstance(death, dict):
        pid = death.get("pid")
        if isinstance(pid, int) and not isinstance(pid, bool):
            known = host.host_pid(pid)
            if known is not None:
                return dict(death, pid=known)
    return death
