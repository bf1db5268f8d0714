"""What the dashboard remembers between snapshots (no UI imports; pure, cheap per tick).

Snapshots are ingested on the UI thread as they arrive, whether or not the view is paused or a
modal is open. Everything here is bounded: a short :class:`~dlmon.model.History` of whole
snapshots, fixed-size downsampled series for the charts, and at most :data:`MAX_ROWS` process
rows, so the dashboard's memory stays flat over hours.

Rows are keyed by DataLoader worker id when the agent knows it (so non-persistent workers that
get new pids every epoch keep their row and history), else by ``(pid, start_time)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from dlmon.model import History, LoaderSample, ProcessSample, Snapshot, WorkerDeath
from dlmon.model.format import DEAD_STATES
from dlmon.ui.columns import SORTS
from dlmon.ui.series import WORKER_TIERS, Series

RowKey = tuple[str, str, int]

HISTORY_CAPACITY = 120  # whole snapshots (~30 KB each with 33 processes)
MAX_ROWS = 128
MAX_LOADERS = 8
GONE_KEEP_S = 60.0  # a vanished process keeps its row (as "gone") this long, or 10 intervals
DEATH_KEEP_S = 600.0  # a worker the agent saw die keeps its row this long


def _new_worker_series() -> Series:
    return Series(WORKER_TIERS)


@dataclass(slots=True, eq=False)
class ProcessRow:
    """One row of the workers table and its history."""

    key: RowKey
    process: ProcessSample  # the newest sample (the last one seen, once gone)
    order: int  # first-seen sequence: the natural order is stable
    first_seen: float
    last_seen: float
    gone: bool = False
    death: WorkerDeath | None = None
    pids_seen: int = 1  # > 1: a non-persistent worker re-spawned under the same worker id
    loader_id: str | None = None
    batch_share: float | None = None
    pss: Series = field(default_factory=_new_worker_series)
    rss: Series = field(default_factory=_new_worker_series)
    uss: Series = field(default_factory=_new_worker_series)
    cpu: Series = field(default_factory=_new_worker_series)
    read: Series = field(default_factory=_new_worker_series)
    batches: int | None = None  # batches this worker delivered (agent), and when that count last moved
    last_batch_time: float | None = None
    batch_age_s: float | None = None  # seconds since its last batch, as of the newest snapshot

    @property
    def label(self) -> str:
        p = self.process
        if p.role == "worker":
            wid = f" {p.worker_id}" if p.worker_id is not None else ""
            return f"worker{wid} (pid {p.pid})"
        return f"{p.role} (pid {p.pid})"


@dataclass(slots=True)
class LoaderHistory:
    loader: LoaderSample
    last_seen: float
    batches_per_s: Series = field(default_factory=Series)
    samples_per_s: Series = field(default_factory=Series)
    data_wait_percent: Series = field(default_factory=Series)


@dataclass(slots=True)
class RankGroup:
    """One DDP rank (a process with its own loaders) and its workers, with sums for the group."""

    owner: ProcessRow
    workers: list[ProcessRow]
    pss_bytes: int | None  # the rank and its live workers
    batches_per_s: float | None  # its loaders together
    data_wait_fraction: float | None  # the worst of its loaders


@dataclass(frozen=True, slots=True)
class ViewContext:
    """What every screen draws from at a repaint: the state, the newest data time, the interval."""

    state: DashboardState
    now: float
    interval: float | None
    # the charts draw the newest data now, whatever their throttle: the user asked for this view
    # (pause, resume, a resize, a zoom, back from a detail) or it is the last one for a while
    # (the source ended) or the history started again (a replay's seek)
    fresh: bool = False


def row_key(process: ProcessSample, loader_of: dict[int, LoaderSample]) -> RowKey:
    if process.role == "worker" and process.worker_id is not None:
        loader = loader_of.get(process.pid)
        owner = loader.id if loader is not None else f"ppid {process.ppid}"
        return ("w", owner, process.worker_id)
    return ("p", str(process.pid), process.start_time)


def _batch_shares(loaders: Iterable[LoaderSample]) -> tuple[dict[int, float], dict[int, LoaderSample]]:
    shares: dict[int, float] = {}
    owner: dict[int, LoaderSample] = {}
    for loader in loaders:
        counts = loader.batches_per_worker
        total = sum(counts)
        for i, pid in enumerate(loader.worker_pids):
            owner[pid] = loader
            if total > 0 and i < len(counts):
                shares[pid] = counts[i] / total
    return shares, owner


class DashboardState:
    """Everything the panels draw from. ``ingest`` is O(processes) and allocation-light."""

    def __init__(self, history_capacity: int = HISTORY_CAPACITY, rank: int | None = None) -> None:
        self.rank = rank  # --rank N: snapshots arrive filtered to that rank (ui/rank_filter.py)
        self.history = History(history_capacity)
        self.latest: Snapshot | None = None
        self.count = 0
        self.version = 0
        self.rows: dict[RowKey, ProcessRow] = {}
        self.loaders: dict[str, LoaderHistory] = {}
        self.pss_sum = Series()
        self.rss_sum = Series()
        self.available = Series()
        self.limit = Series()
        self.cgroup_current = Series()
        self.pss_anon_sum = Series()  # PSS without file-backed pages: what a leak moves
        self.end_reason: str | None = None  # why the source ended, once it did
        self.oom_baseline: int | None = None  # the machine's OOM-kill count when we started
        self.first_time: float | None = None
        self.analysis_errors = 0  # detector failures the analyzer swallowed (it never raises)
        self.analysis_error: str | None = None  # the newest of them, "ValueError: ..."
        # the Throughput panel's line while a job without the agent could be given one: the offer
        # ("press i to load the agent ..."), then how the load went
        self.agent_offer: str | None = None
        self._order = 0
        self._worker_slots: dict[tuple[int, int], RowKey] = {}  # live workers' rows by identity

    # ---- ingest -------------------------------------------------------------------------
    def ingest(self, snapshot: Snapshot) -> None:
        t = snapshot.time
        self.latest = snapshot
        self.history.append(snapshot)
        self.count += 1
        self.version += 1
        if self.first_time is None:
            self.first_time = t

        m = snapshot.memory
        if self.oom_baseline is None and m.oom_kill_count is not None:
            self.oom_baseline = m.oom_kill_count
        self.pss_sum.add(t, m.pss_sum_bytes)
        self.rss_sum.add(t, m.rss_sum_bytes)
        self.available.add(t, m.available_bytes)
        self.limit.add(t, m.cgroup_limit_bytes)
        self.cgroup_current.add(t, m.cgroup_current_bytes)
        self.pss_anon_sum.add(t, m.pss_anon_sum_bytes)

        shares, loader_of = _batch_shares(snapshot.loaders)
        seen: set[RowKey] = set()
        slots: dict[tuple[int, int], RowKey] = {}
        for p, key in self._row_keys(snapshot.processes, loader_of):
            if key in seen:  # two live processes claim one worker slot: keep both rows
                key = ("p", str(p.pid), p.start_time)
            elif key[0] == "w" or p.role == "worker":
                slots[(p.pid, p.start_time)] = key
                if key[0] == "w":  # seen before the agent listed it: one row, not two
                    self.rows.pop(("p", str(p.pid), p.start_time), None)
            seen.add(key)
            row = self.rows.get(key)
            if row is None:
                self._order += 1
                row = ProcessRow(key=key, process=p, order=self._order, first_seen=t, last_seen=t)
                self.rows[key] = row
            elif row.process.pid != p.pid or row.process.start_time != p.start_time:
                row.pids_seen += 1
                row.death = None
            row.process = p
            row.last_seen = t
            row.gone = False
            loader = loader_of.get(p.pid)
            row.loader_id = loader.id if loader is not None else row.loader_id
            row.batch_share = shares.get(p.pid)
            counts = loader.batches_per_worker if loader is not None else ()
            if p.worker_id is not None and p.worker_id < len(counts):
                n = counts[p.worker_id]
                if n != row.batches:
                    row.batches, row.last_batch_time = n, (t if row.batches is not None else None)
                row.batch_age_s = t - row.last_batch_time if row.last_batch_time is not None else None
            row.pss.add(t, p.pss_bytes)
            row.rss.add(t, p.rss_bytes)
            row.uss.add(t, p.uss_bytes)
            row.cpu.add(t, p.cpu_percent)
            row.read.add(t, p.read_bytes_per_s)

        self._worker_slots = slots
        for key, row in self.rows.items():
            if key not in seen:
                row.gone = True
                row.batch_share = None

        if snapshot.worker_deaths:
            by_pid = {d.pid: d for d in snapshot.worker_deaths}
            for row in self.rows.values():
                death = by_pid.get(row.process.pid)
                if death is not None and (row.gone or row.process.state in DEAD_STATES):
                    row.death = death

        for loader in snapshot.loaders:
            hist = self.loaders.get(loader.id)
            if hist is None:
                hist = self.loaders[loader.id] = LoaderHistory(loader=loader, last_seen=t)
            hist.loader = loader
            hist.last_seen = t
            hist.batches_per_s.add(t, loader.batches_per_s)
            hist.samples_per_s.add(t, loader.samples_per_s)
            wait = loader.data_wait_fraction
            hist.data_wait_percent.add(t, None if wait is None else wait * 100.0)

        self._prune(t, snapshot.interval_s)
        # a record that carries the analyzer's own count (a replay, the Snapshot field when present)
        errors = getattr(snapshot, "analysis_errors", None)
        if isinstance(errors, int):
            last = getattr(snapshot, "analysis_error", None)
            self.note_analysis(errors, last if isinstance(last, str) else None)

    def note_analysis(self, errors: int, last: str | None) -> None:
        """The analyzer's failure count so far (it only grows; a restarted count is kept)."""
        if errors > self.analysis_errors or (errors and last and last != self.analysis_error):
            self.analysis_errors = max(errors, self.analysis_errors)
            self.analysis_error = last or self.analysis_error
            self.version += 1

    def _row_keys(
        self, processes: tuple[ProcessSample, ...], loader_of: dict[int, LoaderSample]
    ) -> list[tuple[ProcessSample, RowKey]]:
        """Each process's row. A worker respawned every epoch is seen before the agent lists it
        (or after it stops listing it, or never, when it lives less than a poll): it keeps the
        row it had, or takes over the gone row of an earlier unidentified worker of its parent,
        so a respawning loader has a row per worker slot instead of a "gone" row per respawn."""
        out: list[tuple[ProcessSample, RowKey]] = []
        unplaced: list[int] = []
        for p in processes:
            key = row_key(p, loader_of)
            identity = (p.pid, p.start_time)
            if key[0] == "w":
                old = self._worker_slots.get(identity)
                if old is not None and old != key:
                    self.rows.pop(old, None)
            elif identity in self._worker_slots:
                key = self._worker_slots[identity]
            elif p.role == "worker":
                unplaced.append(len(out))
            out.append((p, key))
        if not unplaced:
            return out
        taken = {key for _, key in out}
        free = sorted(
            (
                row
                for key, row in self.rows.items()
                if key[0] == "p" and row.gone and row.process.role == "worker"
            ),
            key=lambda row: row.order,
        )
        for i in unplaced:
            p = out[i][0]
            reuse = next((r.key for r in free if r.process.ppid == p.ppid and r.key not in taken), None)
            if reuse is not None:  # the gone row of an earlier unidentified worker of this loader
                out[i] = (p, reuse)
                taken.add(reuse)
        return out

    def end(self, reason: str) -> None:
        self.end_reason = reason
        self.version += 1

    def _prune(self, now: float, interval: float | None) -> None:
        keep = max(GONE_KEEP_S, 10 * (interval or 0.0))
        stale = [
            key
            for key, row in self.rows.items()
            if row.gone and now - row.last_seen > (DEATH_KEEP_S if row.death is not None else keep)
        ]
        for key in stale:
            del self.rows[key]
        if len(self.rows) > MAX_ROWS:
            gone_first = sorted(self.rows.values(), key=lambda r: (not r.gone, r.last_seen))
            for row in gone_first[: len(self.rows) - MAX_ROWS]:
                del self.rows[row.key]
        if len(self.loaders) > MAX_LOADERS:
            oldest = sorted(self.loaders.values(), key=lambda h: h.last_seen)
            for hist in oldest[: len(self.loaders) - MAX_LOADERS]:
                del self.loaders[hist.loader.id]

    # ---- queries ------------------------------------------------------------------------
    def sorted_rows(self, sort: str, reverse: bool = False) -> list[ProcessRow]:
        rows = list(self.rows.values())
        getter = SORTS[sort].value
        if getter is None:
            rows.sort(key=natural_key, reverse=reverse)
            return rows

        def metric(row: ProcessRow) -> tuple[int, float, tuple[int, int, int]]:
            value = getter(row)
            # missing values last whatever the direction; ties in natural order
            return (1 if value is None else 0, -(value or 0.0), natural_key(row))

        rows.sort(key=metric)
        if reverse:  # smallest first, missing still last
            present = [r for r in rows if getter(r) is not None]
            missing = [r for r in rows if getter(r) is None]
            rows = present[::-1] + missing
        return rows

    def live_loaders(self) -> list[LoaderHistory]:
        """The loaders in the newest snapshot, busiest (batches/s) first: what the chart plots."""
        if self.latest is None:
            return []
        live = [self.loaders[ld.id] for ld in self.latest.loaders if ld.id in self.loaders]
        live.sort(key=lambda h: -(h.loader.batches_per_s or 0.0))
        return live

    def rank_groups(self) -> dict[int, RankGroup]:
        """DDP (torchrun, mp.spawn): the processes that own DataLoader workers, when there are at
        least two of them, each with its workers and sums. Empty for a single-process job."""
        owners: dict[int, list[ProcessRow]] = {}
        by_pid = {r.process.pid: r for r in self.rows.values() if not r.gone}
        for row in self.rows.values():
            p = row.process
            if p.role == "worker" and p.ppid in by_pid and by_pid[p.ppid].process.role != "worker":
                owners.setdefault(p.ppid, []).append(row)
        if len(owners) < 2:
            return {}
        loaders = self.latest.loaders if self.latest is not None else ()
        groups: dict[int, RankGroup] = {}
        for pid, workers in owners.items():
            owner = by_pid[pid]
            mine = [ld for ld in loaders if ld.pid == pid]
            rates = [ld.batches_per_s for ld in mine if ld.batches_per_s is not None]
            waits = [ld.data_wait_fraction for ld in mine if ld.data_wait_fraction is not None]
            pss = [
                r.process.pss_bytes
                for r in (owner, *workers)
                if not r.gone and r.process.pss_bytes is not None
            ]
            groups[pid] = RankGroup(
                owner=owner,
                workers=sorted(workers, key=natural_key),
                pss_bytes=sum(pss) if pss else None,
                batches_per_s=sum(rates) if rates else None,
                data_wait_fraction=max(waits) if waits else None,
            )
        return groups

    def d_state_count(self) -> int:
        if self.latest is None:
            return 0
        return sum(1 for p in self.latest.processes if p.state == "D")


_ROLE_ORDER = {"main": 0, "worker": 1, "child": 2}


def natural_key(row: ProcessRow) -> tuple[int, int, int]:
    p = row.process
    wid = p.worker_id if p.worker_id is not None else 1 << 30
    return (_ROLE_ORDER.get(p.role, 3), wid, row.order)
