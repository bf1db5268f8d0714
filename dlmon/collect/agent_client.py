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
(``SO_PEERCRED``: that pid, that uid or root). Replies are type-checked: a malformed one is
dropped for that pid, it never raises.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import selectors
import socket
import stat
import struct
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from dlmon.agent._journal import DEATHS_SUFFIX
from dlmon.agent._paths import candidate_socket_dirs, dir_is_private, target_uids
from dlmon.model.snapshot import (
    GpuDevice,
    LoaderSample,
    PinnedMemory,
    RankInfo,
    TrainingException,
    WorkerDeath,
)

REQUEST = b'{"get": "counters"}\n'
STACKS_REQUEST = b'{"get": "stacks"}\n'
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
MAX_REPLY = 4 * 1024 * 1024
DEFAULT_TIMEOUT_S = 0.2
UNANSWERED_NOTE_S = 2.0  # an agent silent this long (and two polls) is said to be not answering
ROLES = ("train", "validation", "test", "other")

_EMPTY_STR: Mapping[str, str] = MappingProxyType({})
_EMPTY_RANKS: Mapping[int, RankInfo] = MappingProxyType({})
_EMPTY_INT: Mapping[int, int] = MappingProxyType({})
_EMPTY_VER: Mapping[int, str | None] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class TorchDeviceMemory:
    """torch.cuda's view of one device in one process (the caching allocator's figures)."""

    pid: int
    device: int  # torch's index: relative to CUDA_VISIBLE_DEVICES in that process
    uuid: str | None
    name: str | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    peak_allocated_bytes: int | None


@dataclass(frozen=True, slots=True)
class LoaderDetail:
    """What the agent knows about a loader beyond :class:`LoaderSample`'s fields (same ``id``)."""

    id: str
    pid: int
    file: str | None
    line: int | None
    multiprocessing_context: str | None
    alive: bool
    epochs: int | None
    epochs_started: int | None
    samples_total: int | None
    startup_wait_s_total: float | None  # first batch of each epoch (worker start-up)
    end_wait_s_total: float | None  # the calls that raised StopIteration
    wait_s_total: float | None  # steady-state wait, the numerator of data_wait_fraction
    compute_s_total: float | None


@dataclass(frozen=True, slots=True)
class AgentReading:
    """One poll of the agents of a set of pids, merged."""

    time: float  # Unix time of the poll
    pids: tuple[int, ...]  # the pids whose agent answered
    loaders: tuple[LoaderSample, ...] = ()
    pinned: PinnedMemory | None = None  # summed over the processes that report it
    devices: tuple[TorchDeviceMemory, ...] = ()
    num_threads: Mapping[int, int] = field(default_factory=lambda: _EMPTY_INT)  # pid -> intra-op threads
    worker_deaths: tuple[WorkerDeath, ...] = ()
    details: tuple[LoaderDetail, ...] = ()
    torch_versions: Mapping[int, str | None] = field(default_factory=lambda: _EMPTY_VER)
    degraded: Mapping[str, str] = field(default_factory=lambda: _EMPTY_STR)  # "pid:hook" -> reason
    ranks: Mapping[int, RankInfo] = field(default_factory=lambda: _EMPTY_RANKS)  # pid -> its rank


@dataclass(slots=True)
class _Prev:
    agent_id: Any
    time_ns: int
    loaders: dict[Any, dict[str, Any]]


_One = tuple[
    _Prev,
    list[LoaderSample],
    list[LoaderDetail],
    list[TorchDeviceMemory],
    list[WorkerDeath],
    int | None,
    str | None,
    dict[str, str],
    tuple[int, str] | None,
]  # one pid's reply, converted: (state, loaders, details, devices, deaths, threads, torch, degraded, pinned)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def peer_cred(sock: socket.socket) -> tuple[int, int] | None:
    """(pid, uid) of the process at the other end of a Unix socket (Linux SO_PEERCRED)."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    size = struct.calcsize("3i")
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, opt, size)[:size])
    return int(pid), int(uid)


def _pending(wl: Mapping[str, Any], key: str) -> int:
    v = _int(wl.get(key))
    return v if v is not None and v > 0 else 0


def _int_tuple(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list):
        return ()
    return tuple(x for x in v if isinstance(x, int) and not isinstance(x, bool))


def _delta(cur: Mapping[str, Any], prev: Mapping[str, Any], key: str) -> int | None:
    a, b = _int(cur.get(key)), _int(prev.get(key))
    if a is None or b is None or a < b:
        return None
    return a - b


class AgentClient:
    """Polls agents by pid and keeps the previous reading of each to compute rates."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = min(max(timeout_s, 0.001), DEFAULT_TIMEOUT_S)
        self._prev: dict[int, _Prev] = {}
        # pid -> (expires, uids, candidate dirs): reading them from /proc/PID/status and environ
        # cost ~80 us per pid per tick; a running process keeps both.
        self._dirs: dict[int, tuple[float, tuple[int, int], tuple[str, ...]]] = {}
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

    # -- transport -----------------------------------------------------------------------------

    @staticmethod
    def _where(pid: int) -> tuple[tuple[int, int], tuple[str, ...]] | None:
        """The target's (real, effective) uid and the directories its agent may serve in."""
        uids = target_uids(pid)
        if uids is None:  # no such process (or no /proc)
            return None
        return uids, tuple(candidate_socket_dirs(pid, uids[0]))

    def _where_cached(self, pid: int) -> tuple[tuple[int, int], tuple[str, ...]] | None:
        now = time.monotonic()
        hit = self._dirs.get(pid)
        if hit is not None and hit[0] > now:
            return hit[1], hit[2]
        where = self._where(pid)
        if where is None:
            self._dirs.pop(pid, None)
        else:
            self._dirs[pid] = (now + WHERE_CACHE_S, *where)
        return where

    @staticmethod
    def _candidates(
        pid: int, where: tuple[tuple[int, int], tuple[str, ...]] | None = None
    ) -> tuple[tuple[int, int], list[str]] | None:
        """(target's (real, effective) uid, socket paths in private directories of that user)."""
        where = where or AgentClient._where(pid)
        if where is None:
            return None
        uids, dirs = where
        owners = set(uids)
        paths: list[str] = []
        for d in dirs:
            if not dir_is_private(d, owners):
                continue  # missing, a symlink, another user's, or open to group/other
            path = os.path.join(d, f"{int(pid)}.sock")
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    paths.append(path)
            except OSError:
                continue
        return uids, paths

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
        got = self._candidates(pid, self._where_cached(pid))
        if got is None or not got[1]:
            self._absent[pid] = (1 if absent is None else absent[0] + 1, now + ABSENT_RECHECK_S)
            return None
        self._absent.pop(pid, None)
        uids, paths = got
        for path in paths:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                sock.connect(path)
                peer = peer_cred(sock)
                if peer is None or peer[0] != pid or peer[1] not in (*uids, 0):
                    sock.close()
                    continue  # someone else's socket under pid's name: never talk to it
                sock.send(request)  # a few bytes into an empty socket buffer: never partial
            except OSError:  # stale (refused), backlog full, or not ours to read: try the next
                sock.close()
                continue
            self._remember_journal(pid, path)
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
                        parsed = self._parse(bytes(buf), pid)
                        out[pid] = parsed if parsed is not None else {}
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

    @staticmethod
    def _parse(data: bytes, pid: int) -> dict[str, Any] | None:
        if not data.endswith(b"\n") or len(data) > MAX_REPLY:
            return None
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the stack
            return None
        if not isinstance(obj, dict) or "error" in obj or _int(obj.get("pid")) != pid:
            return None
        if "threads" in obj:  # a stacks reply
            return obj if isinstance(obj.get("threads"), list) else None
        if _int(obj.get("time_ns")) is None or not isinstance(obj.get("loaders", []), list):
            return None
        return obj

    # -- conversion ----------------------------------------------------------------------------

    def poll(self, pids: int | Iterable[int]) -> AgentReading | None:
        """Read the agents of ``pids`` (ranks) and merge them; None when no agent answered."""
        want = [pids] if isinstance(pids, int) else [int(p) for p in pids]
        raw = self.read_raw(want)
        for gone in set(self._prev) - set(want):
            del self._prev[gone]
        for gone in set(self._dirs) - set(want):
            del self._dirs[gone]
        for gone in set(self._absent) - set(want):
            del self._absent[gone]
        for gone in set(self._unanswered) - set(want):
            del self._unanswered[gone]
        self._read_journals()
        if not raw:
            return None
        reading = self.convert(raw)
        for d in reading.worker_deaths:
            self._deaths.setdefault((d.pid, d.reported_by), d)
        return reading if reading.pids else None

    # -- deaths that outlive the trainer ----------------------------------------------------------

    def _remember_journal(self, pid: int, socket_file: str) -> None:
        if pid in self._journals or len(self._journals) >= MAX_JOURNALS:
            return
        self._journals[pid] = [os.path.join(os.path.dirname(socket_file), f"{pid}{DEATHS_SUFFIX}"), 0]
        self._socket_of[pid] = socket_file

    def _read_journals(self) -> None:
        """New lines of each remembered agent's death journal (one open and read per agent)."""
        for pid, entry in self._journals.items():
            path, offset = entry
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
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
        if raw is None:
            return None
        for t in _list(raw.get("threads")):
            if isinstance(t, dict) and t.get("main") is True:
                frames = [
                    (str(f[0]), _int(f[1]), str(f[2]))
                    for f in _list(t.get("frames"))
                    if isinstance(f, list) and len(f) == 3
                ]
                return str(t.get("name") or "MainThread"), frames
        return None

    def stack_dir(self, pid: int) -> str | None:
        """The private directory of pid's agent (where its workers write their stack files)."""
        path = self._socket_of.get(pid)
        return os.path.dirname(path) if path is not None else None

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
        pinned_bytes: int | None = None
        pinned_source: str | None = None
        pids: list[int] = []
        ranks: dict[int, RankInfo] = {}
        for pid in sorted(p for p in raw if isinstance(p, int)):
            try:
                one = self._convert_one(pid, raw[pid])
            except Exception:
                one = None
            if one is None:
                continue
            prev, ls, det, devs, dths, nt, ver, deg, pin = one
            self._prev[pid] = prev
            pids.append(pid)
            rank = wire_rank(raw[pid].get("rank"))
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
                pinned_bytes = (pinned_bytes or 0) + pin[0]
                pinned_source = pinned_source or pin[1]
        return AgentReading(
            time=time.time(),
            pids=tuple(pids),
            loaders=tuple(loaders),
            pinned=PinnedMemory(pinned_bytes, pinned_source or "") if pinned_bytes is not None else None,
            devices=tuple(devices),
            num_threads=MappingProxyType(threads),
            worker_deaths=tuple(deaths),
            details=tuple(details),
            torch_versions=MappingProxyType(versions),
            degraded=MappingProxyType(degraded),
            ranks=MappingProxyType(ranks),
        )

    def _convert_one(self, pid: int, r: Any) -> _One | None:
        """One pid's reply converted, or None when it is malformed. Touches no state."""
        if not isinstance(r, Mapping):
            return None
        time_ns = _int(r.get("time_ns"))
        agent_id = r.get("agent_id")
        if time_ns is None or not (agent_id is None or isinstance(agent_id, (str, int))):
            return None
        wire_loaders = r.get("loaders", [])
        cuda = r.get("cuda") or []
        wire_deaths = r.get("worker_deaths") or []
        wire_degraded = r.get("degraded") or {}
        pinned = r.get("pinned")
        if not (
            isinstance(wire_loaders, list)
            and isinstance(cuda, list)
            and isinstance(wire_deaths, list)
            and isinstance(wire_degraded, dict)
            and (pinned is None or isinstance(pinned, dict))
        ):
            return None
        prev = self._prev.get(pid)
        same_agent = prev is not None and prev.agent_id == agent_id and time_ns > prev.time_ns
        dt_s = (time_ns - prev.time_ns) / 1e9 if prev is not None and same_agent else None
        cur_loaders: dict[Any, dict[str, Any]] = {}
        loaders: list[LoaderSample] = []
        details: list[LoaderDetail] = []
        for wl in wire_loaders:
            if not isinstance(wl, dict):
                continue
            wid = wl.get("id")
            if isinstance(wid, bool) or not isinstance(wid, (int, str)):
                continue
            cur_loaders[wid] = wl
            if not listed(wl):
                continue
            before = prev.loaders.get(wid) if prev is not None and same_agent else None
            ls, det = self._loader(pid, wl, before, dt_s)
            loaders.append(ls)
            details.append(det)
        devices: list[TorchDeviceMemory] = []
        for d in cuda:
            if isinstance(d, dict) and _int(d.get("device")) is not None:
                devices.append(
                    TorchDeviceMemory(
                        pid=pid,
                        device=d["device"],
                        uuid=_str(d.get("uuid")),
                        name=_str(d.get("name")),
                        allocated_bytes=_int(d.get("allocated")),
                        reserved_bytes=_int(d.get("reserved")),
                        peak_allocated_bytes=_int(d.get("peak_allocated")),
                    )
                )
        pin: tuple[int, str] | None = None
        if pinned is not None:
            pb = _int(pinned.get("bytes"))
            if pb is not None and pb >= 0:
                pin = (pb, _str(pinned.get("source")) or "torch.cuda.host_memory_stats")
        deaths: list[WorkerDeath] = []
        for d in wire_deaths:
            if isinstance(d, dict) and _int(d.get("pid")) is not None:
                deaths.append(_wire_death(pid, d, "agent"))
        degraded = {f"{pid}:{str(hook)[:100]}": str(why)[:300] for hook, why in wire_degraded.items()}
        return (
            _Prev(agent_id, time_ns, cur_loaders),
            loaders,
            details,
            devices,
            deaths,
            _int(r.get("num_threads")),
            _str(r.get("torch_version")),
            degraded,
            pin,
        )

    @staticmethod
    def _loader(
        pid: int, wl: Mapping[str, Any], before: Mapping[str, Any] | None, dt_s: float | None
    ) -> tuple[LoaderSample, LoaderDetail]:
        lid = f"{pid}:{wl['id']}"
        bps = sps = frac = wall = None
        if before is not None and dt_s is not None and dt_s > 0:
            db = _delta(wl, before, "batches_total")
            ds = _delta(wl, before, "samples_total")
            bps = db / dt_s if db is not None else None
            sps = ds / dt_s if ds is not None else None
            frac = _wait_fraction(wl, before, dt_s)
            wall = _wall_wait_fraction(wl, before, dt_s)

        def secs(key: str) -> float | None:
            v = _int(wl.get(key))
            return v / 1e9 if v is not None else None

        sample = LoaderSample(
            id=lid,
            name=_str(wl.get("name")) or lid,
            pid=pid,
            num_workers=_int(wl.get("num_workers")),
            batch_size=_int(wl.get("batch_size")),
            pin_memory=_bool(wl.get("pin_memory")),
            persistent_workers=_bool(wl.get("persistent_workers")),
            prefetch_factor=_int(wl.get("prefetch_factor")),
            batches_total=_int(wl.get("batches_total")),
            batches_per_s=bps,
            samples_per_s=sps,
            data_wait_fraction=frac,
            worker_pids=_int_tuple(wl.get("worker_pids")),
            batches_per_worker=_int_tuple(wl.get("batches_per_worker")),
            samples_total=_int(wl.get("samples_total")),
            epochs=_int(wl.get("epochs")),
            multiprocessing_context=_str(wl.get("multiprocessing_context")),
            alive=wl.get("alive") is not False,
            startup_s_total=_startup_s(wl),
            epochs_started=_int(wl.get("epochs_started")),
            in_call_s=_in_call_s(wl),
            in_startup=_pending(wl, "startup_wait_ns_pending") > 0 and not _pending(wl, "wait_ns_pending"),
            wall_wait_fraction=wall,
            role=_choice(wl.get("role"), ROLES),
            role_source=_choice(wl.get("role_source"), ("framework", "pattern")),
            framework=_str(wl.get("framework")),
        )
        detail = LoaderDetail(
            id=lid,
            pid=pid,
            file=_str(wl.get("file")),
            line=_int(wl.get("line")),
            multiprocessing_context=_str(wl.get("multiprocessing_context")),
            alive=wl.get("alive") is not False,
            epochs=_int(wl.get("epochs")),
            epochs_started=_int(wl.get("epochs_started")),
            samples_total=_int(wl.get("samples_total")),
            startup_wait_s_total=secs("startup_wait_ns_total"),
            end_wait_s_total=secs("end_wait_ns_total"),
            wait_s_total=secs("wait_ns_total"),
            compute_s_total=secs("compute_ns_total"),
        )
        return sample, detail


def wire_rank(v: Any) -> RankInfo | None:
    """The reply's ``rank`` object, or None when absent (an older agent, no distributed job) or malformed."""
    if not isinstance(v, Mapping):
        return None
    rank = _int(v.get("rank"))
    if rank is None or rank < 0:
        return None

    def whole(key: str) -> int | None:
        x = _int(v.get(key))
        return x if x is not None and x >= 0 else None

    return RankInfo(rank, whole("local_rank"), whole("node_rank"), whole("world_size"))


def with_rank(loader: LoaderSample, rank: RankInfo) -> LoaderSample:
    return replace(
        loader,
        rank=rank.rank,
        local_rank=rank.local_rank,
        node_rank=rank.node_rank,
        world_size=rank.world_size,
    )


def _in_call_s(wl: Mapping[str, Any]) -> float | None:
    """The longest call in progress on this loader's iterators, in seconds (0.0: none)."""
    calls = [_int(it.get("in_call_ns")) for it in _list(wl.get("iterators")) if isinstance(it, dict)]
    known = [c for c in calls if c is not None]
    return max(known) / 1e9 if known else None


def _wire_death(reporter: int, d: Mapping[str, Any], source: str) -> WorkerDeath:
    lid = d.get("loader_id")
    return WorkerDeath(
        pid=int(d["pid"]),
        reported_by=reporter,
        worker_id=_int(d.get("worker_id")),
        loader_id=f"{reporter}:{lid}" if isinstance(lid, (int, str)) else None,
        signal=_int(d.get("signal")),
        signal_name=_str(d.get("signal_name")),
        exit_code=_int(d.get("exit_code")),
        time=_num(d.get("unix_time")),
        loader_name=_str(d.get("loader_name")),
        source=source,
    )


def _journal_death(reporter: int, line: bytes) -> WorkerDeath | None:
    try:
        d = json.loads(line)
    except ValueError:
        return None
    if not isinstance(d, dict) or _int(d.get("pid")) is None:
        return None
    return _wire_death(reporter, d, "journal")


def _journal_exception(reporter: int, line: bytes) -> tuple[int, TrainingException] | None:
    """(its sequence number, the exception) of a journal line of kind "exception"; None if garbled."""
    try:
        d = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(d, dict) or d.get("kind") != "exception":
        return None
    seq, origin, kind = _int(d.get("seq")), _str(d.get("origin")), _str(d.get("type"))
    if seq is None or origin is None or kind is None:
        return None
    lid = d.get("loader_id")
    return seq, TrainingException(
        reported_by=reporter,
        origin=origin,
        type=kind,
        message=_str(d.get("message")) or "",
        time=_num(d.get("unix_time")),
        thread=_str(d.get("thread")),
        worker_id=_int(d.get("worker_id")),
        worker_type=_str(d.get("worker_type")),
        worker_message=_str(d.get("worker_message")),
        file=_str(d.get("file")),
        line=_int(d.get("line")),
        function=_str(d.get("function")),
        loader_id=f"{reporter}:{lid}" if isinstance(lid, (int, str)) and not isinstance(lid, bool) else None,
        loader_name=_str(d.get("loader_name")),
        batches=_int(d.get("batches")),
        batch_bytes=_int(d.get("batch_bytes")),
        sharing_strategy=_str(d.get("sharing_strategy")),
        open_fds=_int(d.get("open_fds")),
        fd_limit=_int(d.get("fd_limit")),
        address_space_limit=_int(d.get("address_space_limit")),
        traceback=_str(d.get("traceback")) or "",
        worker_origin=_str(d.get("worker_origin")),
        raised_there=d.get("raised_there") if isinstance(d.get("raised_there"), bool) else None,
        num_workers=_int(d.get("num_workers")),
        prefetch_factor=_int(d.get("prefetch_factor")),
    )


def _choice(v: Any, allowed: tuple[str, ...]) -> str | None:
    return v if isinstance(v, str) and v in allowed else None


def listed(wl: Mapping[str, Any]) -> bool:
    """A loader is listed once it was iterated, unless a framework re-created it (its data goes
    through the new one). Older agents send neither key: listed."""
    return wl.get("iterated") is not False and wl.get("replaced_by") is None


def _steady_deltas(cur: Mapping[str, Any], prev: Mapping[str, Any]) -> tuple[int, int] | None:
    """(wait, compute) ns over the interval, calls in progress included; None when not known."""
    w2, w1 = _int(cur.get("wait_ns_total")), _int(prev.get("wait_ns_total"))
    c2, c1 = _int(cur.get("compute_ns_total")), _int(prev.get("compute_ns_total"))
    if w2 is None or w1 is None or c2 is None or c1 is None:
        return None
    dw = (w2 + _pending(cur, "wait_ns_pending")) - (w1 + _pending(prev, "wait_ns_pending"))
    dc = (c2 + _pending(cur, "compute_ns_pending")) - (c1 + _pending(prev, "compute_ns_pending"))
    if dw < 0 or dc < 0:
        return None
    return dw, dc


def _wall_wait_fraction(cur: Mapping[str, Any], prev: Mapping[str, Any], dt_s: float) -> float | None:
    """The share of the interval's wall time the trainer spent waiting for this loader (steady
    state, a call in progress included): what this loader cost the job, however little of the
    interval it was iterated. Start-up (and the epoch's last call) is left out, as in
    :func:`_wait_fraction`: from the wait and from the wall time too, so that for a bare one-loader
    loop this equals the own share, and an interval that is all start-up has no figure (not a 0
    that would dilute the window's mean)."""
    got = _steady_deltas(cur, prev)
    if got is None or dt_s <= 0:
        return None
    s2, s1 = _int(cur.get("startup_wait_ns_total")), _int(prev.get("startup_wait_ns_total"))
    startup = 0
    if s2 is not None and s1 is not None:
        key = "startup_wait_ns_pending"
        startup = (s2 + _pending(cur, key)) - (s1 + _pending(prev, key))
    e2, e1 = _int(cur.get("end_wait_ns_total")), _int(prev.get("end_wait_ns_total"))
    end = e2 - e1 if e2 is not None and e1 is not None else 0  # the epoch's StopIteration call
    wall_ns = dt_s * 1e9 - max(0, startup) - max(0, end)
    if wall_ns <= 0.01 * dt_s * 1e9:
        return None
    return min(1.0, got[0] / wall_ns)


def _wait_fraction(cur: Mapping[str, Any], prev: Mapping[str, Any], dt_s: float) -> float | None:
    """The share of the interval's steady-state time the training spent waiting for this loader.

    A call still in progress counts up to the reading (``*_pending``), so a loader that hangs
    shows about 1.0 while it hangs rather than nothing until it returns. Worker start-up (building
    the iterator, the first batch of an epoch) is not steady state: an interval spent all in it
    gives None, and the time is in ``startup_s_total`` (a job with slow start-up and no
    persistent workers is not input-bound between epochs).
    """
    got = _steady_deltas(cur, prev)
    if got is None:
        return None
    dw, dc = got
    if dw + dc > 0:
        return min(1.0, dw / (dw + dc))
    return None  # all start-up (LoaderSample.startup_s_total), or nothing happened


def _startup_s(wl: Mapping[str, Any]) -> float | None:
    """Seconds of worker start-up so far, a start-up in progress included."""
    total = _int(wl.get("startup_wait_ns_total"))
    return None if total is None else (total + _pending(wl, "startup_wait_ns_pending")) / 1e9


def _norm_uuid(u: str | None) -> str | None:
    if not u:
        return None
    u = u.strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def merge_torch_memory(gpus: tuple[GpuDevice, ...], reading: AgentReading | None) -> tuple[GpuDevice, ...]:
    """Fill ``GpuDevice.torch_*`` from the agents' figures, summed over processes.

    Devices are matched by UUID when torch reports one (torch's indices are relative to each
    process's CUDA_VISIBLE_DEVICES); by index only when no UUID is known on either side.
    """
    if reading is None or not reading.devices:
        return gpus
    by_uuid = {_norm_uuid(g.uuid): g.index for g in gpus if _norm_uuid(g.uuid)}
    sums: dict[int, list[int | None]] = {}
    for d in reading.devices:
        u = _norm_uuid(d.uuid)
        if u is not None and by_uuid:
            if u not in by_uuid:
                continue
            idx = by_uuid[u]
        else:
            idx = d.device
        acc = sums.setdefault(idx, [None, None, None])
        for i, v in enumerate((d.allocated_bytes, d.reserved_bytes, d.peak_allocated_bytes)):
            if v is not None:
                acc[i] = (acc[i] or 0) + v
    out: list[GpuDevice] = []
    for g in gpus:
        got = sums.get(g.index)
        if got is None:
            out.append(g)
        else:
            out.append(
                replace(
                    g,
                    torch_allocated_bytes=got[0],
                    torch_reserved_bytes=got[1],
                    torch_peak_allocated_bytes=got[2],
                )
            )
    return tuple(out)


def agent_unreachable_reason(pid: int) -> str | None:
    """Why an agent of ``pid`` could not be reached although one may run: a socket directory
    that exists but is not private to the target's user (another user's, a symlink, open to
    group/other), so the agent refuses to serve there and the client refuses to look. None when
    no such directory stands in the way (most often: the job simply runs without the agent)."""
    uids = target_uids(pid)
    if uids is None:
        return None
    owners = set(uids)
    for d in candidate_socket_dirs(pid, uids[0]):
        try:
            st = os.lstat(d)
        except OSError:
            continue
        if dir_is_private(d, owners):
            continue
        if not stat.S_ISDIR(st.st_mode):
            why = "is not a directory"
        elif st.st_uid not in owners:
            why = f"belongs to uid {st.st_uid}, not to the job's user (uid {uids[0]})"
        else:
            why = f"has mode {stat.S_IMODE(st.st_mode):04o} (group/other may enter)"
        return f"agent unreachable: its socket directory {d} {why}, so the agent will not serve there"
    return None
