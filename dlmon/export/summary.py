"""One pass over a recording -> a bounded :class:`RunSummary` (what report, diff and the HTML use).

The recording is streamed through :func:`dlmon.flow.records.iter_records`; nothing grows with its
length: peaks and means are running figures, percentiles come from a fixed-size reservoir, charts
from series thinned to at most ``SERIES_POINTS`` points, and the lists (alerts, deaths, skipped
lines, per-worker peaks) are capped with a count of what was left out. A 24 h recording at 1 Hz
(86 400 snapshots) therefore costs the same memory as a 10-minute one.

The figures are tables: a new Snapshot field becomes a peak or a chart by adding one line to
``PEAKS`` or ``SERIES``.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from math import inf

from dlmon.analysis.kinds import SEVERITY_RANK
from dlmon.analysis.startup import Startup, startup_of
from dlmon.analysis.verdict import exit_verdict
from dlmon.export.metrics import Published, process_series
from dlmon.flow.records import Record, RecordEnd, RecordProblem, iter_records
from dlmon.model import Snapshot, WorkerDeath
from dlmon.model.snapshot import TrainingException

SERIES_POINTS = 512
RESERVOIR_SIZE = 4096
MAX_ALERT_WINDOWS = 500
MAX_DEATHS = 200
MAX_PROBLEMS = 20
MAX_SLOTS = 512

Reader = Callable[[Snapshot], float | None]


def _sum(values: Iterable[int | float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(sum(known)) if known else None


def _max(values: Iterable[int | float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(max(known)) if known else None


def throughput(s: Snapshot) -> float | None:
    """Samples per second over all loaders (batches/s when sample counts are unknown); None until
    the first batch arrived, so worker start-up does not count as zero throughput."""
    if not any(lo.batches_total for lo in s.loaders):
        return None
    samples = _sum(lo.samples_per_s for lo in s.loaders)
    return samples if samples is not None else _sum(lo.batches_per_s for lo in s.loaders)


def data_wait(s: Snapshot) -> float | None:
    """The worst loader's share of time the training waited for data."""
    return _max(lo.data_wait_fraction for lo in s.loaders)


def vram(s: Snapshot) -> float | None:
    used = _sum(g.memory_used_bytes for g in s.gpus)
    return used if used is not None else _sum(p.gpu_memory_bytes for p in s.processes)


@dataclass(frozen=True, slots=True)
class Figure:
    key: str
    label: str
    unit: str  # "bytes" | "ratio" | "per_s" | "bytes_per_s"
    read: Reader
    pss_sum: bool = False  # a sum of smaps figures: skipped where a reading predates a fork


# Peak figures of the run (the max and when it happened).
PEAKS: tuple[Figure, ...] = (
    Figure("job_pss", "job PSS (true total)", "bytes", lambda s: s.memory.pss_sum_bytes, pss_sum=True),
    Figure("rss_sum", "RSS sum (double-counts shared)", "bytes", lambda s: s.memory.rss_sum_bytes),
    Figure("job_uss", "job USS", "bytes", lambda s: s.memory.uss_sum_bytes, pss_sum=True),
    Figure("rss_anon", "anonymous RSS (sum)", "bytes", lambda s: _sum(p.rss_anon_bytes for p in s.processes)),
    Figure(
        "rss_file", "file-backed RSS (sum)", "bytes", lambda s: _sum(p.rss_file_bytes for p in s.processes)
    ),
    Figure("swap", "swap of the job", "bytes", lambda s: _sum(p.swap_bytes for p in s.processes)),
    Figure("shm_used", "/dev/shm used", "bytes", lambda s: s.shm.used_bytes if s.shm else None),
    Figure("pinned", "pinned memory", "bytes", lambda s: s.pinned.bytes if s.pinned else None),
    Figure("cgroup", "memory cgroup usage", "bytes", lambda s: s.cgroup.current_bytes if s.cgroup else None),
    Figure("vram", "VRAM used", "bytes", vram),
    Figure("fds", "open fds (sum)", "count", lambda s: _sum(p.num_fds for p in s.processes)),
)

# Series kept (thinned) for charts, and distributions (mean, p5, p95).
SERIES: tuple[Figure, ...] = (
    Figure("job_pss", "job PSS", "bytes", lambda s: s.memory.pss_sum_bytes, pss_sum=True),
    Figure("rss_sum", "RSS sum", "bytes", lambda s: s.memory.rss_sum_bytes),
    Figure("vram", "VRAM", "bytes", vram),
    Figure("throughput", "throughput", "per_s", throughput),
    Figure("data_wait", "data-wait", "ratio", data_wait),
    Figure("disk_read", "disk read", "bytes_per_s", lambda s: _sum(d.read_bytes_per_s for d in s.disks)),
    Figure("disk_write", "disk write", "bytes_per_s", lambda s: _sum(d.write_bytes_per_s for d in s.disks)),
    Figure("disk_util", "busiest disk %util", "ratio", lambda s: _max(d.util_percent for d in s.disks)),
)
DISTRIBUTIONS = ("throughput", "data_wait")
CHARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Memory", ("job_pss", "rss_sum", "vram")),
    ("Throughput (samples/s)", ("throughput",)),
    ("Data-wait (share of time)", ("data_wait",)),
    ("Disk (bytes/s)", ("disk_read", "disk_write")),
)


class Thinned:
    """At most ``capacity`` points: when full, neighbours merge pairwise (max for memory, mean
    else) and later points are bucketed twice as coarsely. Time is the bucket's first sample."""

    def __init__(self, capacity: int = SERIES_POINTS, keep_max: bool = False) -> None:
        self.capacity = capacity
        self.keep_max = keep_max
        self.points: list[tuple[float, float]] = []
        self._stride = 1
        self._bucket: list[tuple[float, float]] = []

    def add(self, t: float, value: float) -> None:
        self._bucket.append((t, value))
        if len(self._bucket) >= self._stride:
            self.points.append(self._merge(self._bucket))
            self._bucket = []
            if len(self.points) >= self.capacity:
                self.points = [self._merge(self.points[i : i + 2]) for i in range(0, len(self.points), 2)]
                self._stride *= 2

    def _merge(self, group: list[tuple[float, float]]) -> tuple[float, float]:
        values = [v for _, v in group]
        value = max(values) if self.keep_max else sum(values) / len(values)
        return group[0][0], value

    def result(self) -> tuple[tuple[float, float], ...]:
        tail = [self._merge(self._bucket)] if self._bucket else []
        return tuple(self.points + tail)


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
        self.startups: dict[str, Startup] = {}  # keyed like self.loaders: bounded by MAX_SLOTS
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
        self.last: Snapshot | None = None
        self.job_start: float | None = None
        self.agent_loaded: float | None = None

    def feed(self, record: Record) -> None:
        if isinstance(record, RecordProblem):
            self.problems_total += 1
            if len(self.problems) < MAX_PROBLEMS:
                self.problems.append(record)
        elif isinstance(record, RecordEnd):
            self.end_reason = record.reason
        else:
            self._snapshot(record)

    def _drop(self, what: str) -> None:
        self.left_out[what] = self.left_out.get(what, 0) + 1

    def _snapshot(self, s: Snapshot) -> None:
        self.count += 1
        if self.start is None:
            self.start, self.host, self.command = s.time, s.host, s.target.cmdline
            self.job_start = s.target.start_unix_time
        if s.agent_loaded_unix_time is not None:  # the latest load: a restarted agent counts anew
            self.agent_loaded = max(self.agent_loaded or 0.0, s.agent_loaded_unix_time)
        # the earliest to the latest: a clock that stepped back (kept by the reader) spans no less
        self.start = min(self.start, s.time)
        self.end = s.time if self.end is None else max(self.end, s.time)
        stale = self._pss_predates_a_fork(s)
        for fig in PEAKS:
            value = None if fig.pss_sum and stale else fig.read(s)
            if value is not None and (fig.key not in self.peaks or value > self.peaks[fig.key].value):
                self.peaks[fig.key] = Peak(float(value), s.time)
        for fig in SERIES:
            value = None if fig.pss_sum and stale else fig.read(s)
            if value is not None:
                self.series[fig.key].add(s.time, float(value))
                if fig.key in self.reservoirs and (fig.key != "throughput" or s.interval_s):
                    self.reservoirs[fig.key].add(float(value))
        self._slots(s)
        for lo in s.loaders:
            if lo.id not in self.loaders and len(self.loaders) < MAX_SLOTS:
                self.loaders[lo.id] = f"{lo.id} {lo.name} ({lo.num_workers} workers, batch {lo.batch_size})"
            if lo.epochs is not None:
                self.epochs = max(self.epochs or 0, lo.epochs)
            startup = startup_of(s, lo) if lo.id in self.loaders else None
            if startup is not None:
                self.startups[lo.id] = startup  # cumulative counters: the latest reading is the run's
        for death in s.worker_deaths:
            key = (death.pid, death.time)
            if key not in self.deaths:
                if len(self.deaths) < MAX_DEATHS:
                    self.deaths[key] = death
                else:
                    self._drop("deaths")
        self._alerts(s)
        self.last = s
        ooms = s.cgroup.oom_kill_count if s.cgroup and s.cgroup.oom_kill_count is not None else None
        ooms = ooms if ooms is not None else s.memory.oom_kill_count
        if ooms is not None:
            self.oom_first = ooms if self.oom_first is None else self.oom_first
            self.oom_last = ooms

    def _pss_predates_a_fork(self, s: Snapshot) -> bool:
        """True when a PSS/USS reading in ``s`` is older than the newest process of the tree.

        smaps is read on a budget, so a parent's PSS can date from before it forked its workers:
        then it still counts in full the pages it now shares, and the job's sum adds them again in
        each worker (a sum that never existed, e.g. +40% for one tick after a DataLoader starts).
        A process in the recording's first snapshot counts as seen long before.
        """
        first = self.count == 1
        seen = {
            (p.pid, p.start_time): self._first_seen.get((p.pid, p.start_time), -inf if first else s.time)
            for p in s.processes
        }
        self._first_seen = seen
        newest = max(seen.values(), default=-inf)
        return any(
            p.pss_age_s is not None and s.time - p.pss_age_s < newest - 1e-3
            for p in s.processes
            if p.pss_bytes is not None or p.uss_bytes is not None
        )

    def _slots(self, s: Snapshot) -> None:
        for labels, p in process_series(Published(s)):
            measured = next(
                (
                    (basis, v)
                    for basis, v in (("PSS", p.pss_bytes), ("USS", p.uss_bytes), ("RSS", p.rss_bytes))
                    if v is not None
                ),
                None,
            )
            if measured is None:
                continue
            basis, value = measured
            name = slot_name(labels, s.target.pid)
            old = self.slots.get(name)
            if old is not None:
                better = BASIS_RANK[basis] < BASIS_RANK[old.basis]
                if better or (basis == old.basis and value > old.value):
                    self.slots[name] = Peak(float(value), s.time, basis)
            elif len(self.slots) < MAX_SLOTS:
                self.slots[name] = Peak(float(value), s.time, basis)
            else:
                self._drop("processes")

    def _alerts(self, s: Snapshot) -> None:
        now: set[tuple[str, str]] = set()
        for alert in s.alerts:
            key = (alert.kind, alert.subject)
            now.add(key)
            old = self.open_alerts.get(key)
            worst = alert.severity
            if old is not None and SEVERITY_RANK.get(old.severity, 0) > SEVERITY_RANK.get(worst, 0):
                worst = old.severity
            start = old.start if old is not None else min(alert.since, s.time)
            cause = alert.evidence.get("cause")
            self.open_alerts[key] = AlertWindow(
                alert.kind,
                alert.subject,
                worst,
                alert.message,
                start,
                s.time,
                True,
                cause if isinstance(cause, str) else None,
            )
        for key in [k for k in self.open_alerts if k not in now]:
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
            startups=dict(self.startups),
            verdict=self._verdict(),
            exceptions=self.last.exceptions if self.last is not None else (),
            job_start=self.job_start,
            agent_loaded=self.agent_loaded,
        )

    def _verdict(self) -> str | None:
        try:
            return exit_verdict(self.last, None)
        except Exception as exc:  # a report must come out whatever the last snapshot holds
            return f"n/a ({type(exc).__name__}: {exc})"


def summarize(path: str) -> RunSummary:
    """Stream ``path`` (``.gz`` too) into a summary; raises OSError only if it cannot be opened."""
    summarizer = Summarizer(path)
    for record in iter_records(path):
        summarizer.feed(record)
    return summarizer.result()
