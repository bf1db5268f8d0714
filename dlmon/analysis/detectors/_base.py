"""What every detector shares: the candidate it returns, the thresholds, the context it reads.

A detector is a pure function ``Context -> list[Candidate]``: the same context gives the same
candidates. It says what holds *now*; raising only after a condition has lasted, and clearing
only after it has been gone a while, is the Analyzer's job. ``Context.active`` tells a detector
which of its alerts are raised, so it can hold them with a looser threshold than it raises them
with (a gap between the two thresholds is what stops flapping around one).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar

from dlmon.analysis.digest import Digest
from dlmon.analysis.recent import RecentIndex
from dlmon.model import ProcessSample, Snapshot
from dlmon.model.format import DEAD_STATES, human_bytes
from dlmon.model.stall_rule import STALL_RULE, StallRule

Evidence = Mapping[str, float | int | str | None]
AlertKey = tuple[str, str]  # (kind, key)

MIB = 1024 * 1024
GIB = 1024 * MIB
_EMPTY: Evidence = MappingProxyType({})
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A detector's verdict for this tick. ``key`` identifies the condition within its kind
    (``"job"``, ``"disk:vda"``, ``"pid:1234:5678"``); the subject must be as stable as the key."""

    kind: str
    key: str
    severity: str
    subject: str
    message: str
    advice: str
    evidence: Evidence = field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True, slots=True)
class GrowthWindow:
    """One window memory_growth looks through, with what must hold in it to call it growth."""

    name: str
    window_s: float
    min_span_s: float  # the fresh readings in it must cover this much time
    min_points: int
    min_slope_bytes_per_s: float


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Every number the detectors decide with (documented in docs/detectors.md)."""

    # memory_growth: three views of the job (PSS total, workers USS, RssAnon) over three windows
    growth_windows: tuple[GrowthWindow, ...] = (
        GrowthWindow("60 s", 60.0, 35.0, 4, 1.0 * MIB),  # >= 60 MiB/min, seen within a minute
        GrowthWindow("10 min", 600.0, 240.0, 6, 5.0 * MIB / 60),  # >= 5 MiB/min
        GrowthWindow("60 min", 3600.0, 1200.0, 8, 1.0 * MIB / 60),  # >= 1 MiB/min
    )
    growth_min_score: float = 0.6  # Mann-Kendall S: share of rising minus falling pairs
    growth_hold_score: float = 0.35  # ... while already raised
    growth_hold_slope: float = 0.5  # while raised, half the window's slope keeps it
    growth_min_levelling: float = 0.5  # recent slope / slope: below this it is levelling off
    growth_hold_levelling: float = 0.2  # ... while already raised
    growth_step_span_s: float = 15.0  # a rise done within this is one step (PSS is re-read every 10 s)
    growth_lookback_factor: float = 5.0  # a new rise must pass the highest level of 5 windows back
    growth_tolerance_bytes: float = 1.0 * MIB  # changes smaller than this are ties (noise)
    growth_warmup_s: float = 120.0  # no growth is raised in the watch's first 2 minutes ...
    growth_warmup_max_eta_s: float = 300.0  # ... unless the limit is nearer than this at the rate
    growth_critical_eta_s: float = 600.0
    growth_info_eta_s: float = 6 * 3600.0
    process_growth_min_bytes_per_s: float = 2 * 1024.0  # ~0.12 MiB/min: a process "grows"
    in_step_ratio: float = 4.0  # growing workers' rates within this factor: "in step"
    # zombie / orphan / died / leaked
    death_window_s: float = 900.0  # a worker death stays an alert this long
    oom_slack_s: float = 10.0  # OOM counters are compared this far either side of a death
    vanished_s: float = 3.0  # a listed worker pid missing this long has vanished
    leak_generations: int = 3  # worker generations alive at once (without the agent)
    generation_gap_s: float = 2.0  # workers started further apart are different generations
    clock_ticks_per_s: int = 100  # start_time unit (USER_HZ; 100 on every Linux we know)
    # io_saturation
    io_window_s: float = 10.0
    io_util_percent: float = 80.0
    io_hold_util_percent: float = 65.0
    io_pressure_percent: float = 10.0  # PSI io some avg10
    io_queue_depth: float = 16.0  # aqu-sz
    io_await_factor: float = 2.0  # await this many times the low-load baseline ...
    io_await_extra_ms: float = 2.0  # ... and at least this much above it
    io_dstate_fraction: float = 0.3  # share of ticks with a job process in D state
    io_job_read_bytes_per_s: float = 1e6  # the job reads from disk at all
    # input_bound
    input_window_s: float = 10.0
    input_wait_fraction: float = 0.2
    input_hold_wait_fraction: float = 0.15
    input_critical_wait_fraction: float = 0.5
    busy_cpu_percent: float = 85.0  # a worker near one core
    idle_cpu_percent: float = 60.0
    main_busy_cpu_percent: float = 90.0
    # the process's own GPUs this busy over the window: the data wait is hidden behind GPU work
    input_gpu_busy_percent: float = 90.0
    # shm_exhaustion
    shm_free_fraction: float = 0.10
    shm_free_bytes: float = 64.0 * MIB
    shm_critical_free_fraction: float = 0.02
    shm_hold_factor: float = 1.25  # a raised alert clears only above 1.25x the threshold
    default_prefetch_factor: int = 2
    shm_min_batch_bytes: float = 256 * 1024  # smaller worker RssShmem is no batch-size estimate
    # oversubscription
    oversub_window_s: float = 10.0
    oversub_thread_factor: float = 2.0  # workers x threads >= 2x cores is "well above"
    oversub_nvcsw_per_s: float = 100.0  # median involuntary switches per worker per second
    oversub_cpu_pressure_percent: float = 40.0  # PSI cpu some avg10, an alternative witness
    oversub_busy_fraction: float = 0.5  # workers use at least half of the cores
    # vram_pressure
    vram_used_fraction: float = 0.95
    vram_hold_used_fraction: float = 0.92
    vram_critical_used_fraction: float = 0.98
    vram_fragmentation_ratio: float = 1.5  # reserved / allocated
    vram_fragmentation_bytes: float = 1.0 * GIB  # and reserved - allocated at least this
    # swap_activity
    swap_window_s: float = 30.0
    swap_job_rise_bytes: float = 8.0 * MIB
    swap_machine_rise_bytes: float = 32.0 * MIB
    swap_critical_memory_pressure: float = 20.0  # PSI memory some avg10
    # stall: the rule is shared with the stack probe (dlmon.collect.stacks), which must get the same
    stall_rule: StallRule = STALL_RULE
    stall_outside_min_s: float = 60.0  # the trainer outside the loader: no batch for this long, and asleep
    # a call this long and 5 intervals: no input_bound verdict (a hang, or one)
    stall_suspect_min_s: float = 2.0
    stall_suspect_intervals: float = 5.0
    stall_critical_s: float = 300.0
    stall_sleeping_cpu_percent: float = 5.0
    # fd_exhaustion
    fd_trend_window_s: float = 60.0
    fd_min_trend_span_s: float = 10.0
    fd_min_trend_points: int = 4
    fd_high_fraction: float = 0.8
    fd_hold_fraction: float = 0.7
    fd_critical_fraction: float = 0.95
    fd_eta_s: float = 600.0  # growing steadily and out within 10 min
    fd_critical_eta_s: float = 60.0
    fd_late_share: float = 0.25  # a leak at a steady rate rises by half its window's rise in the later half
    fd_min_growth: int = 32  # a rise smaller than this over the window is noise (sockets, pipes come and go)


DEFAULT_THRESHOLDS = Thresholds()


class Context:
    """What a detector reads: the recent snapshots at full rate, the long digest, the machine.

    ``recent`` is oldest first and never empty; ``recent[-1]`` is now. Derived views of the
    latest snapshot (the job's tree) are computed once per context and shared by detectors.
    ``index``: the Analyzer's incremental views of exactly these snapshots (``RecentIndex``);
    without it (a context built from a list) the detectors scan ``recent``, with the same result.
    """

    __slots__ = ("_memo", "_times", "active", "config", "cores", "digest", "index", "recent")

    def __init__(
        self,
        recent: Sequence[Snapshot],
        digest: Digest,
        cores: int,
        config: Thresholds = DEFAULT_THRESHOLDS,
        active: Iterable[AlertKey] = (),
        index: RecentIndex | None = None,
    ) -> None:
        if not recent:
            raise ValueError("a context needs at least one snapshot")
        if index is not None and len(index) != len(recent):
            raise ValueError("the index is of other snapshots")
        self.recent = recent
        self.index = index
        self.digest = digest
        self.cores = max(1, cores)
        self.config = config
        self.active = frozenset(active)
        self._times: list[float] | None = None
        self._memo: dict[str, object] = {}

    @classmethod
    def from_history(
        cls,
        history: Sequence[Snapshot],
        *,
        cores: int = 2,
        config: Thresholds = DEFAULT_THRESHOLDS,
        active: Iterable[AlertKey] = (),
        recent_s: float = 120.0,
    ) -> Context:
        """A context over a whole history, as the Analyzer would have built it at its end."""
        if not history:
            raise ValueError("empty history")
        end = history[-1].time
        recent = [s for s in history if s.time >= end - recent_s]
        return cls(recent, Digest.from_history(history), cores, config, active)

    @property
    def latest(self) -> Snapshot:
        return self.recent[-1]

    @property
    def now(self) -> float:
        return self.recent[-1].time

    def window(self, seconds: float) -> Sequence[Snapshot]:
        """The recent snapshots no older than ``seconds`` before now (at least the latest)."""
        return self.recent[self.window_start(seconds) :]

    def window_start(self, seconds: float) -> int:
        """The index in ``recent`` at which ``window(seconds)`` starts."""
        if self.index is not None:
            start = self.index.start(self.now - seconds)
        else:
            if self._times is None:
                self._times = [s.time for s in self.recent]
            start = bisect.bisect_left(self._times, self.now - seconds)
        return min(start, len(self.recent) - 1)

    def per_snapshot(self, seconds: float, key: Hashable, compute: Callable[[Snapshot], T]) -> list[T]:
        """``[compute(s) for s in window(seconds)]``; with the index each snapshot's value is
        computed once (``key`` names what ``compute`` reads besides the snapshot), so a tick
        gathers the window's values instead of recomputing them."""
        start = self.window_start(seconds)
        if self.index is not None:
            return self.index.memoized(start, key, compute)
        return [compute(s) for s in self.recent[start:]]

    def is_active(self, kind: str, key: str) -> bool:
        return (kind, key) in self.active

    def cached(self, name: str, compute: Callable[[], T]) -> T:
        """``compute()`` once per context: views several detectors share."""
        if name not in self._memo:
            self._memo[name] = compute()
        return self._memo[name]  # type: ignore[return-value]

    def tree(self) -> JobTree:
        """The job's tree in the latest snapshot."""
        return self.cached("tree", lambda: JobTree.of(self.latest))


@dataclass(frozen=True, slots=True)
class JobTree:
    """The latest snapshot's processes split into attached to the trainer, orphaned, zombies."""

    main: ProcessSample | None
    attached: tuple[ProcessSample, ...]  # live and connected to the live main by ppid
    orphans: tuple[ProcessSample, ...]  # live workers (and their descendants) cut off from it
    zombies: tuple[ProcessSample, ...]

    @classmethod
    def of(cls, s: Snapshot) -> JobTree:
        main: ProcessSample | None = None
        live: list[ProcessSample] = []
        zombies: list[ProcessSample] = []
        for p in s.processes:
            if p.role == "main":
                main = p
            if p.state in DEAD_STATES:
                if p.role != "main":
                    zombies.append(p)
            else:
                live.append(p)
        attached: set[int] = set()
        if s.target.alive and main is not None and main.state not in DEAD_STATES:
            attached.add(main.pid)
            pending = [p for p in live if p.pid != main.pid]
            while pending:  # a pass per tree level: two passes for a trainer and its workers
                rest = [p for p in pending if p.ppid not in attached]
                if len(rest) == len(pending):
                    break
                attached.update(p.pid for p in pending if p.ppid in attached)
                pending = rest
        orphaned = {p.pid for p in live if p.role == "worker" and p.pid not in attached}
        if orphaned:
            pending = [p for p in live if p.pid not in attached and p.pid not in orphaned]
            while pending:  # descendants of orphaned workers are orphans too
                rest = [p for p in pending if p.ppid not in orphaned]
                if len(rest) == len(pending):
                    break
                orphaned.update(p.pid for p in pending if p.ppid in orphaned)
                pending = rest
        return cls(
            main=main,
            attached=tuple(p for p in live if p.pid in attached),
            orphans=tuple(p for p in live if p.pid in orphaned),
            zombies=tuple(zombies),
        )

    def workers(self) -> list[ProcessSample]:
        return [p for p in self.attached if p.role == "worker"]


# -- plain-text figures ----------------------------------------------------------------------


def size(value: float | None) -> str:
    return human_bytes(value, missing="unknown")


def per_min(bytes_per_s: float) -> str:
    return f"{bytes_per_s * 60 / MIB:.1f} MiB/min"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    if seconds < 9.95:  # a batch every 0.5 s is not "every 0 s"
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def pid_list(pids: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(p) for p in pids[:limit])
    return shown + (f" and {len(pids) - limit} more" if len(pids) > limit else "")


def sum_known(values: Iterable[int | float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(sum(known)) if known else None


@dataclass(frozen=True, slots=True)
class Headroom:
    """How much more the job can take before something kills it, and what kills it."""

    bytes: int
    source: str  # "cgroup" (limit - usage) or "machine" (MemAvailable)
    limit_bytes: int | None  # the cgroup limit, or MemTotal


def cgroup_working_set(s: Snapshot) -> int | None:
    """The cgroup's usage without its inactive page cache (what the kernel cannot just drop);
    the raw usage from records that predate the working set."""
    cg = s.cgroup
    if cg is not None:
        return cg.working_set_bytes if cg.working_set_bytes is not None else cg.current_bytes
    m = s.memory
    return m.cgroup_working_set_bytes if m.cgroup_working_set_bytes is not None else m.cgroup_current_bytes


def headroom(s: Snapshot) -> Headroom | None:
    """min(MemAvailable, cgroup limit - cgroup working set): the limit that will actually kill
    the job. Page cache is not counted: the kernel reclaims it before any OOM kill."""
    options: list[Headroom] = []
    m = s.memory
    if m.available_bytes is not None:
        options.append(Headroom(max(0, m.available_bytes), "machine", m.total_bytes))
    limit = s.cgroup.limit_bytes if s.cgroup is not None else m.cgroup_limit_bytes
    current = cgroup_working_set(s)
    if limit is not None and current is not None:
        options.append(Headroom(max(0, limit - current), "cgroup", limit))
    return min(options, key=lambda h: h.bytes) if options else None


def describe_headroom(h: Headroom) -> str:
    if h.source == "cgroup":
        return f"the cgroup limit ({size(h.limit_bytes)}, {size(h.bytes)} left)"
    return f"the machine's available memory ({size(h.bytes)} left)"
