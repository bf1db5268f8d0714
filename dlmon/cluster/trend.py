"""A node's recent history of its batches/s and data wait, as a few slots of equal length ending
now: from Prometheus's range queries, or (scraping the nodes directly) from the figures this
reader saw at its own refreshes. Bounded either way: at most POINTS slots, however long the window."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

POINTS = 20  # slots per series: a sparkline cell's width
MIN_STEP_S = 1.0

Points = tuple[float | None, ...]  # oldest first; None: nothing measured in that slot


@dataclass(frozen=True, slots=True)
class Slots:
    """``count`` slots of ``step_s`` seconds, the last ending at ``end``: slot i holds the
    times in (T_i - step_s, T_i], T_i = end - (count - 1 - i) * step_s (a Prometheus range
    query's evaluation times, each averaging the step before it)."""

    end: float
    step_s: float
    count: int

    @property
    def start(self) -> float:
        return self.end - (self.count - 1) * self.step_s

    def index(self, t: float) -> int | None:
        i = -int((self.end - t) // self.step_s) + self.count - 1  # ceil((t - start) / step)
        return i if 0 <= i < self.count else None

    def nearest(self, t: float) -> int | None:
        """The slot whose end ``t`` is (a range query's evaluation time, to its millisecond)."""
        i = round((t - self.start) / self.step_s)
        return i if 0 <= i < self.count else None


def slots(window_s: float, end: float, min_step_s: float = MIN_STEP_S) -> Slots:
    """The slots of a window: POINTS of them (fewer, of ``min_step_s``, for a window that short)."""
    step = max(MIN_STEP_S, min_step_s, window_s / POINTS)
    return Slots(end, step, max(1, min(POINTS, round(window_s / step))))


def bucketed(points: Iterable[tuple[float, float]], where: Slots, at_ends: bool = False) -> Points | None:
    """(time, value) pairs as the mean of each slot (``at_ends``: each time is a slot's end, as a
    range query's are); None when not one falls in the window."""
    sums = [0.0] * where.count
    counts = [0] * where.count
    for t, value in points:
        i = where.nearest(t) if at_ends else where.index(t)
        if i is not None:
            sums[i] += value
            counts[i] += 1
    if not any(counts):
        return None
    return tuple(s / c if c else None for s, c in zip(sums, counts, strict=True))


@dataclass(frozen=True, slots=True)
class Trend:
    batches_per_s: Points | None  # None: no range data for this node ("n/a")
    data_wait: Points | None


NodeFigures = tuple[str, float | None, float | None]  # (address, batches/s, data wait)


@dataclass(slots=True)
class _Seen:
    """A node's readings from ``first`` to ``last``, closer together than History's merge gap,
    as sums and counts (a rate or wait that was None not counted)."""

    first: float
    last: float
    rate_sum: float = 0.0
    rates: int = 0
    wait_sum: float = 0.0
    waits: int = 0

    def add(self, t: float, rate: float | None, wait: float | None) -> None:
        self.last = t
        if rate is not None:
            self.rate_sum += rate
            self.rates += 1
        if wait is not None:
            self.wait_sum += wait
            self.waits += 1


class History:
    """The direct form's memory: each node's figures at this reader's refreshes, for ``window_s``.
    Readings closer together than ``window_s / keep`` (a quarter of a slot by default) are kept as
    one entry of sums, so a node holds at most ~``keep`` entries however fast the refreshes and long
    the window, and every slot of the window fills. Its slots are never shorter than the longest
    time between its last refreshes: a slot between two refreshes would stand blank, as if the node
    had not answered."""

    def __init__(self, window_s: float, keep: int = 4 * POINTS) -> None:
        self.window_s = window_s
        self._merge_s = window_s / keep
        self._keep = keep
        self._seen: dict[str, deque[_Seen]] = {}
        self._refreshes: deque[float] = deque(maxlen=6)

    def record(self, now: float, figures: Iterable[NodeFigures]) -> tuple[Slots, dict[str, Trend]]:
        for address, rate, wait in figures:
            seen = self._seen.setdefault(address, deque(maxlen=self._keep + 2))
            if not seen or now - seen[-1].first >= self._merge_s:
                seen.append(_Seen(now, now))
            seen[-1].add(now, rate, wait)
        self._refreshes.append(now)
        times = list(self._refreshes)
        cadence = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
        where = slots(self.window_s, now, cadence)
        out: dict[str, Trend] = {}
        for address, seen in list(self._seen.items()):
            while seen and seen[0].last <= where.start - where.step_s:
                seen.popleft()
            if not seen:
                del self._seen[address]  # a node gone from the list for a whole window
                continue
            out[address] = Trend(
                _means(((e.last, e.rate_sum, e.rates) for e in seen), where),
                _means(((e.last, e.wait_sum, e.waits) for e in seen), where),
            )
        return where, out


def _means(entries: Iterable[tuple[float, float, int]], where: Slots) -> Points | None:
    """(time, sum, count) entries as the mean of each slot; None when none counted in the window."""
    sums = [0.0] * where.count
    counts = [0] * where.count
    for t, total, n in entries:
        i = where.index(t)
        if i is not None and n:
            sums[i] += total
            counts[i] += n
    if not any(counts):
        return None
    return tuple(s / c if c else None for s, c in zip(sums, counts, strict=True))


BARS = "▁▂▃▄▅▆▇█"


def sparkline(points: Points | None, top: float | None = None) -> str:
    """One character per slot, scaled to ``top`` (the series' own highest when None); a blank
    for a slot with nothing measured; "n/a" for no range data at all."""
    if points is None or all(p is None for p in points):
        return "n/a"
    known = [p for p in points if p is not None]
    high = top if top is not None else max(known)
    if high <= 0:
        return "".join(" " if p is None else BARS[0] for p in points)
    last = len(BARS) - 1
    return "".join(" " if p is None else BARS[max(0, min(last, round(p / high * last)))] for p in points)
