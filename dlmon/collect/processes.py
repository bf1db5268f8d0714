"""The target's process tree, read every tick: the target, all its descendants, and any
process that was once in the tree and is still alive (orphaned DataLoader workers keep their
row after the trainer dies, reparented to init).

What each tick reads, and what it reads less often (docs/performance.md):
- every process, every tick: stat through a held fd (plus a stat read after each open by path
  below: the identity check of procfs.py); status and io too when stat shows it moved (CPU
  time, faults, RSS, threads, state) or its bytes read or written moved at their last read,
  else every ``unmoved_refresh_s``; their rates are over the time since their last read;
- children: every tick only from the threads that fork (the main thread and any thread seen
  with children) of processes that can start workers (the trainer, launchers, ranks); every
  thread when the thread count changed or every ``thread_list_s``; workers' own children every
  ``worker_children_s`` (they rarely fork);
- fd counts: when status FDSize moved, or every ``fd_refresh_s``;
- smaps_rollup: under the budget of ``SmapsBudget`` with what the rest of the tick left.
When the fixed work passes half the budget, those cadences stretch (up to ``max_stretch``x)
before PSS freshness is given up. When even the every-tick reads would pass the budget (hundreds
of processes), workers are read in rotation: each one every ``rotation`` ticks, its last row
shown in between (``Snapshot.rotation_ticks``); the trainer, launchers and ranks every tick.

A transient error reading a process's stat keeps it tracked (only ProcessGone drops it): an
orphan, reparented away from the tree, could never be found again.
"""

from __future__ import annotations

import operator
import resource
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import NamedTuple

from dlmon.collect.limits import FdLimits
from dlmon.collect.procfs import (
    CLOCK_TICKS,
    PAGE_SIZE,
    AccessDenied,
    FieldPicker,
    ProcessGone,
    ProcHandle,
    StatFields,
    all_pids,
    children_files_supported,
    parse_stat,
)
from dlmon.collect.smaps_budget import SmapsBudget, SmapsCandidate
from dlmon.model import ProcessSample
from dlmon.model.format import DEAD_STATES

WORKER_COMMS = frozenset({"pt_data_worker"})


# The lines of /proc/PID/status and /proc/PID/io a row reads (``_build`` says which field each
# fills). VmRSS is stat's RSS when present, VmSwap smaps_rollup's Swap when that is older, and
# FDSize says when to recount the fds; the others are figures of the row as they are.
STATUS_KEYS = (
    "VmRSS",
    "VmSwap",
    "FDSize",
    "RssAnon",
    "RssFile",
    "RssShmem",
    "VmLck",
    "VmPin",
    "voluntary_ctxt_switches",
    "nonvoluntary_ctxt_switches",
)
IO_KEYS = ("read_bytes", "write_bytes")
STATUS_FIELDS = FieldPicker(STATUS_KEYS)
IO_FIELDS = FieldPicker(IO_KEYS)


class Counters(NamedTuple):
    """The cumulative counts of status and io whose change per second the row shows, kept from
    one read to the next (status and io are read only when the process moved, so a rate is over
    the time since the read before, not since the last tick). Tuples, not dataclasses: two are
    made for every row built, every tick, and a frozen dataclass's ``__init__`` costs 3x."""

    nonvoluntary_ctxt_switches: int | None = None
    read_bytes: int | None = None
    write_bytes: int | None = None

    @classmethod
    def read(cls, status: Mapping[str, int], io: Mapping[str, int]) -> Counters:
        return cls(status.get("nonvoluntary_ctxt_switches"), io.get("read_bytes"), io.get("write_bytes"))

    def io_moved_since(self, before: Counters) -> bool:
        """Bytes read or written since ``before``: status and io are read again next tick."""
        return self.read_bytes != before.read_bytes or self.write_bytes != before.write_bytes

    def rates(self, before: Counters, seconds: float | None) -> Rates:
        """Per second since ``before``, ``seconds`` ago."""
        return Rates(
            _rate(self.nonvoluntary_ctxt_switches, before.nonvoluntary_ctxt_switches, seconds),
            _rate(self.read_bytes, before.read_bytes, seconds),
            _rate(self.write_bytes, before.write_bytes, seconds),
        )

    def unmoved(self) -> Rates:
        """The rates of counters not read again this tick: the last read's, at which nothing
        moved and under a CPU tick ran since (0 for each count known)."""
        return Rates(
            *(
                None if c is None else 0.0
                for c in (self.nonvoluntary_ctxt_switches, self.read_bytes, self.write_bytes)
            )
        )


class Rates(NamedTuple):
    nonvoluntary_ctxt_switches_per_s: float | None
    read_bytes_per_s: float | None
    write_bytes_per_s: float | None


_NO_COUNTS = Counters()
# the split, in SmapsValues' order; Pss_Anon/Pss_File are absent before Linux 5.7: None
SMAPS_SPLIT = ("Pss_Anon", "Pss_File", "Anonymous")
SMAPS_FIELDS = FieldPicker(("Pss", "Pss_Shmem", "Private_Clean", "Private_Dirty", "Private_Hugetlb", "Swap", *SMAPS_SPLIT))  # fmt: skip  # noqa: E501
Identity = tuple[int, int]  # (pid, start_time)
FDS_PER_HANDLE = 3  # stat, status, io
SPAWNING_ROLES = frozenset({"main", "child"})  # can start DataLoader workers; workers rarely fork


@dataclass(frozen=True, slots=True)
class Cadence:
    """How often the slow per-process reads are refreshed, before stretching."""

    fd_refresh_s: float = 5.0
    # status and io of a process that did not move (CPU time, faults, RSS, threads and state
    # all as at the last read, and no bytes read or written at that read: what changes there
    # meanwhile is done with less than a CPU tick) are read again after this long; their
    # counters are cumulative, so a late read loses nothing, and its rates are over the time
    # since the read before
    unmoved_refresh_s: float = 5.0
    thread_list_s: float = 5.0
    worker_children_s: float = 10.0
    max_stretch: float = 12.0
    # Of RLIMIT_NOFILE's soft limit, fds dlmon keeps for itself (UI, sockets, record, NVML):
    # handles hold fds only within the rest.
    reserved_fds_fraction: float = 0.25
    reserved_fds_min: int = 64
    # Rotation: workers read every N ticks once the every-tick work passes the budget less
    # smaps_rollup's floor; at most this many ticks between two reads of a worker.
    max_rotation: int = 10
    rotation_settle_ticks: int = 5  # ticks between two changes (the cost is an average)
    # none in the first ticks: their cost holds one-off work (every fd directory listed, every
    # thread list read, new handles opened) that a steady tick does not (a 32-worker tree went to
    # rotation 5 for its first minute, its moving worker's PSS 34 s old)
    rotation_warmup_ticks: int = 10


@dataclass(slots=True)
class PhaseCost:
    """CPU seconds of the sampler thread in one tick of the tracker, by phase."""

    reads: float = 0.0  # stat of every process; status and io of those that moved
    discovery: float = 0.0  # children files, thread lists, adding processes
    fds: float = 0.0  # fd directory listings
    smaps: float = 0.0  # smaps_rollup reads and parsing
    build: float = 0.0  # ProcessSample objects

    def total(self) -> float:
        return self.reads + self.discovery + self.fds + self.smaps + self.build


_NONE_UNAVAILABLE: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class SmapsValues:
    uss_bytes: int | None
    pss_bytes: int | None
    pss_shmem_bytes: int | None
    swap_bytes: int | None
    pss_anon_bytes: int | None = None
    pss_file_bytes: int | None = None
    anonymous_bytes: int | None = None


def parse_smaps_rollup(raw: bytes) -> SmapsValues:
    v = SMAPS_FIELDS(raw)
    if "Pss" not in v:  # a zombie or kernel thread: no address space
        return SmapsValues(None, None, None, None)
    uss = v.get("Private_Clean", 0) + v.get("Private_Dirty", 0) + v.get("Private_Hugetlb", 0)
    return SmapsValues(uss, v["Pss"], v.get("Pss_Shmem"), v.get("Swap"), *map(v.get, SMAPS_SPLIT))


def held_fd_cap(cadence: Cadence) -> int:
    """How many processes may hold fds under the soft RLIMIT_NOFILE right now."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    reserve = max(cadence.reserved_fds_min, int(soft * cadence.reserved_fds_fraction))
    return max(0, (soft - reserve) // FDS_PER_HANDLE)


@dataclass(slots=True)
class _Tracked:
    handle: ProcHandle
    role: str
    first_seen: float
    prev_time: float | None = None  # the last tick it was read (stat: the CPU rate's start)
    prev_cpu_ticks: int | None = None
    counts: Counters = _NO_COUNTS  # status's and io's counters at their last read
    prev_major_faults: int | None = None
    smaps: SmapsValues | None = None
    smaps_time: float | None = None
    smaps_wall_s: float | None = None
    rss_at_smaps: int | None = None
    faults_at_smaps: int | None = None
    smaps_denied: str | None = None
    num_fds: int | None = None
    fds_time: float | None = None
    fdsize: int | None = None
    tids: list[int] | None = None  # None: list every thread at the next discovery
    tids_time: float = 0.0
    tids_num_threads: int | None = None
    forking_tids: set[int] = field(default_factory=set)
    children_time: float | None = None
    unavailable: dict[str, str] = field(default_factory=dict)
    slot: int = 0  # its turn in the rotation
    stat_pair: tuple[bytes, StatFields] | None = None  # the last stat line read, and its fields
    # The last row was built on a tick when nothing it shows had moved, so its rates are 0: on the
    # next such tick it is shown again (with its PSS age advanced) instead of built anew. Cleared
    # by every read that can move it (a new stat line, status and io, smaps_rollup) at the read, so
    # a tick that raised after the read (the watch loop goes on) leaves no stale row to be copied.
    quiet_row: bool = False
    status: dict[str, int] | None = None  # the last status and io read, kept while it rests
    io: dict[str, int] | None = None
    status_time: float = 0.0
    moved_key: tuple[int, int, int, int, str] | None = None
    counters_time: float | None = None  # when ``counts`` were read (their rates' start)
    io_moved: bool = False  # bytes read or written moved at the last read: read again next tick
    last_sample: ProcessSample | None = None  # shown again on ticks it is not read
    memory_key: tuple[int, int, int] | None = None  # minor and major faults, RSS pages at its last stat


_SAMPLE_FIELDS = tuple(f.name for f in fields(ProcessSample))
_sample_values = operator.attrgetter(*_SAMPLE_FIELDS)
_PSS_AGE = _SAMPLE_FIELDS.index("pss_age_s")
_PSS_STILL = _SAMPLE_FIELDS.index("pss_still")


def _aged(sample: ProcessSample, pss_age_s: float, pss_still: bool) -> ProcessSample:
    """``sample`` with its PSS age as of now: a row shown again in rotation holds the same smaps
    reading, and the digest places a reading at snapshot time - pss_age_s (a frozen age made every
    re-show a new reading); whether the tree stood still since moves with the tree, not the row.
    Half the cost of dataclasses.replace."""
    values = list(_sample_values(sample))
    values[_PSS_AGE] = pss_age_s
    values[_PSS_STILL] = pss_still
    return ProcessSample(*values)


def _rate(now: int | None, prev: int | None, dt: float | None) -> float | None:
    if now is None or prev is None or not dt or dt <= 0 or now < prev:
        return None
    return (now - prev) / dt


_Row = tuple[_Tracked, StatFields, dict[str, int], dict[str, int]]  # tracked, stat, status, io


def _moved_key(stat: StatFields) -> tuple[int, int, int, int, str]:
    """What moves in stat when most of status and io can have: a process that did not run (CPU
    time, page faults) and whose memory no one else changed (RSS: reclaim, swap-out, a truncated
    shared file) has the same status and io. CPU time counts 10 ms ticks, so a process that ran
    less than that can look unmoved: what it did meanwhile (IO that the CPU barely touches, such
    as O_DIRECT; context switches; an munmap of swapped-out pages: VmSwap) waits for the next
    read, and the rates of that read are over the whole time since the one before."""
    cpu = stat.utime_ticks + stat.stime_ticks
    return (cpu, stat.minor_faults, stat.rss_pages, stat.num_threads, stat.state)


class ProcessTracker:
    """Reads the process tree rooted at ``target_pid`` each time ``sample`` is called."""

    def __init__(
        self,
        target_pid: int,
        budget: SmapsBudget | None = None,
        proc_root: str = "/proc",
        clock: Callable[[], float] = time.monotonic,
        cadence: Cadence | None = None,
    ) -> None:
        self.proc_root = proc_root
        self.budget = budget or SmapsBudget()
        self.cadence = cadence or Cadence()
        self._clock = clock
        self._tracked: dict[Identity, _Tracked] = {}
        self._use_children_files = children_files_supported(proc_root)
        self._cheap_cost_per_s = 0.0
        self._cheap_cost_known = False
        self.stretch = 1.0  # > 1 when the fixed reads pass half the budget: slower cadences
        self.cost = PhaseCost()
        self.smaps_cpu_last_tick = 0.0
        self.smaps_reads_last_tick: list[Identity] = []
        self.fd_counts_last_tick: list[int] = []  # pids whose fd directory was listed
        self.children_reads_last_tick: list[tuple[int, list[int] | None]] = []  # pid, tids (None: all)
        self.without_held_fds = 0  # processes read by path: dlmon reached its fd cap
        self._new_stats: dict[Identity, StatFields] = {}
        self._unchanged: set[Identity] = set()  # stat read the same bytes as on the last read
        self.rows_shown_again_quiet = 0  # rows of idle processes copied, not built, on the last tick
        self._now = clock()
        self.fd_limits = FdLimits(proc_root)
        # Read workers every ``rotation`` ticks (1: every tick); see record_tick_cost.
        self.rotation = 1
        self.rotated_last_tick = 0  # rows shown again without a read on the last tick
        self.read_last_tick: list[int] = []  # pids whose stat was read on the last tick
        self.status_read_last_tick: list[int] = []  # ... and whose status and io were read too
        self._tick = 0
        self._next_slot = 0
        self._rotation_changed = 0
        self.worker_count = 0
        self._workers_cost_per_s = 0.0  # reading every worker every tick, estimated
        self._children_listed: dict[int, set[int]] = {}  # parent pid -> children listed this tick
        # From the in-process agent's last reading: pid -> worker id, pid -> torch threads. Used
        # when rows are built, so the caller's merge rarely has to rebuild a row.
        self.worker_hints: Mapping[int, int] = MappingProxyType({})
        self.thread_hints: Mapping[int, int] = MappingProxyType({})
        self._listed: set[int] = set()  # worker pids in the agent's reading before the last one
        # When a process of the tree last faulted a page in, changed its RSS, joined or left (the
        # tick it was seen): a reading taken since is still true unless a sharer outside moved.
        self.memory_moved_at: float | None = None
        self._members: frozenset[Identity] = frozenset()
        self._unlisted: set[int] = set()  # ... and no longer in the last one: read them now
        self.target = ProcHandle(target_pid, proc_root)  # raises ProcessGone for no such pid
        self.target_identity: Identity = (target_pid, self.target.start_time)
        # From the read at the open, so a transient error on the first tick keeps it alive too.
        self.last_target_state: str | None = self.target.first_stat.state
        self._tracked[self.target_identity] = _Tracked(self.target, "main", self._now)

    # -- discovery ---------------------------------------------------------------------------

    def _discover(self, stats: Mapping[Identity, StatFields]) -> None:
        """Add descendants of live tracked processes that are not tracked yet, reading children
        only where they can appear (see the module docstring)."""
        known_pids = {pid for pid, _ in self._tracked}
        if not self._use_children_files:
            self._discover_by_scan(known_pids)
            return
        frontier = [
            (tracked, stats[identity])
            for identity, tracked in self._tracked.items()
            if identity in stats and stats[identity].state not in DEAD_STATES
        ]
        while frontier:
            parent, stat = frontier.pop()
            try:
                kids = self._children_due(parent, stat)
            except (ProcessGone, AccessDenied, OSError):
                continue
            for pid in kids:
                if pid not in known_pids:
                    added = self._add(pid, parent.handle.pid)
                    if added is not None:
                        known_pids.add(pid)
                        frontier.append(added)

    def _children_due(self, tracked: _Tracked, stat: StatFields) -> list[int]:
        """The children files due this tick: [] when nothing is due."""
        now, stretch, cadence = self._now, self.stretch, self.cadence
        pid = tracked.handle.pid
        if tracked.role not in SPAWNING_ROLES:
            due = tracked.children_time is None or now - tracked.children_time >= (
                cadence.worker_children_s * stretch
            )
            if not due:
                return []
            tracked.children_time = now
            self.children_reads_last_tick.append((pid, None))
            kids = tracked.handle.children()
            self._children_listed[pid] = set(kids)
            return kids
        relist = (
            tracked.tids is None
            or tracked.tids_num_threads != stat.num_threads
            or now - tracked.tids_time >= cadence.thread_list_s * stretch
        )
        if relist:
            by_thread = tracked.handle.children_by_thread(None)
            tracked.tids = sorted(by_thread)
            tracked.tids_time, tracked.tids_num_threads = now, stat.num_threads
            tracked.children_time = now
            # A thread that forked before stays a forking thread while it lives, even when the
            # relist falls between two epochs of its workers (no children at that moment).
            tracked.forking_tids = {
                tid for tid, kids in by_thread.items() if kids or tid in tracked.forking_tids
            }
            self.children_reads_last_tick.append((pid, None))
        else:
            tids = sorted(tracked.forking_tids | {pid})
            by_thread = tracked.handle.children_by_thread(tids)
            tracked.forking_tids |= {tid for tid, kids in by_thread.items() if kids}
            self.children_reads_last_tick.append((pid, tids))
        listed = [kid for kids in by_thread.values() for kid in kids]
        self._children_listed[pid] = set(listed)
        return listed

    def _discover_by_scan(self, known_pids: set[int]) -> None:
        by_parent: dict[int, list[int]] = {}
        for pid in all_pids(self.proc_root):
            if pid in known_pids:
                continue
            try:
                with open(f"{self.proc_root}/{pid}/stat", "rb") as fh:
                    ppid = parse_stat(fh.read()).ppid
            except (OSError, ValueError, IndexError):
                continue
            by_parent.setdefault(ppid, []).append(pid)
        frontier = list(known_pids)
        while frontier:
            for pid in by_parent.pop(frontier.pop(), []):
                if self._add(pid, None) is not None:
                    frontier.append(pid)

    def _add(self, pid: int, expected_ppid: int | None) -> tuple[_Tracked, StatFields] | None:
        held = sum(1 for t in self._tracked.values() if t.handle.hold_fds)
        try:
            handle = ProcHandle(pid, self.proc_root, hold_fds=held < held_fd_cap(self.cadence))
            stat = handle.first_stat
            if expected_ppid is not None and stat.ppid != expected_ppid:
                handle.close()  # the pid was reused between listing and opening
                return None
        except (ProcessGone, AccessDenied, OSError):
            return None
        tracked = _Tracked(handle, "child", self._now, slot=self._next_slot)
        self._next_slot += 1
        self._tracked[(pid, handle.start_time)] = tracked
        self._new_stats[(pid, handle.start_time)] = stat
        return tracked, stat

    # -- sampling ----------------------------------------------------------------------------

    def record_tick_cost(self, cheap_cpu_s: float, interval_s: float) -> None:
        """What the caller's whole tick cost apart from smaps reads: the budget gets the rest,
        and the slow cadences stretch once it passes half the budget."""
        if interval_s <= 0:
            return
        per_s = cheap_cpu_s / interval_s
        rows = len(self.read_last_tick)
        per_row = (self.cost.reads + self.cost.build) / rows if rows else 0.0
        workers_per_s = per_row * self.worker_count / interval_s
        if self._cheap_cost_known:
            self._cheap_cost_per_s = 0.8 * self._cheap_cost_per_s + 0.2 * per_s
            self._workers_cost_per_s = 0.8 * self._workers_cost_per_s + 0.2 * workers_per_s
        else:
            self._cheap_cost_per_s, self._cheap_cost_known = per_s, True
            self._workers_cost_per_s = workers_per_s
        policy = self.budget.policy
        half = 0.5 * policy.cpu_fraction
        self.stretch = min(self.cadence.max_stretch, max(1.0, self._cheap_cost_per_s / half))
        self._adjust_rotation(policy.cpu_fraction - policy.min_smaps_fraction)

    def _adjust_rotation(self, ceiling: float) -> None:
        """Step 3 of the degradation order: read workers in rotation when the every-tick work
        alone would leave smaps_rollup less than its floor. One step at a time, a few ticks
        apart (the cost is an average); back down only when the bigger cost would still fit
        (as if every cost were the workers': it may not flap).

        Only on a large tree: where reading every worker every tick costs at least as much as
        the rest of the tick. Where the rest alone passes the budget (a short --interval, a
        slow NVML) rotating a few workers saves next to nothing and only makes their rows stale."""
        if self._tick - self._rotation_changed < self.cadence.rotation_settle_ticks:
            return
        if self._tick <= self.cadence.rotation_warmup_ticks:
            return
        per_s, k, workers = self._cheap_cost_per_s, self.rotation, self._workers_cost_per_s
        rest = max(0.0, per_s - workers / k)
        if per_s > ceiling and k < self.cadence.max_rotation and workers >= rest:
            self.rotation, self._rotation_changed = k + 1, self._tick
        elif k > 1 and (per_s * k / (k - 1) < 0.85 * ceiling or workers < 0.8 * rest):
            self.rotation, self._rotation_changed = k - 1, self._tick

    def sample(self) -> tuple[ProcessSample, ...]:
        now = self._now = self._clock()
        cost = self.cost = PhaseCost()
        self.children_reads_last_tick = []
        self.fd_counts_last_tick = []
        self._new_stats = {}
        self._children_listed = {}
        self._tick += 1
        t0 = time.thread_time()
        self._unlisted = self._listed - self.worker_hints.keys()
        self._listed = set(self.worker_hints)
        stats: dict[Identity, StatFields] = {}
        self._unchanged = set()
        resting = (
            {identity for identity, tracked in self._tracked.items() if not self._due(tracked)}
            if self.rotation > 1
            else set()
        )
        # Drop the dead before discovery, so a reused pid is seen as the new process it is.
        for identity, tracked in list(self._tracked.items()):
            if identity in resting:
                continue
            stat = self._stat_or_drop(identity, tracked)
            if stat is not None:
                stats[identity] = stat
        target_stat = stats.get(self.target_identity)
        if target_stat is not None:
            self.last_target_state = target_stat.state
        elif self.target_identity not in self._tracked:
            self.last_target_state = None  # gone (reaped); a transient error keeps the last state
        t1 = time.thread_time()
        self._discover(stats)
        stats.update(self._new_stats)
        self._wake_the_unlisted(resting, stats)
        t2 = time.thread_time()
        rows: dict[Identity, _Row] = {}
        quiet: set[Identity] = set()  # nothing moved: stat's bytes the same, status/io not read again
        self.status_read_last_tick = []
        unmoved_refresh_s = self.cadence.unmoved_refresh_s * self.stretch
        fresh: set[Identity] = set()  # status and io read this tick
        for identity, tracked in self._tracked.items():
            stat = stats.get(identity)
            if stat is None:
                continue  # a transient error this tick: kept, no row
            key = _moved_key(stat)
            status, io = tracked.status, tracked.io
            if (
                status is None
                or io is None
                or tracked.io_moved
                or key != tracked.moved_key
                or now - tracked.status_time >= unmoved_refresh_s
            ):
                fresh.add(identity)
                tracked.quiet_row = False
                zombie = stat.state in DEAD_STATES
                status = self._read_optional(tracked, "status", STATUS_FIELDS)
                io = {} if zombie else self._read_optional(tracked, "io", IO_FIELDS)
                self.status_read_last_tick.append(identity[0])
                # kept only when whole or refused for good: a transient error is read again
                whole = status and (io or zombie or "io" in tracked.unavailable)
                tracked.status, tracked.io = (status, io) if whole else (None, None)
                tracked.status_time, tracked.moved_key = now, key
            elif identity in self._unchanged:
                quiet.add(identity)
            rows[identity] = (tracked, stat, status, io)
        t3 = time.thread_time()
        for tracked, stat, status, _io in rows.values():
            self._maybe_count_fds(tracked, stat, status)
        t4 = time.thread_time()
        self._note_memory_movement(rows, now)
        self._spend_on_smaps(rows, now)
        t5 = time.thread_time()
        samples = []
        self.rows_shown_again_quiet = 0
        for identity, (tracked, stat, status, io) in rows.items():
            again = self._quiet_row(identity, tracked, stat, now) if identity in quiet else None
            if again is None:
                samples.append(self._build(identity, tracked, stat, status, io, now, identity in fresh))
                tracked.quiet_row = identity in quiet
            else:
                samples.append(again)
                self.rows_shown_again_quiet += 1
        shown_again = []
        for identity in resting:
            resting_one = self._tracked.get(identity)
            if resting_one is None or resting_one.last_sample is None:
                continue
            last, smaps_time = resting_one.last_sample, resting_one.smaps_time
            if last.pss_age_s is not None and smaps_time is not None:
                last = _aged(last, round(now - smaps_time, 3), self._still_since(smaps_time))
            shown_again.append(last)
        self.rotated_last_tick = len(shown_again)
        self.read_last_tick = [pid for pid, _ in rows]
        samples.extend(shown_again)
        self.fd_limits.keep_only(set(self._tracked))
        samples.sort(key=lambda s: (s.role != "main", s.role != "worker", s.start_time, s.pid))
        self.without_held_fds = sum(1 for t in self._tracked.values() if not t.handle.hold_fds)
        self.worker_count = sum(1 for t in self._tracked.values() if t.role == "worker")
        t6 = time.thread_time()
        cost.reads = (t1 - t0) + (t3 - t2)
        cost.discovery = t2 - t1
        cost.fds = t4 - t3
        cost.smaps = t5 - t4
        cost.build = t6 - t5
        return tuple(samples)

    def _wake_the_unlisted(self, resting: set[Identity], stats: dict[Identity, StatFields]) -> None:
        """A resting worker its parent no longer lists (it exited and was reaped) is read now, so
        it leaves at once instead of showing its last row until its turn."""
        for identity in list(resting):
            tracked = self._tracked.get(identity)
            last = tracked.last_sample if tracked is not None else None
            if tracked is None or last is None:
                continue
            listed = None if last.ppid is None else self._children_listed.get(last.ppid)
            if listed is None or identity[0] in listed:
                continue
            resting.discard(identity)
            stat = self._stat_or_drop(identity, tracked)
            if stat is not None:
                stats[identity] = stat

    def _due(self, tracked: _Tracked) -> bool:
        """Read this tick: always, but a worker in rotation only on its turn, or at once when the
        agent stopped listing it (its loader joined it at the end of an epoch: it is gone, and
        its last row would show it alive with its worker id beside its successor's)."""
        if self.rotation <= 1 or tracked.role != "worker" or tracked.last_sample is None:
            return True
        if tracked.handle.pid in self._unlisted:
            return True
        return (tracked.slot + self._tick) % self.rotation == 0

    def _stat_or_drop(self, identity: Identity, tracked: _Tracked) -> StatFields | None:
        try:
            previous = tracked.stat_pair
            pair = tracked.stat_pair = tracked.handle.stat_unless(previous)
            if pair is previous:
                self._unchanged.add(identity)
            else:
                tracked.quiet_row = False  # the last row shows an older line
            return pair[1]
        except ProcessGone:
            tracked.handle.close()
            del self._tracked[identity]
            return None
        except (AccessDenied, OSError):
            return None  # transient: dropping it would lose an orphan for good

    def _quiet_row(
        self, identity: Identity, tracked: _Tracked, stat: StatFields, now: float
    ) -> ProcessSample | None:
        """The last row again, for a process that did not move since a row with zero rates was
        built (only its PSS age advances); None when anything that row shows may differ: a read
        since (stat, status and io, smaps: ``quiet_row`` cleared), its fd count, the agent's
        worker id or thread count (which also decides a child's role: its comm is as it was when
        the row was built), a reason something is unavailable, its fd limit."""
        last = tracked.last_sample
        if last is None or not tracked.quiet_row:
            return None
        pid = identity[0]
        worker_id = self.worker_hints.get(pid)
        if (
            last.worker_id != worker_id
            or last.torch_threads != self.thread_hints.get(pid)
            or last.num_fds != (None if stat.state in DEAD_STATES else tracked.num_fds)
            or ((tracked.unavailable or last.unavailable) and dict(last.unavailable) != tracked.unavailable)
            or (last.num_fds is not None and last.fd_limit != self.fd_limits.limit(pid, identity[1], now))
        ):
            return None
        if last.pss_age_s is not None and tracked.smaps_time is not None:
            last = _aged(last, round(now - tracked.smaps_time, 3), self._still_since(tracked.smaps_time))
        tracked.prev_time = now  # the next rates count from here: nothing moved before it
        tracked.last_sample = last
        return last

    def _read_optional(self, tracked: _Tracked, name: str, fields: FieldPicker) -> dict[str, int]:
        """The named fields of /proc/PID/<name>; {} and a reason in ``unavailable`` if denied."""
        group = name
        try:
            values = fields(tracked.handle.read(name))
        except AccessDenied as exc:
            tracked.unavailable[group] = str(exc)
            return {}
        except (ProcessGone, OSError):
            return {}
        tracked.unavailable.pop(group, None)
        return values

    def _maybe_count_fds(self, tracked: _Tracked, stat: StatFields, status: dict[str, int]) -> None:
        """Recount open fds when FDSize (the fd table size) moved, or on the slow cadence."""
        if stat.state in DEAD_STATES:
            tracked.num_fds = None
            return
        fdsize = status.get("FDSize")
        due = (
            tracked.fds_time is None
            or (fdsize is not None and fdsize != tracked.fdsize)
            or self._now - tracked.fds_time >= self.cadence.fd_refresh_s * self.stretch
        )
        if not due:
            return
        tracked.fdsize = fdsize
        tracked.fds_time = self._now
        self.fd_counts_last_tick.append(tracked.handle.pid)
        try:
            tracked.num_fds = tracked.handle.count_fds()
            tracked.unavailable.pop("fd", None)
        except AccessDenied as exc:
            tracked.num_fds = None
            tracked.unavailable["fd"] = str(exc)
        except (ProcessGone, OSError):
            tracked.num_fds = None

    def _note_memory_movement(self, rows: dict[Identity, _Row], now: float) -> None:
        # A leave shows only here; a join also as a process without a key yet. No shortcut for an
        # unchanged stat line: a tick that raised after reading a new one kept the line, not its key.
        moved = self._members != self._tracked.keys()
        if moved:
            self._members = frozenset(self._tracked)
        for tracked, stat, _status, _io in rows.values():
            key = (stat.minor_faults, stat.major_faults, stat.rss_pages)
            if key != tracked.memory_key:
                tracked.memory_key = key
                moved = True
        if moved:
            self.memory_moved_at = now

    def _still_since(self, smaps_time: float | None) -> bool:
        """Nothing in the tree moved since a reading taken at ``smaps_time``."""
        moved_at = self.memory_moved_at
        return smaps_time is not None and moved_at is not None and smaps_time >= moved_at

    def _spend_on_smaps(self, rows: dict[Identity, _Row], now: float) -> None:
        self.budget.refill(now, self._cheap_cost_per_s)
        self.smaps_reads_last_tick = []
        self.smaps_cpu_last_tick = 0.0
        candidates = [
            SmapsCandidate(
                identity,
                stat.rss_pages * PAGE_SIZE,
                tracked.smaps_time,
                tracked.rss_at_smaps,
                faulted_bytes_since_read=(
                    0
                    if tracked.faults_at_smaps is None
                    else (stat.minor_faults - tracked.faults_at_smaps) * PAGE_SIZE
                ),
                is_main=tracked.role == "main",
                first_seen=tracked.first_seen,
                last_read_wall_s=tracked.smaps_wall_s,
                tree_still_since_read=self._still_since(tracked.smaps_time),
            )
            for identity, (tracked, stat, _status, _io) in rows.items()
            if stat.state not in DEAD_STATES and tracked.smaps_denied is None
        ]
        for candidate in self.budget.order(candidates, now):
            if not self.budget.can_spend():
                break
            tracked = rows[candidate.key][0]  # type: ignore[index]
            tracked.quiet_row = False  # read (or refused): its row shows what it read
            before = time.thread_time()
            wall_before = time.perf_counter()
            try:
                tracked.smaps = parse_smaps_rollup(tracked.handle.read_once("smaps_rollup"))
            except AccessDenied as exc:
                tracked.smaps_denied = str(exc)
                continue
            except (ProcessGone, OSError):
                continue
            finally:
                spent = time.thread_time() - before
                self.budget.charge(spent)
                self.smaps_cpu_last_tick += spent
            tracked.smaps_wall_s = time.perf_counter() - wall_before
            tracked.smaps_time = now
            tracked.rss_at_smaps = candidate.rss_bytes
            tracked.faults_at_smaps = rows[candidate.key][1].minor_faults  # type: ignore[index]
            self.smaps_reads_last_tick.append(candidate.key)  # type: ignore[arg-type]

    def _build(
        self,
        identity: Identity,
        tracked: _Tracked,
        stat: StatFields,
        status: dict[str, int],
        io: dict[str, int],
        now: float,
        fresh: bool = True,
    ) -> ProcessSample:
        """The row; ``fresh``: status and io were read this tick (else they are the last read's,
        unmoved since)."""
        pid = identity[0]
        worker_id = self.worker_hints.get(pid)
        if tracked.role == "child" and (stat.comm in WORKER_COMMS or worker_id is not None):
            tracked.role = "worker"  # a forked worker renames itself once it starts
        zombie = stat.state in DEAD_STATES
        dt = None if tracked.prev_time is None else now - tracked.prev_time
        cpu_ticks = stat.utime_ticks + stat.stime_ticks
        cpu_rate = _rate(cpu_ticks, tracked.prev_cpu_ticks, dt)
        counts = Counters.read(status, io)
        if fresh:
            # over the time since they were last read, not since the last tick: a read after an
            # unmoved stretch holds that whole stretch's bytes (per tick, 5-60x too high)
            cdt = None if tracked.counters_time is None else now - tracked.counters_time
            rates = counts.rates(tracked.counts, cdt)
            tracked.io_moved = counts.io_moved_since(tracked.counts)
            tracked.counts, tracked.counters_time = counts, now
        else:
            rates = counts.unmoved()
        if tracked.smaps_denied:
            tracked.unavailable["smaps"] = tracked.smaps_denied
        if zombie:
            tracked.unavailable["memory"] = "zombie: the process has exited and holds no memory"
        smaps = None if zombie else tracked.smaps
        swap = status.get("VmSwap")  # as of the last status read (<= 5 s); smaps Swap may be minutes old
        if swap is None and smaps is not None:
            swap = smaps.swap_bytes
        sample = ProcessSample(
            pid=identity[0],
            start_time=identity[1],
            ppid=stat.ppid,
            role=tracked.role,
            comm=stat.comm,
            state=stat.state,
            cpu_percent=None if cpu_rate is None else 100.0 * cpu_rate / CLOCK_TICKS,
            num_threads=stat.num_threads,
            rss_bytes=None if zombie else status.get("VmRSS", stat.rss_pages * PAGE_SIZE),
            uss_bytes=smaps.uss_bytes if smaps else None,
            pss_bytes=smaps.pss_bytes if smaps else None,
            pss_shmem_bytes=smaps.pss_shmem_bytes if smaps else None,
            swap_bytes=swap,
            pss_age_s=(
                None if smaps is None or tracked.smaps_time is None else round(now - tracked.smaps_time, 3)
            ),
            pss_still=smaps is not None and self._still_since(tracked.smaps_time),
            major_faults_per_s=_rate(stat.major_faults, tracked.prev_major_faults, dt),
            num_fds=None if zombie else tracked.num_fds,
            fd_limit=(
                None if zombie or tracked.num_fds is None else self.fd_limits.limit(pid, identity[1], now)
            ),
            worker_id=worker_id,
            torch_threads=self.thread_hints.get(pid),
            pss_anon_bytes=smaps.pss_anon_bytes if smaps else None,
            pss_file_bytes=smaps.pss_file_bytes if smaps else None,
            anonymous_bytes=smaps.anonymous_bytes if smaps else None,
            unavailable=MappingProxyType(dict(tracked.unavailable))
            if tracked.unavailable
            else _NONE_UNAVAILABLE,
            rss_anon_bytes=status.get("RssAnon"),
            rss_file_bytes=status.get("RssFile"),
            shmem_bytes=status.get("RssShmem"),
            locked_bytes=status.get("VmLck"),
            pinned_bytes=status.get("VmPin"),
            voluntary_ctxt_switches=status.get("voluntary_ctxt_switches"),
            nonvoluntary_ctxt_switches=counts.nonvoluntary_ctxt_switches,
            nonvoluntary_ctxt_switches_per_s=rates.nonvoluntary_ctxt_switches_per_s,
            read_bytes=counts.read_bytes,
            read_bytes_per_s=rates.read_bytes_per_s,
            write_bytes=counts.write_bytes,
            write_bytes_per_s=rates.write_bytes_per_s,
        )
        tracked.prev_time = now
        tracked.prev_cpu_ticks = cpu_ticks
        tracked.prev_major_faults = stat.major_faults
        tracked.last_sample = sample
        return sample

    def target_state(self) -> str | None:
        """The target's state letter, or None when it is gone (reaped)."""
        try:
            return self.target.stat().state
        except (ProcessGone, AccessDenied, OSError):
            return None

    def close(self) -> None:
        for tracked in self._tracked.values():
            tracked.handle.close()
        self._tracked.clear()

    @property
    def tracked_count(self) -> int:
        return len(self._tracked)

    def roles(self) -> Mapping[Identity, str]:
        return {identity: t.role for identity, t in self._tracked.items()}

    def held_fd_pids(self) -> list[int]:
        return [pid for (pid, _), t in self._tracked.items() if t.handle.hold_fds]
