"""The long memory of the analysis: compact, thinned series that an hour at 1 Hz keeps small.

Full snapshots are kept for a couple of minutes only (the short-window detectors need no more).
What the slow detectors need over tens of minutes is extracted here, one snapshot at a time:

* each process's **fresh** USS/PSS readings, without file-backed pages when the kernel splits
  them (see :func:`memory_views`). PSS/USS are refreshed on a CPU budget, so most
  snapshots repeat an old value; a reading is placed at the time it was really taken
  (``snapshot.time - pss_age_s``) and a repeat of the same reading is ignored;
* the job's PSS total, recorded only when some reading in it is new, at the mean time its
  readings were taken; and the same for the sum of the workers' USS (copy-on-read shows there
  without the main process's own ups and downs);
* the job's RSS and RssAnon totals, and each process's RssAnon (fresh every tick). RssAnon is
  immune to what PSS suffers on a shared machine (a shared library's pages are split among
  however many processes map them, so an unrelated process starting moves everyone's PSS), and
  new allocations show there at once; copy-on-read does not move it (the page was resident).
* the OOM-kill counters (machine and cgroup), kept only when they change.
* the trainer's own RssAnon (its workers come and go every epoch without persistent_workers; it
  stays), when the training loop was first seen running (workers alive or batches delivered), and
  when a worker was last forked (its RssAnon counts the trainer's pages again).

``Digest.ingest`` is O(processes) per snapshot; ``Digest.from_history`` builds the same digest
from a sequence of snapshots (the pure form the detectors' tests use).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from dlmon.analysis.stats import Point
from dlmon.model import ProcessSample, Snapshot
from dlmon.model.format import DEAD_STATES

Identity = tuple[int, int]  # (pid, start_time)


class Series:
    """``(time, value)`` points, oldest first, at least ``min_gap_s`` apart and at most ``capacity``.

    When full, every second point of the older half is dropped: recent points stay dense, old ones
    get sparser, and the whole span is kept however long it runs.
    """

    __slots__ = ("_points", "_times", "capacity", "min_gap_s")

    def __init__(self, min_gap_s: float = 2.0, capacity: int = 256) -> None:
        if capacity < 4:
            raise ValueError("capacity must be at least 4")
        self.min_gap_s = min_gap_s
        self.capacity = capacity
        self._points: list[Point] = []
        self._times: list[float] = []

    def add(self, t: float, value: float) -> bool:
        """Append a point; False when it is not after the last one by ``min_gap_s``."""
        if self._times and t < self._times[-1] + self.min_gap_s:
            return False
        self._points.append((t, value))
        self._times.append(t)
        if len(self._points) > self.capacity:
            half = len(self._points) // 2
            kept = self._points[:half:2] + self._points[half:]
            self._points = kept
            self._times = [p[0] for p in kept]
        return True

    def since(self, start: float) -> list[Point]:
        """The points with time >= ``start``."""
        return self._points[bisect.bisect_left(self._times, start) :]

    def between(self, start: float, end: float) -> list[Point]:
        """The points with ``start`` <= time <= ``end``."""
        return self._points[bisect.bisect_left(self._times, start) : bisect.bisect_right(self._times, end)]

    def last(self) -> Point | None:
        return self._points[-1] if self._points else None

    def first(self) -> Point | None:
        return self._points[0] if self._points else None

    def __len__(self) -> int:
        return len(self._points)

    @property
    def points(self) -> list[Point]:
        return list(self._points)


@dataclass(slots=True)
class ProcessMemory:
    """One process's fresh memory readings."""

    pid: int
    start_time: int
    role: str
    worker_id: int | None
    uss: Series
    pss: Series
    anon: Series
    last_seen: float
    alive: bool = True
    last_reading: float | None = None  # real time of the newest reading seen

    @property
    def label(self) -> str:
        return process_label(self.role, self.pid, self.worker_id)


def memory_views(pss: int, p: ProcessSample) -> tuple[int, int | None]:
    """(PSS, private part) of a process with a PSS reading, without file-backed pages where the
    kernel splits them (Pss_File, Linux >= 5.7): a worker mapping an np.memmap / Arrow / LMDB file
    maps more clean file pages the more it reads, which the kernel drops under pressure and which
    is no leak; USS counts them (Private_Clean). Copy-on-read shows in what is left: a copied page
    is private anonymous. On older kernels: PSS and USS as they are."""
    if p.pss_file_bytes is None:
        return pss, p.uss_bytes
    anon = max(0, pss - p.pss_file_bytes)
    return anon, anon


def process_label(role: str, pid: int, worker_id: int | None = None) -> str:
    """``worker 3 (pid 1234)``, ``main (pid 1000)``, ``child (pid 77)``."""
    if role == "worker" and worker_id is not None:
        return f"worker {worker_id} (pid {pid})"
    return f"{role} (pid {pid})"


@dataclass(frozen=True, slots=True)
class DigestLimits:
    process_points: int = 240  # per process: 8 min at one reading per 2 s before thinning
    anon_points: int = 120  # per process RssAnon (every tick): 4 min at full density
    job_points: int = 512
    min_gap_s: float = 2.0
    same_reading_s: float = 0.2  # two readings this close in real time are the same reading
    forget_gone_s: float = 900.0  # series of vanished processes are kept this long
    max_processes: int = 512
    oom_records: int = 64


@dataclass(slots=True)
class WorkerSum:
    total: int = 0
    time_total: float = 0.0
    count: int = 0
    fresh: bool = False
    complete: bool = True

    def add(self, uss: int | None, taken: float, fresh: bool) -> None:
        if uss is None:
            self.complete = False
            return
        self.total += uss
        self.time_total += taken
        self.count += 1
        self.fresh = self.fresh or fresh


@dataclass(frozen=True, slots=True)
class OomRecord:
    time: float
    machine: int | None
    cgroup: int | None


@dataclass(slots=True)
class Digest:
    limits: DigestLimits = field(default_factory=DigestLimits)
    processes: dict[Identity, ProcessMemory] = field(default_factory=dict)
    job_pss: Series = field(init=False)
    workers_uss: Series = field(init=False)
    job_rss: Series = field(init=False)
    job_anon: Series = field(init=False)
    oom: list[OomRecord] = field(default_factory=list)
    deaths_seen: dict[tuple[int, float | None], float] = field(default_factory=dict)  # first seen
    first_time: float | None = None
    last_time: float | None = None
    readings: int = 0  # fresh PSS readings taken in so far: a cheap change marker for caches
    split: bool = False  # readings come without file-backed pages (smaps_rollup has Pss_File)
    worker_slots: dict[int, Identity] = field(default_factory=dict)  # worker id -> its newest process
    restarts: list[float] = field(default_factory=list)  # when a new generation of workers started
    # when the generation before ``restarts[0]`` started: the first tick with any worker (the
    # trainer's own start-up before it is no generation), then each restart trimmed from the list
    generation_start: float | None = None
    main_anon: Series = field(init=False)  # the trainer's own RssAnon: no worker churn moves it
    training_seen: float | None = None  # first snapshot with DataLoader workers or batches: the loop runs
    # when a worker process was last seen for the first time: forked from the trainer then, its
    # RssAnon holds the trainer's copy-on-write pages whole (without the agent no restart is known)
    worker_forked: float | None = None

    def __post_init__(self) -> None:
        self.job_pss = Series(self.limits.min_gap_s, self.limits.job_points)
        self.workers_uss = Series(self.limits.min_gap_s, self.limits.job_points)
        self.job_rss = Series(self.limits.min_gap_s, self.limits.job_points)
        self.job_anon = Series(self.limits.min_gap_s, self.limits.job_points)
        self.main_anon = Series(self.limits.min_gap_s, self.limits.job_points)

    @classmethod
    def from_history(cls, history: Iterable[Snapshot], limits: DigestLimits | None = None) -> Digest:
        digest = cls(limits or DigestLimits())
        for snapshot in history:
            digest.ingest(snapshot)
        return digest

    def ingest(self, s: Snapshot) -> None:
        now = s.time
        if self.first_time is None:
            self.first_time = now
        self.last_time = now
        limits = self.limits
        seen: set[Identity] = set()
        fresh_any = False
        complete = True
        pss_total = 0
        time_total = 0.0
        counted = 0
        rss_total = anon_total = 0
        rss_known = anon_known = False
        workers = WorkerSum()
        for p in s.processes:
            if p.state in DEAD_STATES:
                continue
            identity = (p.pid, p.start_time)
            seen.add(identity)
            if self.generation_start is None and p.role == "worker":
                self.generation_start = now
            if p.rss_bytes is not None:
                rss_total += p.rss_bytes
                rss_known = True
            track = self.processes.get(identity)
            if p.role == "worker" and (track is None or track.role != "worker"):
                self.worker_forked = now
            if track is None:
                track = ProcessMemory(
                    p.pid,
                    p.start_time,
                    p.role,
                    p.worker_id,
                    Series(limits.min_gap_s, limits.process_points),
                    Series(limits.min_gap_s, limits.process_points),
                    Series(limits.min_gap_s, limits.anon_points),
                    now,
                )
                self.processes[identity] = track
                if p.role == "worker" and p.worker_id is not None:
                    self._note_worker(p.worker_id, identity, now, s)
            track.last_seen = now
            track.alive = True
            if p.rss_anon_bytes is not None:
                anon_total += p.rss_anon_bytes
                anon_known = True
                track.anon.add(now, float(p.rss_anon_bytes))
            track.role = p.role
            if p.worker_id is not None:
                track.worker_id = p.worker_id
            if p.pss_bytes is None:
                if "smaps" not in p.unavailable:  # denied for good: the total is without it
                    complete = False
                    if p.role == "worker":
                        workers.complete = False
                continue
            taken = now - (p.pss_age_s or 0.0)
            pss, uss = memory_views(p.pss_bytes, p)
            if p.pss_file_bytes is not None:
                self.split = True
            pss_total += pss
            time_total += taken
            counted += 1
            fresh = track.last_reading is None or taken > track.last_reading + limits.same_reading_s
            if p.role == "worker":
                workers.add(uss, taken, fresh)
            if not fresh:
                continue  # the same (stale) reading again
            track.last_reading = taken
            fresh_any = True
            self.readings += 1
            track.pss.add(taken, float(pss))
            if uss is not None:
                track.uss.add(taken, float(uss))
        if rss_known:
            self.job_rss.add(now, float(rss_total))
        if anon_known:
            self.job_anon.add(now, float(anon_total))
        if fresh_any and complete and counted:
            self.job_pss.add(time_total / counted, float(pss_total))
        if workers.fresh and workers.complete and workers.count:
            self.workers_uss.add(workers.time_total / workers.count, float(workers.total))
        self._forget(seen, now)
        self._note_oom(s)
        for death in s.worker_deaths:
            key = (death.pid, death.time)
            if key not in self.deaths_seen and len(self.deaths_seen) < 4096:
                self.deaths_seen[key] = now
        self._note_trainer(s)

    def _note_trainer(self, s: Snapshot) -> None:
        """The trainer's own RssAnon (its workers come and go, it stays), and when the training loop
        was first seen running: DataLoader workers alive (they start at the loader's first
        iteration, after the dataset and the model are built) or a loader that delivered batches."""
        main = next((p for p in s.processes if p.role == "main" and p.state not in DEAD_STATES), None)
        if main is not None and main.rss_anon_bytes is not None:
            self.main_anon.add(s.time, float(main.rss_anon_bytes))
        if self.training_seen is None and (
            any(p.role == "worker" and p.state not in DEAD_STATES for p in s.processes)
            or any((x.batches_total or 0) > 0 for x in s.loaders)
        ):
            self.training_seen = s.time

    def _forget(self, seen: set[Identity], now: float) -> None:
        gone = [k for k in self.processes if k not in seen]
        for key in gone:
            track = self.processes[key]
            track.alive = False
            if now - track.last_seen > self.limits.forget_gone_s:
                del self.processes[key]
        if len(self.processes) > self.limits.max_processes:
            dead = sorted((t.last_seen, k) for k, t in self.processes.items() if not t.alive)
            for _, key in dead[: len(self.processes) - self.limits.max_processes]:
                del self.processes[key]

    def _note_worker(self, worker_id: int, identity: Identity, now: float, s: Snapshot) -> None:
        """A new process in a worker slot that had another one: the workers were restarted (an
        epoch or a validation pass without persistent_workers). One restart per 2 s. A slot whose
        process still lives keeps it: the newcomer is another loader's worker with the same id."""
        before = self.worker_slots.get(worker_id)
        if (
            before is not None
            and before != identity
            and any((p.pid, p.start_time) == before and p.state not in DEAD_STATES for p in s.processes)
        ):
            return
        self.worker_slots[worker_id] = identity
        if len(self.worker_slots) > self.limits.max_processes:
            self.worker_slots.pop(next(iter(self.worker_slots)))
        if before is None or before == identity:
            return
        if self.restarts and now - self.restarts[-1] < self.limits.min_gap_s:
            return
        self.restarts.append(now)
        if len(self.restarts) > self.limits.oom_records:
            self.generation_start = self.restarts.pop(0)

    def _note_oom(self, s: Snapshot) -> None:
        machine = s.memory.oom_kill_count
        cgroup = s.cgroup.oom_kill_count if s.cgroup is not None else None
        last = self.oom[-1] if self.oom else None
        if last is None or last.machine != machine or last.cgroup != cgroup:
            self.oom.append(OomRecord(s.time, machine, cgroup))
            if len(self.oom) > self.limits.oom_records:
                del self.oom[1]  # keep the first: it says since when we know the counters

    def oom_at(self, t: float) -> OomRecord | None:
        """The counters as they stood at time ``t``; None before monitoring began."""
        found: OomRecord | None = None
        for record in self.oom:
            if record.time > t:
                break
            found = record
        return found

    def live(self) -> list[ProcessMemory]:
        return [t for t in self.processes.values() if t.alive]
