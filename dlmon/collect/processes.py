"""The target's process tree, read every tick: the target, all its descendants, and any
process that was once in the tree and is still alive (orphaned DataLoader workers keep their
row after the trainer dies, reparented to init).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

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

WORKER_COMMS = frozenset({"pt_data_worker"})
STATUS_FIELDS = FieldPicker(
    (
        "VmRSS", "RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin", "VmSwap",
        "voluntary_ctxt_switches", "nonvoluntary_ctxt_switches",
    )
)  # fmt: skip
IO_FIELDS = FieldPicker(("read_bytes", "write_bytes"))
# the split, in SmapsValues' order; Pss_Anon/Pss_File are absent before Linux 5.7: None
SMAPS_SPLIT = ("Pss_Anon", "Pss_File", "Anonymous")
SMAPS_FIELDS = FieldPicker(("Pss", "Pss_Shmem", "Private_Clean", "Private_Dirty", "Private_Hugetlb", "Swap", *SMAPS_SPLIT))  # fmt: skip  # noqa: E501
Identity = tuple[int, int]  # (pid, start_time)
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


@dataclass(slots=True)
class _Tracked:
    handle: ProcHandle
    role: str
    prev_time: float | None = None
    prev_cpu_ticks: int | None = None
    prev_read_bytes: int | None = None
    prev_write_bytes: int | None = None
    prev_nvcsw: int | None = None
    smaps: SmapsValues | None = None
    smaps_time: float | None = None
    rss_at_smaps: int | None = None
    faults_at_smaps: int | None = None
    smaps_denied: str | None = None
    unavailable: dict[str, str] = field(default_factory=dict)


def _rate(now: int | None, prev: int | None, dt: float | None) -> float | None:
    if now is None or prev is None or not dt or dt <= 0 or now < prev:
        return None
    return (now - prev) / dt


class ProcessTracker:
    """Reads the process tree rooted at ``target_pid`` each time ``sample`` is called."""

    def __init__(
        self,
        target_pid: int,
        budget: SmapsBudget | None = None,
        proc_root: str = "/proc",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.proc_root = proc_root
        self.budget = budget or SmapsBudget()
        self._clock = clock
        self._tracked: dict[Identity, _Tracked] = {}
        self._use_children_files = children_files_supported(proc_root)
        self._cheap_cost_per_s = 0.0
        self._cheap_cost_known = False
        self.smaps_cpu_last_tick = 0.0
        self.smaps_reads_last_tick: list[Identity] = []
        self.target = ProcHandle(target_pid, proc_root)  # raises ProcessGone for no such pid
        self.target_identity: Identity = (target_pid, self.target.start_time)
        self._tracked[self.target_identity] = _Tracked(self.target, "main")

    # -- discovery ---------------------------------------------------------------------------

    def _discover(self) -> None:
        """Add descendants of every live tracked process that are not tracked yet."""
        known_pids = {pid for pid, _ in self._tracked}
        if self._use_children_files:
            frontier = list(self._tracked.values())
            while frontier:
                parent = frontier.pop()
                try:
                    kids = parent.handle.children()
                except (ProcessGone, AccessDenied, OSError):
                    continue
                for pid in kids:
                    if pid not in known_pids:
                        added = self._add(pid, parent.handle.pid)
                        if added is not None:
                            known_pids.add(pid)
                            frontier.append(added)
        else:
            self._discover_by_scan(known_pids)

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

    def _add(self, pid: int, expected_ppid: int | None) -> _Tracked | None:
        try:
            handle = ProcHandle(pid, self.proc_root)
            if expected_ppid is not None and handle.stat().ppid != expected_ppid:
                handle.close()  # the pid was reused between listing and opening
                return None
        except (ProcessGone, AccessDenied, OSError):
            return None
        tracked = _Tracked(handle, "child")
        self._tracked[(pid, handle.start_time)] = tracked
        return tracked

    # -- sampling ----------------------------------------------------------------------------

    def record_tick_cost(self, cheap_cpu_s: float, interval_s: float) -> None:
        """What the caller's whole tick cost apart from smaps reads: the budget gets the rest."""
        if interval_s <= 0:
            return
        per_s = cheap_cpu_s / interval_s
        if self._cheap_cost_known:
            self._cheap_cost_per_s = 0.8 * self._cheap_cost_per_s + 0.2 * per_s
        else:
            self._cheap_cost_per_s, self._cheap_cost_known = per_s, True

    def sample(self) -> tuple[ProcessSample, ...]:
        now = self._clock()
        stats: dict[Identity, StatFields] = {}
        # Drop the dead before discovery, so a reused pid is seen as the new process it is.
        for identity, tracked in list(self._tracked.items()):
            stat = self._stat_or_drop(identity, tracked)
            if stat is not None:
                stats[identity] = stat
        self._discover()
        rows: dict[Identity, tuple[_Tracked, StatFields, dict[str, int]]] = {}
        for identity, tracked in list(self._tracked.items()):
            stat = stats.get(identity) or self._stat_or_drop(identity, tracked)
            if stat is not None:
                rows[identity] = (tracked, stat, self._read_optional(tracked, "status", STATUS_FIELDS))
        self._spend_on_smaps(rows, now)
        samples = [
            self._build(identity, tracked, stat, status, now)
            for identity, (tracked, stat, status) in rows.items()
        ]
        samples.sort(key=lambda s: (s.role != "main", s.role != "worker", s.start_time, s.pid))
        return tuple(samples)

    def _stat_or_drop(self, identity: Identity, tracked: _Tracked) -> StatFields | None:
        try:
            return tracked.handle.stat()
        except (ProcessGone, AccessDenied, OSError):
            tracked.handle.close()
            del self._tracked[identity]
            return None

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

    def _spend_on_smaps(
        self, rows: dict[Identity, tuple[_Tracked, StatFields, dict[str, int]]], now: float
    ) -> None:
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
            )
            for identity, (tracked, stat, _status) in rows.items()
            if stat.state not in ("Z", "X") and tracked.smaps_denied is None
        ]
        for candidate in self.budget.order(candidates, now):
            if not self.budget.can_spend():
                break
            tracked = rows[candidate.key][0]  # type: ignore[index]
            before = time.thread_time()
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
        now: float,
    ) -> ProcessSample:
        if tracked.role == "child" and stat.comm in WORKER_COMMS:
            tracked.role = "worker"  # a forked worker renames itself once it starts
        zombie = stat.state in ("Z", "X")
        dt = None if tracked.prev_time is None else now - tracked.prev_time
        cpu_ticks = stat.utime_ticks + stat.stime_ticks
        cpu_rate = _rate(cpu_ticks, tracked.prev_cpu_ticks, dt)
        io = {} if zombie else self._read_optional(tracked, "io", IO_FIELDS)
        read_bytes = io.get("read_bytes")
        write_bytes = io.get("write_bytes")
        nvcsw = status.get("nonvoluntary_ctxt_switches")
        num_fds: int | None = None
        if not zombie:
            try:
                num_fds = tracked.handle.count_fds()
                tracked.unavailable.pop("fd", None)
            except AccessDenied as exc:
                tracked.unavailable["fd"] = str(exc)
            except (ProcessGone, OSError):
                pass
        if tracked.smaps_denied:
            tracked.unavailable["smaps"] = tracked.smaps_denied
        if zombie:
            tracked.unavailable["memory"] = "zombie: the process has exited and holds no memory"
        smaps = None if zombie else tracked.smaps
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
            rss_anon_bytes=status.get("RssAnon"),
            rss_file_bytes=status.get("RssFile"),
            shmem_bytes=status.get("RssShmem"),
            uss_bytes=smaps.uss_bytes if smaps else None,
            pss_bytes=smaps.pss_bytes if smaps else None,
            pss_shmem_bytes=smaps.pss_shmem_bytes if smaps else None,
            swap_bytes=smaps.swap_bytes if smaps else status.get("VmSwap"),
            pss_age_s=(
                None if smaps is None or tracked.smaps_time is None else round(now - tracked.smaps_time, 3)
            ),
            locked_bytes=status.get("VmLck"),
            pinned_bytes=status.get("VmPin"),
            read_bytes=read_bytes,
            write_bytes=write_bytes,
            read_bytes_per_s=_rate(read_bytes, tracked.prev_read_bytes, dt),
            write_bytes_per_s=_rate(write_bytes, tracked.prev_write_bytes, dt),
            voluntary_ctxt_switches=status.get("voluntary_ctxt_switches"),
            nonvoluntary_ctxt_switches=nvcsw,
            nonvoluntary_ctxt_switches_per_s=_rate(nvcsw, tracked.prev_nvcsw, dt),
            num_fds=num_fds,
            pss_anon_bytes=smaps.pss_anon_bytes if smaps else None,
            pss_file_bytes=smaps.pss_file_bytes if smaps else None,
            anonymous_bytes=smaps.anonymous_bytes if smaps else None,
            unavailable=MappingProxyType(dict(tracked.unavailable))
            if tracked.unavailable
            else _NONE_UNAVAILABLE,
        )
        tracked.prev_time = now
        tracked.prev_cpu_ticks = cpu_ticks
        tracked.prev_read_bytes = read_bytes
        tracked.prev_write_bytes = write_bytes
        tracked.prev_nvcsw = nvcsw
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
