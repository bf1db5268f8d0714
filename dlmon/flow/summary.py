"""One pass over a recording -> a bounded :class:`RunSummary` (what report, diff and the HTML use).

The recording is streamed through :func:`dlmon.flow.records.iter_checked_records`, and each
snapshot is read in its JSON form (:data:`SnapshotData`): the summary needs a few figures of each
line, so no typed Snapshot is built but the last one's (its verdict, its exceptions). Nothing grows
with the recording's length: peaks and means are running figures, percentiles come from a
fixed-size reservoir, charts from series thinned to at most ``SERIES_POINTS`` points, and the lists
(alerts, deaths, skipped lines, per-worker peaks) are capped with a count of what was left out. A
24 h recording at 1 Hz (86 400 snapshots) therefore costs the same memory as a 10-minute one.

The figures are tables: a new Snapshot field becomes a peak or a chart by adding one line to
``PEAKS`` or ``SERIES`` (reading the field by its JSON name, which is the dataclass field's).

A :class:`Summarizer` is resumable: :meth:`Summarizer.to_state` is its whole state as JSON values
and :meth:`Summarizer.from_state` goes on from it exactly. The recorder saves it beside the record
(dlmon/flow/sidecar.py), so the report reads only the lines after. Sidecars of another table
(``sidecar.TABLES``) or dlmon version are passed over; a change to what the summary makes of a line
must also bump ``sidecar.VERSION``, or a sidecar written before it would still be taken.
"""

from __future__ import annotations

import dataclasses
import math
import random
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from math import inf
from typing import Any, TypeVar, cast

from dlmon.analysis.kinds import SEVERITY_RANK
from dlmon.analysis.startup import Startup, startup_from
from dlmon.analysis.verdict import exit_verdict
from dlmon.flow.records import (
    MAX_UNIX_TIME,
    CheckedRecord,
    CheckedSnapshot,
    RecordProblem,
    iter_checked_records,
)
from dlmon.model import Snapshot, WorkerDeath
from dlmon.model.format import DEAD_STATES
from dlmon.model.serialize import snapshot_to_dict
from dlmon.model.snapshot import TrainingException

SERIES_POINTS = 512
RESERVOIR_SIZE = 4096
MAX_ALERT_WINDOWS = 500
MAX_DEATHS = 200
MAX_PROBLEMS = 20
MAX_SLOTS = 512

# A snapshot in its JSON form: a record line's object (checked: dlmon.flow.records.CheckedSnapshot)
# or snapshot_to_dict of a Snapshot; every field there, each value as the Snapshot holds it (lists
# for tuples). The summary reads a few figures of each line: building the typed Snapshot of every
# line cost several times the line's json.loads.
SnapshotData = Mapping[str, Any]
Reader = Callable[[SnapshotData], float | None]


def _total(items: Iterable[Mapping[str, Any]], key: str) -> float | None:
    """The sum of ``key`` over ``items`` where known; None when none is."""
    known = [v for x in items if (v := x[key]) is not None]
    return float(sum(known)) if known else None


def _most(items: Iterable[Mapping[str, Any]], key: str) -> float | None:
    known = [v for x in items if (v := x[key]) is not None]
    return float(max(known)) if known else None


def throughput(s: SnapshotData) -> float | None:
    """Samples per second over all loaders (batches/s when sample counts are unknown); None until
    the first batch arrived, so worker start-up does not count as zero throughput."""
    loaders = s["loaders"]
    if not any(lo["batches_total"] for lo in loaders):
        return None
    samples = _total(loaders, "samples_per_s")
    return samples if samples is not None else _total(loaders, "batches_per_s")


def data_wait(s: SnapshotData) -> float | None:
    """The worst loader's share of time the training waited for data."""
    return _most(s["loaders"], "data_wait_fraction")


def vram(s: SnapshotData) -> float | None:
    """The job's VRAM as :func:`dlmon.analysis.job_gpus.job_vram_bytes` reads it from a Snapshot:
    NVML's figures for the job's processes, else torch's reserved memory on the job's GPUs; never
    every GPU's use on the machine."""
    used = _total(s["processes"], "gpu_memory_bytes")
    if used is not None:
        return used
    pids = {p["pid"] for p in s["processes"] if p["state"] not in DEAD_STATES}
    reserved = [
        g["torch_reserved_bytes"]
        for g in s["gpus"]
        if g["torch_reserved_bytes"] is not None
        and not (g["mig_mode"] and g["mig_index"] is None)  # a MIG card: its slices are the devices
        and (
            any(gp["pid"] in pids for gp in g["processes"])
            or g["torch_reserved_bytes"]
            or g["torch_allocated_bytes"]
        )
    ]
    return float(sum(reserved)) if reserved else None


def _part(section: str, key: str) -> Reader:
    """``s[section][key]``, None where the section is (no shm, no cgroup, no pinned figure)."""

    def read(s: SnapshotData) -> float | None:
        part = s[section]
        return part[key] if part else None

    return read


@dataclass(frozen=True, slots=True)
class Figure:
    key: str  # one figure per key: a key in both PEAKS and SERIES must read the same
    label: str
    unit: str  # "bytes" | "ratio" | "per_s" | "bytes_per_s"
    read: Reader
    pss_sum: bool = False  # a sum of smaps figures: skipped where a reading predates a fork


# Peak figures of the run (the max and when it happened).
PEAKS: tuple[Figure, ...] = (
    Figure("job_pss", "job PSS (true total)", "bytes", _part("memory", "pss_sum_bytes"), pss_sum=True),
    Figure("rss_sum", "RSS sum (double-counts shared)", "bytes", _part("memory", "rss_sum_bytes")),
    Figure("job_uss", "job USS", "bytes", _part("memory", "uss_sum_bytes"), pss_sum=True),
    Figure("rss_anon", "anonymous RSS (sum)", "bytes", lambda s: _total(s["processes"], "rss_anon_bytes")),
    Figure("rss_file", "file-backed RSS (sum)", "bytes", lambda s: _total(s["processes"], "rss_file_bytes")),
    Figure("swap", "swap of the job", "bytes", lambda s: _total(s["processes"], "swap_bytes")),
    Figure("shm_used", "/dev/shm used", "bytes", _part("shm", "used_bytes")),
    Figure("pinned", "CUDA pinned pool", "bytes", _part("pinned", "bytes")),
    Figure("cgroup", "memory cgroup usage", "bytes", _part("cgroup", "current_bytes")),
    Figure("vram", "VRAM used (the job's processes)", "bytes", vram),
    Figure("fds", "open fds (sum)", "count", lambda s: _total(s["processes"], "num_fds")),
)

# Series kept (thinned) for charts, and distributions (mean, p5, p95).
SERIES: tuple[Figure, ...] = (
    Figure("job_pss", "job PSS", "bytes", _part("memory", "pss_sum_bytes"), pss_sum=True),
    Figure("rss_sum", "RSS sum", "bytes", _part("memory", "rss_sum_bytes")),
    Figure("vram", "VRAM", "bytes", vram),
    Figure("throughput", "throughput", "per_s", throughput),
    Figure("data_wait", "data-wait", "ratio", data_wait),
    Figure("disk_read", "disk read", "bytes_per_s", lambda s: _total(s["disks"], "read_bytes_per_s")),
    Figure("disk_write", "disk write", "bytes_per_s", lambda s: _total(s["disks"], "write_bytes_per_s")),
    Figure("disk_util", "busiest disk %util", "ratio", lambda s: _most(s["disks"], "util_percent")),
)
# Each figure once: a key in both tables names one figure, read once per snapshot.
FIGURES: tuple[Figure, ...] = tuple({f.key: f for f in (*SERIES, *PEAKS)}.values())
DISTRIBUTIONS = ("throughput", "data_wait")
CHARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Memory", ("job_pss", "rss_sum", "vram")),
    ("Throughput (samples/s)", ("throughput",)),
    ("Data-wait (share of time)", ("data_wait",)),
    ("Disk (bytes/s)", ("disk_read", "disk_write")),
)


class StateError(ValueError):
    """A saved summary state (:meth:`Summarizer.to_state`) that does not read back."""


T = TypeVar("T")


def _num(x: Any) -> float:
    """A finite JSON number as it stands (an int stays one); never a bool. A record's reader lets
    no NaN or infinity through: a state holding one was not saved from a record."""
    if type(x) not in (int, float) or not math.isfinite(x):
        raise StateError(f"{x!r:.40} is not a finite number")
    return cast(float, x)


def _time(x: Any) -> float:
    """A Unix time in the range a record's reader lets through (the report formats it as a date)."""
    if not 0 <= _num(x) < MAX_UNIX_TIME:
        raise StateError(f"{x!r:.40} is not a time a record holds")
    return cast(float, x)


def _seen_time(x: Any) -> float:
    """A time or -inf (a process of the recording's first snapshot, seen "long before")."""
    return x if x == -inf and type(x) is float else _time(x)


def _typed(cls: Any, x: Any, times: tuple[str, ...]) -> Any:
    """``cls(**x)``, a frozen dataclass of scalars, when each field holds a value of its type
    (``times`` a time a record holds): a forged one must fail here, not in the report's sorting."""
    made = cls(**_dict(x))
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, value = hints[f.name], getattr(made, f.name)
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        allowed = set(typing.get_args(hint) if union else (hint,))
        if value is None and type(None) in allowed:
            continue
        if f.name in times:
            _time(value)
        elif float in allowed and type(value) in (int, float):
            _num(value)
        elif type(value) not in allowed:
            raise StateError(f"{f.name} {value!r:.40} is not a {hint}")
    return made


def _int(x: Any) -> int:
    if type(x) is not int:
        raise StateError(f"{x!r:.40} is not a whole number")
    return x


def _str(x: Any) -> str:
    if type(x) is not str:
        raise StateError(f"{x!r:.40} is not a string")
    return x


def _list(x: Any) -> list[Any]:
    if type(x) is not list:
        raise StateError(f"{x!r:.40} is not a list")
    return x


def _peak(v: Any, t: Any, basis: Any) -> Peak:
    if basis not in BASIS_RANK:
        raise StateError(f"{basis!r:.40} is not a basis of a peak")
    return Peak(_num(v), _time(t), basis)


def _dict(x: Any) -> dict[str, Any]:
    if type(x) is not dict:
        raise StateError(f"{x!r:.40} is not an object")
    return x


def _opt(read: Callable[[Any], T], x: Any) -> T | None:
    return None if x is None else read(x)


class Thinned:
    """At most ``capacity`` points: when full, neighbours merge pairwise (max for memory, mean
    else) and later points are bucketed twice as coarsely. Time is the bucket's first sample."""

    def __init__(self, capacity: int = SERIES_POINTS, keep_max: bool = False) -> None:
        self.capacity = capacity
        self.keep_max = keep_max
        self.points: list[tuple[float, float]] = []
        self._stride = 1
        # the bucket being filled, as running figures (a list of its points cost a merge per point):
        # its first time, how many points, and their max or their sum (added in order, as sum() does)
        self._first = 0.0
        self._count = 0
        self._acc = 0.0

    def add(self, t: float, value: float) -> None:
        if not self._count:
            self._first, self._acc = t, (value if self.keep_max else 0 + value)
        elif self.keep_max:
            if value > self._acc:
                self._acc = value
        else:
            self._acc += value
        self._count += 1
        if self._count >= self._stride:
            self.points.append(self._bucket())
            self._count = 0
            if len(self.points) >= self.capacity:
                self.points = [self._merge(self.points[i : i + 2]) for i in range(0, len(self.points), 2)]
                self._stride *= 2

    def _bucket(self) -> tuple[float, float]:
        return self._first, (self._acc if self.keep_max else self._acc / self._count)

    def _merge(self, group: list[tuple[float, float]]) -> tuple[float, float]:
        values = [v for _, v in group]
        value = max(values) if self.keep_max else sum(values) / len(values)
        return group[0][0], value

    def result(self) -> tuple[tuple[float, float], ...]:
        tail = [self._bucket()] if self._count else []
        return tuple(self.points + tail)

    def to_state(self) -> dict[str, Any]:
        return {
            "points": [list(p) for p in self.points],
            "stride": self._stride,
            "first": self._first,
            "count": self._count,
            "acc": self._acc,
        }

    @classmethod
    def from_state(cls, state: Any, keep_max: bool) -> Thinned:
        thinned = cls(keep_max=keep_max)
        thinned.points = [(_time(t), _num(v)) for t, v in _list(state["points"])]
        if len(thinned.points) >= thinned.capacity:
            raise StateError("more points than a series holds")
        thinned._stride, thinned._count = _int(state["stride"]), _int(state["count"])
        if not 0 <= thinned._count < thinned._stride:
            raise StateError("a bucket fuller than its stride")
        thinned._first, thinned._acc = _time(state["first"]), _num(state["acc"])
        return thinned


class Reservoir:
    """A uniform sample of at most ``size`` values (Algorithm R), seeded: reports are reproducible."""

    def __init__(self, size: int = RESERVOIR_SIZE) -> None:
        self.size = size
        self.values: list[float] = []
        self.seen = 0
        self.total = 0.0
        self._random = random.Random(0)

    def add(self, value: float) -> None:
        self.seen += 1
        self.total += value
        if len(self.values) < self.size:
            self.values.append(value)
        else:
            slot = self._random.randrange(self.seen)
            if slot < self.size:
                self.values[slot] = value

    def to_state(self) -> dict[str, Any]:
        version, internal, gauss = self._random.getstate()
        return {
            "values": self.values,
            "seen": self.seen,
            "total": self.total,
            "random": [version, list(internal), gauss],
        }

    @classmethod
    def from_state(cls, state: Any) -> Reservoir:
        reservoir = cls()
        reservoir.values = [_num(v) for v in _list(state["values"])]
        reservoir.seen, reservoir.total = _int(state["seen"]), _num(state["total"])
        if len(reservoir.values) != min(reservoir.seen, reservoir.size):
            raise StateError("a reservoir of the wrong size")
        version, internal, gauss = _list(state["random"])
        try:
            reservoir._random.setstate((version, tuple(_int(x) for x in _list(internal)), gauss))
        except (TypeError, ValueError) as exc:
            raise StateError(f"a random state that does not read: {exc}") from exc
        return reservoir

    def stats(self) -> Distribution | None:
        if not self.seen:
            return None
        ordered = sorted(self.values)
        return Distribution(
            self.total / self.seen, _quantile(ordered, 0.05), _quantile(ordered, 0.95), self.seen
        )


def _quantile(ordered: list[float], q: float) -> float:
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class Distribution:
    mean: float
    p5: float
    p95: float
    samples: int


@dataclass(frozen=True, slots=True)
class Peak:
    value: float
    time: float
    basis: str = "PSS"  # per-process peaks: "PSS", or "USS"/"RSS" where PSS was never read


# A per-process peak keeps the best measure it has seen: PSS over USS over RSS (an RSS peak counts
# every shared page once per process, so it must never stand beside or above a PSS one).
BASIS_RANK = {"PSS": 0, "USS": 1, "RSS": 2}


@dataclass(frozen=True, slots=True)
class AlertWindow:
    kind: str
    subject: str
    severity: str  # the worst it reached
    message: str  # the last one shown
    start: float
    end: float
    open_at_end: bool  # still active when the recording stopped
    cause: str | None = None  # evidence["cause"] (how a death happened: "oom_killer", "shm_exhausted")


@dataclass(frozen=True, slots=True)
class RunSummary:
    path: str
    snapshots: int
    start: float | None
    end: float | None
    end_reason: str | None
    host: str | None
    command: str | None
    peaks: Mapping[str, Peak]
    distributions: Mapping[str, Distribution]
    series: Mapping[str, tuple[tuple[float, float], ...]]
    slot_peaks: Mapping[str, Peak]  # "worker 0 (loader 12:1)" -> peak PSS (USS/RSS when unknown)
    loaders: tuple[str, ...]  # "12:1 train.py:40 (4 workers, batch 64)"
    epochs: int | None
    deaths: tuple[WorkerDeath, ...]
    alerts: tuple[AlertWindow, ...]
    problems: tuple[RecordProblem, ...]
    problems_total: int = 0
    oom_kills: int | None = None  # OOM kills (machine or the job's cgroup) during the recording
    left_out: Mapping[str, int] = field(default_factory=dict)  # what the caps dropped
    startups: Mapping[str, Startup] = field(default_factory=dict)  # loader id -> its last start-up figures
    # the exit verdict of the last snapshot (its alerts as recorded): None while the training ran on
    verdict: str | None = None
    exceptions: tuple[TrainingException, ...] = ()  # what the agent's journal told (cumulative)
    job_start: float | None = None  # Unix time the job started (the agent's counters count from it)
    # the agent was loaded into the running job then (attach --inject): its counters count from it
    agent_loaded: float | None = None

    @property
    def duration_s(self) -> float | None:
        return self.end - self.start if self.start is not None and self.end is not None else None


def slot_name(labels: tuple[str, ...], target_pid: int) -> str:
    """A name that is the same in two runs of the same job (for diff): the trainer is "main", its
    loaders go by their number ("PID:N" -> "N"); other processes keep their pid."""
    pid, role, loader, worker_id = labels[:4]  # then the rank labels
    owner, _, number = loader.partition(":")
    if owner == str(target_pid):
        loader = number
    if worker_id:
        return f"worker {worker_id}" + (f" (loader {loader})" if loader else "")
    return "main" if pid == str(target_pid) else f"{role} (pid {pid})"


def slot_names(s: SnapshotData) -> list[tuple[str, Mapping[str, Any]]]:
    """Each process of ``s`` with its :func:`slot_name`: the labels
    :func:`dlmon.export.metrics.process_series` gives it, from the snapshot's JSON form."""
    slots: dict[int, tuple[str, int]] = {}  # worker pid -> (loader id, worker id), as worker_slots
    for loader in s["loaders"]:
        for worker_id, pid in enumerate(loader["worker_pids"]):
            slots[pid] = (loader["id"], worker_id)
    target_pid = s["target"]["pid"]
    seen: set[tuple[str, str, str, str]] = set()
    out = []
    # Live processes first: a zombie of the previous epoch must not take its successor's slot.
    for p in sorted(s["processes"], key=lambda p: p["state"] in DEAD_STATES):
        role = p["role"]
        labels = (str(p["pid"]), role, "", "")
        if role == "worker":
            loader, worker_id = slots.get(p["pid"], ("", p["worker_id"]))
            if worker_id is not None:
                labels = ("", role, loader, str(worker_id))
        if labels in seen:
            labels = (str(p["pid"]), role, labels[2], labels[3])
        seen.add(labels)
        out.append((slot_name(labels, target_pid), p))
    return out


class Summarizer:
    """Feed records one by one; :meth:`result` any time."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.count = 0
        self.start: float | None = None
        self.end: float | None = None
        self.end_reason: str | None = None
        self.host: str | None = None
        self.command: str | None = None
        self.peaks: dict[str, Peak] = {}
        self.series = {f.key: Thinned(keep_max=f.unit == "bytes") for f in SERIES}
        self.reservoirs = {key: Reservoir() for key in DISTRIBUTIONS}
        self.slots: dict[str, Peak] = {}
        self.loaders: dict[str, str] = {}
        # keyed like self.loaders (bounded by MAX_SLOTS): the latest start-up figures, made Startups
        # at the end (cumulative counters: the latest reading is the run's)
        self.startups: dict[str, tuple[float, int | None, int | None, float | None, float]] = {}
        self.epochs: int | None = None
        self.deaths: dict[tuple[int, float | None], WorkerDeath] = {}
        self.open_alerts: dict[tuple[str, str], AlertWindow] = {}
        self.closed_alerts: list[AlertWindow] = []
        self.problems: list[RecordProblem] = []
        self.problems_total = 0
        self.left_out: dict[str, int] = {}
        self.oom_first: int | None = None
        self.oom_last: int | None = None
        self._first_seen: dict[tuple[int, int], float] = {}  # the current tree only: bounded
        self.last: CheckedSnapshot | Snapshot | None = None
        self.job_start: float | None = None
        self.agent_loaded: float | None = None

    def feed(self, record: CheckedRecord) -> None:
        if isinstance(record, CheckedSnapshot):
            self._snapshot(record.data)
            self.last = record
        elif isinstance(record, Snapshot):  # a line only the full reader could vouch for
            self._snapshot(snapshot_to_dict(record))
            self.last = record
        elif isinstance(record, RecordProblem):
            self.problems_total += 1
            if len(self.problems) < MAX_PROBLEMS:
                self.problems.append(record)
        else:
            self.end_reason = record.reason

    def _drop(self, what: str) -> None:
        self.left_out[what] = self.left_out.get(what, 0) + 1

    def _snapshot(self, s: SnapshotData) -> None:
        self.count += 1
        now = s["time"]
        target = s["target"]
        if self.start is None:
            self.start, self.host, self.command = now, s["host"], target["cmdline"]
            self.job_start = target["start_unix_time"]
        if s["agent_loaded_unix_time"] is not None:  # the latest load: a restarted agent counts anew
            self.agent_loaded = max(self.agent_loaded or 0.0, s["agent_loaded_unix_time"])
        # the earliest to the latest: a clock that stepped back (kept by the reader) spans no less
        self.start = min(self.start, now)
        self.end = now if self.end is None else max(self.end, now)
        stale = self._pss_predates_a_fork(s)
        read = {fig.key: None if fig.pss_sum and stale else fig.read(s) for fig in FIGURES}
        for fig in PEAKS:
            value = read[fig.key]
            if value is not None:
                peak = self.peaks.get(fig.key)
                if peak is None or value > peak.value:
                    self.peaks[fig.key] = Peak(float(value), now)
        for fig in SERIES:
            value = read[fig.key]
            if value is not None:
                self.series[fig.key].add(now, float(value))
                if fig.key in self.reservoirs and (fig.key != "throughput" or s["interval_s"]):
                    self.reservoirs[fig.key].add(float(value))
        self._slots(s)
        for lo in s["loaders"]:
            loader_id = lo["id"]
            if loader_id not in self.loaders and len(self.loaders) < MAX_SLOTS:
                self.loaders[loader_id] = (
                    f"{loader_id} {lo['name']} ({lo['num_workers']} workers, batch {lo['batch_size']})"
                )
            if lo["epochs"] is not None:
                self.epochs = max(self.epochs or 0, lo["epochs"])
            total, workers = lo["startup_s_total"], lo["num_workers"]
            if total is not None and workers and loader_id in self.loaders:  # startup_from is not None
                self.startups[loader_id] = (
                    total,
                    workers,
                    lo["epochs_started"],
                    target["start_unix_time"],
                    now,
                )
        for death in s["worker_deaths"]:
            key = (death["pid"], death["time"])
            if key not in self.deaths:
                if len(self.deaths) < MAX_DEATHS:
                    self.deaths[key] = WorkerDeath(**death)
                else:
                    self._drop("deaths")
        self._alerts(s)
        cgroup = s["cgroup"]
        ooms = cgroup["oom_kill_count"] if cgroup else None
        ooms = ooms if ooms is not None else s["memory"]["oom_kill_count"]
        if ooms is not None:
            self.oom_first = ooms if self.oom_first is None else self.oom_first
            self.oom_last = ooms

    def _pss_predates_a_fork(self, s: SnapshotData) -> bool:
        """True when a PSS/USS reading in ``s`` is older than the newest process of the tree.

        smaps is read on a budget, so a parent's PSS can date from before it forked its workers:
        then it still counts in full the pages it now shares, and the job's sum adds them again in
        each worker (a sum that never existed, e.g. +40% for one tick after a DataLoader starts).
        A process in the recording's first snapshot counts as seen long before.
        """
        now, processes = s["time"], s["processes"]
        unseen = -inf if self.count == 1 else now
        first_seen = self._first_seen
        seen = {key: first_seen.get(key, unseen) for key in [(p["pid"], p["start_time"]) for p in processes]}
        self._first_seen = seen
        newest = max(seen.values(), default=-inf)
        return any(
            p["pss_age_s"] is not None and now - p["pss_age_s"] < newest - 1e-3
            for p in processes
            if p["pss_bytes"] is not None or p["uss_bytes"] is not None
        )

    def _slots(self, s: SnapshotData) -> None:
        now = s["time"]
        for name, p in slot_names(s):
            if (value := p["pss_bytes"]) is not None:
                basis = "PSS"
            elif (value := p["uss_bytes"]) is not None:
                basis = "USS"
            elif (value := p["rss_bytes"]) is not None:
                basis = "RSS"
            else:
                continue
            old = self.slots.get(name)
            if old is not None:
                better = BASIS_RANK[basis] < BASIS_RANK[old.basis]
                if better or (basis == old.basis and value > old.value):
                    self.slots[name] = Peak(float(value), now, basis)
            elif len(self.slots) < MAX_SLOTS:
                self.slots[name] = Peak(float(value), now, basis)
            else:
                self._drop("processes")

    def _alerts(self, s: SnapshotData) -> None:
        now = s["time"]
        active: set[tuple[str, str]] = set()
        for alert in s["alerts"]:
            key = (alert["kind"], alert["subject"])
            active.add(key)
            old = self.open_alerts.get(key)
            worst = alert["severity"]
            if old is not None and SEVERITY_RANK.get(old.severity, 0) > SEVERITY_RANK.get(worst, 0):
                worst = old.severity
            start = old.start if old is not None else min(alert["since"], now)
            cause = alert["evidence"].get("cause")
            self.open_alerts[key] = AlertWindow(
                alert["kind"],
                alert["subject"],
                worst,
                alert["message"],
                start,
                now,
                True,
                cause if isinstance(cause, str) else None,
            )
        for key in [k for k in self.open_alerts if k not in active]:
            window = self.open_alerts.pop(key)
            self._close(dataclasses.replace(window, open_at_end=False))

    def _close(self, window: AlertWindow) -> None:
        if len(self.closed_alerts) < MAX_ALERT_WINDOWS:
            self.closed_alerts.append(window)
        else:
            self._drop("alerts")

    def result(self) -> RunSummary:
        windows = sorted([*self.closed_alerts, *self.open_alerts.values()], key=lambda w: (w.start, w.kind))
        distributions = {k: d for k, r in self.reservoirs.items() if (d := r.stats()) is not None}
        startups = {loader_id: startup_from(*figures) for loader_id, figures in self.startups.items()}
        last = self.last.snapshot() if isinstance(self.last, CheckedSnapshot) else self.last
        return RunSummary(
            path=self.path,
            snapshots=self.count,
            start=self.start,
            end=self.end,
            end_reason=self.end_reason,
            host=self.host,
            command=self.command,
            peaks=dict(self.peaks),
            distributions=distributions,
            series={k: t.result() for k, t in self.series.items()},
            slot_peaks=dict(self.slots),
            loaders=tuple(self.loaders.values()),
            epochs=self.epochs,
            deaths=tuple(sorted(self.deaths.values(), key=lambda d: d.time or 0.0)),
            alerts=tuple(windows),
            problems=tuple(self.problems),
            problems_total=self.problems_total,
            oom_kills=None
            if self.oom_first is None or self.oom_last is None
            else self.oom_last - self.oom_first,
            left_out=dict(self.left_out),
            startups={k: v for k, v in startups.items() if v is not None},
            verdict=self._verdict(last),
            exceptions=last.exceptions if last is not None else (),
            job_start=self.job_start,
            agent_loaded=self.agent_loaded,
        )

    def to_state(self) -> dict[str, Any]:
        """Everything :meth:`result` and further :meth:`feed` calls read, as JSON values (no
        pickle): :meth:`from_state` gives back a Summarizer that goes on exactly as this one
        would. What a summary checkpoint saves (dlmon/flow/sidecar.py); not the path."""
        last = self.last
        return {
            "count": self.count,
            "start": self.start,
            "end": self.end,
            "end_reason": self.end_reason,
            "host": self.host,
            "command": self.command,
            "peaks": [[k, p.value, p.time, p.basis] for k, p in self.peaks.items()],
            "series": {k: t.to_state() for k, t in self.series.items()},
            "reservoirs": {k: r.to_state() for k, r in self.reservoirs.items()},
            "slots": [[k, p.value, p.time, p.basis] for k, p in self.slots.items()],
            "loaders": [[k, v] for k, v in self.loaders.items()],
            "startups": [[k, *v] for k, v in self.startups.items()],
            "epochs": self.epochs,
            "deaths": [dataclasses.asdict(d) for d in self.deaths.values()],
            "open_alerts": [dataclasses.asdict(w) for w in self.open_alerts.values()],
            "closed_alerts": [dataclasses.asdict(w) for w in self.closed_alerts],
            "problems": [[p.line, p.reason] for p in self.problems],
            "problems_total": self.problems_total,
            "left_out": self.left_out,
            "oom_first": self.oom_first,
            "oom_last": self.oom_last,
            "first_seen": [[pid, start, t] for (pid, start), t in self._first_seen.items()],
            "last": None
            if last is None
            else (last.data if isinstance(last, CheckedSnapshot) else snapshot_to_dict(last)),
            "job_start": self.job_start,
            "agent_loaded": self.agent_loaded,
        }

    @classmethod
    def from_state(cls, path: str, state: Any) -> Summarizer:
        """The Summarizer :meth:`to_state` saved; raises :class:`StateError` for a state that does
        not read back as one (a damaged or forged checkpoint)."""
        try:
            return cls._from_state(path, state)
        except StateError:
            raise
        except Exception as exc:  # KeyError, TypeError, RecursionError...: whatever a forged one raises
            raise StateError(f"{type(exc).__name__}: {exc}") from exc

    @classmethod
    def _from_state(cls, path: str, state: Any) -> Summarizer:
        new = cls(path)
        new.count = _int(state["count"])
        new.start, new.end = _opt(_time, state["start"]), _opt(_time, state["end"])
        new.end_reason, new.host = _opt(_str, state["end_reason"]), _opt(_str, state["host"])
        new.command = _opt(_str, state["command"])
        new.peaks = {_str(k): _peak(v, t, b) for k, v, t, b in _list(state["peaks"])}
        keep_max = {f.key: f.unit == "bytes" for f in SERIES}
        series, reservoirs = _dict(state["series"]), _dict(state["reservoirs"])
        if set(series) != set(keep_max) or set(reservoirs) != set(DISTRIBUTIONS):
            raise StateError("other figures than this dlmon's")
        new.series = {k: Thinned.from_state(series[k], keep_max[k]) for k in keep_max}
        new.reservoirs = {k: Reservoir.from_state(reservoirs[k]) for k in DISTRIBUTIONS}
        new.slots = {_str(k): _peak(v, t, b) for k, v, t, b in _list(state["slots"])}
        new.loaders = {_str(k): _str(v) for k, v in _list(state["loaders"])}
        new.startups = {
            _str(k): (_num(total), _opt(_int, workers), _opt(_int, started), _opt(_time, unix), _time(now))
            for k, total, workers, started, unix, now in _list(state["startups"])
        }
        new.epochs = _opt(_int, state["epochs"])
        new.deaths = {}
        for death in _list(state["deaths"]):
            d = _typed(WorkerDeath, death, ("time",))
            new.deaths[(d.pid, d.time)] = d
        new.open_alerts = {}
        for window in _list(state["open_alerts"]):
            w = _typed(AlertWindow, window, ("start", "end"))
            new.open_alerts[(w.kind, w.subject)] = w
        new.closed_alerts = [_typed(AlertWindow, w, ("start", "end")) for w in _list(state["closed_alerts"])]
        new.problems = [RecordProblem(_int(line), _str(reason)) for line, reason in _list(state["problems"])]
        new.problems_total = _int(state["problems_total"])
        new.left_out = {_str(k): _int(v) for k, v in _dict(state["left_out"]).items()}
        new.oom_first, new.oom_last = _opt(_int, state["oom_first"]), _opt(_int, state["oom_last"])
        new._first_seen = {
            (_int(pid), _int(start)): _seen_time(t) for pid, start, t in _list(state["first_seen"])
        }
        last = state["last"]
        if last is not None:
            data = _dict(last)
            new.last = CheckedSnapshot(_time(data["time"]), data)
            new.last.snapshot()  # raises SnapshotFormatError (a ValueError) for a forged one
        new.job_start, new.agent_loaded = _opt(_time, state["job_start"]), _opt(_num, state["agent_loaded"])
        if new.count and (new.start is None or new.end is None):
            raise StateError("snapshots without a time span")
        return new

    @staticmethod
    def _verdict(last: Snapshot | None) -> str | None:
        try:
            return exit_verdict(last, None)
        except Exception as exc:  # a report must come out whatever the last snapshot holds
            return f"n/a ({type(exc).__name__}: {exc})"


def summarize(path: str) -> RunSummary:
    """Stream ``path`` (``.gz`` too) into a summary; raises OSError only if it cannot be opened.

    Where the recorder left a summary checkpoint beside ``path`` that still matches its first bytes
    (dlmon/flow/sidecar.py), only the lines after them are read: the same summary, sooner."""
    from dlmon.flow.sidecar import resumed_summary  # it saves Summarizers: imports this module

    resumed = resumed_summary(path)
    if resumed is not None:
        try:
            return _fed(*resumed)
        except Exception:  # a saved state that reads back yet fails on a later line: read every line
            pass
    return _fed(Summarizer(path), iter_checked_records(path))


def _fed(summarizer: Summarizer, records: Iterable[CheckedRecord]) -> RunSummary:
    for record in records:
        summarizer.feed(record)
    return summarizer.result()
