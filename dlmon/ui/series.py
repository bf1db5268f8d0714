"""Bounded time series for the charts: fixed memory however long dlmon runs (no UI imports).

A :class:`Series` keeps the newest raw points and, at the same time, the means of coarser
buckets (10 s, 60 s by default), each in a fixed-size ring of machine floats. A chart asks for
a window: the finest tier that still reaches back far enough answers, re-bucketed to the chart's
own step. Buckets are aligned to multiples of the step, so a chart only changes when a bucket
closes, and can skip redrawing in between (see :func:`chart_step`).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Sequence

Point = tuple[float, float]

# (bucket seconds, capacity); 0 seconds = raw points. 10 min raw at 1 Hz, 1 h of 10 s, 24 h of 1 min.
DEFAULT_TIERS: tuple[tuple[float, int], ...] = ((0.0, 600), (10.0, 360), (60.0, 1440))
# The per-worker histories: 5 min raw, 12 h of 1 min.
WORKER_TIERS: tuple[tuple[float, int], ...] = ((0.0, 300), (60.0, 720))

NICE_STEPS: tuple[float, ...] = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200)


class Ring:
    """A fixed-capacity ring of (time, value) pairs stored as two arrays of doubles."""

    __slots__ = ("_count", "_start", "_t", "_v", "capacity", "wrapped")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._t = array("d", bytes(8 * capacity))
        self._v = array("d", bytes(8 * capacity))
        self._start = 0
        self._count = 0
        self.wrapped = False  # an old point was dropped: the ring no longer holds everything

    def __len__(self) -> int:
        return self._count

    def append(self, t: float, v: float) -> None:
        if self._count < self.capacity:
            i = (self._start + self._count) % self.capacity
            self._count += 1
        else:
            i = self._start
            self._start = (self._start + 1) % self.capacity
            self.wrapped = True
        self._t[i] = t
        self._v[i] = v

    def first_time(self) -> float | None:
        return self._t[self._start] if self._count else None

    def last(self) -> Point | None:
        if not self._count:
            return None
        i = (self._start + self._count - 1) % self.capacity
        return (self._t[i], self._v[i])

    def __iter__(self) -> Iterator[Point]:
        t, v, cap = self._t, self._v, self.capacity
        for k in range(self._count):
            i = (self._start + k) % cap
            yield (t[i], v[i])

    def since(self, start: float) -> list[Point]:
        """Points with time >= start, oldest first (binary search on the ring)."""
        t, cap, n = self._t, self.capacity, self._count
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) // 2
            if t[(self._start + mid) % cap] < start:
                lo = mid + 1
            else:
                hi = mid
        v = self._v
        return [(t[(self._start + k) % cap], v[(self._start + k) % cap]) for k in range(lo, n)]


class _Tier:
    __slots__ = ("bucket", "count", "index", "ring", "total")

    def __init__(self, bucket: float, capacity: int) -> None:
        self.bucket = bucket
        self.ring = Ring(capacity)
        self.index: int | None = None  # the open bucket
        self.total = 0.0
        self.count = 0

    def add(self, t: float, v: float) -> None:
        if self.bucket <= 0:
            self.ring.append(t, v)
            return
        index = math.floor(t / self.bucket)
        if self.index is not None and index != self.index:
            self._close()
        if self.index != index:
            self.index, self.total, self.count = index, 0.0, 0
        self.total += v
        self.count += 1

    def _close(self) -> None:
        if self.index is not None and self.count:
            self.ring.append(self.index * self.bucket, self.total / self.count)
        self.index, self.total, self.count = None, 0.0, 0

    def points_since(self, start: float) -> list[Point]:
        points = self.ring.since(start)
        if self.bucket > 0 and self.index is not None and self.count:
            points.append((self.index * self.bucket, self.total / self.count))
        return points

    def complete_since(self, start: float) -> bool:
        """Whether this tier holds every point from ``start`` on."""
        if not self.ring.wrapped:
            return self.ring.first_time() is not None or self.index is not None
        oldest = self.ring.first_time()
        return oldest is not None and oldest <= start


class Series:
    """A bounded multi-resolution time series. ``None`` values are gaps (not stored)."""

    __slots__ = ("_last", "_tiers", "first_time")

    def __init__(self, tiers: Sequence[tuple[float, int]] = DEFAULT_TIERS) -> None:
        self._tiers = tuple(_Tier(bucket, capacity) for bucket, capacity in tiers)
        self._last: Point | None = None
        self.first_time: float | None = None

    def add(self, t: float, value: float | None) -> None:
        if value is None or value != value:
            return
        v = float(value)
        for tier in self._tiers:
            tier.add(t, v)
        self._last = (t, v)
        if self.first_time is None:
            self.first_time = t

    def latest(self) -> Point | None:
        return self._last

    def points(self, start: float) -> list[Point]:
        """Points from ``start`` on, from the finest tier that reaches back to it."""
        for tier in self._tiers:
            if tier.complete_since(start):
                return tier.points_since(start)
        return self._tiers[-1].points_since(start) if self._tiers else []

    def resample(self, start: float, end: float, step: float) -> list[Point]:
        """Means over buckets ``[k*step, (k+1)*step)`` in ``[start, end)``; empty buckets left out."""
        sums: dict[int, list[float]] = {}
        first = math.floor(start / step)
        last = math.ceil(end / step)
        for t, v in self.points(first * step):
            k = math.floor(t / step)
            if k < first or k >= last:
                continue
            acc = sums.get(k)
            if acc is None:
                sums[k] = [v, 1.0]
            else:
                acc[0] += v
                acc[1] += 1.0
        return [(k * step, acc[0] / acc[1]) for k, acc in sorted(sums.items())]

    def slope(self, seconds: float, now: float) -> float | None:
        """Least-squares slope (units per second) of the raw points of the last ``seconds``."""
        points = self.points(now - seconds)
        if len(points) < 3:
            return None
        t0 = points[0][0]
        span = points[-1][0] - t0
        if span < min(seconds / 4, 30.0):
            return None
        n = len(points)
        mean_t = sum(t - t0 for t, _ in points) / n
        mean_v = sum(v for _, v in points) / n
        num = sum((t - t0 - mean_t) * (v - mean_v) for t, v in points)
        den = sum((t - t0 - mean_t) ** 2 for t, _ in points)
        return num / den if den > 0 else None

    def memory_points(self) -> int:
        """How many points this series can ever hold (for the boundedness tests)."""
        return sum(t.ring.capacity for t in self._tiers)


def chart_step(span: float, dots: int, interval: float | None, min_window: float = 600.0) -> float:
    """The bucket width of a chart ``dots`` points wide showing at least ``min_window`` seconds
    (or all of ``span``), never finer than the sampling interval: a nice round number of seconds."""
    need = max(span, min_window) / max(dots, 1)
    need = max(need, interval or 0.0)
    for step in NICE_STEPS:
        if step >= need:
            return step
    return float(math.ceil(need / NICE_STEPS[-1]) * NICE_STEPS[-1])
