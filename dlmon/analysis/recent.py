"""The recent window, indexed as it moves: what the per-tick detectors read of it, one snapshot at a time.

The Analyzer keeps the last ``keep_s`` seconds of snapshots at full rate (``Context.recent``). A
detector that rescans that window on every tick costs what the window holds: at 10 Hz the 120 s
window is 1200 snapshots, so the cost of a tick grew with the rate and over the window's first
two minutes (issue 22). Here each view adds the new snapshot's part and drops the expired
snapshot's part, so keeping them costs O(processes + loaders + stacks) per tick, and reading them
O(log window):

* the snapshots' times, for ``Context.window``'s cut;
* each process's fd counts (``detectors/fds.py``'s trend): times, counts and a running count of
  falls, so a sub-window's first, last, falls and midpoint are index arithmetic and a bisection;
* each loader's pace readings as a sorted multiset (their median) and its batch counts with where
  their last change was (``detectors/stall.pace``);
* the newest stack taken of each pid (``detectors/processes.latest_stack``);
* a memo per snapshot (``Context.per_snapshot``): what a detector computes of one snapshot for a
  short window (a process's share of wall time waiting for data, its workers' CPU) is computed
  once, when the snapshot first falls in the window, and only gathered on the ticks after.

Every view gives exactly what the scan of the same snapshots gives (no running float sums: those
would round differently). The detectors still scan when a context has no index (a test's context
from a list of snapshots): that path is the reference the tests compare this one with. Pure: no
I/O, only dlmon.model.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import TypeVar

from dlmon.model import Snapshot
from dlmon.model.snapshot import LoaderSample, ProcessStack
from dlmon.model.stall_rule import pace_reading

_COMPACT = 256  # a list's dropped head is deleted once it is this long and half the list
T = TypeVar("T")


class FdTrail:
    """One process's fd readings in the window, oldest first: parallel lists from ``head`` on."""

    __slots__ = ("falls", "fds", "head", "seqs", "times")

    def __init__(self) -> None:
        self.seqs: list[int] = []  # the sequence number of the snapshot each reading is from
        self.times: list[float] = []
        self.fds: list[int] = []
        self.falls: list[int] = []  # falls[i]: readings lower than the one before, up to i (running)
        self.head = 0

    def add(self, seq: int, t: float, fds: int) -> None:
        before = self.fds[-1] if len(self.fds) > self.head else None
        fell = 1 if before is not None and fds < before else 0
        self.falls.append((self.falls[-1] if self.falls else 0) + fell)
        self.seqs.append(seq)
        self.times.append(t)
        self.fds.append(fds)

    def pop(self) -> None:
        self.head += 1
        if self.head >= _COMPACT and 2 * self.head >= len(self.seqs):
            h = self.head
            del self.seqs[:h], self.times[:h], self.fds[:h], self.falls[:h]
            self.head = 0

    def __len__(self) -> int:
        return len(self.seqs) - self.head

    def start(self, seq: int) -> int:
        """The index of the first reading from snapshot ``seq`` or later."""
        return bisect.bisect_left(self.seqs, seq, self.head)


class LoaderTrail:
    """One loader's pace readings and batch counts in the window (``stall.pace``'s inputs)."""

    __slots__ = ("count", "entries", "rates", "run_pos", "run_time", "sorted_rates", "totals")

    def __init__(self) -> None:
        self.rates: deque[float] = deque()  # in window order
        self.sorted_rates: list[float] = []  # the same, sorted: the median is its middle
        self.totals: deque[tuple[int, float, int]] = deque()  # (position, time, batches_total)
        self.entries = 0  # how many totals were ever added: the next one's position
        self.run_pos = 0  # the position of the first count of the trailing run of equal counts
        self.run_time = 0.0  # ... and its snapshot's time
        self.count = 0  # samples of this loader in the window, with or without figures

    def add(self, t: float, ls: LoaderSample) -> None:
        self.count += 1
        rate = pace_reading(ls)
        if rate is not None:
            self.rates.append(rate)
            bisect.insort(self.sorted_rates, rate)
        total = ls.batches_total
        if total is not None:
            if not self.totals or self.totals[-1][2] != total:
                self.run_pos, self.run_time = self.entries, t
            self.totals.append((self.entries, t, total))
            self.entries += 1

    def pop(self, ls: LoaderSample) -> None:
        """Drop the oldest entry, ``ls`` (the same sample that was added first)."""
        self.count -= 1
        if pace_reading(ls) is not None:
            rate = self.rates.popleft()
            del self.sorted_rates[bisect.bisect_left(self.sorted_rates, rate)]
        if ls.batches_total is not None:
            self.totals.popleft()
            if self.totals and self.run_pos < self.totals[0][0]:
                # the run's start has left the window: the whole window is one run, from its first
                self.run_pos, self.run_time = self.totals[0][0], self.totals[0][1]

    def median_rate(self) -> float | None:
        """``stats.median`` of the rates, from the sorted multiset."""
        ordered = self.sorted_rates
        n = len(ordered)
        if not n:
            return None
        mid = n // 2
        return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])

    def progress(self) -> tuple[int | None, float | None]:
        """(the last batch count, the time of the snapshot where the count last changed within
        the window, its first count counting as a change): what the scan of ``stall.pace`` finds."""
        if not self.totals:
            return None, None
        return self.totals[-1][2], self.run_time


class RecentIndex:
    """The snapshots of the last ``keep_s`` seconds (at most ``maxlen``), oldest first, and the
    views above. ``add`` drops what expires exactly as the Analyzer's deque did."""

    __slots__ = (
        "_first_seq",
        "_head",
        "_inversions",
        "_memos",
        "_snaps",
        "_times",
        "fds",
        "keep_s",
        "loaders",
        "maxlen",
        "stacks",
    )

    def __init__(self, keep_s: float, maxlen: int) -> None:
        self.keep_s = keep_s
        self.maxlen = maxlen
        self._snaps: deque[Snapshot] = deque()
        # from _head on: the snapshots' times and memos
        self._times: list[float] = []
        self._memos: list[dict[Hashable, object] | None] = []
        self._head = 0
        self._first_seq = 0  # the sequence number of _snaps[0]
        self._inversions: deque[int] = deque()  # seqs of snapshots older than the one before them
        self.fds: dict[tuple[int, int], FdTrail] = {}
        self.loaders: dict[str, LoaderTrail] = {}
        self.stacks: dict[int, tuple[int, ProcessStack]] = {}  # pid -> (seq, its newest stack)

    # -- the window ------------------------------------------------------------------------------

    def add(self, s: Snapshot) -> None:
        if self.maxlen <= 0:
            return
        if len(self) >= self.maxlen:
            self._drop()
        seq = self._first_seq + len(self)
        if len(self) and s.time < self._times[-1]:
            self._inversions.append(seq)
        self._snaps.append(s)
        self._times.append(s.time)
        self._memos.append(None)
        self._index(seq, s)
        while len(self) and self._times[self._head] < s.time - self.keep_s:
            self._drop()

    def snapshots(self) -> tuple[Snapshot, ...]:
        return tuple(self._snaps)

    def __len__(self) -> int:
        return len(self._snaps)

    def __iter__(self) -> Iterator[Snapshot]:
        return iter(self._snaps)

    @property
    def ordered(self) -> bool:
        """No snapshot in the window is older than the one before it (a clock stepped back less
        than the Analyzer's 1 s restart threshold breaks this): bisecting by time is exact."""
        return not self._inversions

    def start(self, since: float) -> int:
        """``bisect_left`` of ``since`` in the window's times: the index ``Context.window`` cuts at."""
        return bisect.bisect_left(self._times, since, self._head) - self._head

    def seq_at(self, index: int) -> int:
        return self._first_seq + index

    # -- views -----------------------------------------------------------------------------------

    def latest_stack(self, pid: int) -> ProcessStack | None:
        found = self.stacks.get(pid)
        return found[1] if found is not None else None

    def memoized(self, start: int, key: Hashable, compute: Callable[[Snapshot], T]) -> list[T]:
        """``[compute(s) for s in window[start:]]``, each computed once per snapshot and ``key``
        (``key`` must name everything ``compute`` depends on besides the snapshot)."""
        out: list[T] = []
        snaps, memos = self._snaps, self._memos
        n = len(snaps)
        for i in range(start, n):
            memo = memos[self._head + i]
            if memo is None:
                memo = memos[self._head + i] = {}
            if key in memo:
                out.append(memo[key])  # type: ignore[arg-type]
            else:
                value = memo[key] = compute(snaps[i - n])  # from the deque's right end: a short walk
                out.append(value)
        return out

    # -- upkeep ----------------------------------------------------------------------------------

    def _index(self, seq: int, s: Snapshot) -> None:
        t = s.time
        fds = self.fds
        for p in s.processes:
            if p.num_fds is not None:
                key = (p.pid, p.start_time)
                trail = fds.get(key)
                if trail is None:
                    trail = fds[key] = FdTrail()
                trail.add(seq, t, p.num_fds)
        for ls in s.loaders:
            lt = self.loaders.get(ls.id)
            if lt is None:
                lt = self.loaders[ls.id] = LoaderTrail()
            lt.add(t, ls)
        if s.stacks:
            seen: set[int] = set()
            for st in s.stacks:  # the first of a pid in a snapshot is the one a scan finds
                if st.pid not in seen:
                    seen.add(st.pid)
                    self.stacks[st.pid] = (seq, st)

    def _drop(self) -> None:
        s = self._snaps.popleft()
        seq = self._first_seq
        self._first_seq += 1
        self._memos[self._head] = None
        self._head += 1
        if self._head >= _COMPACT and 2 * self._head >= len(self._times):
            del self._times[: self._head], self._memos[: self._head]
            self._head = 0
        while self._inversions and self._inversions[0] <= self._first_seq:
            self._inversions.popleft()  # the pair (dropped, new first) is no longer in the window
        for p in s.processes:
            if p.num_fds is not None:
                key = (p.pid, p.start_time)
                trail = self.fds[key]
                trail.pop()
                if not len(trail):
                    del self.fds[key]
        for ls in s.loaders:
            lt = self.loaders[ls.id]
            lt.pop(ls)
            if not lt.count:
                del self.loaders[ls.id]
        for st in s.stacks:
            found = self.stacks.get(st.pid)
            if found is not None and found[0] == seq:
                del self.stacks[st.pid]
