"""Reads the in-process agents (``dlmon.agent``) of one or more training processes.

Agents serve cumulative counters; this client turns two consecutive readings of the same agent
into rates over the interval between them (batches/s, samples/s, data-wait fraction). The first
reading of an agent has no rates (None). A missed poll loses nothing: the next one computes over
the longer interval.

Polling never takes more than ``timeout_s`` (200 ms by default) in all, whatever the number of
pids: the sockets are read side by side under one deadline. A missing, dead, slow or garbled
agent is "no agent" for that pid, quietly.

The socket is looked for where the *target* puts it (its uid and its ``XDG_RUNTIME_DIR``, read
from ``/proc``), and trusted only when its directory is private to the target's user (a real
directory, owned by that uid, mode 0700) and the process listening on it is the target itself
(``SO_PEERCRED``: that pid, that uid or root). Replies are decoded and type-checked by
``dlmon.collect.agent_decode``: a malformed one is dropped for that pid, it never raises; one of
another protocol version (``dlmon.agent.wire``) is not decoded, and :meth:`AgentClient.note` says so.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import stat
import struct
import time
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from dlmon.agent import wire
from dlmon.agent._journal import DEATHS_SUFFIX
from dlmon.agent._paths import SUN_PATH_MAX, dir_is_private
from dlmon.collect.agent_decode import (
    MAX_REPLY,
    ROLES,
    AgentReading,
    LoaderDetail,
    TorchDeviceMemory,
    _journal_death,
    _journal_exception,
    _Prev,
    convert_one,
    injected_at,
    listed,
    main_stack,
    merge_torch_memory,
    parse_reply,
    version_note,
    wire_rank,
    with_rank,
)
from dlmon.collect.agent_place import (
    AgentPlace,
    HostPids,
    agent_place,
    death_line_to_host,
    namespace_reason,
    to_host,
)
from dlmon.model.snapshot import LoaderSample, PinnedMemory, RankInfo, TrainingException, WorkerDeath

__all__ = [
    "MAX_REPLY",
    "REQUEST",
    "ROLES",
    "STACKS_REQUEST",
    "AgentClient",
    "AgentReading",
    "LoaderDetail",
    "TorchDeviceMemory",
    "agent_unreachable_reason",
    "listed",
    "merge_torch_memory",
    "peer_cred",
    "wire_rank",
    "with_rank",
]

REQUEST = wire.COUNTERS_REQUEST
STACKS_REQUEST = wire.STACKS_REQUEST
MAX_JOURNALS = 64
MAX_JOURNAL_READ = 256 * 1024
MAX_KNOWN_DEATHS = 256
MAX_KNOWN_EXCEPTIONS = 64
WHERE_CACHE_S = 10.0  # how long a target's uid and agent directories are trusted
# A pid without an agent socket (attach to a job that has none) is looked for on every poll this
# many times (an agent starts within the first second of its process), then every ABSENT_RECHECK_S
# seconds: the lookup's stat calls were the whole cost of polling a job without an agent.
ABSENT_FAST_POLLS = 10
ABSENT_RECHECK_S = 2.0
DEFAULT_TIMEOUT_S = 0.2
UNANSWERED_NOTE_S = 2.0  # an agent silent this long (and two polls) is said to be not answering


def _connect_unix(sock: socket.socket, path: str) -> None:
    """Connect to a Unix socket at ``path``, through an fd of its directory when the path is too
    long for AF_UNIX (a container's TMPDIR reached through /proc/PID/root)."""
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        sock.connect(path)
        return
    fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sock.connect(f"/proc/self/fd/{fd}/{os.path.basename(path)}")
    finally:
        os.close(fd)


DirId = tuple[int, int]  # (st_dev, st_ino) of an agent's directory, as checked at the connect


def _connect_pinned(sock: socket.socket, path: str, owners: tuple[int, int]) -> DirId:
    """Connect to the socket at ``path`` in a directory of a file system the job may change (a
    container's): through an fd of the directory, checked private as the fd's, whatever its path
    leads to a moment later; the directory's id, for what is read there after."""
    fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid not in owners or st.st_mode & 0o077:
            raise PermissionError(f"{os.path.dirname(path)} is not private to the job's user")
        sock.connect(f"/proc/self/fd/{fd}/{os.path.basename(path)}")
        return st.st_dev, st.st_ino
    finally:
        os.close(fd)


def _open_in(path: str, directory: DirId | None, mode: int = os.O_RDONLY) -> int:
    """Open ``path`` (to read, or ``mode``), never through a link; when ``directory`` is given, only
    while the directory on the path is still that one (a container may have put a link on the way)."""
    flags = mode | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    if directory is None:
        return os.open(path, flags)
    dfd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(dfd)
        if (st.st_dev, st.st_ino) != directory:
            raise FileNotFoundError(path)
        return os.open(os.path.basename(path), flags, dir_fd=dfd)
    finally:
        os.close(dfd)


def peer_cred(sock: socket.socket) -> tuple[int, int] | None:
    """(pid, uid) of the process at the other end of a Unix socket (Linux SO_PEERCRED)."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    size = struct.calcsize("3i")
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, opt, size)[:size])
    return int(pid), int(uid)


class AgentClient:
    """Polls agents by pid and keeps the previous reading of each to compute rates."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = min(max(timeout_s, 0.001), DEFAULT_TIMEOUT_S)
        self._prev: dict[int, _Prev] = {}
        # pid -> (expires, uids, candidate dirs): reading them from /proc/PID/status and environ
        # cost ~80 us per pid per tick; a running process keeps both.
        self._dirs: dict[int, tuple[float, AgentPlace]] = {}
        # pid -> its agent's pids made ours, for an agent in a pid namespace below ours (a container)
        self._host_pids: dict[int, HostPids] = {}
        # pid -> [death journal path, bytes read]: remembered after the pid's agent answered once
        # and read on every poll, the target's death included (that is when it matters most).
        self._journals: dict[int, list[Any]] = {}
        self._deaths: dict[tuple[int, int | None], WorkerDeath] = {}  # (pid, reported_by) -> death
        self._exceptions: dict[tuple[int, int], TrainingException] = {}  # (reported_by, seq) -> it
        self._socket_of: dict[int, str] = {}
        self._absent: dict[int, tuple[int, float]] = {}  # pid -> (lookups without a socket, next one)
        # pid -> consecutive polls whose request its agent's socket took without a valid reply
        # within the deadline: the agent exists but is not answering (its loaders are unknown,
        # not absent).
        self._unanswered: dict[int, tuple[int, float]] = {}  # pid -> (polls, monotonic time of the first)
        self._other_version: dict[int, object] = {}  # pid -> the protocol version its agent speaks

    # -- transport -----------------------------------------------------------------------------

    @staticmethod
    def _where(pid: int) -> AgentPlace | None:
        """The target's uid, the directories its agent may serve in and the agent's own pid."""
        return agent_place(pid)

    def _where_cached(self, pid: int) -> AgentPlace | None:
        now = time.monotonic()
        hit = self._dirs.get(pid)
        if hit is not None and hit[0] > now:
            return hit[1]
        where = self._where(pid)
        if where is None:
            self._dirs.pop(pid, None)
        else:
            self._dirs[pid] = (now + WHERE_CACHE_S, where)
        return where

    @staticmethod
    def _candidates(pid: int, where: AgentPlace | None = None) -> tuple[tuple[int, int], list[str]] | None:
        """(target's (real, effective) uid, socket paths in private directories of that user)."""
        where = where or AgentClient._where(pid)
        if where is None:
            return None
        owners = set(where.uids)
        paths: list[str] = []
        for d in where.dirs:
            if not dir_is_private(d, owners):
                continue  # missing, a symlink, another user's, or open to group/other
            path = os.path.join(d, f"{int(where.agent_pid)}.sock")
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    paths.append(path)
            except OSError:
                continue
        return where.uids, paths

    @classmethod
    def find_socket(cls, pid: int) -> str | None:
        """The socket of pid's agent, if one exists in a private directory (it may still be stale)."""
        got = cls._candidates(pid)
        return got[1][0] if got is not None and got[1] else None

    def _connect(self, pid: int, request: bytes = REQUEST) -> socket.socket | None:
        """A connected socket with the request sent, trying each place pid's agent may serve.

        The process listening must be ``pid`` itself, running as the target's uid or as root.
        """
        now = time.monotonic()
        absent = self._absent.get(pid)
        if absent is not None and absent[0] >= ABSENT_FAST_POLLS and now < absent[1]:
            return None
        where = self._where_cached(pid)
        got = self._candidates(pid, where)
        if where is None or got is None or not got[1]:
            self._absent[pid] = (1 if absent is None else absent[0] + 1, now + ABSENT_RECHECK_S)
            return None
        self._absent.pop(pid, None)
        uids, paths = got
        for path in paths:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                pinned = _connect_pinned(sock, path, uids) if where.root else None
                if pinned is None:
                    _connect_unix(sock, path)
                peer = peer_cred(sock)
                if peer is None or peer[0] != pid or peer[1] not in (*uids, 0):
                    sock.close()
                    continue  # someone else's socket under pid's name: never talk to it
                sock.send(request)  # a few bytes into an empty socket buffer: never partial
            except OSError:  # stale (refused), backlog full, or not ours to read: try the next
                sock.close()
                continue
            self._remember_journal(pid, path, where.agent_pid, pinned)
            if where.translated:
                host = self._host_pids.get(pid)
                if host is None or host.agent_pid(pid) != where.agent_pid:  # new, or pid reused
                    self._host_pids[pid] = HostPids(pid, where.agent_pid)
            else:
                self._host_pids.pop(pid, None)
            return sock
        return None

    def read_raw(self, pids: Iterable[int], request: bytes = REQUEST) -> dict[int, dict[str, Any]]:
        """One raw (cumulative) reply per pid whose agent answered within the deadline."""
        deadline = time.monotonic() + self.timeout_s
        sockets: list[tuple[int, socket.socket]] = []
        bufs: dict[int, bytearray] = {}
        out: dict[int, dict[str, Any]] = {}
        sel: selectors.BaseSelector | None = None
        try:
            for pid in dict.fromkeys(int(p) for p in pids):
                sock = self._connect(pid, request)  # may raise (EMFILE): the ones before are closed
                if sock is not None:
                    sockets.append((pid, sock))
            if not sockets:  # no agent (attach to a job without one): no selector to make and close
                return {}
            sel = selectors.DefaultSelector()
            for pid, sock in sockets:
                bufs[pid] = bytearray()
                sel.register(sock, selectors.EVENT_READ, pid)
            while bufs.keys() - out.keys():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for key, _mask in sel.select(left):
                    pid = key.data
                    rsock = key.fileobj
                    if not isinstance(rsock, socket.socket):
                        continue
                    try:
                        chunk = rsock.recv(65536)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        chunk = b""
                    buf = bufs[pid]
                    buf += chunk
                    done = not chunk or buf.endswith(b"\n") or len(buf) > MAX_REPLY
                    if done:
                        sel.unregister(rsock)
                        rsock.close()
                        out[pid] = self._parse(bytes(buf), pid)
        finally:
            for _pid, sock in sockets:  # closing twice is harmless; a socket never registered is not lost
                with contextlib.suppress(OSError):
                    sock.close()
            if sel is not None:
                sel.close()
            if request == REQUEST:
                now = time.monotonic()
                for pid, _sock in sockets:
                    if out.get(pid):
                        self._unanswered.pop(pid, None)
                    else:
                        polls, since = self._unanswered.get(pid, (0, now))
                        self._unanswered[pid] = (polls + 1, since)
        return {pid: r for pid, r in out.items() if r}

    def _parse(self, data: bytes, pid: int) -> dict[str, Any]:
        """One reply of pid's agent, checked, with the pids of an agent in a container made ours."""
        host = self._host_pids.get(pid)
        if host is None:
            return parse_reply(data, pid) or {}
        inner = host.agent_pid(pid)
        parsed = parse_reply(data, inner if inner is not None else pid)
        return {} if parsed is None else to_host(parsed, pid, host)

    def agent_pid_of(self, trainer: int, pid: int) -> int:
        """What the agent of ``trainer`` calls process ``pid`` (its own name for it in a container,
        where its workers' stack files are named by it); ``pid`` itself when the agent is ours."""
        host = self._host_pids.get(trainer)
        inner = host.agent_pid(pid) if host is not None else None
        return pid if inner is None else inner

    def note(self) -> str | None:
        """What the user should know about the agents' figures (an agent of another protocol
        version, or one not answering); None when nothing stands in the way."""
        return self.version_note() or self.unanswered_note()

    def version_note(self) -> str | None:
        """A line when an agent speaks another protocol version (its replies are not decoded)."""
        first = min(self._other_version.items(), key=lambda pv: pv[0], default=None)
        return None if first is None else version_note(*first)

    def unanswered_note(self) -> str | None:
        """A line when an agent has taken the requests but given no valid reply in time for
        UNANSWERED_NOTE_S (two polls at least); None when every agent found answered (or none was
        found). One late reply is no news: an import holding the GIL (torch's) delays one."""
        now = time.monotonic()
        for pid, (polls, since) in sorted(self._unanswered.items()):
            if polls >= 2 and now - since >= UNANSWERED_NOTE_S:
                ms = round(self.timeout_s * 1000)
                return (
                    f"agent of pid {pid} is not answering (no valid reply within {ms} ms): "
                    "its DataLoader figures are unknown, not zero"
                )
        return None

    # -- conversion ----------------------------------------------------------------------------

    def poll(self, pids: int | Iterable[int]) -> AgentReading | None:
        """Read the agents of ``pids`` (ranks) and merge them; None when no agent answered."""
        want = [pids] if isinstance(pids, int) else [int(p) for p in pids]
        raw = self.read_raw(want)
        for gone in set(self._prev) - set(want):
            del self._prev[gone]
        for gone in set(self._dirs) - set(want):
            del self._dirs[gone]
        for gone in set(self._host_pids) - set(want):
            del self._host_pids[gone]
        for gone in set(self._absent) - set(want):
            del self._absent[gone]
        for gone in set(self._unanswered) - set(want):
            del self._unanswered[gone]
        for gone in set(self._other_version) - set(want):
            del self._other_version[gone]
        self._read_journals()
        if not raw:
            return None
        reading = self.convert(raw)
        for d in reading.worker_deaths:
            self._deaths.setdefault((d.pid, d.reported_by), d)
        return reading if reading.pids else None

    # -- deaths that outlive the trainer ----------------------------------------------------------

    def _remember_journal(self, pid: int, socket_file: str, agent_pid: int, directory: DirId | None) -> None:
        if pid in self._journals or len(self._journals) >= MAX_JOURNALS:
            return
        journal = os.path.join(os.path.dirname(socket_file), f"{agent_pid}{DEATHS_SUFFIX}")
        self._journals[pid] = [journal, 0, directory]
        self._socket_of[pid] = socket_file

    def _read_journals(self) -> None:
        """New lines of each remembered agent's death journal (one open and read per agent)."""
        for pid, entry in self._journals.items():
            if pid in self._other_version:  # its journal's lines are of that version's shape too
                continue
            path, offset, directory = entry
            try:
                fd = _open_in(path, directory)
            except OSError:
                continue
            try:
                data = os.pread(fd, MAX_JOURNAL_READ, offset)
            except OSError:
                data = b""
            finally:
                os.close(fd)
            end = data.rfind(b"\n") + 1  # whole lines only: a line being written waits for the next poll
            entry[1] = offset + end
            for line in data[:end].splitlines():
                if b'"kind":"exception"' in line:
                    got = _journal_exception(pid, line)
                    if got is not None and len(self._exceptions) < MAX_KNOWN_EXCEPTIONS:
                        self._exceptions.setdefault((pid, got[0]), got[1])
                    continue
                host = self._host_pids.get(pid)
                if host is not None:
                    line = death_line_to_host(line, host)
                d = _journal_death(pid, line)
                if d is not None and len(self._deaths) < MAX_KNOWN_DEATHS:
                    self._deaths.setdefault((d.pid, d.reported_by), d)

    def known_deaths(self) -> tuple[WorkerDeath, ...]:
        """Every worker death seen so far, by the socket or the agents' journals, oldest first."""
        return tuple(sorted(self._deaths.values(), key=lambda d: (d.time or 0.0, d.pid)))

    def known_exceptions(self) -> tuple[TrainingException, ...]:
        """Every exception the agents' journals told of so far (their last words), oldest first."""
        return tuple(sorted(self._exceptions.values(), key=lambda e: (e.time or 0.0, e.reported_by)))

    # -- stacks -----------------------------------------------------------------------------------

    def main_thread_stack(self, pid: int) -> tuple[str, list[tuple[str, int | None, str]]] | None:
        """(thread name, frames outermost first) of the main thread of pid's agent; None if unknown."""
        raw = self.read_raw([pid], STACKS_REQUEST).get(pid)
        return main_stack(raw) if raw is not None else None

    def stack_dir(self, pid: int) -> str | None:
        """The private directory of pid's agent (where its workers write their stack files)."""
        path = self._socket_of.get(pid)
        return os.path.dirname(path) if path is not None else None

    def open_agent_file(self, pid: int, name: str, mode: int = os.O_RDONLY) -> int:
        """An fd of file ``name`` in the directory of pid's agent (its workers' stack files), never
        through a link, and for a container's agent only while its path still leads to the
        directory checked at the connect. Raises OSError (FileNotFoundError: no such directory)."""
        path = self._socket_of.get(pid)
        if path is None:
            raise FileNotFoundError(name)
        return _open_in(os.path.join(os.path.dirname(path), name), self._journals[pid][2], mode)

    def convert(self, raw: Mapping[int, Mapping[str, Any]]) -> AgentReading:
        """Turn raw replies (pid -> reply) into a reading, updating the previous-reading state.

        A reply that is not what an agent sends (wrong types where it matters) is dropped for
        its pid: that pid is left out of the reading, and its previous reading is kept.
        """
        loaders: list[LoaderSample] = []
        details: list[LoaderDetail] = []
        devices: list[TorchDeviceMemory] = []
        deaths: list[WorkerDeath] = []
        threads: dict[int, int] = {}
        versions: dict[int, str | None] = {}
        degraded: dict[str, str] = {}
        pinned: PinnedMemory | None = None
        pids: list[int] = []
        ranks: dict[int, RankInfo] = {}
        injected: dict[int, float] = {}
        for pid in sorted(p for p in raw if isinstance(p, int)):
            if not wire.speaks_this_version(raw[pid]):
                self._other_version[pid] = wire.version_of(raw[pid])
                continue
            self._other_version.pop(pid, None)
            try:
                one = convert_one(pid, raw[pid], self._prev.get(pid))
            except Exception:
                one = None
            if one is None:
                continue
            prev, ls, det, devs, dths, nt, ver, deg, pin = one
            self._prev[pid] = prev
            pids.append(pid)
            rank = wire_rank(raw[pid].get("rank"))
            at = injected_at(raw[pid])
            if at is not None:
                injected[pid] = at
            if rank is not None:
                ranks[pid] = rank
                ls = [with_rank(x, rank) for x in ls]
            loaders.extend(ls)
            details.extend(det)
            devices.extend(devs)
            deaths.extend(dths)
            if nt is not None:
                threads[pid] = nt
            versions[pid] = ver
            degraded.update(deg)
            if pin is not None:
                pinned = pin if pinned is None else pinned.plus(pin)
        return AgentReading(
            time=time.time(),
            pids=tuple(pids),
            loaders=tuple(loaders),
            pinned=pinned,
            devices=tuple(devices),
            num_threads=MappingProxyType(threads),
            worker_deaths=tuple(deaths),
            details=tuple(details),
            torch_versions=MappingProxyType(versions),
            degraded=MappingProxyType(degraded),
            ranks=MappingProxyType(ranks),
            injected=MappingProxyType(injected),
        )


def agent_unreachable_reason(pid: int) -> str | None:
    """Why an agent of ``pid`` could not be reached although one may run: the job runs in a
    container whose file system dlmon may not read, or a socket directory exists but is not
    private to the target's user (another user's, a symlink, open to group/other), so the agent
    refuses to serve there and the client refuses to look. None when no such thing stands in the
    way (most often: the job simply runs without the agent)."""
    reason = namespace_reason(pid)
    if reason is not None:
        return reason
    where = agent_place(pid)
    if where is None:
        return None
    owners = set(where.uids)
    for d in where.dirs:
        try:
            st = os.lstat(d)
        except OSError:
            continue
        if dir_is_private(d, owners):
            continue
        if not stat.S_ISDIR(st.st_mode):
            why = "is not a directory"
        elif st.st_uid not in owners:
            why = f"belongs to uid {st.st_uid}, not to the job's user (uid {where.uids[0]})"
        else:
            why = f"has mode {stat.S_IMODE(st.st_mode):04o} (group/other may enter)"
        return f"agent unreachable: its socket directory {d} {why}, so the agent will not serve there"
    return None
