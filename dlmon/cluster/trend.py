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


class History:
    """The direct form's memory: each node's figures at this reader's refreshes, for ``window_s``
    (at most ``keep`` readings a node, so a fast refresh cannot grow it). Its slots are never
    shorter than the longest time between its last refreshes: a slot between two refreshes
    would stand blank, as if the node had not answered."""

    def __init__(self, window_s: float, keep: int = 50 * POINTS) -> None:
        self.window_s = window_s
        self._keep = keep
        self._seen: dict[str, deque[tuple[float, float | None, float | None]]] = {}
        self._refreshes: deque[float] = deque(maxlen=6)

    def record(self, now: float, figures: Iterable[NodeFigures]) -> tuple[Slots, dict[str, Trend]]:
        for address, rate, wait in figures:
            self._seen.setdefault(address, deque(maxlen=self._keep)).append((now, rate, wait))
        self._refreshes.append(now)
        times = list(self._refreshes)
        cadence = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
        where = slots(self.window_s, now, cadence)
        out: dict[str, Trend] = {}
        for address, seen in list(self._seen.items()):
            while seen and seen[0][0] <= where.start - where.step_s:
                seen.popleft()
            if not seen:
                del self._seen[address]  # a node gone from the list for a whole window
                continue
            out[address] = Trend(
                bucketed(((t, r) for t, r, _ in seen if r is not None), where),
                bucketed(((t, w) for t, _, w in seen if w is not None), where),
            )
        return where, out


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
