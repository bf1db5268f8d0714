"""Decoding the agent's replies: wire dicts (``dlmon.agent.wire``) to dlmon's typed samples.

Replies come from another process and are type-checked here: a malformed one is dropped for its
pid (None), never raised. A reply of another protocol version is not decoded at all. Counters
are cumulative; two consecutive readings of one agent give rates over the interval between them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from dlmon.agent import wire
from dlmon.model.snapshot import (
    GpuDevice,
    LoaderSample,
    PinnedMemory,
    RankInfo,
    TrainingException,
    WorkerDeath,
)

MAX_REPLY = 4 * 1024 * 1024
ROLES = ("train", "validation", "test", "other")

_EMPTY_STR: Mapping[str, str] = MappingProxyType({})
_EMPTY_RANKS: Mapping[int, RankInfo] = MappingProxyType({})
_EMPTY_INT: Mapping[int, int] = MappingProxyType({})
_EMPTY_VER: Mapping[int, str | None] = MappingProxyType({})
_EMPTY_TIME: Mapping[int, float] = MappingProxyType({})


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
    # pid -> Unix time its agent was loaded into it while it ran (attach --inject): counts from then
    injected: Mapping[int, float] = field(default_factory=lambda: _EMPTY_TIME)


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
    PinnedMemory | None,
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


def parse_reply(data: bytes, pid: int) -> dict[str, Any] | None:
    """One reply line of pid's agent, checked as far as its kind; None when it is not one.

    A reply of another protocol version is returned with nothing but its pid checked: the
    client tells of it (:func:`version_note`) instead of taking the agent for a silent one.
    """
    if not data.endswith(b"\n") or len(data) > MAX_REPLY:
        return None
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the stack
        return None
    return check_reply(obj, pid)


def check_reply(obj: Any, pid: int) -> dict[str, Any] | None:
    """A parsed reply of pid's agent if it is one (see :func:`parse_reply`), else None."""
    if not isinstance(obj, dict) or "error" in obj or _int(obj.get("pid")) != pid:
        return None
    if not wire.speaks_this_version(obj):
        return obj
    if "threads" in obj:  # a stacks reply
        return obj if isinstance(obj.get("threads"), list) else None
    if _int(obj.get("time_ns")) is None or not isinstance(obj.get("loaders", []), list):
        return None
    return obj


def injected_at(reply: Mapping[str, Any]) -> float | None:
    """When the agent was loaded into its running process (``attach --inject``); None: at its start."""
    return _num(reply.get("injected_unix_time"))


def version_note(pid: int, version: object) -> str:
    try:  # as JSON wrote it: "1" (a string) and true stay apart from 1
        said = json.dumps(version)[:20]
    except (TypeError, ValueError):
        said = "unknown"
    return (
        f"agent of pid {pid} speaks wire protocol version {said}, this dlmon speaks "
        f"{wire.WIRE_VERSION}: its DataLoader figures are not read (start the training with this "
        "dlmon's agent: the same dlmon version on both sides)"
    )


def main_stack(raw: Mapping[str, Any]) -> tuple[str, list[tuple[str, int | None, str]]] | None:
    """(thread name, frames outermost first) of the main thread in a stacks reply; None if unknown."""
    if not wire.speaks_this_version(raw):
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


def convert_one(pid: int, r: Any, prev: _Prev | None) -> _One | None:
    """One pid's reply converted (``prev``: its previous reading, for rates), or None when it is
    malformed or of another protocol version. Touches no state."""
    if not wire.speaks_this_version(r):
        return None
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
        ls, det = loader_sample(pid, wl, before, dt_s)
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
    pin: PinnedMemory | None = None
    if pinned is not None:
        pb = _int(pinned.get("bytes"))
        if pb is not None and pb >= 0:
            in_use = _int(pinned.get("in_use"))  # absent from agents before the pool/in-use split
            source = _str(pinned.get("source")) or "torch.cuda.host_memory_stats"
            pin = PinnedMemory(pb, source, in_use if in_use is not None and in_use >= 0 else None)
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


def loader_sample(
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
    """A UUID without its "GPU-" (a card) or "MIG-" (a MIG device) prefix: torch may give the
    bare hex, NVML always the prefix."""
    if not u:
        return None
    u = u.strip().lower()
    return u[4:] if u.startswith(("gpu-", "mig-")) else u


def merge_torch_memory(gpus: tuple[GpuDevice, ...], reading: AgentReading | None) -> tuple[GpuDevice, ...]:
    """Fill ``GpuDevice.torch_*`` from the agents' figures, summed over processes.

    Devices are matched by UUID when torch reports one (torch's indices are relative to each
    process's CUDA_VISIBLE_DEVICES; on a MIG device torch's UUID is the MIG device's, "MIG-…",
    which matches that MIG device, never its card); by index only when no UUID is known on
    either side.
    """
    if reading is None or not reading.devices:
        return gpus
    by_uuid = {_norm_uuid(g.uuid): g.key for g in gpus if _norm_uuid(g.uuid)}
    sums: dict[str, list[int | None]] = {}
    for d in reading.devices:
        u = _norm_uuid(d.uuid)
        if u is not None and by_uuid:
            if u not in by_uuid:
                continue
            key = by_uuid[u]
        else:
            key = str(d.device)
        acc = sums.setdefault(key, [None, None, None])
        for i, v in enumerate((d.allocated_bytes, d.reserved_bytes, d.peak_allocated_bytes)):
            if v is not None:
                acc[i] = (acc[i] or 0) + v
    out: list[GpuDevice] = []
    for g in gpus:
        got = sums.get(g.key)
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
