"""Reads the in-process agents (``dlmon.agent``) of one or more training processes.

Agents serve cumulative counters; this client turns two consecutive readings of the same agent
into rates over the interval between them (batches/s, samples/s, data-wait fraction). The first
reading of an agent has no rates (None). A missed poll loses nothing: the next one computes over
the longer interval.

Polling never takes more than ``timeout_s`` (200 ms by default) in all, whatever the number of
pids: the sockets are read side by side under one deadline. A missing, dead, slow or garbled
agent is "no agent" for that pid, quietly.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from dlmon.agent._paths import candidate_socket_paths
from dlmon.model.snapshot import GpuDevice, LoaderSample, PinnedMemory, WorkerDeath

REQUEST = b'{"get": "counters"}\n'
MAX_REPLY = 4 * 1024 * 1024
DEFAULT_TIMEOUT_S = 0.2

_EMPTY_STR: Mapping[str, str] = MappingProxyType({})
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


@dataclass(slots=True)
class _Prev:
    agent_id: Any
    time_ns: int
    loaders: dict[Any, dict[str, Any]]


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


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

    # -- transport -----------------------------------------------------------------------------

    @staticmethod
    def find_socket(pid: int) -> str | None:
        """The socket of pid's agent, if one exists (it may still be stale)."""
        for path in candidate_socket_paths(pid):
            if os.path.exists(path):
                return path
        return None

    @staticmethod
    def _connect(pid: int) -> socket.socket | None:
        """A connected socket with the request sent, trying each place pid's agent may serve."""
        for path in candidate_socket_paths(pid):
            if not os.path.exists(path):
                continue
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                sock.connect(path)
                sock.send(REQUEST)  # 20 bytes into an empty socket buffer: never partial
            except OSError:  # stale (refused), backlog full, or not ours to read: try the next
                sock.close()
                continue
            return sock
        return None

    def read_raw(self, pids: Iterable[int]) -> dict[int, dict[str, Any]]:
        """One raw (cumulative) reply per pid whose agent answered within the deadline."""
        deadline = time.monotonic() + self.timeout_s
        sel = selectors.DefaultSelector()
        bufs: dict[int, bytearray] = {}
        out: dict[int, dict[str, Any]] = {}
        try:
            for pid in dict.fromkeys(int(p) for p in pids):
                sock = self._connect(pid)
                if sock is None:
                    continue
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
            for key in list(sel.get_map().values()):
                fobj = key.fileobj
                if isinstance(fobj, socket.socket):
                    with contextlib.suppress(OSError):
                        fobj.close()
            sel.close()
        return {pid: r for pid, r in out.items() if r}

    @staticmethod
    def _parse(data: bytes, pid: int) -> dict[str, Any] | None:
        if not data.endswith(b"\n") or len(data) > MAX_REPLY:
            return None
        try:
            obj = json.loads(data)
        except ValueError:
            return None
        if not isinstance(obj, dict) or "error" in obj or obj.get("pid") != pid:
            return None
        if not isinstance(obj.get("time_ns"), int) or not isinstance(obj.get("loaders", []), list):
            return None
        return obj

    # -- conversion ----------------------------------------------------------------------------

    def poll(self, pids: int | Iterable[int]) -> AgentReading | None:
        """Read the agents of ``pids`` (ranks) and merge them; None when no agent answered."""
        want = [pids] if isinstance(pids, int) else [int(p) for p in pids]
        raw = self.read_raw(want)
        for gone in set(self._prev) - set(want):
            del self._prev[gone]
        if not raw:
            return None
        return self.convert(raw)

    def convert(self, raw: Mapping[int, Mapping[str, Any]]) -> AgentReading:
        """Turn raw replies (pid -> reply) into a reading, updating the previous-reading state."""
        loaders: list[LoaderSample] = []
        details: list[LoaderDetail] = []
        devices: list[TorchDeviceMemory] = []
        deaths: list[WorkerDeath] = []
        threads: dict[int, int] = {}
        versions: dict[int, str | None] = {}
        degraded: dict[str, str] = {}
        pinned_bytes: int | None = None
        pinned_source: str | None = None
        for pid in sorted(raw):
            r = raw[pid]
            prev = self._prev.get(pid)
            time_ns = int(r["time_ns"])
            same_agent = prev is not None and prev.agent_id == r.get("agent_id") and time_ns > prev.time_ns
            dt_s = (time_ns - prev.time_ns) / 1e9 if prev is not None and same_agent else None
            cur_loaders: dict[Any, dict[str, Any]] = {}
            for wl in r.get("loaders", []):
                if not isinstance(wl, dict) or "id" not in wl:
                    continue
                cur_loaders[wl["id"]] = wl
                before = prev.loaders.get(wl["id"]) if prev is not None and same_agent else None
                ls, det = self._loader(pid, wl, before, dt_s)
                loaders.append(ls)
                details.append(det)
            self._prev[pid] = _Prev(r.get("agent_id"), time_ns, cur_loaders)
            for d in r.get("cuda", []) or []:
                if isinstance(d, dict) and isinstance(d.get("device"), int):
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
            pinned = r.get("pinned")
            if isinstance(pinned, dict) and _int(pinned.get("bytes")) is not None:
                pinned_bytes = (pinned_bytes or 0) + int(pinned["bytes"])
                pinned_source = pinned_source or _str(pinned.get("source")) or "torch.cuda.host_memory_stats"
            for d in r.get("worker_deaths", []) or []:
                if isinstance(d, dict) and _int(d.get("pid")) is not None:
                    lid = d.get("loader_id")
                    ut = d.get("unix_time")
                    deaths.append(
                        WorkerDeath(
                            pid=int(d["pid"]),
                            reported_by=pid,
                            worker_id=_int(d.get("worker_id")),
                            loader_id=f"{pid}:{lid}" if lid is not None else None,
                            signal=_int(d.get("signal")),
                            signal_name=_str(d.get("signal_name")),
                            exit_code=_int(d.get("exit_code")),
                            time=float(ut) if isinstance(ut, (int, float)) else None,
                        )
                    )
            nt = _int(r.get("num_threads"))
            if nt is not None:
                threads[pid] = nt
            versions[pid] = _str(r.get("torch_version"))
            for hook, why in (r.get("degraded") or {}).items():
                degraded[f"{pid}:{hook}"] = str(why)
        return AgentReading(
            time=time.time(),
            pids=tuple(sorted(raw)),
            loaders=tuple(loaders),
            pinned=PinnedMemory(pinned_bytes, pinned_source or "") if pinned_bytes is not None else None,
            devices=tuple(devices),
            num_threads=MappingProxyType(threads),
            worker_deaths=tuple(deaths),
            details=tuple(details),
            torch_versions=MappingProxyType(versions),
            degraded=MappingProxyType(degraded),
        )

    @staticmethod
    def _loader(
        pid: int, wl: Mapping[str, Any], before: Mapping[str, Any] | None, dt_s: float | None
    ) -> tuple[LoaderSample, LoaderDetail]:
        lid = f"{pid}:{wl['id']}"
        bps = sps = frac = None
        if before is not None and dt_s is not None and dt_s > 0:
            db = _delta(wl, before, "batches_total")
            ds = _delta(wl, before, "samples_total")
            dw = _delta(wl, before, "wait_ns_total")
            dc = _delta(wl, before, "compute_ns_total")
            bps = db / dt_s if db is not None else None
            sps = ds / dt_s if ds is not None else None
            if dw is not None and dc is not None and dw + dc > 0:
                frac = dw / (dw + dc)

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
